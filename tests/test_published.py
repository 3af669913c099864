"""C's prices against real engines: precision, tensor parallel, engine profiles, --validate."""
import csv
import dataclasses
import json
import os

import numpy as np
import pytest

import nn40.published
from nn40.accounting import (
    active_param_count, attention_flops_per_key, attention_weights, card_experts,
    card_kv_bytes_per_token, card_share, card_weight_bytes, dense_twin, ep_card_cost,
    expert_inclusion, experts_touched, kv_bytes_per_token, layer_weights, moe_step_bytes,
    param_count, flops_and_bytes, weight_bytes)
from nn40.cli import parse_args
from nn40.config import (
    CALIBRATION_CSV, GPUS, MODELS, ModelConfig, PUBLISHED_CSV, read_model_config)
from nn40.loop import simulate_serving
from nn40.pricing import (
    ENGINE_PROFILES, EngineProfile, StepCosts, card_costs, card_kv_terms, card_kv_tokens,
    pass_cost, pass_seconds)
from nn40.published import (
    Published, max_load_tokens_per_s, predict_published, read_published, row_model, validate)
from nn40.replicas import Replica
from nn40.runs import vllm_refuses
from nn40.tables_c import capacity_text
from nn40.text_ko import TEXT
from nn40.workload import Requests, read_engine_run
import fit_profiles as F
from test_cli import expect_usage_error, run_main, said

LLAMA2_7B_MATMULS = 32 * (2 * 4096 * 4096 + 2 * 4096 * 4096 + 3 * 4096 * 11008)  # 6,476,005,376
LLAMA2_7B_REST = 2 * 32000 * 4096 + (2 * 32 + 1) * 4096  # LM head, token table, norms (16-bit)
needs_calibration = pytest.mark.skipif(not os.path.exists(CALIBRATION_CSV),
                                       reason="../shared/published/calibration.csv is absent")


def with_format(name, **fields):
    return dataclasses.replace(MODELS[name], **fields)


@pytest.mark.parametrize("weights, per_weight", [
    ("bf16", 2), ("fp16", 2), ("fp8", 1),
    ("int8", 1 + 2 / 4096),      # one 2-byte scale per output channel of 4,096 inputs
    ("int4", 0.5 + 4 / 32)])     # a 2-byte scale and a 2-byte zero per group of 32
def test_weight_bytes_of_llama_2_7b_in_each_format_by_hand(weights, per_weight):
    assert LLAMA2_7B_MATMULS == 6_476_005_376
    cfg = with_format("llama-2-7b", weights=weights)
    assert cfg.weight_element_bytes == per_weight
    assert weight_bytes(cfg) == pytest.approx(LLAMA2_7B_MATMULS * per_weight
                                                + LLAMA2_7B_REST * 2, rel=1e-12)
    # a decode step reads every matmul weight, the LM head and one row of the token table
    read = flops_and_bytes(cfg, 1, 1, 0)["weight_bytes"]
    assert read == pytest.approx(LLAMA2_7B_MATMULS * per_weight
                                 + (32000 * 4096 + 65 * 4096 + 4096) * 2, rel=1e-12)


def test_an_fp8_kv_cache_halves_the_bytes_per_token():
    # Llama-3.1-8B: 32 layers x K and V x 8 heads x 128 x 2 bytes = 131,072; in fp8 65,536
    assert kv_bytes_per_token(MODELS["llama-3.1-8b"]) == 131_072
    cfg = with_format("llama-3.1-8b", kv_dtype="fp8")
    assert kv_bytes_per_token(cfg) == 65_536
    assert flops_and_bytes(cfg, 4, 1, 100)["kv_read_bytes"] == 4 * 100 * 65_536


def test_tensor_parallel_shards_by_hand():
    cfg = MODELS["llama-3.1-70b"]  # 8 K/V heads, 80 layers, 128 wide
    norms = (2 * 80 + 1) * 8192 * 2
    assert card_weight_bytes(cfg, 4) == pytest.approx((weight_bytes(cfg) - norms) / 4 + norms)
    assert card_kv_bytes_per_token(cfg, 4) == 80 * 2 * 2 * 128 * 2      # two heads a card
    assert card_kv_bytes_per_token(cfg, 8) == 80 * 2 * 1 * 128 * 2      # one
    assert card_kv_bytes_per_token(cfg, 16) == 80 * 2 * 1 * 128 * 2     # one, copied
    cost = flops_and_bytes(cfg, 8, 1, 64)
    share = card_share(cfg, cost, 4)
    assert share["matmul_flops"] == cost["matmul_flops"] / 4
    assert share["kv_read_bytes"] == cost["kv_read_bytes"] / 4
    assert share["weight_bytes"] == pytest.approx((cost["weight_bytes"] - norms) / 4 + norms)
    assert card_share(cfg, cost, 1)["collective_bytes"] == 0


def test_all_reduce_bytes_by_hand():
    # two ring all-reduces a layer of tokens x hidden x 2 bytes, each card sending 2 (tp-1)/tp
    # of it: Llama-3.1-8B, 10 tokens on 4 cards: 2 x 32 x 10 x 4,096 x 2 x 2 x 3/4 = 7,864,320
    cfg = MODELS["llama-3.1-8b"]
    share = card_share(cfg, flops_and_bytes(cfg, 10, 1, 0), 4)
    assert share["collective_bytes"] == 7_864_320


def test_a_pass_price_by_hand():
    cfg, card = MODELS["llama-3.1-8b"], GPUS["h100"]
    profile = EngineProfile("hand", bandwidth_share=0.5, matmul_share=0.5, half_tokens=100,
                              step_s=1e-3, layer_s=2e-5, allreduce_s=1e-5, link_share=0.5,
                              activation_passes=0.5)
    for tokens, tp in ((1, 1), (4096, 1), (64, 2)):
        cost = card_share(cfg, flops_and_bytes(cfg, tokens, 1, 0), tp)
        bandwidth = 3350e9 * 0.5
        matmul = max(cost["matmul_flops"] / (989.4e12 * 0.5 * tokens / (tokens + 100)),
                     (cost["weight_bytes"] + cost["activation_bytes"]) / bandwidth)
        want = 1e-3 + 32 * 2e-5 + matmul + (cost["kv_write_bytes"]
                                            + 0.5 * cost["activation_bytes"]) / bandwidth
        if tp > 1:
            want += 2 * 32 * 1e-5 + cost["collective_bytes"] / (450e9 * 0.5)
        assert pass_seconds(cfg, card, profile, tp, tokens) == pytest.approx(want, rel=1e-12)
    costs = card_costs(cfg, card, profile, 2)
    assert costs.kv_token_s == pytest.approx(131_072 / 2 / bandwidth)
    # weight-only int8 on 2 cards: each dequantizes its half of the matmul weights
    int8 = with_format("llama-3.1-8b", weights="int8")
    dq = dataclasses.replace(profile, dequant_flops=20.0)
    extra = 32 * layer_weights(int8) / 2 * 20.0 / 989.4e12
    assert pass_seconds(int8, card, dq, 2, 1) == pytest.approx(
        pass_seconds(int8, card, profile, 2, 1) + extra, rel=1e-12)


