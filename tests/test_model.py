"""The transformer, its KV cache and the FLOP/byte model."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import NN_40_serving as S

TINY = S.ModelConfig(layers=2, hidden=64, heads=4, vocab=97, max_positions=64, dtype="float32")


def full_forward_logits(model, tokens):
    """Reference: a plain forward of the whole sequence into a fresh cache; last logits."""
    cache = S.new_kv_cache(TINY, 1, len(tokens), "cpu")
    return S.prefill(model, cache, tokens[None])[0]


@torch.inference_mode()
def test_cached_decode_equals_full_forward_with_rows_at_different_positions():
    model = S.build_model(TINY, "cpu", seed=1)
    g = torch.Generator().manual_seed(0)
    prompt_lens = [3, 7, 1]  # three rows, each at its own position
    total = 12
    seqs = [torch.randint(TINY.vocab, (total,), generator=g) for _ in prompt_lens]
    cache = S.new_kv_cache(TINY, 4, total, "cpu")  # one spare row that nobody uses
    rows = torch.tensor([2, 0, 3])  # rows of the cache, deliberately out of order
    for seq, n, row in zip(seqs, prompt_lens, rows):
        S.prefill(model, cache, seq[None, :n], rows=row[None])
    positions = torch.tensor(prompt_lens)
    for _ in range(4):
        tokens = torch.stack([seq[p] for seq, p in zip(seqs, positions)])
        logits = S.decode_step(model, cache, tokens, positions, rows=rows)
        for b, seq in enumerate(seqs):
            expected = full_forward_logits(model, seq[:positions[b] + 1])
            torch.testing.assert_close(logits[b], expected, rtol=1e-5, atol=1e-5)
        positions = positions + 1


@torch.inference_mode()
def test_prefill_writes_the_cache_a_decode_reads():
    model = S.build_model(TINY, "cpu")
    seq = torch.randint(TINY.vocab, (1, 9))
    cache = S.new_kv_cache(TINY, 1, 9, "cpu")
    S.prefill(model, cache, seq[:, :8])
    before = cache.clone()
    S.decode_step(model, cache, seq[:, 8], torch.tensor([8]))
    assert torch.equal(before[..., :8, :], cache[..., :8, :])  # old entries untouched
    assert not torch.equal(before[..., 8, :], cache[..., 8, :])  # the new one written


def test_param_count_matches_the_model():
    model = S.build_model(TINY, "cpu")
    assert S.param_count(TINY) == sum(p.numel() for p in model.parameters())
    default = S.ModelConfig()
    # the post's model: 12 layers x 12 h^2 matmul weights, plus embeddings and the LM head
    assert S.param_count(default) == 12 * (12 * 2048**2 + 4 * 2048) + 2 * 2048 \
        + 2048 * 32000 + (32000 + 8192) * 2048


def weight_bytes_of(model):
    """Bytes of every parameter a step reads whole (all but the embedding tables)."""
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters()
               if "embed" not in name)


@torch.inference_mode()
def test_flop_model_equals_counted_matmul_flops():
    model = S.build_model(TINY, "cpu")
    for batch, new_tokens, context in [(1, 16, 0), (3, 1, 10), (5, 1, 0)]:
        cache = S.new_kv_cache(TINY, batch, context + new_tokens, "cpu")
        tokens = torch.randint(TINY.vocab, (batch, new_tokens))
        with FlopCounterMode(display=False) as counter:
            if context == 0 and new_tokens > 1:
                S.prefill(model, cache, tokens)
            else:
                S.decode_step(model, cache, tokens[:, 0], torch.full((batch,), context))
        cost = S.step_cost(TINY, batch, new_tokens, context)
        # FlopCounterMode counts the matmuls (it does not count CPU attention kernels)
        assert cost["matmul_flops"] == counter.get_total_flops()
        tokens_total = batch * new_tokens
        embedding_rows = 2 * tokens_total * TINY.hidden * 4
        assert cost["weight_bytes"] == weight_bytes_of(model) + embedding_rows


def test_attention_flops_and_kv_bytes_by_hand():
    cfg = S.ModelConfig(layers=2, hidden=8, heads=2, vocab=10, dtype="float16")
    # prefill of 3 tokens: queries see 1, 2, 3 keys; QK^T and PV are 2 * 2 * h FLOPs per key
    assert S.step_cost(cfg, 1, 3, 0)["attention_flops"] == 2 * 4 * 8 * (1 + 2 + 3)
    # decode of 4 rows with 5 cached tokens: each query sees the 5 cached keys and itself
    cost = S.step_cost(cfg, 4, 1, 5)
    assert cost["attention_flops"] == 2 * 4 * 8 * 4 * 6
    assert S.kv_bytes_per_token(cfg) == 2 * 2 * 8 * 2  # layers x (K, V) x hidden x 2 bytes
    assert cost["kv_read_bytes"] == 4 * 5 * 64 and cost["kv_write_bytes"] == 4 * 64


def test_decode_intensity_is_about_the_batch_size():
    cfg = S.ModelConfig()
    for batch in (1, 32):
        cost = S.step_cost(cfg, batch, 1, 0)
        assert 0.8 * batch < cost["flops"] / cost["bytes"] <= batch


def test_memory_estimate_refuses_what_cannot_fit():
    cfg = S.ModelConfig()
    # 1M rows of 8k tokens: ~750 TiB of KV cache
    ok, needed, free = S.fits(cfg, S.torch.device("cpu"), 1_000_000, 8192, 1)
    assert not ok and needed > 700 * 2**40
    assert S.fits(cfg, S.torch.device("cpu"), 1, 16, 1)[0]


@torch.inference_mode()
def test_padded_decode_equals_one_call_per_span():
    model = S.build_model(TINY, "cpu", seed=2)
    cache = S.new_kv_cache(TINY, 5, 20, "cpu", seed=4)
    tokens = torch.randint(TINY.vocab, (5,))
    positions = [3, 3, 11, 0, 19]
    spans = S.decode_step(model, cache.clone(), tokens, positions)
    padded = S.decode_step(model, cache.clone(), tokens, positions, pad=True)
    torch.testing.assert_close(padded, spans, rtol=1e-5, atol=1e-5)


POST = S.ModelConfig(layers=3, hidden=64, heads=4, vocab=97, dtype="float32", arch="post")


@torch.inference_mode()
def test_the_posts_proxy_counts_2_l_h_squared_per_token():
    model = S.build_model(POST, "cpu")
    assert isinstance(model, S.PostProxy) and len(model.layers) == 3
    assert S.param_count(POST) == sum(p.numel() for p in model.parameters()) == 3 * 64 * 64
    for tokens in (1, 32, 512):
        with FlopCounterMode(display=False) as counter:
            model(torch.randn(tokens, 64))
        cost = S.step_cost(POST, tokens, 1, 128)  # (the context changes nothing: no KV cache)
        assert cost["flops"] == counter.get_total_flops() == 2 * 3 * 64**2 * tokens
        assert cost["weight_bytes"] == weight_bytes_of(model) == 3 * 64 * 64 * 4
        assert cost["kv_read_bytes"] == cost["kv_write_bytes"] == 0
    assert S.kv_bytes_per_token(POST) == 0 and S.kv_crossover_batch(POST, 1024) is None
    # the post's own figure: prefill 512 in 0.664 ms is 77.6 TFLOP/s only under this count
    post = S.ModelConfig(arch="post")
    assert S.step_cost(post, 1, 512, 0)["flops"] / 0.664e-3 / 1e12 == pytest.approx(77.6, abs=0.05)
