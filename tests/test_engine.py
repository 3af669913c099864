"""Experiment D: the real engine, against generating alone and against C's step counts."""
import math

import numpy as np
import pytest
import torch

import NN_40_serving as S
from test_cli import expect_usage_error, run_main

TINY = S.ModelConfig(layers=2, hidden=64, heads=4, vocab=97, max_positions=64, dtype="float32")


def test_attention_spans_by_hand():
    # rows 0,1 at position 5 share a span; row 2 starts a new one (position 7); row 4 is not
    # next to row 2 in the cache; rows 4,5 at 7 share one again
    assert S.attention_spans([0, 1, 2, 4, 5], [5, 5, 7, 7, 7]) == \
        [(0, 2, 0, 6), (2, 3, 2, 8), (3, 5, 4, 8)]
    assert S.attention_spans(list(range(4)), [9] * 4) == [(0, 4, 0, 10)]


def generate_alone(model, prompt, n, device="cpu"):
    """The plain reference: the whole sequence through the model for every token, no cache."""
    seq = prompt.tolist()
    for _ in range(n):
        cache = S.new_kv_cache(TINY, 1, len(seq), device)
        seq.append(int(S.prefill(model, cache, torch.tensor([seq], device=device))[0].argmax()))
    return seq[len(prompt):]


@torch.inference_mode()
@pytest.mark.parametrize("policy", ["static", "continuous"])
def test_every_request_generates_what_it_would_alone(policy):
    model = S.build_model(TINY, "cpu", seed=3)
    lengths = [7, 1, 12, 3, 3, 9, 2, 15, 5, 1]  # different lengths share batches of 4 slots
    prompts = torch.randint(TINY.vocab, (len(lengths), 6), generator=torch.Generator()
                            .manual_seed(0))
    cache = S.new_kv_cache(TINY, 4, 6 + max(lengths), "cpu")
    generated, log = S.run_engine(model, cache, prompts, lengths, policy)
    for prompt, n, tokens in zip(prompts, lengths, generated):
        assert tokens == generate_alone(model, prompt, n)
    assert max(log["running"]) == 4 and len(set(lengths)) > 4


@torch.inference_mode()
@pytest.mark.parametrize("policy", ["static", "continuous"])
def test_engine_takes_the_steps_the_simulation_counts(policy):
    model = S.build_model(TINY, "cpu")
    lengths = S.lognormal_lengths(40, 5, mu=math.log(8), max_len=40)
    prompts = torch.randint(TINY.vocab, (40, 4))
    cache = S.new_kv_cache(TINY, 8, 4 + int(lengths.max()), "cpu")
    _, log = S.run_engine(model, cache, prompts, lengths.tolist(), policy)
    req = S.Requests(np.zeros(40), np.full(40, 4), lengths, "test")
    sim = S.simulate_serving(req, 8, S.StepCosts((1, 2), (1.0, 1.0), 0.0, "unit"), policy)
    assert len(log["t_s"]) == sim["steps"]
    assert sum(log["running"]) == round(sim["occupancy"] * sim["steps"] * 8)


def test_verdict_names_the_cost_the_simulation_missed():
    def mode(wall, other):
        return {"wall_s": wall, "prefill_s": 1.0, "decode_s": wall - 1.0 - other,
                "other_s": other, "predicted": {"wall_s": wall - other, "prefill_s": 1.0,
                                                "decode_s": wall - 1.0 - other}}
    D = {"static": mode(10.0, 0.1), "continuous": mode(5.0, 2.0)}
    D["speedup_measured"], D["speedup_predicted"] = 10.0 / 5.0, 9.9 / 3.0
    verdict = S.engine_verdict(D)
    assert (verdict["mode"], verdict["part"]) == ("continuous", "host")
    text = S.verdict_text(S.TEXT["en"], verdict)
    assert "outside 15%" in text and "continuous batching's host work between passes" in text
    D["speedup_predicted"] = 2.1
    assert S.verdict_text(S.TEXT["en"], S.engine_verdict(D)).endswith("within 15%")


def test_d_end_to_end(tiny_args, tmp_path, capsys):
    results, out = run_main(tiny_args + ["--experiments", "D", "--engine-requests", "12",
                                         "--max-positions", "4096"], capsys)
    D = results["D"]
    for policy in ("static", "continuous"):
        assert {"wall_s", "output_tokens_per_s", "steps", "occupancy"} <= set(D[policy])
        assert D[policy]["steps"] == D[policy]["predicted"]["steps"]
    assert D["speedup_measured"] > 0 and D["speedup_predicted"] > 0
    assert "D  a real engine on the model" in out.out and "speedup: measured" in out.out
    assert (tmp_path / "engine.png").stat().st_size > 10_000


def test_d_longer_than_the_position_table(tiny_args, capsys):
    expect_usage_error(tiny_args + ["--experiments", "D", "--max-positions", "64"], capsys,
                       "exceeds --max-positions")


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@torch.inference_mode()
@pytest.mark.parametrize("device", DEVICES)
def test_a_padded_engine_still_generates_what_it_would_alone(device):
    # the padded decode (the default on CUDA): one masked attention call per layer
    model = S.build_model(TINY, device, seed=3)
    lengths = [7, 1, 12, 3, 3, 9, 2, 15, 5, 1]
    prompts = torch.randint(TINY.vocab, (len(lengths), 6), generator=torch.Generator()
                            .manual_seed(0)).to(device)
    cache = S.new_kv_cache(TINY, 4, 6 + max(lengths), device)
    generated, log = S.run_engine(model, cache, prompts, lengths, "continuous", pad=True)
    assert 0 < log["padded_decode_steps"] < log["decode_steps"]
    assert log["attention_calls"] == log["decode_steps"]  # one call per layer, every step
    for prompt, n, tokens in zip(prompts, lengths, generated):
        assert tokens == generate_alone(model, prompt, n, device)


def test_forced_padding_is_priced_as_it_runs(tiny_args, capsys):
    # D with the padded path forced on CPU: the cost rows include padded decodes of every
    # batch above one, the continuous engine pads, and its prediction uses the padded prices
    results, out = run_main(tiny_args + ["--experiments", "D", "--engine-requests", "12",
                                         "--max-positions", "4096", "--engine-attention",
                                         "padded"], capsys)
    D = results["D"]
    rows = [r for r in D["cost_model"]["rows"] if "context" in r]
    assert {r["batch"] for r in rows if r["padded"]} == {r["batch"] for r in rows} - {1}
    assert all(128 < r["context"] < 128 + 512 for r in rows if r["padded"])
    assert D["attention"] == "padded" and "cost_model_padded" in D
    assert D["continuous"]["padded_decode_steps"] > 0 == D["static"]["padded_decode_steps"]
    assert D["continuous"]["predicted"]["cost_model"] == "padded"
    assert D["static"]["predicted"]["cost_model"] == "spans"  # a static batch never pads
    assert "decode steps padded to their longest row" in out.out
    assert D["sdpa_backends"] == ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]


def test_by_default_the_cpu_engine_runs_spans(tiny_args, capsys):
    results, out = run_main(tiny_args + ["--experiments", "D", "--engine-requests", "12",
                                         "--max-positions", "4096"], capsys)
    D = results["D"]
    assert D["attention"] == "spans" and "cost_model_padded" not in D
    assert not any(r["padded"] for r in D["cost_model"]["rows"])
    assert D["continuous"]["padded_decode_steps"] == 0
    assert D["continuous"]["attention_calls_per_decode"] > 1  # rows at several positions
