"""The transformer, its KV cache and the FLOP/byte model."""
import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from nn40.accounting import (
    active_param_count, dense_twin, expert_weights, experts_touched, kv_bytes_per_token,
    kv_crossover_batch, moe_step_bytes, param_count, flops_and_bytes, weight_bytes, weight_parts)
from nn40.cli import parse_args
from nn40.config import MODELS, ModelConfig
from nn40.device import fits
from nn40.experiment_ab import Bench, decode_row
from nn40.model import (
    MoE, PostProxy, build_model, decode_step, grouped_mm_works, new_kv_cache, prefill,
    ragged_step)
from test_cli import said

TINY = ModelConfig(layers=2, hidden=64, heads=4, vocab=97, max_positions=64, dtype="float32")
# the open models' kind, small: grouped K/V heads (8 query heads on 1, 2 or all 8), a gated SiLU
# MLP, RMSNorm, rotary positions, a tied LM head
OPEN = ModelConfig(layers=2, hidden=64, heads=8, kv_heads=2, vocab=97, max_positions=64,
                     dtype="float32", mlp="gated", ffn_hidden=96, norm="rms", positions="rope",
                     tied=True, name="open")
SHAPES = {"post": TINY, "gqa-2": OPEN, "mqa": dataclasses.replace(OPEN, kv_heads=1),
          "mha-gated": dataclasses.replace(OPEN, kv_heads=None, tied=False),
          "gqa-gelu-learned": dataclasses.replace(OPEN, mlp="gelu", ffn_hidden=None,
                                                  positions="learned", norm="layer"),
          # Qwen3's kind: heads wider than hidden / heads (8 heads of 16 on a width of 64)
          "wide-heads": dataclasses.replace(OPEN, head_width=16),
          # mixtures of experts: 8 experts of 32, 2 a token (Mixtral's kind); and DeepSeek's
          # kind, a dense first layer and a shared expert beside them
          "moe": dataclasses.replace(OPEN, experts=8, experts_per_token=2, expert_ffn=32),
          "moe-shared-dense": dataclasses.replace(OPEN, experts=8, experts_per_token=2,
                                                  expert_ffn=32, shared_experts=1,
                                                  dense_layers=1)}


def full_forward_logits(model, tokens):
    """Reference: a plain forward of the whole sequence into a fresh cache; last logits."""
    cache = new_kv_cache(model.cfg, 1, len(tokens), "cpu")
    return prefill(model, cache, tokens[None])[0]


@torch.inference_mode()
@pytest.mark.parametrize("shape", SHAPES)
def test_cached_decode_equals_full_forward_with_rows_at_different_positions(shape):
    cfg = SHAPES[shape]
    model = build_model(cfg, "cpu", seed=1)
    g = torch.Generator().manual_seed(0)
    prompt_lens = [3, 7, 1]  # three rows, each at its own position
    total = 12
    seqs = [torch.randint(cfg.vocab, (total,), generator=g) for _ in prompt_lens]
    cache = new_kv_cache(cfg, 4, total, "cpu")  # one spare row that nobody uses
    rows = torch.tensor([2, 0, 3])  # rows of the cache, deliberately out of order
    for seq, n, row in zip(seqs, prompt_lens, rows):
        prefill(model, cache, seq[None, :n], rows=row[None])
    positions = torch.tensor(prompt_lens)
    for _ in range(4):
        tokens = torch.stack([seq[p] for seq, p in zip(seqs, positions)])
        logits = decode_step(model, cache, tokens, positions, rows=rows)
        for b, seq in enumerate(seqs):
            expected = full_forward_logits(model, seq[:positions[b] + 1])
            torch.testing.assert_close(logits[b], expected, rtol=1e-5, atol=1e-5)
        positions = positions + 1


