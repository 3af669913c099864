"""Experiment D: the real engine, against generating alone and against C's step counts."""
import math
import time

import numpy as np
import pytest
import torch

import NN_40_serving as S
import dataclasses
import nn40.engine_check
import nn40.experiment_d
import nn40.model
import nn40.speculative
from nn40.cli import parse_args
from nn40.config import ModelConfig
from nn40.engine_check import (
    ENGINE_BOUND_S, bounded_lengths, engine_costs, engine_requests, engine_verdict,
    steps_check)
from nn40.experiment_d import EngineBlocks, EngineRequests, engine_pool_blocks, run_engine
from nn40.kv import KVBudget, PagedBlocks, PrefixCache, Seq
from nn40.loop import simulate_serving
from nn40.metrics import LATENCIES
from nn40.model import attention_spans, build_model, new_kv_cache
from nn40.pricing import StepCosts, fit_passes
from nn40.queues import ORDERS, BlockQueue, RequestTimes, queue_order
from nn40.replicas import Replica
from nn40.settings import RunConfig
from nn40.tables_c import verdict_text
from nn40.text_ko import TEXT
from nn40.workload import Requests, SharedPrompts, lognormal_lengths
from test_cli import expect_usage_error, run_main, said

TINY = ModelConfig(layers=2, hidden=64, heads=4, vocab=97, max_positions=64, dtype="float32")


def test_attention_spans_by_hand():
    # rows 0,1 at position 5 share a span; row 2 starts a new one (position 7); row 4 is not
    # next to row 2 in the cache; rows 4,5 at 7 share one again
    assert attention_spans([0, 1, 2, 4, 5], [5, 5, 7, 7, 7]) == \
        [(0, 2, 0, 6), (2, 3, 2, 8), (3, 5, 4, 8)]
    assert attention_spans(list(range(4)), [9] * 4) == [(0, 4, 0, 10)]


def generate_alone(model, prompt, n, device="cpu"):
    """The plain reference: the whole sequence through the model for every token, no cache."""
    seq = prompt.tolist()
    for _ in range(n):
        cache = new_kv_cache(TINY, 1, len(seq), device)
        logits = nn40.model.prefill(model, cache, torch.tensor([seq], device=device))
        seq.append(int(logits[0].argmax()))
    return seq[len(prompt):]


@torch.inference_mode()
@pytest.mark.parametrize("policy", ["static", "continuous"])
def test_every_request_generates_what_it_would_alone(policy):
    model = build_model(TINY, "cpu", seed=3)
    lengths = [7, 1, 12, 3, 3, 9, 2, 15, 5, 1]  # different lengths share batches of 4 slots
    prompts = torch.randint(TINY.vocab, (len(lengths), 6), generator=torch.Generator()
                            .manual_seed(0))
    cache = new_kv_cache(TINY, 4, 6 + max(lengths), "cpu")
    generated, log = run_engine(model, cache, EngineRequests(prompts, lengths), policy)
    for prompt, n, tokens in zip(prompts, lengths, generated):
        assert tokens == generate_alone(model, prompt, n)
    assert max(log["running"]) == 4 and len(set(lengths)) > 4


@torch.inference_mode()
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("policy", ["static", "continuous"])
def test_every_request_takes_the_steps_the_simulation_gives_it(policy, order):
    model = build_model(TINY, "cpu")
    lengths = lognormal_lengths(40, 5, mu=math.log(8), max_len=40)
    prompts = torch.randint(TINY.vocab, (40, 4))
    cache = new_kv_cache(TINY, 8, 4 + int(lengths.max()), "cpu")
    o = queue_order(order, lengths, 0.8, 1)
    _, log = run_engine(model, cache, EngineRequests(prompts, lengths.tolist()), policy,
                          order=o)
    req = Requests(np.zeros(40), np.full(40, 4), lengths)
    sim = simulate_serving(req, Replica(8, StepCosts((1, 2), (1.0, 1.0), 0.0, "unit"),
                                            policy, order=o))
    assert len(log["t_s"]) == sim["steps"]
    assert sum(log["running"]) == round(sim["occupancy"] * sim["steps"] * 8)
    assert log["times"].first_step.tolist() == sim["times"].first_step.tolist()
    assert log["times"].finish_step.tolist() == sim["times"].finish_step.tolist()
    assert steps_check(log["times"], sim["times"]) == {"requests": 40, "agree": 40}
    if order != "fcfs":  # (the order changes who runs when: the check is not vacuous)
        fcfs = simulate_serving(req, Replica(8, StepCosts((1, 2), (1.0, 1.0), 0.0, "unit"),
                                                 policy))
        assert steps_check(log["times"], fcfs["times"])["agree"] < 40


def test_steps_check_names_the_first_request_that_differs():
    def times(first_step, finish_step):
        return RequestTimes(*[np.zeros(4)] * 4, np.array(first_step), np.array(finish_step),
                              np.ones(4))
    engine, sim = times([1, 1, 3, 4], [5, 2, 7, 9]), times([1, 1, 3, 5], [5, 2, 8, 9])
    assert steps_check(engine, sim) == {"requests": 4, "agree": 2, "first_mismatch": {
        "request": 2, "engine": [3, 7], "simulated": [3, 8]}}


class FakeClock:
    """time for run_engine, independent of the machine's speed: every read of the clock
    advances it 0.1 ms (a step is a few reads), and a sleep advances it by what it asks."""

    def __init__(self):
        self.now, self.slept = 0.0, []

    def perf_counter(self):
        self.now += 1e-4
        return self.now

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += seconds

    strftime = staticmethod(time.strftime)


