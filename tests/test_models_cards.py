"""Named models and cards: shapes, rotary positions, pricing, memory, the catalog."""
import math

import pytest
import torch

import nn40.device
import nn40.experiment_ab
import nn40.model
from nn40.accounting import kv_bytes_per_token, kv_crossover_batch, param_count, flops_and_bytes
from nn40.config import GPUS, MODELS, ModelConfig
from nn40.experiment_c import catalog
from nn40.model import RMSNorm, build_model, new_kv_cache, rope_frequencies, rotate
from nn40.pricing import ENGINE_PROFILES, measured
from test_cli import expect_usage_error, run_main, said


def test_rotary_positions_turn_pairs_and_keep_relative_angles():
    cfg = ModelConfig(hidden=8, heads=1, positions="rope", rope_theta=100.0)
    inv_freq = rope_frequencies(cfg)  # theta^(-2i/D): 1, 100^-0.25, 100^-0.5, 100^-0.75
    assert inv_freq.tolist() == pytest.approx([1.0, 100 ** -0.25, 0.1, 100 ** -0.75])

    def rope(position):
        angles = torch.tensor([[[[float(position)]]]]) * inv_freq  # (1, 1, 1, D/2)
        return angles.cos(), angles.sin()
    x = torch.zeros(1, 1, 1, 8)
    x[..., 0] = 1.0  # the pair (x_0, x_4) = (1, 0), turned by 1 radian at position 1
    turned = rotate(x, rope(1))
    assert turned[..., 0].item() == pytest.approx(math.cos(1.0))
    assert turned[..., 4].item() == pytest.approx(math.sin(1.0))
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, 8, generator=g), torch.randn(1, 1, 1, 8, generator=g)
    dot = [(rotate(q, rope(p + 3)) * rotate(k, rope(p))).sum().item() for p in (0, 5, 40)]
    assert dot == pytest.approx([dot[0]] * 3, rel=1e-5)  # only the distance, 3, matters


def test_rms_norm_of_a_four_element_vector_by_hand():
    # x = (1, 2, 3, 4): mean of squares 30 / 4 = 7.5, so x / sqrt(7.5 + 1e-5), times the weight
    norm = RMSNorm(4)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.0, 0.5, 2.0, -1.0]))
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    scale = 1 / math.sqrt(7.5 + 1e-5)
    want = [1 * scale, 2 * scale * 0.5, 3 * scale * 2.0, -4 * scale]
    assert norm(x)[0].tolist() == pytest.approx(want, rel=1e-6)
    assert want[0] == pytest.approx(0.365148, rel=1e-5)
    half = norm.to(torch.float16)(x.half())  # (computed in fp32, returned in the input's type)
    assert half.dtype == torch.float16 and half[0].float().tolist() == pytest.approx(want,
                                                                                     rel=1e-3)


@torch.inference_mode()
def test_rotary_attention_sees_only_relative_positions():
    # a rope model's prefill of the same tokens at positions 0..5 and at 37..42 gives the same
    # logits: rotating q and k by their positions leaves only the distance between them in
    # their dot products. Keys left unrotated (or rotated by another position) break this.
    cfg = ModelConfig(layers=2, hidden=64, heads=4, kv_heads=2, vocab=97, max_positions=64,
                        dtype="float32", mlp="gated", norm="rms", positions="rope")
    model = build_model(cfg, "cpu", seed=1)
    tokens = torch.randint(cfg.vocab, (2, 6), generator=torch.Generator().manual_seed(2))
    logits = []
    for shift in (0, 37):
        cache = new_kv_cache(cfg, 2, 64, "cpu")
        positions = torch.arange(shift, shift + 6).expand(2, 6)
        logits.append(model(tokens, positions, cache))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)
    # (the property is not empty: the same model without rotary positions on the keys differs)
    real = nn40.model.rotate
    calls = []

    def rotate_queries_only(x, rope):
        calls.append(1)
        return real(x, rope) if len(calls) % 2 else x
    try:
        nn40.model.rotate = rotate_queries_only
        shifted = [model(tokens, torch.arange(s, s + 6).expand(2, 6),
                         new_kv_cache(cfg, 2, 64, "cpu")) for s in (0, 37)]
    finally:
        nn40.model.rotate = real
    assert (shifted[0] - shifted[1]).abs().max() > 1e-3