@torch.inference_mode()
def test_prefill_writes_the_cache_a_decode_reads():
    model = build_model(TINY, "cpu")
    seq = torch.randint(TINY.vocab, (1, 9))
    cache = new_kv_cache(TINY, 1, 9, "cpu")
    prefill(model, cache, seq[:, :8])
    before = cache.clone()
    decode_step(model, cache, seq[:, 8], torch.tensor([8]))
    assert torch.equal(before[..., :8, :], cache[..., :8, :])  # old entries untouched
    assert not torch.equal(before[..., 8, :], cache[..., 8, :])  # the new one written


@pytest.mark.parametrize("shape", SHAPES)
def test_param_count_matches_the_model(shape):
    model = build_model(SHAPES[shape], "cpu")
    assert param_count(SHAPES[shape]) == sum(p.numel() for p in model.parameters())


def test_param_count_by_hand_for_each_mlp_and_kv_heads():
    h, f, L, V = 64, 96, 2, 97
    for kv_heads, kv_dim in ((1, 8), (2, 16), (8, 64)):  # 8 heads of 8
        cfg = dataclasses.replace(OPEN, kv_heads=kv_heads, tied=False)
        attention = 2 * h * h + 2 * h * kv_dim  # q and out h x h; K and V h x kv_dim
        assert param_count(cfg) == L * (attention + 3 * h * f + 2 * h) + h + 2 * V * h
        gelu = dataclasses.replace(cfg, mlp="gelu")
        assert param_count(gelu) == L * (attention + 2 * h * f + 2 * h) + h + 2 * V * h


def test_the_open_models_have_their_published_sizes():
    # parameter counts the models' makers publish (Qwen2.5 adds biases on q, k and v)
    assert param_count(MODELS["llama-3-8b"]) == 8_030_261_248
    assert param_count(MODELS["mistral-7b"]) == 7_248_023_552
    assert param_count(MODELS["llama-3.2-1b"]) == 1_235_814_400
    assert param_count(MODELS["qwen2.5-7b"]) + 28 * (3584 + 2 * 512) == 7_615_616_512
    assert param_count(MODELS["llama-2-7b"]) == 6_738_415_616
    assert param_count(MODELS["llama-2-70b"]) == 68_976_648_192
    assert param_count(MODELS["llama-3.1-8b"]) == 8_030_261_248
    assert param_count(MODELS["llama-3.1-70b"]) == 70_553_706_496
    assert param_count(MODELS["llama-3.1-405b"]) == 405_853_388_800
    # Qwen3-32B (its heads 128 wide on a width of 5,120): "32.8B" less its q/k norms
    assert param_count(MODELS["qwen3-32b"]) + 64 * 2 * 128 == pytest.approx(32.8e9, rel=2e-3)
    assert kv_bytes_per_token(MODELS["qwen3-32b"]) == 2 * 64 * 8 * 128 * 2 == 262_144
    # (GPT-J and OPT without their biases: 0.04% and 0.01% short of the makers' counts)
    assert param_count(MODELS["gpt-j-6b"]) == pytest.approx(6_053_381_344, rel=1e-3)
    assert param_count(MODELS["opt-13b"]) == pytest.approx(12_852_855_808, rel=1e-3)
    # KV bytes per token: layers x (K, V) x kv_heads x head_dim x 2 bytes (bf16)
    assert kv_bytes_per_token(MODELS["llama-3-8b"]) == 2 * 32 * 8 * 128 * 2 == 131_072
    assert kv_bytes_per_token(MODELS["mistral-7b"]) == 131_072
    assert kv_bytes_per_token(MODELS["qwen2.5-7b"]) == 2 * 28 * 4 * 128 * 2 == 57_344
    assert kv_bytes_per_token(MODELS["llama-3.2-1b"]) == 2 * 16 * 8 * 64 * 2 == 32_768
    assert kv_bytes_per_token(MODELS["post"]) == 2 * 12 * 2048 * 2 == 98_304
    # a quarter of the same width's multi-head cache: 4x later crossover of KV over weights
    llama = MODELS["llama-3-8b"]
    mha = dataclasses.replace(llama, kv_heads=None)
    assert kv_bytes_per_token(mha) == 4 * kv_bytes_per_token(llama)
    default = ModelConfig()
    # the post's model: 12 layers x 12 h^2 matmul weights, plus embeddings and the LM head
    assert param_count(default) == 12 * (12 * 2048**2 + 4 * 2048) + 2 * 2048 \
        + 2048 * 32000 + (32000 + 8192) * 2048