def test_wide_heads_attention_costs_by_hand():
    # 8 heads of 16 on a width of 64: q is 128 wide, K and V 2 heads x 16 = 32
    cfg = ModelConfig(layers=2, hidden=64, heads=8, kv_heads=2, head_width=16, vocab=97,
                        max_positions=64, dtype="float32", mlp="gated", ffn_hidden=96,
                        norm="rms", positions="rope")
    assert (cfg.q_dim, cfg.kv_dim) == (128, 32)
    assert layer_weights(cfg) == 2 * 64 * 128 + 2 * 64 * 32 + 3 * 64 * 96
    cost = flops_and_bytes(cfg, 3, 1, 10)  # 3 rows, 1 new token each after 10 cached
    # QK^T and PV: 2 x 16 FLOPs each per head per key, 8 heads, 11 keys, 2 layers, 3 rows
    assert cost["attention_flops"] == 4 * 16 * 8 * 11 * 2 * 3
    # a token's activations: qkv in 64, out 128 + 2 x 32; attention's q in and out 2 x 128;
    # proj in 128, out 64; the gated MLP (64 + 2 x 96) + (96 + 64); the logits once a row
    per_token = 64 + 192 + 256 + 192 + (64 + 192) + (96 + 64)
    assert cost["activation_bytes"] == (2 * per_token * 3 + 3 * 97) * 4


def test_fp8_matmuls_run_at_the_fp8_rate_where_the_card_has_one():
    profile = ENGINE_PROFILES["roofline"]
    bf16, fp8 = MODELS["llama-3.1-8b"], with_format("llama-3.1-8b", weights="fp8")
    big = 16384  # compute-bound: the FLOPs set the price
    h100 = [pass_seconds(c, GPUS["h100"], profile, 1, big) for c in (bf16, fp8)]
    a100 = [pass_seconds(c, GPUS["a100-80gb"], profile, 1, big) for c in (bf16, fp8)]
    assert h100[1] == pytest.approx(h100[0] / 2, rel=0.02)  # 1,978.9 against 989.4 TFLOP/s
    assert a100[1] == pytest.approx(a100[0], rel=0.02)      # no FP8 units: the 16-bit rate
    # at batch 1 the bytes set it: fp8 weights are half the bytes
    one = [pass_seconds(c, GPUS["a100-80gb"], profile, 1, 1) for c in (bf16, fp8)]
    assert one[1] < 0.55 * one[0]


