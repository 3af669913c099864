"""Ceilings, MBU/MFU from the one byte/FLOP model, the KV crossover, and CUDA graphs."""
import math

import pytest
import torch

import dataclasses
import nn40.experiment_ab
from nn40.accounting import kv_bytes_per_token, kv_crossover_batch, flops_and_bytes
from nn40.config import ModelConfig
from nn40.experiment_ab import Bench, measure_ceilings, roofline_row
from nn40.model import MoE, build_model, decode_step, grouped_mm_works, new_kv_cache
from nn40.settings import RunConfig
from nn40.timing import capture_blocker, cuda_graph

TINY = ModelConfig(layers=2, hidden=64, heads=4, vocab=97, max_positions=64, dtype="float32")


def test_ceilings_are_positive_and_finite_on_cpu():
    run = RunConfig.of(model=TINY, warmup=1, reps=5, time_budget_s=0.2)
    ceilings = measure_ceilings(run, torch.device("cpu"), log=lambda m: None)
    for key in ("bandwidth_gbs", "matmul_tflops", "ridge_flop_per_byte"):
        assert math.isfinite(ceilings[key]) and ceilings[key] > 0
    assert ceilings["ridge_flop_per_byte"] == pytest.approx(
        ceilings["matmul_tflops"] * 1e3 / ceilings["bandwidth_gbs"])


def test_given_peaks_replace_measurements():
    run = RunConfig.of(model=TINY, peak_bandwidth_gbs=1000.0, peak_tflops=100.0)
    ceilings = measure_ceilings(run, torch.device("cpu"), log=lambda m: None)
    assert (ceilings["bandwidth_gbs"], ceilings["matmul_tflops"]) == (1000.0, 100.0)
    assert ceilings["ridge_flop_per_byte"] == 100.0


def test_mbu_and_mfu_use_the_step_cost_model():
    ceilings = {"bandwidth_gbs": 1000.0, "matmul_tflops": 100.0, "ridge_flop_per_byte": 100.0}
    timing = {"median_ms": 2.0, "p10_ms": 1.9, "p90_ms": 2.2, "n": 10}
    cfg = ModelConfig()
    row = roofline_row(cfg, ceilings, timing, (8, 1, 128))
    cost = flops_and_bytes(cfg, 8, 1, 128)
    assert row["bytes"] == cost["bytes"] and row["flops"] == cost["flops"]
    assert row["mbu"] == pytest.approx(cost["bytes"] / 2e-3 / 1e12)
    assert row["mfu"] == pytest.approx(cost["flops"] / 2e-3 / 100e12)
    assert row["bound"] == "memory"  # intensity ~8 < ridge 100
    prefill = roofline_row(cfg, ceilings, timing, (1, 2048, 0))
    assert prefill["bound"] == "compute"


def test_kv_crossover_batch_by_hand():
    cfg = ModelConfig()
    context = 1024
    cost = flops_and_bytes(cfg, 1, 1, context)
    b = kv_crossover_batch(cfg, context)
    assert (b - 1) * cost["kv_read_bytes"] <= cost["weight_bytes"] < b * cost["kv_read_bytes"]
    # the post's model, fp16: 98,304 bytes of KV per token, so 100.7 MB per row at context
    # 1024, against 1.339 GB of weights read per step: 13.3 rows -> batch 14
    assert kv_bytes_per_token(cfg) == 98304 and cost["weight_bytes"] == 1_339_244_544
    assert b == 14


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
@torch.inference_mode()
def test_cuda_graph_gives_the_eager_logits():
    cfg = ModelConfig(layers=2, hidden=256, heads=4, vocab=1000, max_positions=128,
                        dtype="float32")
    device = torch.device("cuda")
    model = build_model(cfg, device)
    cache = new_kv_cache(cfg, 4, 33, device)
    tokens = torch.randint(cfg.vocab, (4,), device=device)
    out = {}

    def step():
        out["logits"] = decode_step(model, cache, tokens, 32)
    replay = cuda_graph(step)
    graphed_out = out["logits"]  # the graph's static output buffer
    for _ in range(3):
        tokens.copy_(torch.randint(cfg.vocab, (4,), device=device))
        replay()
        torch.cuda.synchronize()
        eager = decode_step(model, cache, tokens, 32)
        torch.testing.assert_close(graphed_out, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
@torch.inference_mode()
def test_cuda_moe_step_refused_in_its_loop_form_captured_in_its_grouped_form():
    # on the device: the loop's host syncs are caught before any capture begins (so a dense
    # capture after it still works), and where grouped_mm_works the grouped form is captured
    # and its replay gives the loop's logits
    cfg = ModelConfig(layers=2, hidden=256, heads=4, kv_heads=2, vocab=1000,
                        max_positions=128, dtype="bfloat16", mlp="gated", norm="rms",
                        positions="rope", experts=8, experts_per_token=2, expert_ffn=128)
    device = torch.device("cuda")
    model = build_model(cfg, device, seed=3)
    cache = new_kv_cache(cfg, 4, 33, device)
    tokens = torch.randint(cfg.vocab, (4,), device=device)
    moe = [m for m in model.modules() if isinstance(m, MoE)]
    for m in moe:
        m.set_grouped(False)
    assert capture_blocker(lambda: decode_step(model, cache, tokens, 32)) is not None
    dense = dataclasses.replace(cfg, experts=0, expert_ffn=None, ffn_hidden=512)
    dense_model = build_model(dense, device)
    cuda_graph(lambda: decode_step(dense_model, cache, tokens, 32))()  # (not poisoned)
    loop = decode_step(model, cache, tokens, 32)
    if not grouped_mm_works(device, torch.bfloat16):
        pytest.skip("torch._grouped_mm does not run on this device in bfloat16")
    for m in moe:
        m.set_grouped(True)
    out = {}

    def step():
        out["logits"] = decode_step(model, cache, tokens, 32)
    assert capture_blocker(step) is None
    cuda_graph(step)()
    torch.cuda.synchronize()
    torch.testing.assert_close(out["logits"].float(), loop.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("arch", ["transformer", "post"])
def test_a_graph_replays_on_fresh_inputs(arch, monkeypatch):
    # a CUDA graph replays the kernels it captured, copies included, from the tensors it
    # captured; so the step it captures must only read the input buffer, and the fresh
    # inputs must be copied in outside it. Checked on CPU by standing in for the capture.
    captured = []

    def capture(step):
        captured.append(step)
        return step
    monkeypatch.setattr(nn40.experiment_ab, "cuda_graph", capture)
    cfg = dataclasses.replace(TINY, arch=arch)
    run = RunConfig.of(model=cfg, warmup=1, reps=5, time_budget_s=0.1)
    bench = Bench(run, torch.device("cpu"))
    bench.time_decode(4, 8, mode="graph")
    step, = captured
    buffers = {}
    # the captured step reads its input buffer and copies nothing into it
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src: buffers.setdefault("copied",
                                                                                  True))
    step()
    assert "copied" not in buffers