def weight_bytes_of(model):
    """Bytes of every parameter a step reads whole: all but the embedding tables, and the LM
    head's matrix even when it is the token table (tied)."""
    whole = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                if "embed" not in name)
    if model.cfg.arch == "transformer" and model.cfg.tied:
        whole += model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    return whole


@torch.no_grad()  # (FlopCounterMode under inference_mode misses matmuls in torch 2.3)
@pytest.mark.parametrize("shape", SHAPES)
def test_flop_model_equals_counted_matmul_flops(shape):
    cfg = SHAPES[shape]
    model = build_model(cfg, "cpu")
    for batch, new_tokens, context in [(1, 16, 0), (3, 1, 10), (5, 1, 0)]:
        cache = new_kv_cache(cfg, batch, context + new_tokens, "cpu")
        tokens = torch.randint(cfg.vocab, (batch, new_tokens))
        with FlopCounterMode(display=False) as counter:
            if context == 0 and new_tokens > 1:
                prefill(model, cache, tokens)
            else:
                decode_step(model, cache, tokens[:, 0], torch.full((batch,), context))
        cost = flops_and_bytes(cfg, batch, new_tokens, context)
        # FlopCounterMode counts the matmuls (it does not count CPU attention kernels); an MoE
        # layer runs each token through its k experts only
        assert cost["matmul_flops"] == counter.get_total_flops()
        tables = 2 if cfg.positions == "learned" else 1  # (rows looked up per token)
        embedding_rows = tables * batch * new_tokens * cfg.hidden * 4
        # (the experts a step reads: their expectation under uniform routing, not all)
        unread = cfg.moe_layers * (cfg.experts - experts_touched(cfg, batch * new_tokens)) * \
            expert_weights(cfg) * 4
        assert cost["weight_bytes"] == pytest.approx(weight_bytes_of(model) + embedding_rows
                                                     - unread, rel=1e-12)


def test_attention_flops_and_kv_bytes_by_hand():
    cfg = ModelConfig(layers=2, hidden=8, heads=2, vocab=10, dtype="float16")
    # prefill of 3 tokens: queries see 1, 2, 3 keys; QK^T and PV are 2 * 2 * h FLOPs per key
    assert flops_and_bytes(cfg, 1, 3, 0)["attention_flops"] == 2 * 4 * 8 * (1 + 2 + 3)
    # decode of 4 rows with 5 cached tokens: each query sees the 5 cached keys and itself
    cost = flops_and_bytes(cfg, 4, 1, 5)
    assert cost["attention_flops"] == 2 * 4 * 8 * 4 * 6
    assert kv_bytes_per_token(cfg) == 2 * 2 * 8 * 2  # layers x (K, V) x hidden x 2 bytes
    assert cost["kv_read_bytes"] == 4 * 5 * 64 and cost["kv_write_bytes"] == 4 * 64