def test_card_kv_tokens_by_hand():
    cfg, card = MODELS["llama-3.1-8b"], GPUS["h100"]
    profile = EngineProfile("hand", 0.9, 0.8, reserved_gb=2.0, kv_fraction=0.9)
    free = 81559 * 2**20 - weight_bytes(cfg) - 2e9
    assert card_kv_tokens(cfg, card, profile) == int(0.9 * free // 131_072)
    # a model larger than the card: nothing fits
    assert card_kv_tokens(MODELS["llama-3.1-70b"], card, profile) == 0


def test_max_load_steady_state_by_hand():
    costs = StepCosts((1, 100000), (0.01, 0.01), 0.0, {"kind": "hand"})
    profile = EngineProfile("hand", 1, 1, max_batch=64, max_tokens=8192)
    # 10,000 KV tokens hold 10,000 // (100 + 100) = 50 whole requests: 50 rows, 10 ms a step
    assert max_load_tokens_per_s(costs, 10_000, profile, 100, 100) == pytest.approx(5000)
    # the batch limit binds: 64 rows
    assert max_load_tokens_per_s(costs, 10**6, profile, 100, 100) == pytest.approx(6400)
    # the tokens per pass bind: rows x (1 + 2,000 / 100) <= 8,192 -> 390.1 rows (fractional)
    wide = dataclasses.replace(profile, max_batch=10**4)
    assert max_load_tokens_per_s(costs, 10**8, wide, 2000, 100) == pytest.approx(
        8192 / 21 / 0.01)
    assert max_load_tokens_per_s(costs, 150, profile, 100, 100) is None  # not one fits
    # the cache's reads: every row holds isl + osl/2 tokens on average
    kv = dataclasses.replace(costs, kv_token_s=1e-7)
    assert max_load_tokens_per_s(kv, 10_000, profile, 100, 100) == pytest.approx(
        50 / (0.01 + 1e-7 * 50 * 150))
    # and the prompts' attention: 50 / 100 prompts start a step, 5,050 pairs each
    pairs = dataclasses.replace(costs, pair_s=1e-7)
    assert max_load_tokens_per_s(pairs, 10_000, profile, 100, 100) == pytest.approx(
        50 / (0.01 + 1e-7 * 0.5 * 5050))


def test_prompt_attention_priced_by_its_pairs_by_hand():
    cfg, card = MODELS["llama-3.1-8b"], GPUS["h100"]
    profile = EngineProfile("hand", 0.5, 0.5)
    costs = card_costs(cfg, card, profile)
    # QK^T and PV: 2 x 4,096 FLOPs each, a (query, key) pair, in each of 32 layers
    assert costs.pair_s == pytest.approx(4 * 4096 * 32 / (989.4e12 * 0.5))
    assert card_costs(cfg, card, profile, tp=2).pair_s == pytest.approx(costs.pair_s / 2)
    # a decode's key: 131,072 bytes at 1,675 GB/s outweigh its 524,288 FLOPs
    assert costs.kv_token_s == pytest.approx(131_072 / (3350e9 * 0.5))
    # latent attention's absorbed key: 2 x 128 heads x (2 x 512 + 64) FLOPs a layer against
    # 1,152 bytes (its latent and rotary key in bf16), 242 FLOPs a byte, past an H200's 206:
    # a decode's key at its FLOPs; over 8 cards each has 16 heads but the whole latent
    mla, h200 = MODELS["deepseek-v3"], GPUS["h200"]
    ds = card_costs(mla, h200, profile)
    assert ds.pair_s == pytest.approx(2 * 128 * (2 * 512 + 64) * 61 / (989.4e12 * 0.5))
    assert ds.kv_token_s == ds.pair_s
    tp8 = card_costs(mla, h200, profile, tp=8)
    assert tp8.kv_token_s == pytest.approx(70_272 / (4800e9 * 0.5)) and tp8.kv_token_s > tp8.pair_s


def test_chunked_prefill_pays_each_chunks_pairs_by_hand():
    # one prompt of 10 tokens in chunks of 4, 4 and 2 (then 2 output tokens), every pass 1 s
    # and each attention pair 1 ms: the chunks see 4 x 0 + 10, 4 x 4 + 10 and 2 x 8 + 3 pairs
    costs = StepCosts((1, 2), (1.0, 1.0), 0.0, "unit", pair_s=1e-3)
    req = Requests(np.zeros(1), np.array([10]), np.array([2]))
    for fused in (False, True):
        sim = simulate_serving(req, Replica(1, costs, "chunked", 4, fused=fused))
        assert sim["prefill_s"] == pytest.approx(3 + 1e-3 * (10 + 26 + 19))
        assert sim["times"].first_token[0] == pytest.approx(3 + 0.055)


@pytest.mark.parametrize("scheduler", ["static", "continuous", "chunked"])
@pytest.mark.parametrize("fused", [False, True])
def test_every_prompt_pays_its_pairs_once_however_it_is_chunked(scheduler, fused):
    # all waiting at 0, so pricing cannot change the schedule: pricing the pairs adds their
    # seconds, sum over prompts of P (P + 1) / 2, whatever the chunks and the decodes beside
    rng = np.random.default_rng(3)
    prompt, output = rng.integers(1, 300, 40), rng.integers(1, 60, 40)
    req = Requests(np.zeros(40), prompt, output)
    costs = StepCosts((1, 64, 512), (0.01, 0.02, 0.1), 1e-6, "hand")
    replica = Replica(8, costs, scheduler, 96, fused=fused)
    plain = simulate_serving(req, replica)
    priced = simulate_serving(req, dataclasses.replace(
        replica, costs=dataclasses.replace(costs, pair_s=1e-7)))
    assert priced["steps"] == plain["steps"]
    added = priced["prefill_s"] + priced["decode_s"] - plain["prefill_s"] - plain["decode_s"]
    assert added == pytest.approx(1e-7 * sum(p * (p + 1) // 2 for p in prompt.tolist()))


def test_predictions_of_each_kind_of_row_by_hand():
    profile = ENGINE_PROFILES["gpt-fast"]
    row = Published("hand", "gpt-fast", "llama-2-7b", "a100-80gb", 1, "bf16", "auto", 1, 5,
                      200, "tokens_per_s_per_user", 100.0, "validation")
    costs = card_costs(row_model(row), GPUS["a100-80gb"], profile, 1)
    assert costs.pair_s > 0
    # the prompt's pass computes 1 + 2 + ... + 5 = 15 attention pairs
    seconds = costs.pass_s(5, 0, 15) + sum(costs.pass_s(1, 5 + j) for j in range(199))
    assert predict_published(row, profile) == pytest.approx(200 / seconds, rel=1e-9)
    ttft = row._replace(metric="ttft_ms", isl=128, osl=1)
    assert predict_published(ttft, profile) == pytest.approx(
        1e3 * costs.pass_s(128, 0, 128 * 129 / 2))
    static = row._replace(batch=8, isl=64, osl=32, metric="output_tokens_per_s")
    seconds = costs.pass_s(8 * 64, 0, 8 * 64 * 65 / 2) + \
        sum(costs.pass_s(8, 8 * (64 + j)) for j in range(31))
    assert predict_published(static, profile) == pytest.approx(8 * 32 / seconds, rel=1e-9)


def write_rows(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


THREE_ROWS = [
    dict(source_id="gptfast_hand", model="Llama-2-7B", gpu="A100 80GB", tp=1, weights="bf16",
         kv_dtype="bf16", batch=1, isl=5, osl="", metric="tokens_per_s_per_user", value=100),
    dict(source_id="trtllm_hand", model="Llama-3.1-8B", gpu="H100 80GB HBM3", tp=1,
         weights="fp8", kv_dtype="fp8", batch="max-load", isl=128, osl=128,
         metric="output_tokens_per_s", value=25000),
    dict(source_id="gptfast_hand", model="Llama-2-7B", gpu="A100 80GB", tp=4, weights="bf16",
         kv_dtype="bf16", batch=1, isl=5, osl="", metric="tokens_per_s_per_user", value=250),
    dict(source_id="trtllm_hand", model="Falcon-180B", gpu="H100 80GB HBM3", tp=2,
         weights="fp8", kv_dtype="fp8", batch="max-load", isl=128, osl=128,
         metric="output_tokens_per_s", value=24000),
    dict(source_id="trtllm_hand", model="Llama-3.1-8B", gpu="H100 80GB HBM3", tp=1,
         weights="fp8", kv_dtype="fp8", batch="server-slo", isl=128, osl=128,
         metric="output_tokens_per_s", value=20000),
    dict(source_id="trtllm_hand", model="Llama-3.1-8B", gpu="H100 80GB HBM3", tp=1,
         weights="fp8", kv_dtype="fp8", batch=8, isl=128, osl=128,
         metric="tpot_ms_p50", value=9)]


def test_validate_on_a_three_row_file(tmp_path, capsys):
    # (and three more C cannot express: a model it lacks, an SLO-bound load, a metric)
    path = tmp_path / "three.csv"
    write_rows(path, THREE_ROWS)
    results, out = run_main(["--validate", str(path), "--calibration", str(tmp_path / "none"),
                             "--out", str(tmp_path)], capsys)
    V = results["validation"]
    assert [r["model"] for r in V["rows"]] == ["llama-2-7b", "llama-3.1-8b", "llama-2-7b"]
    assert V["left_out"] == {"model Falcon-180B": 1, "batch server-slo": 1,
                             "metric tpot_ms_p50": 1}
    first = V["rows"][0]
    row = Published(**{k: first[k] for k in Published._fields})
    got = predict_published(row, ENGINE_PROFILES["gpt-fast"])  # osl: gpt-fast's 200
    assert first["osl"] == 200 and first["predicted"] == pytest.approx(got)
    assert first["error"] == pytest.approx(got / 100 - 1)
    assert first["profile"] == "gpt-fast" and V["rows"][1]["profile"] == "tensorrt-llm"
    summary = {(s["role"], s["source"]): s for s in V["summary"]}
    assert summary["validation", "all"]["rows"] == 3
    assert summary["validation", "all"]["median_abs"] == pytest.approx(
        sorted(abs(r["error"]) for r in V["rows"])[1])  # (the middle one of three)
    assert summary["validation", "gptfast_hand"]["rows"] == 2
    saved = json.loads((tmp_path / "validation.json").read_text())
    assert len(saved["validation"]["rows"]) == 3
    assert said("Falcon-180B", out.out) and said("gptfast_hand", out.out)


def test_validate_refuses_a_file_that_is_not_published_rows(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    for text in ("a,b\n1,2\n", "source_id,model,gpu,tp\ntrtllm_x,Llama-3.1-8B,L40S,1\n",
                 "\xff\xfe\x00junk"):
        bad.write_bytes(text.encode("latin-1"))
        assert "not a file of published rows" in expect_usage_error(
            ["--validate", str(bad), "--out", str(tmp_path)], capsys)
    assert "cannot read" in expect_usage_error(
        ["--validate", str(tmp_path / "missing.csv"), "--out", str(tmp_path)], capsys)


def test_the_projects_published_rows_all_name_a_source_and_are_expressible():
    rows, left = read_published(PUBLISHED_CSV, "validation")
    assert len(rows) >= 150 and not left
    assert {r.source for r in rows} == {"trtllm_perf_v0.14.0", "gptfast_readme_0f925b5"}


@needs_calibration
def test_no_row_is_both_calibration_and_validation():
    def key(r):
        return (r.engine, r.model, r.gpu, r.tp, r.weights, r.batch, r.isl, r.osl, r.metric)
    cal, _ = read_published(CALIBRATION_CSV, "calibration")
    val, _ = read_published(PUBLISHED_CSV, "validation")
    assert len(cal) >= 50 and not {key(r) for r in cal} & {key(r) for r in val}


@needs_calibration
def test_the_committed_profiles_are_the_fit_on_calibration_rows_alone(monkeypatch):
    cal, _ = read_published(CALIBRATION_CSV, "calibration")
    seen = []
    real = predict_published

    def recording(row, profile):
        seen.append(row)
        return real(row, profile)
    monkeypatch.setattr(nn40.published, "predict_published", recording)
    for engine in ("gpt-fast", "tensorrt-llm"):
        fitted, _ = F.refit(engine, cal)
        for field in F.FIT_FIELDS:
            committed = getattr(ENGINE_PROFILES[engine], field)
            assert getattr(fitted, field) == pytest.approx(committed), field
    assert seen and {r.role for r in seen} == {"calibration"}
    assert not {r.model for r in seen} & {"mixtral-8x7b", "mixtral-8x22b"}  # (checked, not fit)
    assert len(F.fit_rows(cal, "tensorrt-llm")) == 48 and len(F.fit_rows(cal, "gpt-fast")) == 6


@needs_calibration
def test_the_fitted_profiles_meet_the_calibration_target():
    V = validate(PUBLISHED_CSV, CALIBRATION_CSV)
    summary = {(s["role"], s["source"]): s for s in V["summary"]}
    assert summary["calibration", "all"]["median_abs"] <= 0.10
    assert summary["validation", "all"]["median_abs"] <= 0.15


def test_c_runs_a_tensor_parallel_replica_in_fp8(tmp_path, capsys):
    argv = ["--experiments", "C", "--model", "llama-3.1-70b", "--gpu", "h100", "--requests",
            "200", "--rates", "5", "--no-figures", "--out", str(tmp_path)]
    results, out = run_main(argv + ["--tp", "4", "--weights", "fp8", "--kv-dtype", "fp8"],
                            capsys)
    source = results["C"]["cost_model"]["source"]
    assert (source["tp"], source["weights"], source["kv_dtype"]) == (4, "fp8", "fp8")
    assert source["profile"] == "tensorrt-llm" and said("4 x H100 SXM", out.out)
    cfg = with_format("llama-3.1-70b", weights="fp8", kv_dtype="fp8")
    tokens = card_kv_tokens(cfg, GPUS["h100"], ENGINE_PROFILES["tensorrt-llm"], 4)
    assert results["C"]["kv"]["budget_tokens"] == tokens
    assert results["C"]["kv"]["bytes_per_token"] == 80 * 2 * 8 * 128  # fp8: a byte each
    # one card cannot hold the bf16 model: a clear line, not a traceback
    assert "give --tp 2 (it divides the 64 heads)" in expect_usage_error(argv, capsys)


@pytest.mark.parametrize("argv, says", [
    (["--experiments", "C", "--tp", "2"], "--tp prices a named card"),
    (["--experiments", "C", "--engine-profile", "vllm"], "--engine-profile prices a named card"),
    (["--weights", "int4", "--gpu", "h100"], "--weights and --kv-dtype price C only"),
    (["--experiments", "C", "--gpu", "h100", "--tp", "3"], "--tp 3 must divide the model's"),
])
def test_precision_and_parallel_flags_that_contradict(argv, says, capsys, tmp_path):
    assert says in expect_usage_error(argv + ["--out", str(tmp_path)], capsys)


def test_a_fused_step_reads_the_weights_once():
    # one pass of 64 prompt tokens and 4 decodes, against a prefill pass and a decode pass:
    # flat passes of 10 ms (f) and 1 us per cached token, caches of 100 tokens each
    costs = StepCosts((1, 1000), (0.01, 0.01), 1e-6, {"kind": "hand"})
    req = Requests(np.zeros(5), np.array([100, 100, 100, 100, 64]),
                     np.array([50, 50, 50, 50, 2]))
    sims = {fused: simulate_serving(req, Replica(8, costs, "chunked", 512, fused=fused))
            for fused in (False, True)}
    # step 1 prefills all five prompts (464 tokens): one pass either way, 10 ms + nothing cached
    for sim in sims.values():
        assert sim["times"].first_token[0] == pytest.approx(0.01)
    # then every step decodes; with nothing left to prefill, fused or not, one pass each
    assert sims[True]["times"].finish.max() == pytest.approx(sims[False]["times"].finish.max())
    # a step with prompt left and decodes: two passes' fixed costs, or one
    req2 = Requests(np.array([0.0, 0.005]), np.array([10, 300]), np.array([5, 3]))
    split, fused = (simulate_serving(req2, Replica(8, costs, "chunked", 100, fused=f))
                    for f in (False, True))
    assert fused["times"].first_token[1] < split["times"].first_token[1]


def test_the_fused_price_of_one_step_by_hand():
    # three prompts of 99 prefill in step 1 (one pass of 297 tokens, nothing cached); a fourth,
    # arriving meanwhile with 30 of its 70 prompt tokens cached, prefills its other 40 in
    # step 2 beside the three decodes, each holding 100 tokens: one pass of 43 tokens
    costs = StepCosts((1, 1000), (0.01, 0.02), 2e-6, {"kind": "hand"})
    req = Requests(np.array([0, 0, 0, 0.001]), np.array([99, 99, 99, 70]),
                     np.array([5, 5, 5, 2]), cached=np.array([0, 0, 0, 30]))
    sim = simulate_serving(req, Replica(4, costs, "continuous", fused=True))

    def f(tokens):  # the pass of this many tokens, interpolated
        return 0.01 + 0.01 * (tokens - 1) / 999
    step1, step2 = f(297), f(43) + 2e-6 * (30 + 300)
    assert sim["times"].first_token.tolist() == pytest.approx([step1] * 3 + [step1 + step2])
    # the fused step's seconds split by its tokens: 40 of 43 to the prefill
    assert sim["prefill_s"] == pytest.approx(step1 + step2 * 40 / 43)


def test_vllms_kv_cache_is_a_share_of_the_whole_card():
    # (its every term by hand: tests/test_engines.py)
    cfg, card = MODELS["llama-3.1-8b"], GPUS["rtx-4090"]
    terms = card_kv_terms(cfg, card, ENGINE_PROFILES["vllm"])
    free = 0.9 * 24081 * 2**20 - weight_bytes(cfg) - terms["activation"] - 0.25 * 2**30
    assert terms["tokens"] == max(int(free // 131_072), 0) // 16 * 16


VLLM_LOG = [  # three requests as LLMServingSim's vLLM runs log them (seconds, engine clock)
    {"input_toks": 10, "output_toks": 5, "queued_ts": 100.0, "first_token_ts": 100.2,
     "last_token_ts": 100.6},
    {"input_toks": 20, "output_toks": 1, "queued_ts": 100.5, "first_token_ts": 100.9,
     "last_token_ts": 100.9},
    {"input_toks": 0, "output_toks": 3, "queued_ts": 101.0, "first_token_ts": 101.1,
     "last_token_ts": 101.5}]


def test_reading_an_engines_logged_requests_by_hand(tmp_path):
    log = tmp_path / "requests.jsonl"
    log.write_text("\n".join(json.dumps(r) for r in VLLM_LOG) + "\n")
    (tmp_path / "meta.json").write_text(json.dumps({
        "vllm_version": "0.19.0", "engine_kwargs": {"max_num_seqs": 7,
                                                    "max_num_batched_tokens": 64},
        "kv_cache": {"num_kv_tokens": 4096}}))
    run = read_engine_run(str(log))
    assert run["prompt"].tolist() == [10, 20, 1] and run["output"].tolist() == [5, 1, 3]
    assert run["arrival_s"] == pytest.approx([0.0, 0.5, 1.0])
    assert run["ttft_s"] == pytest.approx([0.2, 0.4, 0.1])
    assert run["tpot_s"] == pytest.approx([0.4 / 4, 0.4 / 2])  # (one-token requests: none)
    assert run["e2e_s"] == pytest.approx([0.6, 0.4, 0.5])
    assert run["settings"] == {"engine": "vLLM 0.19.0", "max_num_seqs": 7,
                               "max_num_batched_tokens": 64, "num_kv_tokens": 4096}
    # DistServe's: a Python list on the first line, in completion order, then a summary
    exp = tmp_path / "vllm-1-1.exp"
    exp.write_text(repr([{"prompt_len": 8, "output_len": 3, "issue_time": 5.0,
                          "ttft_ms": 30.0, "tpot_ms": 10.0, "latency_ms": 50.0},
                         {"prompt_len": 4, "output_len": 2, "issue_time": 4.0,
                          "ttft_ms": 20.0, "tpot_ms": 5.0, "latency_ms": 25.0}])
                   + "\n{\n\tnum_requests: 2\n}\n")
    run = read_engine_run(str(exp))
    assert run["prompt"].tolist() == [4, 8] and run["arrival_s"] == pytest.approx([0, 1])
    assert run["tpot_s"] == pytest.approx([0.005, 0.010]) and run["settings"] == {}


def test_a_bad_engine_log_is_one_line(tmp_path, capsys):
    bad = tmp_path / "requests.jsonl"
    bad.write_text('{"input_toks": 3}\n')
    assert "not a log of an engine's requests" in expect_usage_error(
        ["--experiments", "C", "--trace", str(bad), "--out", str(tmp_path)], capsys)


def test_c_replays_an_engines_run_beside_its_measurements(tmp_path, capsys):
    log = tmp_path / "requests.jsonl"
    log.write_text("\n".join(json.dumps(r) for r in VLLM_LOG) + "\n")
    (tmp_path / "meta.json").write_text(json.dumps({  # (vLLM v1's default, as it says)
        "vllm_version": "0.19.0", "kv_cache": {"enable_prefix_caching": True}}))
    results, out = run_main(["--experiments", "C", "--trace", str(log), "--rate", "trace",
                             "--model", "llama-3.1-8b", "--gpu", "rtx-4090", "--engine-profile",
                             "vllm", "--slots", "4", "--chunk-tokens", "64", "--kv-tokens",
                             "4096", "--rates", "5", "--no-figures", "--out", str(tmp_path)],
                            capsys)
    E = results["C"]["engine_run"]
    assert E["measured"]["ttft_s"]["p50"] == pytest.approx(0.2)
    assert E["measured"]["tpot_s"]["p50"] == pytest.approx(0.15)
    chunked = E["simulated"]["kv paged chunked"]
    assert chunked["error"]["e2e_s"]["p50"] == pytest.approx(
        chunked["e2e_s"]["p50"] / 0.5 - 1)
    assert results["C"]["kv"]["budget_tokens"] == 4096
    assert said("C against the engine's own run", out.out) and "max_num_seqs 4" not in out.out
    assert E["settings"]["prefix_caching"] == "on"  # (said, and C replays it without hits)
    assert said(TEXT["en"]["replay_cached"].format(runs=TEXT["en"]["engine_measured"]),
                out.out)


def test_a_logged_runs_replay_runs_as_the_run_ran(tmp_path, capsys):
    """Its seats, step budget and KV cache are its meta.json's where no flag gives them (the
    engine profile's defaults on the card are another engine's settings); a flag still wins,
    and D's block pool stays --kv-tokens's alone."""
    log = tmp_path / "requests.jsonl"
    log.write_text("\n".join(json.dumps(r) for r in VLLM_LOG) + "\n")
    (tmp_path / "meta.json").write_text(json.dumps({
        "vllm_version": "0.19.0", "engine_kwargs": {"max_num_seqs": 7,
                                                    "max_num_batched_tokens": 64,
                                                    "max_model_len": 2048},
        "kv_cache": {"num_kv_tokens": 4096},
        "hardware": {"device_name": "NVIDIA GeForce RTX 4090"}}))
    flags = ["--experiments", "C", "--trace", str(log), "--rate", "trace", "--model",
             "llama-3.1-8b", "--gpu", "rtx-4090", "--engine-profile", "vllm"]
    run = parse_args(flags)
    assert (run.scheduler.serve_slots, run.scheduler.serve_chunk_tokens,
            run.scheduler.serve_source) == (7, 64, "logged")
    assert run.scheduler.serve_kv_tokens == 4096 and run.scheduler.kv_tokens is None
    given = parse_args(flags + ["--slots", "4", "--kv-tokens", "2048"]).scheduler
    assert (given.serve_slots, given.serve_chunk_tokens, given.serve_source) == \
        (4, 64, "logged+flag")
    assert (given.kv_tokens, given.serve_kv_tokens) == (2048, None)
    plain = parse_args(flags[:2] + flags[6:]).scheduler  # (no engine's log: the profile's)
    assert plain.serve_source == "vllm_small" and plain.serve_slots == 256
    results, out = run_main(flags + ["--rates", "5", "--no-figures", "--out",
                                     str(tmp_path / "out")], capsys)
    assert results["C"]["engine_run"]["run"] == {"slots": 7, "chunk_tokens": 64,
                                                 "kv_tokens": 4096, "rate": "trace"}
    assert results["C"]["kv"]["budget_tokens"] == 4096
    assert "engine_refuses" not in results["C"]["kv"]  # (its 2,048-token context fits)
    assert said("C's: 7 slots, 64 tokens a step, 4,096 KV tokens", out.out)
    short = parse_args(flags + ["--kv-tokens", "1024"])  # (under its context: it would not
    assert vllm_refuses(short, 1024) == {"kind": "vllm_short_max_model_len",  # start)
                                         "context": 2048, "tokens": 1024}
    assert results["C"]["who_waits"]["slots"] == 7  # (its study runs the same replica)
    assert said("through continuous batching, 7 slots", out.out)


def logged_run(tmp_path, meta):
    """VLLM_LOG as LLMServingSim keeps it, with this meta.json beside it. -> the log's path."""
    log = tmp_path / "requests.jsonl"
    log.write_text("\n".join(json.dumps(r) for r in VLLM_LOG) + "\n")
    (tmp_path / "meta.json").write_text(meta if isinstance(meta, str) else json.dumps(meta))
    return str(log)


@pytest.mark.parametrize("meta, why", [
    ({"kv_cache": {"num_kv_tokens": "4096"}}, "num_kv_tokens must be a whole number"),
    ({"engine_kwargs": {"max_num_seqs": "8"}}, "max_num_seqs must be a whole number"),
    ({"engine_kwargs": {"max_num_seqs": 0}}, "max_num_seqs must be a whole number"),
    ({"engine_kwargs": {"max_num_seqs": -4}}, "max_num_seqs must be a whole number"),
    ({"kv_cache": {"num_kv_tokens": True}}, "num_kv_tokens must be a whole number"),
    ({"kv_cache": {"num_kv_tokens": 4096.7}}, "num_kv_tokens must be a whole number"),
    ({"resolved_config": {"cache_config": [1]}}, "cache_config must be an object"),
    ({"kv_cache": "x"}, "kv_cache must be an object"),
    ([1, 2], "expected a JSON object"), ("{not json", "not JSON")])
def test_a_logged_runs_odd_meta_json_is_one_line(tmp_path, capsys, meta, why):
    """Its values set C's seats, step budget and cache: each checked as vLLM writes it (a count
    of at least 1, an object), else one line naming the file and the field."""
    log = logged_run(tmp_path, meta)
    out = expect_usage_error(["--experiments", "C", "--trace", log, "--rate", "trace",
                              "--model", "llama-3.1-8b", "--gpu", "rtx-4090", "--engine-profile",
                              "vllm", "--no-figures", "--out", str(tmp_path / "out")], capsys, why)
    assert "meta.json" in out
    logged_run(tmp_path, {"engine_kwargs": None, "kv_cache": None})  # (null: nothing logged)
    nothing = parse_args(["--experiments", "C", "--trace", log, "--gpu", "rtx-4090"]).scheduler
    assert (nothing.serve_source, nothing.serve_kv_tokens) == ("profile", None)


def test_the_logged_cache_is_the_runs_only_on_its_own_card_and_when_no_flag_sizes_it(tmp_path):
    """The log's seats and step budget are its engine's settings; its KV tokens are its card's
    and TP's cache: another card, another TP, or a flag that sizes the cache (tokens, memory,
    the engine's fraction) leaves them out. A log that gives one limit of two says both
    sources."""
    log = logged_run(tmp_path, {"hardware": {"device_name": "NVIDIA GeForce RTX 4090"},
                                "engine_kwargs": {"max_num_seqs": 7},
                                "kv_cache": {"num_kv_tokens": 4096}})
    base = ["--experiments", "C", "--trace", log, "--model", "llama-3.1-8b", "--engine-profile",
            "vllm"]
    mine = parse_args(base + ["--gpu", "rtx-4090"]).scheduler
    assert (mine.serve_slots, mine.serve_chunk_tokens, mine.serve_kv_tokens) == (7, 2048, 4096)
    assert mine.serve_source == "vllm_small+logged"
    for other in (["--gpu", "h100"], ["--gpu", "rtx-4090", "--tp", "2"],
                  ["--gpu", "rtx-4090", "--kv-memory-gb", "3"],
                  ["--gpu", "rtx-4090", "--kv-fraction", "0.8"]):
        scheduler = parse_args(base + other).scheduler
        assert scheduler.serve_kv_tokens is None and scheduler.serve_slots == 7, other


def test_the_capacity_answer_counts_gpus_as_replicas_times_tp():
    cap = {"slo_ttft_s": 0.5, "slo_tpot_s": None, "attainment": 0.9, "requests": 4000,
           "seeds": 5, "gpus_per_replica": 4,
           "one_replica": {"rate_rps": 10.0, "rates_rps": [9.0, 10.0, 11.0],
                           "output_tokens_per_s": 700.0, "tried": [(10.0, 0.9)]},
           "target_rate": 50.0, "fleet_requests": 4000,
           "routers": {"round-robin": {"replicas": 6, "attainment": 0.95, "below": 0.8}}}
    assert "answer: 6 replicas (24 GPUs), with round-robin" in capacity_text(TEXT["en"],
                                                                               cap)


def test_mixture_of_experts_parameter_counts_against_the_makers():
    # totals and actives as published (the makers round: Qwen3's 3.35 B is "3.3 B", DeepSeek's
    # 37.55 B "37 B"; both embedding tables counted as active, as Mistral's 12.9 B counts them)
    for name, total, active in (("mixtral-8x7b", 46.7e9, 12.9e9),
                                ("qwen3-30b-a3b", 30.5e9, 3.3e9),
                                ("deepseek-v3", 671e9, 37e9)):
        cfg = MODELS[name]
        assert param_count(cfg) == pytest.approx(total, rel=2e-3), name
        assert active_param_count(cfg) == pytest.approx(active, rel=0.02), name
    # Mixtral by hand: 32 layers of attention (2 x 4096^2 + 2 x 4096 x 1024), a router
    # (4096 x 8) and 8 experts of 3 x 4096 x 14,336; embeddings and LM head of 32,000 x 4096
    mixtral = MODELS["mixtral-8x7b"]
    expert = 3 * 4096 * 14336
    want = 32 * (2 * 4096**2 + 2 * 4096 * 1024 + 4096 * 8 + 8 * expert) + 2 * 32000 * 4096 + \
        (2 * 32 + 1) * 4096
    assert param_count(mixtral) == want == 46_702_792_704
    assert active_param_count(mixtral) == want - 32 * 6 * expert


def test_latent_attention_caches_70272_bytes_a_token_in_deepseek_v3():
    cfg = MODELS["deepseek-v3"]
    assert kv_bytes_per_token(cfg) == 61 * (512 + 64) * 2 == 70_272
    # its attention by hand: q down 7168 x 1536 and up 1536 x 128 x (128 + 64), the K/V latent
    # and rotary key 7168 x (512 + 64), their up-projection 512 x 128 x (128 + 128), output
    assert attention_weights(cfg) == 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + \
        512 * 128 * 256 + 128 * 128 * 7168
    # a query against a cached key, weights absorbed: 2 x 128 heads x (512 + 64 + 512)
    assert attention_flops_per_key(cfg) == 2 * 128 * (2 * 512 + 64)
    assert card_kv_bytes_per_token(cfg, 8) == 70_272  # (the latent is every head's)


def test_experts_touched_grow_with_the_batch_then_saturate():
    cfg = MODELS["mixtral-8x7b"]  # 8 experts, 2 a token
    assert experts_touched(cfg, 1) == pytest.approx(2)
    assert experts_touched(cfg, 2) == pytest.approx(8 * (1 - 0.75**2))  # 3.5
    assert experts_touched(cfg, 64) == pytest.approx(8, rel=1e-7)
    assert experts_touched(MODELS["llama-3.1-8b"], 64) == 0
    # a decode step reads the experts its tokens touch: batch 1 two of eight, batch 2 3.5
    expert = 3 * 4096 * 14336 * 2  # bytes in bf16
    one, two = (flops_and_bytes(cfg, b, 1, 0)["weight_bytes"] for b in (1, 2))
    assert two - one == pytest.approx(32 * 1.5 * expert)
    # while the FLOPs follow the active parameters: 2 experts a token
    flops = flops_and_bytes(cfg, 1, 1, 0)["matmul_flops"]
    assert flops == 2 * (active_param_count(cfg) - 2 * 32000 * 4096 - 65 * 4096) + \
        2 * 4096 * 32000
    # gpt-oss-20b's experts in MXFP4: 4 bits and a 1-byte scale per 32
    assert MODELS["gpt-oss-20b"].expert_element_bytes == 0.5 + 1 / 32


def test_skewed_routing_reads_fewer_experts_by_hand():
    two = dataclasses.replace(MODELS["mixtral-8x7b"], experts=2, experts_per_token=1)
    # skew 1 over 2 experts, 1 a token: picked 2/3 and 1/3 of the time; two tokens read
    # 1 - (1/3)^2 + 1 - (2/3)^2 = 13/9 experts
    skewed = dataclasses.replace(two, expert_skew=1.0)
    assert expert_inclusion(skewed) == pytest.approx([2 / 3, 1 / 3])
    assert experts_touched(skewed, 1) == pytest.approx(1)
    assert experts_touched(skewed, 2) == pytest.approx(13 / 9)
    # a favourite picked at most once a token: 4 experts, 2 a token, skew 3 gives the first
    # 2 x 1 / 1.1777 > 1, so it is capped at 1 and the second pick shared by the others
    four = dataclasses.replace(two, experts=4, experts_per_token=2, expert_skew=3.0)
    rest = np.array([1 / 8, 1 / 27, 1 / 64])
    assert expert_inclusion(four) == pytest.approx([1.0, *(rest / rest.sum())])
    assert expert_inclusion(four).sum() == pytest.approx(2)
    # skew 0 is the uniform formula; more skew, fewer experts read, the same at batch 1
    cfg = MODELS["qwen3-30b-a3b"]
    flat = dataclasses.replace(cfg, expert_skew=1e-9)
    assert experts_touched(flat, 16) == pytest.approx(experts_touched(cfg, 16))
    read = [experts_touched(dataclasses.replace(cfg, expert_skew=a), 16)
            for a in (0, 0.5, 1, 2)]
    assert read == sorted(read, reverse=True) and read[-1] < 0.5 * read[0]
    assert experts_touched(dataclasses.replace(cfg, expert_skew=2), 1) == pytest.approx(8)
    # and a step reads the skewed count's weights
    cost = flops_and_bytes(dataclasses.replace(cfg, expert_skew=2), 16, 1, 0)
    uniform = flops_and_bytes(cfg, 16, 1, 0)
    assert uniform["weight_bytes"] - cost["weight_bytes"] == pytest.approx(
        48 * (read[0] - read[-1]) * 3 * 2048 * 768 * 2)


def test_moe_models_run_in_c_and_latent_attention_is_refused_by_a_b_and_d(tmp_path, capsys):
    assert "latent attention is priced by C only" in expect_usage_error(
        ["--model", "deepseek-v3", "--out", str(tmp_path)], capsys)
    assert "give both" in expect_usage_error(
        ["--experiments", "C", "--experts", "8", "--out", str(tmp_path)], capsys)
    assert "give a mixture of experts" in expect_usage_error(
        ["--experiments", "C", "--expert-skew", "1", "--out", str(tmp_path)], capsys)
    results, _ = run_main(["--experiments", "C", "--model", "mixtral-8x7b", "--gpu", "h100",
                           "--tp", "2", "--weights", "fp8", "--kv-dtype", "fp8", "--requests",
                           "200", "--rates", "5", "--no-figures", "--out", str(tmp_path)],
                          capsys)
    assert results["C"]["cost_model"]["source"]["model"].startswith("mixtral-8x7b")
    # its batch-1 decode reads 2 of 8 experts: far less than all the weights
    costs = card_costs(dataclasses.replace(MODELS["mixtral-8x7b"], weights="fp8"),
                         GPUS["h100"], ENGINE_PROFILES["roofline"], 2)
    all_weights = card_weight_bytes(MODELS["mixtral-8x7b"], 2) / 2  # fp8: half of bf16
    assert costs.pass_s(1) < 0.45 * all_weights / (0.9 * 3350e9)


HF_CONFIGS = {  # the fields that matter of each model's config.json on the Hugging Face Hub
    "llama-3.1-8b": {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
                     "num_attention_heads": 32, "num_key_value_heads": 8,
                     "intermediate_size": 14336, "vocab_size": 128256,
                     "max_position_embeddings": 131072, "rope_theta": 500000.0,
                     "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    "qwen3-32b": {"model_type": "qwen3", "num_hidden_layers": 64, "hidden_size": 5120,
                  "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
                  "intermediate_size": 25600, "vocab_size": 151936,
                  "max_position_embeddings": 40960, "rope_theta": 1000000,
                  "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    "mixtral-8x7b": {"model_type": "mixtral", "num_hidden_layers": 32, "hidden_size": 4096,
                     "num_attention_heads": 32, "num_key_value_heads": 8,
                     "intermediate_size": 14336, "num_local_experts": 8,
                     "num_experts_per_tok": 2, "vocab_size": 32000,
                     "max_position_embeddings": 32768, "rope_theta": 1e6},
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "num_hidden_layers": 48, "hidden_size": 2048,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                      "intermediate_size": 6144, "moe_intermediate_size": 768,
                      "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936,
                      "max_position_embeddings": 40960, "tie_word_embeddings": False},
    "deepseek-v3": {"model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168,
                    "num_attention_heads": 128, "num_key_value_heads": 128,
                    "intermediate_size": 18432, "moe_intermediate_size": 2048,
                    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
                    "first_k_dense_replace": 3, "kv_lora_rank": 512, "q_lora_rank": 1536,
                    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
                    "vocab_size": 129280, "max_position_embeddings": 163840},
}


@pytest.mark.parametrize("name", HF_CONFIGS)
def test_a_hugging_face_config_gives_the_presets_shape(name, tmp_path):
    path = tmp_path / name / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(HF_CONFIGS[name]))
    cfg = read_model_config(str(path))
    preset = MODELS[name]
    assert cfg.name == name
    assert param_count(cfg) == param_count(preset)
    assert active_param_count(cfg) == active_param_count(preset)
    assert kv_bytes_per_token(cfg) == kv_bytes_per_token(preset)


def test_a_config_it_cannot_read_is_one_line(tmp_path, capsys):
    path = tmp_path / "config.json"
    for bad, says in (({"model_type": "gpt2"}, "model_type 'gpt2' is not one this reads"),
                      ({**HF_CONFIGS["mixtral-8x7b"], "num_local_experts": None},
                       "no 'num_local_experts'"),
                      ({**HF_CONFIGS["llama-3.1-8b"], "hidden_size": "big"},
                       "hidden_size must be a whole number")):
        path.write_text(json.dumps(bad))
        assert says in expect_usage_error(["--experiments", "C", "--model-config", str(path),
                                           "--out", str(tmp_path)], capsys)
    results, _ = run_main(["--experiments", "C", "--model-config", str(
        _write(tmp_path / "qwen" / "config.json", HF_CONFIGS["qwen3-32b"])), "--gpu",
        "rtx-pro-6000", "--tp", "2", "--requests", "100", "--rates", "5", "--no-figures",
        "--out", str(tmp_path)], capsys)
    assert results["config"]["model"]["head_width"] == 128


def _write(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def test_expert_parallel_card_cost_by_hand():
    cfg = MODELS["qwen3-30b-a3b"]  # 128 experts of 3 x 2048 x 768, 8 a token, 48 layers
    expert = 3 * 2048 * 768 * 2  # bytes in bf16
    own = flops_and_bytes(cfg, 4, 1, 0)
    ep = ep_card_cost(cfg, 4, 2)
    # each card holds 64 experts and reads those the group's 8 tokens touch: 64 (1 - (1 -
    # 8/128)^8), in place of the 128 (1 - (1 - 8/128)^4) its own 4 tokens would touch
    read = 64 * (1 - (1 - 1 / 16) ** 8)
    assert ep["weight_bytes"] - own["weight_bytes"] == pytest.approx(
        48 * (read - experts_touched(cfg, 4)) * expert)
    assert ep["matmul_flops"] == pytest.approx(own["matmul_flops"])  # (balanced routes)
    assert ep["kv_read_bytes"] == own["kv_read_bytes"]
    # two all-to-alls an MoE layer, each sending half of its 4 x 8 routes of 2048 x 2 bytes
    assert ep["collectives"] == 96
    assert ep["collective_bytes"] == 96 * 4 * 8 * 2048 * 2 / 2
    # a card holds every weight but the experts, and half of those
    experts = 48 * 128 * expert
    assert card_weight_bytes(cfg, ep=2) == pytest.approx(weight_bytes(cfg) - experts / 2)
    assert card_weight_bytes(cfg, ep=4) == pytest.approx(weight_bytes(cfg) - experts * 3 / 4)
    # skewed routing: the card with the favourite experts reads more and computes more
    skewed = dataclasses.replace(cfg, expert_skew=1.0)
    busiest, routes = card_experts(skewed, 8, 2)
    q = expert_inclusion(skewed)
    assert busiest == pytest.approx(max(np.sum(1 - (1 - q[c::2]) ** 8) for c in (0, 1)))
    assert routes == pytest.approx(q[0::2].sum() / 8) and routes > 0.5
    assert ep_card_cost(skewed, 4, 2)["matmul_flops"] > flops_and_bytes(skewed, 4, 1, 0)[
        "matmul_flops"]


def test_expert_parallel_prices_all_to_alls_over_the_link():
    # (at the all-to-alls' own share of the link: the all-reduces' share prices tp alone)
    cfg, card = MODELS["qwen3-30b-a3b"], GPUS["rtx-pro-6000"]
    profile = EngineProfile("hand", 0.5, 0.5, allreduce_s=1e-5, all_to_all_share=0.5)
    cost = pass_cost(cfg, 1, 16, 2)
    alone = dataclasses.replace(profile, allreduce_s=0.0, all_to_all_share=1e9)  # (free links)
    got = pass_seconds(cfg, card, profile, 1, 16, 2) - pass_seconds(cfg, card, alone, 1, 16, 2)
    want = 96 * 1e-5 + cost["collective_bytes"] / (card.link_gbs * 1e9 * 0.5)
    assert got == pytest.approx(want, rel=1e-6)
    for share, tp, ep in (("link_share", 1, 2), ("all_to_all_share", 2, 1)):  # (each its own)
        slow = dataclasses.replace(profile, **{share: 0.01})
        assert pass_seconds(cfg, card, slow, tp, 16, ep) == \
            pass_seconds(cfg, card, profile, tp, 16, ep)
        other = "all_to_all_share" if share == "link_share" else "link_share"
        assert pass_seconds(cfg, card, dataclasses.replace(profile, **{other: 0.01}), tp,
                              16, ep) > pass_seconds(cfg, card, profile, tp, 16, ep)


def test_ep_flag_checks(tmp_path, capsys):
    base = ["--experiments", "C", "--requests", "50", "--no-figures", "--out", str(tmp_path)]
    assert "give --gpu" in expect_usage_error(base + ["--ep", "2"], capsys)
    assert "give --tp 1" in expect_usage_error(
        base + ["--gpu", "h100", "--model", "qwen3-30b-a3b", "--ep", "2", "--tp", "2"], capsys)
    assert "must divide over the cards" in expect_usage_error(
        base + ["--gpu", "h100", "--model", "llama-3.1-8b", "--ep", "2"], capsys)
    results, out = run_main(base + ["--gpu", "h100", "--model", "qwen3-30b-a3b", "--ep", "2",
                                    "--replicas", "2", "--rates", "5"], capsys)
    assert said("each replica one card of 2 that spread the experts", out.out)
    assert results["C"]["cost_model"]["source"]["ep"] == 2


def test_a_mixtures_dense_twin_runs_its_active_parameters_by_hand():
    cfg = MODELS["deepseek-v3"]  # 8 routed and 1 shared expert of 2,048 a token
    twin = dense_twin(cfg)
    assert twin.ffn == 9 * 2048 and not twin.experts and twin.mlp == "gated"
    # every layer's MLP is the active experts' width: the twin's parameters are the MoE's
    # active ones with the three dense layers' wider MLPs and the routers taken out
    h, dense = 7168, 3 * 3 * 7168 * (18432 - 9 * 2048)
    routers = 58 * h * 256
    assert param_count(twin) == active_param_count(cfg) - dense - routers
    # a measured step's bytes: the experts it read in place of the routing's expectation
    assert moe_step_bytes(cfg, 4, 100, experts_touched(cfg, 4)) == \
        flops_and_bytes(cfg, 4, 1, 100)["bytes"]
    assert moe_step_bytes(cfg, 4, 100, 10) - moe_step_bytes(cfg, 4, 100, 9) == \
        pytest.approx(58 * 3 * h * 2048 * 1)  # (one more expert a layer, in fp8)


def test_a_file_of_published_rows_with_blanks_is_scored_row_by_row(tmp_path, capsys):
    # one row with a blank tp, one in a precision C does not price, one with a value that is
    # no number: each named with its line, and the good rows scored
    with open(PUBLISHED_CSV, encoding="utf-8") as f:
        lines = f.read().splitlines()
    header, good = lines[0], lines[1:6]
    cells = [row.split(",") for row in lines[1:4]]
    cells[0][header.split(",").index("tp")] = ""
    cells[1][header.split(",").index("weights")] = "nvfp4"
    cells[2][header.split(",").index("value")] = "n/a"
    path = tmp_path / "rows.csv"
    path.write_text("\n".join([header, *good, *(",".join(c) for c in cells)]) + "\n")
    results, out = run_main(["--validate", str(path), "--out", str(tmp_path)], capsys)
    V = results["validation"]
    assert len([r for r in V["rows"] if r["role"] == "validation"]) == 5
    assert V["left_out"]["blank tp: line 7"] == 1
    assert V["left_out"]["precision 'nvfp4': line 8"] == 1
    assert V["left_out"]["value 'n/a': line 9"] == 1
    assert said("(blank tp: line 7)", out.out) and said("(precision 'nvfp4': line 8)", out.out)
    # (the reader names a row's reason; a column missing from the file refuses the file)
    path.write_text("\n".join([header.replace("tp,", "tensor,"), *good]) + "\n")
    expect_usage_error(["--validate", str(path), "--out", str(tmp_path)], capsys,
                       "not a file of published rows")