@torch.inference_mode()
def test_arrivals_are_honoured_on_the_wall_clock(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(nn40.experiment_d, "time", clock)
    model = build_model(TINY, "cpu")
    lengths = [3, 5, 2, 4, 6, 1]
    arrival = [0.0, 0.0, 0.05, 0.08, 0.2, 0.21]  # the engine idles until the fifth arrives
    prompts = torch.randint(TINY.vocab, (6, 4))
    cache = new_kv_cache(TINY, 2, 4 + max(lengths), "cpu")
    generated, log = run_engine(model, cache, EngineRequests(prompts, lengths, arrival),
                                  "continuous")
    times = log["times"]
    assert all(start >= a for start, a in zip(times.start, arrival))
    # the first four are done within a few ms of the clock: it sleeps to each later arrival
    assert max(times.finish[:4]) < 0.2 and log["idle_s"] == pytest.approx(sum(clock.slept))
    assert 0.2 <= times.start[4] < 0.2 + 1e-3 and log["idle_s"] > 0.1
    assert [len(g) for g in generated] == lengths
    assert all(s <= f <= e for s, f, e in zip(times.start, times.first_token, times.finish))
    assert times.arrival.tolist() == arrival and (times.ttft() >= 0).all()


def test_fitting_an_engines_passes_by_hand():
    # decode passes of 2 rows cost 10 ms + 1 µs per cached token; of 4 rows, 12 ms + 0.5 µs;
    # prefills of 32 tokens 20 ms: the fit recovers them, and prices the same passes back
    passes = [(2, kv, 0.010 + 1e-6 * kv) for kv in (100, 300, 900)] + \
             [(4, kv, 0.012 + 0.5e-6 * kv) for kv in (400, 800, 1600, 2000)] + \
             [(32, 0, 0.020), (32, 0, 0.020)]
    costs = fit_passes(passes, "hand")
    assert costs.tokens == (2, 4, 32)
    np.testing.assert_allclose(costs.seconds, (0.010, 0.012, 0.020))
    np.testing.assert_allclose([s for _, s in costs.kv_by_batch], (1e-6, 0.5e-6))
    for tokens, kv, seconds in passes:
        assert costs.pass_s(tokens, kv) == pytest.approx(seconds)


def test_fitted_passes_sum_back_to_the_measured_time_with_noisy_passes():
    # decode passes of 1, 2 and 8 rows with skewed noise (exponential: mean above median) over
    # spread contexts, prefills of 16 and 128 tokens: whatever the noise, the fit prices each
    # kind of pass back to the seconds the engine measured (least squares: residuals sum to 0)
    rng = np.random.default_rng(4)
    passes = []
    for rows, base, per_kv in ((1, 0.010, 2e-7), (2, 0.011, 1.5e-7), (8, 0.013, 1e-7)):
        kv = rng.integers(16, 4000, size=40)
        passes += [(rows, int(k), base + per_kv * k + rng.exponential(0.002)) for k in kv]
    passes += [(tokens, 0, 0.02 * tokens / 16 + rng.exponential(0.003)) for tokens in (16, 128)
               for _ in range(15)]
    costs = fit_passes(passes, "noisy")
    for tokens in (1, 2, 8, 16, 128):
        mine = [(kv, sec) for t, kv, sec in passes if t == tokens]
        assert sum(costs.pass_s(tokens, kv) for kv, _ in mine) == pytest.approx(
            sum(sec for _, sec in mine), rel=1e-9)


def test_a_run_faster_than_its_price_is_outside_the_tolerance_too():
    # every latency 20% below the price, and a speedup 23% below the one predicted: the
    # verdict counts how far off, either way
    D = {"static": engine_run(10.0, 0.0), "continuous": engine_run(5.0, 0.0)}
    for run in (D["static"], D["continuous"]):
        run["latency"]["priced"] = {k: v / 0.8 for k, v in run["latency"]["measured"].items()}
    D["speedup_measured"], D["speedup_predicted"] = 2.0, 2.6
    verdict = engine_verdict(D)
    assert verdict["priced"]["within"] == 0 and verdict["priced"]["worst"]["off"] == \
        pytest.approx(-0.2)
    assert verdict["passes"]["within"] == 10  # (priced with its own passes: exact)
    assert verdict["off"] == pytest.approx(2.0 / 2.6 - 1) and not verdict["within"]
    just = {"static": engine_run(10.0, 0.0), "continuous": engine_run(5.0, 0.0)}
    for run in (just["static"], just["continuous"]):
        run["latency"]["priced"] = {k: v / 0.86 for k, v in run["latency"]["measured"].items()}
    just["speedup_measured"], just["speedup_predicted"] = 2.0, 2.0 / 0.86
    verdict = engine_verdict(just)  # 14% under the price: within 15%
    assert verdict["priced"]["within"] == 10 and verdict["within"]


def engine_run(wall, other, prefill=1.0, agree=10):
    latency = {"makespan_s": wall, "ttft_p50_s": 0.3 * wall, "ttft_p90_s": 0.6 * wall,
               "e2e_p50_s": 0.5 * wall, "e2e_p90_s": 0.9 * wall}
    return {"wall_s": wall, "prefill_s": prefill, "decode_s": wall - prefill - other,
            "other_s": other, "steps_check": {"requests": 10, "agree": agree},
            "predicted": {"wall_s": wall - other, "prefill_s": prefill,
                          "decode_s": wall - prefill - other},
            "latency": {"measured": latency, "passes": latency,
                        "priced": {k: v * (wall - other) / wall for k, v in latency.items()}}}


def test_verdict_names_the_cost_the_simulation_missed():
    D = {"static": engine_run(10.0, 0.1), "continuous": engine_run(5.0, 2.0)}
    D["speedup_measured"], D["speedup_predicted"] = 10.0 / 5.0, 9.9 / 3.0
    verdict = engine_verdict(D)
    assert (verdict["mode"], verdict["part"]) == ("continuous", "host")
    assert verdict["steps_exact"] and verdict["passes"]["within"] == 10
    assert verdict["priced"]["within"] == 5  # continuous priced 40% short on every metric
    assert verdict["priced"]["worst"]["mode"] == "continuous"
    text = verdict_text(TEXT["en"], verdict)
    assert "outside 15%" in text and "continuous batching's host work between passes" in text
    assert "5 of 10 priced beforehand" in text
    D["speedup_predicted"] = 2.1
    assert verdict_text(TEXT["en"], engine_verdict(D)).endswith("within 15%")
    D["continuous"]["steps_check"] = {"requests": 10, "agree": 9}
    assert "steps exact for every request: no" in verdict_text(TEXT["en"],
                                                                  engine_verdict(D))


def test_speculations_speedup_holds_or_misses_by_hand():
    """The speculating run against the continuous one: a speedup of 5 / 4 = 1.25x measured,
    against 5 / 4.2 = 1.19x predicted (+5%) holds; against 5 / 3 = 1.67x (-25%) it does
    not, and the verdict says so."""
    from nn40.engine_check import speculation_check
    from nn40.speculative import Speculation
    spec = Speculation("ngram", 2, (0.5, 0.25), "given", 2)
    D = {"static": engine_run(10.0, 0.0), "continuous": engine_run(5.0, 0.0),
         "speculative": {**engine_run(4.0, 0.0), "verify_steps": 4},
         "requests": 3, "lengths": {"total": 12}}  # (outputs 1, 4 and 7)
    D["speedup_measured"], D["speedup_predicted"] = 2.0, 2.0
    for predicted, within in ((4.2, True), (3.0, False)):
        D["speculative"]["predicted"]["wall_s"] = predicted
        D["speculation_check"] = check = speculation_check(D, spec)
        assert check["measured"] == 1.25 and check["predicted"] == pytest.approx(5 / predicted)
        assert check["within"] is within and check["emitted_per_step"] == 2.25  # (9 / 4)
        verdict = engine_verdict(D)
        assert verdict["speculation_within"] is within and verdict["priced"]["checked"] == 15
        answer = "yes" if within else "no"
        assert f"speculation's speedup within 15% of C's: {answer}" in verdict_text(
            TEXT["en"], verdict)


def test_a_mispriced_cost_model_fails_the_seconds(tiny_args, capsys, monkeypatch):
    # every pass priced at a third of what it costs: the steps still agree request by
    # request, the run's own passes still price it, the costs timed beforehand do not
    timed = engine_costs

    def cheap(bench, prompt_len, pad):
        spans, padded, rows = timed(bench, prompt_len, pad)
        return dataclasses.replace(spans, seconds=tuple(s / 3 for s in spans.seconds),
                                     kv_token_s=spans.kv_token_s / 3, kv_by_batch=tuple(
                                         (b, s / 3) for b, s in spans.kv_by_batch)), padded, rows
    monkeypatch.setattr(nn40.engine_check, "engine_costs", cheap)
    results, out = run_main(tiny_args + ["--experiments", "D", "--engine-requests", "12",
                                         "--max-positions", "4096", "--no-figures"], capsys)
    v = results["D"]["verdict"]
    assert v["steps_exact"] is True and v["priced"]["within"] < v["priced"]["checked"]
    assert v["priced"]["worst"]["off"] > 1.0  # measured over twice the price
    assert said("priced beforehand (worst", out.out)


def test_d_end_to_end(tiny_args, tmp_path, capsys):
    results, out = run_main(tiny_args + ["--experiments", "D", "--engine-requests", "12",
                                         "--max-positions", "4096"], capsys)
    D = results["D"]
    assert (D["requests"], D["slots"], D["prompt_tokens"], D["shrink"]) == (12, 8, 16, 8)
    for policy in ("static", "continuous"):
        assert {"wall_s", "output_tokens_per_s", "steps", "occupancy"} <= set(D[policy])
        assert D[policy]["steps"] == D[policy]["predicted"]["steps"]
        assert D[policy]["steps_check"] == {"requests": 12, "agree": 12}
        assert set(D[policy]["latency"]["measured"]) == set(LATENCIES)
        per = D[policy]["per_request"]
        assert per["engine_finish_step"] == list(per["simulated_finish_step"])
    assert D["verdict"]["steps_exact"] is True
    assert D["speedup_measured"] > 0 and D["speedup_predicted"] > 0
    assert said("D  a real engine on the model", out.out) and said("speedup: measured", out.out)
    assert said("12 of 12 requests (static)", out.out) and said("D  request by request", out.out)
    assert (tmp_path / "engine.png").stat().st_size > 10_000


def test_d_longer_than_the_position_table(tiny_args, capsys):
    expect_usage_error(tiny_args + ["--experiments", "D", "--max-positions", "64"], capsys,
                       "exceeds --max-positions")


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@torch.inference_mode()
@pytest.mark.parametrize("device", DEVICES)
def test_a_padded_engine_still_generates_what_it_would_alone(device):
    # the padded decode (the default on CUDA): one masked attention call per layer
    model = build_model(TINY, device, seed=3)
    lengths = [7, 1, 12, 3, 3, 9, 2, 15, 5, 1]
    prompts = torch.randint(TINY.vocab, (len(lengths), 6), generator=torch.Generator()
                            .manual_seed(0)).to(device)
    cache = new_kv_cache(TINY, 4, 6 + max(lengths), device)
    generated, log = run_engine(model, cache, EngineRequests(prompts, lengths),
                                  "continuous", pad=True)
    assert 0 < log["padded_decode_steps"] < log["decode_steps"]
    assert log["attention_calls"] == log["decode_steps"]  # one call per layer, every step
    for prompt, n, tokens in zip(prompts, lengths, generated):
        assert tokens == generate_alone(model, prompt, n, device)


def test_forced_padding_is_priced_as_it_runs(tiny_args, capsys):
    # D with the padded path forced on CPU: the cost rows include padded decodes of every
    # batch above one, rows spread over the contexts; the continuous engine pads, and its
    # prediction uses the spread (here padded) prices
    results, out = run_main(tiny_args + ["--experiments", "D", "--engine-requests", "12",
                                         "--max-positions", "4096", "--engine-attention",
                                         "padded"], capsys)
    D = results["D"]
    rows = [r for r in D["cost_model"]["rows"] if "context" in r]
    assert {r["batch"] for r in rows if r["padded"]} == {r["batch"] for r in rows} - {1}
    assert all(r["spread"] and 16 < r["context"] < 16 + 512 for r in rows if r["padded"])
    assert D["attention"] == "padded" and "cost_model_spread" in D
    assert D["continuous"]["padded_decode_steps"] > 0 == D["static"]["padded_decode_steps"]
    assert D["continuous"]["predicted"]["cost_model"] == "spread"
    assert D["static"]["predicted"]["cost_model"] == "one_span"  # a static batch never pads
    assert said("decode steps padded to their longest row", out.out)
    assert D["sdpa_backends"] == ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]