def test_costs_by_component_each_at_its_own_element_size():
    cfg = ModelConfig(layers=2, hidden=8, heads=2, vocab=10, max_positions=16, dtype="float16")
    h, L = 8, 2
    matmuls, norms = L * 12 * h * h, (2 * L + 1) * 2 * h
    assert weight_parts(cfg) == {"matmuls": (matmuls, 2), "lm_head": (10 * h, 2),
                                   "norms": (norms, 2), "embeddings": ((10 + 16) * h, 2)}
    assert weight_bytes(cfg) == 2 * param_count(cfg)
    small = dataclasses.replace(cfg, weights="fp8")  # the matmul weights at a byte each
    assert weight_bytes(small) == matmuls + 2 * (10 * h + norms + 26 * h)
    full, cheap = flops_and_bytes(cfg, 3, 1, 5), flops_and_bytes(small, 3, 1, 5)
    # only the matmul weights read half the bytes (the LM head stays in 16 bits, as
    # quantizers leave it); the rest is unchanged
    assert full["weight_bytes"] - cheap["weight_bytes"] == matmuls
    for key in ("kv_read_bytes", "kv_write_bytes", "activation_bytes", "flops"):
        assert full[key] == cheap[key]


def test_decode_intensity_is_about_the_batch_size():
    cfg = ModelConfig()
    for batch in (1, 32):
        cost = flops_and_bytes(cfg, batch, 1, 0)
        assert 0.8 * batch < cost["flops"] / cost["bytes"] <= batch


def test_memory_estimate_refuses_what_cannot_fit():
    cfg = ModelConfig()
    # 1M rows of 8k tokens: ~750 TiB of KV cache
    ok, needed, free = fits(cfg, torch.device("cpu"), 1_000_000, 8192, 1)
    assert not ok and needed > 700 * 2**40
    assert fits(cfg, torch.device("cpu"), 1, 16, 1)[0]


def test_kv_cache_holds_the_kv_heads():
    cache = new_kv_cache(OPEN, 3, 10, "cpu")
    assert cache.shape == (2, 2, 3, 2, 10, 8)  # (layers, K/V, rows, kv_heads, tokens, head)
    assert cache.numel() * 4 == 3 * 10 * kv_bytes_per_token(OPEN)