def test_c_prices_a_named_model_on_a_named_card(tmp_path, capsys):
    results, out = run_main(["--experiments", "C", "--model", "llama-3-8b", "--gpu", "h100",
                             "--engine-profile", "roofline", "--requests", "200", "--rates",
                             "5", "--no-figures", "--out", str(tmp_path)], capsys)
    C = results["C"]
    source = C["cost_model"]["source"]
    assert source["kind"] == "pricing_card" and source["card"] == "H100 SXM"
    assert (source["profile"], source["bandwidth_share"], source["matmul_share"]) == \
        ("roofline", 0.9, 0.8)
    # 0.9 x (81,559 MiB less 16.06 GB of weights), in 131,072-byte tokens
    assert C["kv"]["budget_tokens"] == int(0.9 * (81559 * 2**20 - 8_030_261_248 * 2)
                                           // 131_072)
    assert C["kv"]["memory_source"]["kind"] == "memory_card"
    # a decode step at batch 1 reads the weights (less the token table) at 3,015 GB/s
    weights = (8_030_261_248 - 128_256 * 4096) * 2
    assert C["cost_model"]["seconds"][0] == pytest.approx(weights / 3015e9, rel=0.01)
    for text in ("model: llama-3-8b: 32 layers, hidden 4096, 32 heads (8 K/V heads), gated "
                 "SiLU MLP of 14,336", "card: 1 x H100 SXM", "the H100 SXM's spec priced by "
                 "the roofline profile", "0.9 x (85.5 GB of each of 1 x H100 SXM"):
        assert said(text, out.out)


def test_the_default_c_is_the_posts_card(tmp_path, capsys):
    results, _ = run_main(["--experiments", "C", "--requests", "100", "--rates", "5",
                           "--no-figures", "--out", str(tmp_path)], capsys)
    source = results["C"]["cost_model"]["source"]
    assert (source["kind"], source["bandwidth_gbs"], source["tflops"]) == \
        ("pricing_analytic", 960.0, 105.5)


def test_a_model_the_card_cannot_hold_still_prices(tmp_path, capsys):
    # Llama-3-8B's 16 GB of weights leave the RTX 5080 no KV cache: C marks the KV rows, says
    # by how much each card falls short and what would leave it room
    results, out = run_main(["--experiments", "C", "--model", "llama-3-8b", "--gpu", "rtx-5080",
                             "--requests", "100", "--rates", "5", "--no-figures",
                             "--out", str(tmp_path)], capsys)
    why = results["C"]["kv"]["unfit"]["paged"]
    assert why["kind"] == "kv_short" and why["would"] == "--weights fp8, --tp 2"
    assert said("the engine's rule leaves the KV cache nothing", out.out)
    assert results["C"]["schedulers"]["continuous"]["steps"] > 0


def test_an_unfit_model_is_refused_before_allocating(capsys, monkeypatch):
    monkeypatch.setattr(nn40.device, "free_memory_bytes", lambda device: 2**30)
    monkeypatch.setattr(nn40.experiment_ab, "build_model",
                        lambda *a, **k: pytest.fail("allocated"))
    err = expect_usage_error(["--device", "cpu", "--model", "llama-3.2-1b", "--experiments",
                              "A"], capsys, "its weights need", "1.00 GiB free")
    assert "llama-3.2-1b" in err


def test_d_s_cache_counts_with_the_weights(tiny_args, capsys, monkeypatch):
    # the weights fit alone; with D's 64 rows x 1,343 tokens of KV they do not
    weights = param_count(ModelConfig(layers=1, hidden=64, heads=4, vocab=128,
                                          max_positions=4096, dtype="float32")) * 4
    monkeypatch.setattr(nn40.device, "free_memory_bytes", lambda device: int(2.5 * weights))
    expect_usage_error(tiny_args + ["--experiments", "D", "--engine-requests", "12",
                                    "--engine-slots", "64", "--engine-shrink", "1",
                                    "--max-positions", "4096"], capsys,
                       "D's KV cache (64 rows x 1,343 tokens)")


@pytest.mark.parametrize("args, fragment", [
    (["--heads", "4", "--kv-heads", "3"], "must divide --heads"),
    (["--heads", "4", "--kv-heads", "8"], "must divide --heads"),
    (["--arch", "post", "--model", "llama-3-8b"], "give one or the other"),
    (["--gpu", "tpu"], "--gpu"),
    (["--model", "gpt-5"], "--model"),
])
def test_bad_model_flags(args, fragment, capsys):
    expect_usage_error(["--device", "cpu", "--experiments", "A"] + args, capsys, fragment)


def test_a_named_model_with_fields_overridden_runs_a_and_b(tiny_args, tmp_path, capsys):
    # the open models' kind, shrunk by flags: GQA, gated MLP, RMSNorm, rotary positions, tied
    args = [a for a in tiny_args] + ["--model", "llama-3.2-1b", "--layers", "1", "--hidden",
                                     "64", "--heads", "8", "--kv-heads", "2", "--ffn-hidden",
                                     "96", "--vocab", "128", "--experiments", "AB",
                                     "--no-figures"]
    results, out = run_main(args, capsys)
    cfg = results["config"]["model"]
    assert (cfg["kv_heads"], cfg["mlp"], cfg["norm"], cfg["positions"], cfg["tied"]) == \
        (2, "gated", "rms", "rope", True)
    assert cfg["name"].startswith("llama-3.2-1b (layers=1, hidden=64, heads=8, kv-heads=2")
    assert all(r["step_ms"] > 0 for r in measured(results["A"]["rows"]))
    # KV reads pass weight reads 4x later than with all 8 heads keeping K and V
    mha = ModelConfig(**{**{k: v for k, v in cfg.items() if k in
                                ModelConfig.__dataclass_fields__}, "kv_heads": None})
    assert kv_bytes_per_token(mha) == 4 * cfg["layers"] * 2 * 16 * 4


def test_the_catalog(capsys):
    results, out = run_main(["--catalog"], capsys)
    rows = results["catalog"]["rows"]
    assert len(rows) == len(MODELS) * len(GPUS)
    by = {(r["model"], r["gpu"]): r for r in rows}
    assert by["llama-3-8b", "rtx-5080"]["kv_tokens"] == 0  # 16 GB of weights on a 16 GB card
    assert by["llama-3-8b", "rtx-5080"]["decode_b1_ms"] is None
    # (a property of the model alone: the same on every card)
    assert len({r["crossover_batch"] for r in rows if r["model"] == "llama-3-8b"}) == 1
    # the faster card prices the same step shorter
    assert by["llama-3-8b", "h200"]["decode_b1_ms"] < by["llama-3-8b", "h100"]["decode_b1_ms"]
    # where KV reads pass weight reads: weights / (1,024 tokens x KV bytes per token)
    llama = MODELS["llama-3-8b"]
    assert by["llama-3-8b", "h100"]["crossover_batch"] == kv_crossover_batch(llama, 1024) == \
        math.floor(flops_and_bytes(llama, 1, 1, 1024)["weight_bytes"] / (1024 * 131_072)) + 1
    assert said("does not fit", out.out) and said("H200 SXM", out.out)


@pytest.mark.parametrize("flags, tokens, rule", [
    # Llama-3.1-8B on an RTX 4090 (vLLM 0.19 logged 41,408 there: C is 9% over, README)
    (["--engine-profile", "vllm"], 45_184, "by vLLM's rule (0.9 of the card's memory"),
    # (0.1 of the card's 23.52 GiB less: 19,266 tokens of 131,072 bytes, to whole blocks)
    (["--engine-profile", "vllm", "--kv-fraction", "0.8"], 25_920,
     "by vLLM's rule (0.8 of the card's memory"),
    (["--engine-profile", "sglang"], 36_592, "by SGLang's rule (its mem_fraction_static"),
    ([], 15_039, "in 0.9 of the card's memory after the weights and 7 GB")])
def test_the_catalog_under_an_engine_profile(capsys, flags, tokens, rule):
    """--engine-profile sizes every card's cache by that engine's rule (at --kv-fraction where
    given) and prices its steps, and the header says which rule."""
    results, out = run_main(["--catalog"] + flags, capsys)
    by = {(r["model"], r["gpu"]): r for r in results["catalog"]["rows"]}
    assert by["llama-3.1-8b", "rtx-4090"]["kv_tokens"] == tokens
    assert results["catalog"]["profile"]["name"] == (flags[1] if flags else "tensorrt-llm")
    assert said(f"KV tokens that fit {rule}", out.out)


@pytest.mark.parametrize("card, flags, tokens", [
    ("rtx-4090", ["--engine-profile", "vllm"], 45_184),  # of 131,072
    ("h100", ["--engine-profile", "vllm"], None),  # 428,880 tokens
    ("h100", ["--engine-profile", "vllm", "--kv-tokens", "20000"], 20_000),  # (its size given)
    ("rtx-4090", ["--engine-profile", "sglang"], None)])  # (SGLang caps a request, and starts)
def test_vllm_refusing_to_start_short_of_the_models_context_is_said(
        tmp_path, capsys, card, flags, tokens):
    """vLLM's check_enough_kv_cache_memory (vllm/v1/core/kv_cache_utils.py) stops the engine
    where one request of max_model_len (by default the model's context) does not fit its KV
    cache; C says so, and what --max-model-len would start it."""
    results, out = run_main(["--experiments", "C", "--model", "llama-3.1-8b", "--gpu", card,
                             "--requests", "40", "--no-figures", "--out", str(tmp_path)] + flags,
                            capsys)
    kv = results["C"]["kv"]
    assert said("vllm serve would not start here", out.out) == bool(tokens)
    assert kv.get("engine_refuses") == (tokens and {"kind": "vllm_short_context",
                                                    "context": 131072, "tokens": tokens})
    if tokens:
        assert said(f"start it with --max-model-len {tokens:,} or less", out.out)


def test_the_catalogs_batch_1_price_of_llama_3_8b_on_an_h100_by_hand():
    # bf16 weights read once per step: 8,030,261,248 parameters less the token table
    # (128,256 x 4,096 = 525,336,576), whose one looked-up row (4,096) is all a step reads:
    # 7,504,928,768 x 2 bytes = 15.01 GB; 1,024 cached tokens of 131,072 bytes each (32 layers
    # x K and V x 8 heads x 128 x 2 bytes): 134 MB. At the roofline profile's 90% of the
    # H100's 3,350 GB/s: 4.978 + 0.045 = 5.02 ms. (Activations add 5 MB, 0.03%.)
    by = {(r["model"], r["gpu"]): r for r in catalog(profile_name="roofline")["rows"]}
    weights = (8_030_261_248 - 128_256 * 4_096 + 4_096) * 2
    kv = 1024 * 32 * 2 * 8 * 128 * 2
    assert ENGINE_PROFILES["roofline"].bandwidth_share == 0.9
    want_ms = 1e3 * (weights + kv) / (0.9 * 3350e9)
    assert want_ms == pytest.approx(5.023, abs=1e-3)
    assert by["llama-3-8b", "h100"]["decode_b1_ms"] == pytest.approx(want_ms, rel=1e-3)
    # the default, TensorRT-LLM's fitted profile: a fixed cost per pass and per layer, its
    # share of the bandwidth, and the activations' traffic once more (5 MB)
    tensorrt = {(r["model"], r["gpu"]): r for r in catalog()["rows"]}
    profile = ENGINE_PROFILES["tensorrt-llm"]
    fixed = profile.step_s + 32 * profile.layer_s
    want_ms = 1e3 * (fixed + (weights + kv) / (profile.bandwidth_share * 3350e9))
    assert tensorrt["llama-3-8b", "h100"]["decode_b1_ms"] == pytest.approx(want_ms, rel=1e-3)