def test_by_default_the_cpu_engine_runs_spans_and_prices_them(tiny_args, capsys):
    results, out = run_main(tiny_args + ["--experiments", "D", "--engine-requests", "12",
                                         "--max-positions", "4096"], capsys)
    D = results["D"]
    assert D["attention"] == "spans" and not any(r["padded"] for r in D["cost_model"]["rows"])
    # continuous: rows at several positions, a call per span, priced by decodes timed so
    spread = [r for r in D["cost_model"]["rows"] if r["spread"]]
    assert {r["batch"] for r in spread} == {2, 8}
    assert D["continuous"]["padded_decode_steps"] == 0
    assert D["continuous"]["attention_calls_per_decode"] > 1  # rows at several positions
    assert D["continuous"]["predicted"]["cost_model"] == "spread"
    assert D["static"]["predicted"]["cost_model"] == "one_span"


def test_d_with_arrivals_and_an_order(tiny_args, capsys):
    results, out = run_main(tiny_args + ["--experiments", "D", "--engine-requests", "10",
                                         "--max-positions", "4096", "--rate", "400", "--order",
                                         "sjf", "--no-figures"], capsys)
    D = results["D"]
    assert D["order"]["name"] == "sjf" and D["arrivals"]["kind"] == "arrivals_poisson"
    assert D["static"]["steps_check"] is None and D["verdict"]["steps_exact"] is None
    assert said("steps: not compared", out.out) and said("queue: shortest first", out.out)