@torch.inference_mode()
@pytest.mark.parametrize("shape", ["post", "gqa-2", "mqa"])
def test_padded_decode_equals_one_call_per_span(shape):
    cfg = SHAPES[shape]
    model = build_model(cfg, "cpu", seed=2)
    cache = new_kv_cache(cfg, 5, 20, "cpu", seed=4)
    tokens = torch.randint(cfg.vocab, (5,))
    positions = [3, 3, 11, 0, 19]
    spans = decode_step(model, cache.clone(), tokens, positions)
    padded = decode_step(model, cache.clone(), tokens, positions, pad=True)
    torch.testing.assert_close(padded, spans, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("shape", ["post", "gqa-2", "mqa", "moe"])
def test_a_verify_pass_equals_a_full_forward_at_each_of_its_tokens(shape, pad):
    """Speculative decoding's verify pass: each row's last token and its drafts (T = 4 a row),
    rows at their own positions, two of them in one span: the logits at each of a row's tokens
    are those of a plain forward of its sequence up to that token, and the row's cache past
    its context is written with the drafts' K/V (rolled back by writing over it)."""
    cfg = SHAPES[shape]
    model = build_model(cfg, "cpu", seed=5)
    g = torch.Generator().manual_seed(1)
    contexts, T = [5, 5, 9, 2], 4  # rows 0 and 1 share a position: one span
    seqs = [torch.randint(cfg.vocab, (n + T,), generator=g) for n in contexts]
    cache = new_kv_cache(cfg, 4, 16, "cpu", seed=2)
    for row, (seq, n) in enumerate(zip(seqs, contexts)):
        prefill(model, cache, seq[None, :n], rows=torch.tensor([row]))
    tokens = torch.stack([seq[n:n + T] for seq, n in zip(seqs, contexts)])
    logits = ragged_step(model, cache, tokens, contexts, pad=pad)
    assert logits.shape == (4, T, cfg.vocab)
    for b, (seq, n) in enumerate(zip(seqs, contexts)):
        for t in range(T):
            torch.testing.assert_close(logits[b, t], full_forward_logits(model, seq[:n + t + 1]),
                                       rtol=1e-4, atol=1e-4)
    one = ragged_step(model, cache.clone(), tokens[:, :1], contexts, pad=pad)
    torch.testing.assert_close(one[:, 0], logits[:, 0], rtol=1e-5, atol=1e-5)


POST = ModelConfig(layers=3, hidden=64, heads=4, vocab=97, dtype="float32", arch="post")


@torch.no_grad()  # (FlopCounterMode under inference_mode misses matmuls in torch 2.3)
def test_the_posts_proxy_counts_2_l_h_squared_per_token():
    model = build_model(POST, "cpu")
    assert isinstance(model, PostProxy) and len(model.layers) == 3
    assert param_count(POST) == sum(p.numel() for p in model.parameters()) == 3 * 64 * 64
    for tokens in (1, 32, 512):
        with FlopCounterMode(display=False) as counter:
            model(torch.randn(tokens, 64))
        cost = flops_and_bytes(POST, tokens, 1, 128)  # (the context changes nothing: no KV cache)
        assert cost["flops"] == counter.get_total_flops() == 2 * 3 * 64**2 * tokens
        assert cost["weight_bytes"] == weight_bytes_of(model) == 3 * 64 * 64 * 4
        assert cost["kv_read_bytes"] == cost["kv_write_bytes"] == 0
    assert kv_bytes_per_token(POST) == 0 and kv_crossover_batch(POST, 1024) is None
    # the post's own figure: prefill 512 in 0.664 ms is 77.6 TFLOP/s only under this count
    post = ModelConfig(arch="post")
    assert flops_and_bytes(post, 1, 512, 0)["flops"] / 0.664e-3 / 1e12 == pytest.approx(77.6, abs=0.05)


@torch.inference_mode()
def test_the_moe_layer_reads_only_the_experts_its_tokens_chose():
    cfg = SHAPES["moe"]
    model = build_model(cfg, "cpu", seed=3)
    moe = model.blocks[0].moe
    x = torch.randn(5, cfg.hidden, generator=torch.Generator().manual_seed(1))
    chosen = moe.router(x).topk(2, dim=-1).indices
    out = moe(x)
    assert moe.touched == len(chosen.unique())
    # each token's output is the softmax-weighted sum of its two experts, computed alone
    for t in range(5):
        logits = moe.router(x[t])
        top = logits.topk(2)
        want = sum(w * (torch.nn.functional.silu(x[t] @ moe.gate_up[e][:32].T)
                        * (x[t] @ moe.gate_up[e][32:].T)) @ moe.down[e].T
                   for w, e in zip(top.values.softmax(0), top.indices))
        torch.testing.assert_close(out[t], want, rtol=1e-5, atol=1e-6)


def grouped_moe_runs_here():
    return grouped_mm_works(torch.device("cpu"), torch.float32)


@torch.inference_mode()
@pytest.mark.skipif(not grouped_moe_runs_here(), reason="torch._grouped_mm does not run here")
@pytest.mark.parametrize("shape", ["moe", "moe-shared-dense"])
def test_the_grouped_moe_layer_computes_what_the_loop_does(shape):
    # the formulation a CUDA graph can capture against the loop over touched experts: the same
    # logits at a prefill, at a decode at one position and at several, and the same experts read
    cfg = SHAPES[shape]
    tokens = torch.randint(cfg.vocab, (5, 9), generator=torch.Generator().manual_seed(4))
    logits, tallies = [], []
    for grouped in (False, True):
        model = build_model(cfg, "cpu", seed=6)
        moe = [m for m in model.modules() if isinstance(m, MoE)]
        for m in moe:
            m.set_grouped(grouped)
        cache = new_kv_cache(cfg, 5, 12, "cpu")
        logits.append([prefill(model, cache, tokens),
                       decode_step(model, cache, tokens[:, 1], 9),
                       decode_step(model, cache, tokens[:, 2], [10, 10, 9, 10, 9])])
        tallies.append([m.tallies() for m in moe])
    for loop, grouped in zip(*logits):
        torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-5)
    assert tallies[0] == tallies[1] and tallies[0][0][1] == 3  # (3 calls of each layer)


def test_a_times_an_moe_model_and_counts_the_experts_read(tmp_path, capsys):
    from test_cli import run_main, said
    results, out = run_main(["--device", "cpu", "--experiments", "A", "--layers", "2",
                             "--hidden", "64", "--heads", "4", "--vocab", "128", "--dtype",
                             "float32", "--mlp", "gated", "--experts", "8",
                             "--experts-per-token", "2", "--expert-ffn", "32", "--batch-sizes",
                             "1,16", "--contexts", "8", "--context", "8", "--reps", "3",
                             "--warmup", "1", "--no-figures", "--out", str(tmp_path)], capsys)
    rows = {r["batch"]: r for r in results["A"]["rows"]}
    assert rows[1]["experts_touched"] == 2 and rows[1]["experts_expected"] == pytest.approx(2)
    assert 2 < rows[16]["experts_touched"] <= 8
    assert rows[16]["experts_expected"] == pytest.approx(8 * (1 - 0.75**16))
    assert said("experts read", out.out) and said("dense twin ms", out.out)
    # beside it, its dense twin: one gated MLP of 2 x 32 in both layers, timed at each batch
    twin = results["A"]["dense_twin"]
    assert twin["ffn"] == 64 and [r["batch"] for r in twin["rows"]] == [1, 16]
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    cfg = ModelConfig(**{k: v for k, v in results["config"]["model"].items() if k in fields})
    assert twin["params"] == param_count(dense_twin(cfg))
    assert active_param_count(cfg) - twin["params"] == 2 * 64 * 8  # (the routers)
    assert all(r["dense_twin_ms"] > 0 for r in rows.values())


@pytest.mark.parametrize("shape", ["moe-shared-dense", "gqa-2"])
def test_every_matmul_weight_is_drawn_at_its_fan_in(shape):
    # (out, in) for a Linear, (experts, out, in) for an expert stack: std in^-1/2, so a
    # matmul's output stays the size of its input whatever the widths
    model = build_model(SHAPES[shape], "cpu", seed=2)
    for name, p in model.named_parameters():
        if p.dim() >= 2 and "embed" not in name:
            assert p.std().item() == pytest.approx(p.shape[-1] ** -0.5, rel=0.15), name


@torch.inference_mode()
def test_a_row_counts_the_experts_read_over_every_timed_step():
    run = parse_args(["--device", "cpu", "--experiments", "A", "--layers", "2", "--hidden",
                        "64", "--heads", "4", "--vocab", "128", "--dtype", "float32", "--mlp",
                        "gated", "--experts", "16", "--experts-per-token", "2", "--expert-ffn",
                        "32", "--context", "8", "--contexts", "8", "--warmup", "1", "--reps",
                        "6"])
    # (a budget no loaded machine reaches: the 6 reps, not the time, end each row)
    bench = Bench(run.replace(time_budget_s=600.0), torch.device("cpu"))
    ceilings = {"bandwidth_gbs": 10.0, "matmul_tflops": 0.1, "ridge_flop_per_byte": 10.0}
    decode_row(bench, ceilings, 1, 8, "eager")  # (counts from a batch before are dropped)
    row = decode_row(bench, ceilings, 4, 8, "eager")
    moe = [m for m in bench.model.modules() if isinstance(m, MoE)]
    assert [m.calls for m in moe] == [7, 7]  # 1 warm-up and 6 timed steps, this row's alone
    mean = sum(m.touched_sum for m in moe) / 14
    assert row["experts_touched"] == pytest.approx(mean)
    # (the 4 tokens of each of the 7 steps, fresh each, do not all reach as many experts)
    assert mean != pytest.approx(sum(m.touched for m in moe) / 2)
    assert row["bytes_read"] == moe_step_bytes(bench.cfg, 4, 8, row["experts_touched"])