UNIT = StepCosts((1, 2), (1.0, 1.0), 0.0, {"kind": "pricing_engine", "device": "unit"})


def test_d_past_its_bound_shrinks_its_outputs_by_hand():
    # every pass 1 s; 4 requests of 40 tokens on 2 slots: static, two batches of a prefill and
    # 39 decodes (80 s); continuous the same (80 s): 160 s past 120, so outputs are halved
    run = RunConfig.of(model=TINY, engine_slots=2, engine_prompt_len=4)
    lengths = np.full(4, 40)
    got, divisor, (first, shrunk) = bounded_lengths(run, lengths, None, UNIT, UNIT)
    assert ENGINE_BOUND_S == 120 and (first, divisor, shrunk) == (160, 2, 80)
    assert got.tolist() == [20] * 4
    assert bounded_lengths(run, np.full(4, 10), None, UNIT, UNIT)[1:] == (1, (40, 40))
    with pytest.raises(RuntimeError, match="even with one-token outputs"):
        bounded_lengths(run, np.full(400, 3), None, UNIT, UNIT)  # (200 prefills alone)


def test_d_whose_steps_take_it_past_its_bound_shrinks_before_running(tiny_args, capsys,
                                                                     monkeypatch):
    monkeypatch.setattr(nn40.engine_check, "engine_costs",
                        lambda bench, prompt_len, pad: (UNIT, UNIT, []))
    results, out = run_main(tiny_args + ["--experiments", "D", "--engine-requests", "12",
                                         "--max-positions", "4096", "--no-figures"], capsys)
    D = results["D"]
    assert D["bound"]["priced_s"] > 120 >= D["bound"]["priced_shrunk_s"]
    run = parse_args(tiny_args + ["--experiments", "D", "--engine-requests", "12"])
    lengths, _ = engine_requests(run)  # (the outputs as drawn: / 8 on CPU)
    assert D["shrink"] == 8 * D["bound"]["shrunk_by"] > 8
    assert D["lengths"]["total"] == np.maximum(lengths // D["bound"]["shrunk_by"], 1).sum()
    assert D["static"]["steps_check"]["agree"] == 12  # (the run and its price, shrunk alike)
    assert said("past D's bound of 120 s: outputs divided by", out.out)
    assert said("past D's bound of 120 s: outputs divided by", out.err)  # (said before it runs)


def test_d_that_cannot_fit_its_bound_is_refused_in_one_line(tiny_args, capsys, monkeypatch):
    monkeypatch.setattr(nn40.engine_check, "ENGINE_BOUND_S", 1.0)
    monkeypatch.setattr(nn40.engine_check, "engine_costs",
                        lambda bench, prompt_len, pad: (UNIT, UNIT, []))
    with pytest.raises(SystemExit) as stop:
        S.main(tiny_args + ["--experiments", "D", "--engine-requests", "12", "--no-figures"])
    err = capsys.readouterr().err
    assert stop.value.code == 1 and "Traceback" not in err
    line, = [e for e in err.splitlines() if "error:" in e]
    assert "experiment D failed" in line and "even with one-token outputs" in line


@torch.inference_mode()
def test_a_prefill_after_a_cached_prefix_equals_the_whole_prompts():
    model = build_model(TINY, "cpu", seed=3)
    tokens = torch.randint(TINY.vocab, (3, 20), generator=torch.Generator().manual_seed(0))
    whole, split = (new_kv_cache(TINY, 3, 24, "cpu", seed=s) for s in (0, 1))
    logits = nn40.model.prefill(model, whole, tokens)
    nn40.model.prefill(model, split, tokens[:, :12])  # the prefix, then the rest over it
    rest = nn40.model.prefill(model, split, tokens[:, 12:], torch.arange(3), start=12)
    assert torch.allclose(rest, logits, atol=1e-5)
    assert torch.allclose(split[..., :20, :], whole[..., :20, :], atol=1e-5)


@torch.inference_mode()
def test_the_engines_prefix_cache_keeps_its_tokens_and_takes_cs_steps(monkeypatch):
    model, n, P, prefix_len = build_model(TINY, "cpu", seed=3), 12, 20, 16
    g = torch.Generator().manual_seed(1)
    system = np.array([0, 1, 0, -1, 0, 1, 0, 0, 1, -1, 0, 0])
    prompts = torch.randint(TINY.vocab, (n, P), generator=g)
    texts = torch.randint(TINY.vocab, (2, prefix_len), generator=g)
    prompts[system >= 0, :prefix_len] = texts[system[system >= 0]]
    lengths = [5, 3, 7, 2, 9, 4, 1, 6, 3, 8, 2, 5]
    cache = new_kv_cache(TINY, 4, P + 10, "cpu")
    plain, _ = run_engine(model, cache, EngineRequests(prompts, lengths), "continuous")
    cached, log = run_engine(model, cache, EngineRequests(
        prompts, lengths, pool=EngineBlocks(prompts, 40, 16)), "continuous")
    assert cached == plain
    # the first four are admitted in one step: 0 and 1 compute system prompts 0 and 1, 3 has
    # none, and 2 shares 0's (vLLM caches a block as its step is scheduled); 9 opens with no
    # system prompt; the rest find theirs, computed in an earlier step
    assert log["hit_tokens"] == [0, 0, 16, 0, 16, 16, 16, 16, 16, 0, 16, 16]
    prefills = [log["passes"][i][:2] for i in log["prefill_passes"]]
    assert sum(c for _, c in prefills) == sum(log["hit_tokens"])  # (each row: 4 new, 16 cached)
    assert all(4 * c == 16 * t for t, c in prefills if c) and prefills[:2] == [(60, 0), (4, 16)]
    identity = SharedPrompts(system, np.full(2, prefix_len), np.full(n, -1))
    req = Requests(np.zeros(n), np.full(n, P), np.array(lengths), identity=identity)
    sim = simulate_serving(req, Replica(4, StepCosts((1, 2), (1.0, 1.0), 0.0, "unit"),
                                            kv=KVBudget("prefix", math.inf, 16)))
    assert (list(sim["times"].first_step), list(sim["times"].finish_step)) == \
        (log["times"].first_step.tolist(), log["times"].finish_step.tolist())
    assert sim["prefix_cache"]["hits"] == dict(enumerate(log["hit_tokens"]))
    # a seeded wrong rule in C (blocks cached once computed: no sharing within a step) is
    # caught by the engine's own cache
    monkeypatch.setattr(PrefixCache, "caches_scheduled", False)
    late = simulate_serving(req, Replica(4, StepCosts((1, 2), (1.0, 1.0), 0.0, "unit"),
                                             kv=KVBudget("prefix", math.inf, 16)))
    assert late["prefix_cache"]["hits"] != dict(enumerate(log["hit_tokens"]))
    assert late["prefix_cache"]["hits"][2] == 0 and log["hit_tokens"][2] == 16


def test_the_engines_block_pool_by_hand():
    # 4 blocks of 2 tokens; 5-token prompts: 0, 1 and 3 share their first 4 tokens, 2 not
    prompts = torch.tensor([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [7, 8, 9, 9, 9], [1, 2, 3, 4, 7]])
    pool = EngineBlocks(prompts, 4, 2)
    assert pool.admit(0, 5) == 0 and pool.table[0] == [0, 1, 2]  # (the free queue's head)
    assert pool.admit(1, 5) == 2 and pool.table[1] == [0, 1, 3]  # (cached as scheduled)
    assert pool.admit(2, 5) is None  # (3 blocks, none free: it waits)
    pool.release(0)  # its last block first; 0 and 1 still held by 1
    pool.release(1)
    assert list(pool.free) == [2, 3, 1, 0]
    assert pool.admit(2, 5) == 0 and pool.table[2] == [2, 3, 1] and pool.evicted == 1
    # 3 finds the shared head only (its second block evicted above); it needs 2 new blocks
    # and its hit block, free, out of the queue: 3 of the 1 free, so it waits
    assert pool.admit(3, 5) is None and list(pool.free) == [0]
    pool.release(2)
    assert pool.admit(3, 5) == 1 and pool.table[3][0] == 0


def tight_pool_case(seed):
    """n requests at t=0, each opening with one of `systems` system prompts of 2 blocks (or
    none), 4 tokens of its own after it, outputs of 1-29 tokens; D's block pool the memory of
    its 2 rows (8-10 blocks): cached blocks are evicted, some a prompt's tail alone.
    -> (D's hit tokens, its steps, C's simulation of the same requests on the same pool)"""
    log, _, _, simulated = pool_case(seed, slots=2)
    steps = (log["times"].first_step.tolist(), log["times"].finish_step.tolist())
    return dict(enumerate(log["hit_tokens"])), steps, simulated


def pool_case(seed, slots, pool=None, n=16, P=36, prefix_len=32, systems=4, caching=True):
    """n requests of P prompt tokens at t=0, each opening with one of `systems` system prompts
    of `prefix_len` tokens (or none), outputs of 1-29 tokens, served by D on `slots` rows with a
    block pool of `pool` blocks (None: its rows' memory), caching prefixes or (`caching` off)
    paged blocks alone, and by C on as many blocks. -> (D's log, its tokens, the tokens of its
    run without a pool, C's simulation)"""
    rng = np.random.default_rng(seed)
    system = rng.integers(-1, systems, n)
    lengths = [int(x) for x in rng.integers(1, 30, n)]
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(TINY.vocab, (n, P), generator=g)
    texts = torch.randint(TINY.vocab, (systems, prefix_len), generator=g)
    prompts[system >= 0, :prefix_len] = texts[system[system >= 0]]
    pool = pool or engine_pool_blocks(slots, P + max(lengths), 16)
    cache = new_kv_cache(TINY, slots, P + max(lengths), "cpu")
    with torch.inference_mode():
        model = build_model(TINY, "cpu", seed=3)
        generated, log = run_engine(model, cache, EngineRequests(
            prompts, lengths, pool=EngineBlocks(prompts, pool, 16, caching)), "continuous")
        plain, _ = run_engine(model, cache, EngineRequests(prompts, lengths), "continuous")
    identity = SharedPrompts(system, np.full(systems, prefix_len), np.full(n, -1))
    req = Requests(np.zeros(n), np.full(n, P), np.array(lengths), identity=identity)

    def simulated():
        return simulate_serving(req, Replica(slots, StepCosts((1, 2), (1.0, 1.0), 0.0, "unit"),
                                             kv=KVBudget("prefix" if caching else "paged",
                                                         pool * 16, 16)))
    return log, generated, plain, simulated


@pytest.mark.parametrize("seed", [1, 8, 17, 54])
def test_the_engines_block_pool_evicts_as_cs_prefix_cache(seed, monkeypatch):
    """D's pool, written from vLLM's block pool, against C's PrefixCache on a pool that
    evicts: every request's hit and steps equal (on 8, only where C takes a newcomer's blocks
    before it looks the next one up, as vLLM's scheduler does; on 17, only where a decoder's
    blocks hold the tokens whose KV is written, not its newest; on 54, only where the
    decoders' next blocks are taken before a newcomer is looked up)."""
    hits, steps, simulated = tight_pool_case(seed)
    sim = simulated()
    assert sim["prefix_cache"]["hits"] == hits
    assert (list(sim["times"].first_step), list(sim["times"].finish_step)) == steps
    assert sim["prefix_cache"]["evicted_blocks"] >= 8 and \
        {0, 32} <= set(hits.values()) <= {0, 16, 32}  # (evicted blocks, prefixes found whole;
    # on 1, 8 and 54 some by their head alone)


def newest_token_held(monkeypatch):
    """C's blocks seeded to hold a request's newest token, as before vLLM's rule: written
    tokens counted with it, a prompt's last chunk taking a slot for its first token, a decoder
    taking its next block as its newest token is sampled."""
    monkeypatch.setattr(Seq, "written", lambda seq, ctx: ctx)
    monkeypatch.setattr(PagedBlocks, "written_at_admission", staticmethod(
        lambda seq: seq.num_cached))
    monkeypatch.setattr(PagedBlocks, "phase_of", lambda self, seq: -(
        (seq.decode_base - 1) // self.gains) % self.period)
    monkeypatch.setattr(PagedBlocks, "prompt_blocks", lambda self, seq, tokens, chunk: self.blocks(
        seq.num_cached + tokens + (chunk == seq.prompt_left) * (1 + self.lookahead)))
    need = PagedBlocks.need
    monkeypatch.setattr(PagedBlocks, "need", lambda self, prompt, cached, chunk, to_prefill: need(
        self, prompt, cached + 1, chunk, to_prefill))


def freed_head_first(monkeypatch):
    """A request's head block freed first, so a prefix loses its head before its tail."""
    push = BlockQueue.push
    monkeypatch.setattr(BlockQueue, "push", lambda queue, keys: push(queue, keys[::-1]))


@pytest.mark.parametrize("seed, wrong", [
    (1, freed_head_first), (8, freed_head_first), (17, newest_token_held),
    (54, lambda monkeypatch: monkeypatch.setattr(PrefixCache, "schedule_decoders",
                                                 lambda self, steps: None))])
def test_the_engines_block_pool_fails_a_wrong_rule_in_c(seed, wrong, monkeypatch):
    """Seeded into C: a wrong freeing order; blocks holding a request's newest token (sampled,
    its KV not yet written: a decoder takes its next block a step early); the decoders' next
    blocks taken as their step runs, after the newcomers have looked theirs up. D's pool
    disagrees with each (each seeded rule a whole one: the run still ends, nothing preempted)."""
    hits, steps, simulated = tight_pool_case(seed)
    wrong(monkeypatch)
    sim = simulated()
    assert sim["prefix_cache"]["hits"] != hits or \
        (list(sim["times"].first_step), list(sim["times"].finish_step)) != steps
    assert sim["kv"]["preemptions"] == 0 and np.isfinite(sim["times"].finish).all()


def test_d_with_prefix_caching_end_to_end(tiny_args, capsys):
    results, out = run_main(tiny_args + ["--experiments", "D", "--engine-requests", "12",
                                         "--prompt-len", "8", "--prefix-len", "32",
                                         "--num-prefixes", "2", "--max-positions", "4096",
                                         "--no-figures"], capsys)
    D, check = results["D"], results["D"]["prefix_check"]
    assert check["tokens_identical"] is True
    assert check["hit_tokens"] == check["hit_tokens_simulated"] > 0
    assert check["hits_agree"] == check["requests"] == 12 and D["verdict"]["prefix_exact"]
    # (a system prompt opens a prompt, its own 8 tokens follow: 40 tokens, as C's prompts)
    assert check["hit_tokens"] % 32 == 0 and check["prompt_tokens"] == 12 * 40
    assert D["prefix"]["steps_check"] == {"requests": 12, "agree": 12}
    assert said("continuous + prefix cache", out.out) and said("greedy tokens identical", out.out)
    assert said("the prefix cache's hits (and steps, all waiting at t=0) as C's for every request: yes", out.out)


def test_ds_verdict_fails_on_a_wrong_caching_rule_in_c(tiny_args, capsys, monkeypatch):
    """The rule vLLM does not run, seeded into C: blocks cached once computed, so requests
    admitted in one step do not share. D's engine shares them, and its verdict says no."""
    monkeypatch.setattr(PrefixCache, "caches_scheduled", False)
    results, out = run_main(tiny_args + ["--experiments", "D", "--engine-requests", "12",
                                         "--prompt-len", "8", "--prefix-len", "32",
                                         "--num-prefixes", "2", "--max-positions", "4096",
                                         "--no-figures"], capsys)
    check = results["D"]["prefix_check"]
    assert check["hits_agree"] < check["requests"] and not results["D"]["verdict"]["prefix_exact"]
    assert said("the prefix cache's hits (and steps, all waiting at t=0) as C's for every request: no", out.out)


def test_d_prefix_must_be_whole_blocks(tiny_args, capsys):
    for prefix_len in ("24", "8"):  # not whole blocks of 16
        expect_usage_error(tiny_args + ["--experiments", "D", "--prefix-len", prefix_len],
                           capsys, "--prefix-len", "whole blocks")


# Speculative decoding in D: the verify pass on the model, C's draws for the gains

@torch.inference_mode()
def test_a_speculating_engine_emits_the_targets_own_tokens_after_its_accepted_drafts():
    """Each verify step emits its accepted drafts, then the target's own token after them:
    a full forward of the request's text up to each of those tokens picks it greedily. With
    every gain 1 (nothing accepted) the engine generates what plain decoding does."""
    model = build_model(TINY, "cpu", seed=3)
    lengths = [7, 1, 12, 3, 9, 2, 15, 5]
    prompts = torch.randint(TINY.vocab, (len(lengths), 6), generator=torch.Generator()
                            .manual_seed(2))
    k, rng = 3, np.random.default_rng(4)
    gains = []
    for n in lengths:  # each request's gains, 1..k+1 a step, adding up to its decode
        g, left = [], n - 1
        while left:
            g.append(min(int(rng.integers(1, k + 2)), left))
            left -= g[-1]
        gains.append(g)
    cache = new_kv_cache(TINY, 4, 6 + max(lengths) + k, "cpu")
    generated, elog = run_engine(model, cache, EngineRequests(
        prompts, lengths, drafts=nn40.experiment_d.EngineDrafts(k, gains, seed=1)), "continuous")
    assert [len(t) for t in generated] == lengths
    assert elog["verify_steps"] == sum(len(g) for g in gains)
    for r, (tokens, g) in enumerate(zip(generated, gains)):
        text = torch.cat((prompts[r], torch.tensor(tokens)))[None]
        logits = nn40.model.ragged_step(model, new_kv_cache(TINY, 1, text.shape[1], "cpu"),
                                        text, [0])[0]  # (every token's, from an empty row)
        targets = [0] + np.cumsum(g).tolist()  # the prefill's token, then each step's last
        for t in targets:
            assert int(logits[6 + t - 1].argmax()) == tokens[t]
    plain, _ = run_engine(model, cache, EngineRequests(prompts, lengths), "continuous")
    ones = [[1] * (n - 1) for n in lengths]
    same, _ = run_engine(model, cache, EngineRequests(
        prompts, lengths, drafts=nn40.experiment_d.EngineDrafts(k, ones)), "continuous")
    assert same == plain


def spec_args(tiny_args, *more):
    return tiny_args + ["--experiments", "D", "--engine-requests", "12", "--max-positions",
                        "4096", "--speculative-config",
                        '{"method": "ngram", "num_speculative_tokens": 3}',
                        "--acceptance-rate", "0.7", *more]


def test_d_speculates_as_c_draws_end_to_end(tiny_args, tmp_path, capsys):
    import matplotlib.image
    results, out = run_main(spec_args(tiny_args), capsys)
    assert matplotlib.image.imread(tmp_path / "engine.png").shape[0] == 690  # (three panels)
    D = results["D"]
    fast, check = D["speculative"], D["speculation_check"]
    assert fast["steps_check"] == {"requests": 12, "agree": 12}
    assert fast["steps"] == fast["predicted"]["steps"] < D["continuous"]["steps"]
    assert D["verdict"]["steps_exact"] is True and "speculation_within" in D["verdict"]
    assert check["k"] == 3 and check["rates"] == pytest.approx([0.7, 0.49, 0.343])
    assert 1 < check["emitted_per_step"] <= 4 and check["measured"] > 0
    assert said("continuous + speculating", out.out) and said("speculating: 12 of 12", out.out)
    assert said("speculation's speedup within 15% of C's:", out.out)


def test_ds_verdict_fails_where_c_draws_other_gains(tiny_args, capsys, monkeypatch):
    """A wrong rule seeded into C: each request's verify steps drawn from another seed than
    the one the engine emits by. The steps no longer agree request by request, and the
    verdict says so."""
    drawn = nn40.speculative.Speculation.steps_for
    monkeypatch.setattr(nn40.speculative.Speculation, "steps_for", lambda self, output: drawn(
        dataclasses.replace(self, seed=self.seed + 1), output))
    results, out = run_main(spec_args(tiny_args, "--no-figures"), capsys)
    D = results["D"]
    assert D["speculative"]["steps_check"]["agree"] < 12
    assert D["verdict"]["steps_exact"] is False
    assert said("verdict: steps exact for every request: no", out.out)


@pytest.mark.parametrize("more, says", [
    (["--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 3}'],
     "has no eagle3 draft: give method ngram with D"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
      "--acceptance-rate", "0.7", "--experiments", "AB"], "give --experiments C, D or CD"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
      "--acceptance-rate", "0.7", "--experiments", "CD"], "give --gpu"),
])
def test_a_speculation_d_cannot_run_is_one_line(tiny_args, capsys, more, says):
    args = tiny_args + ["--experiments", "D"] + more
    expect_usage_error(args, capsys, says)


# D's pool smaller than its rows: the engine preempts as vLLM's scheduler does

def preempting_case(seed):
    """16 requests at t=0 (system prompts of 2 blocks as tight_pool_case's), 4 rows on a pool
    of 6 blocks, where one request at its longest takes 5: the running requests outgrow it and
    the newest is preempted, again and again. -> pool_case's"""
    return pool_case(seed, slots=4, pool=6)


def preemption_record(log, sim):
    """(every request's hit at first admission, its first-token and finish steps, the
    preemptions, the tokens the preempted found again on return): D's or C's."""
    if sim is None:
        times = log["times"]
        return (dict(enumerate(log["hit_tokens"])), times.first_step.tolist(),
                times.finish_step.tolist(), log["preemptions"], log["readmitted_hit_tokens"])
    cache = sim.get("prefix_cache", {"hits": {}, "readmitted_hit_tokens": 0})  # (paged: none)
    return (cache["hits"], list(sim["times"].first_step), list(sim["times"].finish_step),
            sim["kv"]["preemptions"], cache["readmitted_hit_tokens"])


@pytest.mark.parametrize("seed", [0, 3, 11, 23])
def test_the_engine_preempts_and_finds_its_own_blocks_again_as_c(seed):
    """vLLM's rules written plainly in D (the running requests' blocks taken oldest first, the
    newest preempted where none is free, its computed blocks keyed by their tokens, the
    preempted back first, the oldest of them first) against C's on the same pool: hits,
    steps, preemptions and the tokens found again on return all equal, and the tokens the
    engine generates equal the run without a pool's (what it found again was its own K/V)."""
    log, generated, plain, simulated = preempting_case(seed)
    assert preemption_record(log, None) == preemption_record(None, simulated())
    assert log["preemptions"] >= 3 and log["readmitted_hit_tokens"] > 0
    assert generated == plain


def oldest_preempted(monkeypatch):
    """C seeded to preempt its oldest running request instead of its newest."""
    from nn40.loop import Admission
    make_room = Admission.make_room

    def oldest_first(self):  # (make_room preempts the last of the running requests' order)
        self.running = dict(reversed(list(self.running.items())))
        try:
            return make_room(self)
        finally:
            self.running = dict(reversed(list(self.running.items())))
    monkeypatch.setattr(Admission, "make_room", oldest_first)


@pytest.mark.parametrize("seed, wrong", [
    (0, lambda monkeypatch: monkeypatch.setattr(
        PrefixCache, "keys_of", lambda self, r, tokens: self.identity.block_keys(
            r, tokens, self.block))),
    (3, oldest_preempted)])
def test_the_preempting_engine_fails_a_wrong_rule_in_c(seed, wrong, monkeypatch):
    """Seeded into C: a preempted request finding only the blocks it shares with others (its
    answer's blocks unkeyed); the oldest running request preempted. D disagrees with each."""
    log, _, _, simulated = preempting_case(seed)
    wrong(monkeypatch)
    assert preemption_record(log, None) != preemption_record(None, simulated())


@pytest.mark.parametrize("seed", [0, 4, 9])
def test_the_engine_on_paged_blocks_preempts_and_recomputes_as_c(seed, monkeypatch):
    """Caching nothing (vLLM without prefix caching), 4 rows on 7 blocks: the newest running
    request preempted where the running ones outgrow the pool, and computed again whole on its
    return; every step and preemption as C's paged blocks' (C preempting its oldest fails it),
    the tokens as the run without a pool's."""
    log, generated, plain, simulated = pool_case(seed, slots=4, pool=7, caching=False)
    sim = simulated()
    record = preemption_record(log, None)[1:]
    assert record == preemption_record(None, sim)[1:]
    assert log["preemptions"] >= 2 and log["readmitted_hit_tokens"] == 0 and generated == plain
    oldest_preempted(monkeypatch)
    assert preemption_record(None, simulated())[1:] != record


def test_d_preempts_end_to_end_and_a_pool_too_small_is_one_line(tiny_args, capsys):
    args = tiny_args + ["--experiments", "D", "--engine-requests", "24", "--prompt-len", "8",
                        "--prefix-len", "32", "--num-prefixes", "2", "--max-positions", "4096",
                        "--no-figures"]
    results, out = run_main(args + ["--kv-tokens", "224"], capsys)
    check = results["D"]["prefix_check"]
    assert check["preemptions"] == check["preemptions_simulated"] > 0
    assert check["readmitted_hit_tokens"] == check["readmitted_hit_tokens_simulated"] > 0
    assert check["tokens_identical"] and results["D"]["verdict"]["prefix_exact"]
    assert said(f"preempted {check['preemptions']} times (C: {check['preemptions']})", out.out)
    plain = results["D"]["continuous"]  # (on paged blocks of the same pool)
    assert plain["preemptions"] == plain["preemptions_simulated"] > 0
    assert plain["steps_check"] == {"requests": 24, "agree": 24}
    assert said(f"preempted {plain['preemptions']} times (C's paged blocks: "
                f"{plain['preemptions']})", out.out)
    expect_usage_error(args + ["--kv-tokens", "200"], capsys, "D's longest request alone needs")
    expect_usage_error(args + ["--kv-tokens", "224", "--speculative-config", '{"method": '
                               '"ngram", "num_speculative_tokens": 2}', "--acceptance-rate",
                               "0.5"], capsys, "give --kv-tokens or --speculative-config")
