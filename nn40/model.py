"""The model: a decoder-only transformer with a static KV cache (device code)

The cache is one preallocated tensor (layers, 2, batch, kv_heads, max_len, head_dim); each
row writes its new K/V at its own positions, so shapes never change between steps. The post's
model: LayerNorm, learned positions, multi-head attention, a 4x GELU MLP. The open models
(MODELS): RMSNorm, rotary positions, grouped K/V heads, a gated SiLU MLP.
"""
import functools
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from nn40.config import DTYPE_NAMES


DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # (the config's type names)


class RMSNorm(nn.Module):
    def __init__(self, h, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(h))

    def forward(self, x):  # (computed in fp32, as the open models do)
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) \
            * self.weight


def norm_layer(cfg):
    return nn.LayerNorm(cfg.hidden) if cfg.norm == "layer" else RMSNorm(cfg.hidden)


def linear(x, weight, weight_first_rows=0):
    """x W^T for a weight W (out, in). With at most `weight_first_rows` rows on a CPU it runs
    as W x^T, transposed back: the same products, but on some CPUs' matmul libraries (MKL on
    an AMD EPYC, with 2 to 64 rows) F.linear takes 2-4x batch 1's time over the same weights,
    where W x^T streams them at batch 1's rate (probe_layouts measures which, per machine)."""
    rows = x.numel() // x.shape[-1]
    if rows <= weight_first_rows and x.device.type == "cpu":  # (both ends row-major, as timed)
        y = torch.mm(weight, x.reshape(rows, x.shape[-1]).contiguous().T).T.contiguous()
        return y.reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)


class Linear(nn.Linear):
    """nn.Linear (no bias) through linear(): weight_first_rows is set by build_model."""
    weight_first_rows = 0

    def __init__(self, inputs, outputs):
        super().__init__(inputs, outputs, bias=False)

    def forward(self, x):
        return linear(x, self.weight, self.weight_first_rows)


def rotate(x, rope):
    """Rotary positions: each pair (x_i, x_{i + D/2}) turned by its position's angle."""
    cos, sin = rope  # (B, 1, T, D/2)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class MoE(nn.Module):
    """Routed experts: each token's top-k of E gated MLPs, weighted by the softmax of its k
    router logits (Mixtral's), plus shared experts every token uses. Tokens are grouped by
    expert, so an expert computes only its own tokens and an expert no token chose is never
    read. Two formulations of the same sums: a loop over the touched experts (the host reads
    their counts: what a CPU runs), or, where `grouped` (build_model sets it on CUDA where
    grouped_mm_works), two grouped matmuls over the slots sorted by expert, each group's end
    counted on the device: no host value is read, so a CUDA graph can capture the layer, and
    an expert no slot chose is an empty group. tallies(): the experts read summed over the
    calls since reset_tally(), and those calls."""
    weight_first_rows = 0  # (see linear; set by build_model)

    def __init__(self, cfg):
        super().__init__()
        h, f, E = cfg.hidden, cfg.expert_width, cfg.experts
        self.k = cfg.experts_per_token
        self.router = Linear(h, E)
        self.gate_up = nn.Parameter(torch.empty(E, 2 * f, h))  # (each expert's gate; up)
        self.down = nn.Parameter(torch.empty(E, h, f))         # (out, in), as a Linear's
        n = cfg.shared_experts * f  # (the shared experts as one gated MLP of their widths)
        self.shared = nn.ModuleList([Linear(h, 2 * n), Linear(n, h)]) if n else None
        self.touched = self.touched_sum = self.calls = 0
        self.grouped, self.tally = False, None

    def set_grouped(self, grouped):
        """The grouped formulation (True) or the loop; the grouped one tallies on the device."""
        self.grouped = grouped
        self.tally = torch.zeros(2, dtype=torch.long, device=self.down.device) if grouped \
            else None

    def reset_tally(self):
        self.touched_sum = self.calls = 0
        if self.tally is not None:
            self.tally.zero_()

    def tallies(self):
        """(experts read, summed over the calls since reset_tally; those calls)."""
        return tuple(self.tally.tolist()) if self.grouped else (self.touched_sum, self.calls)

    def forward(self, x):
        shape, x = x.shape, x.reshape(-1, x.shape[-1])
        top, chosen = self.router(x).topk(self.k, dim=-1)          # (N, k) each
        weight, chosen = top.softmax(dim=-1).reshape(-1), chosen.reshape(-1)
        order = chosen.argsort()
        token = order // self.k                                      # each slot's token
        routed = self.grouped_experts if self.grouped else self.looped_experts
        out = routed(x, chosen, order, token, weight)
        if self.shared is not None:
            gate, up = self.shared[0](x).chunk(2, dim=-1)
            out = out + self.shared[1](F.silu(gate) * up)
        return out.reshape(shape)

    def looped_experts(self, x, chosen, order, token, weight):
        counts = torch.bincount(chosen, minlength=len(self.down)).tolist()
        out, start, first = torch.zeros_like(x), 0, self.weight_first_rows
        for e, n in enumerate(counts):
            if n:
                rows, slots = token[start:start + n], order[start:start + n]
                gate, up = linear(x[rows], self.gate_up[e], first).chunk(2, dim=-1)
                y = linear(F.silu(gate) * up, self.down[e], first)
                out.index_add_(0, rows, y * weight[slots, None].to(y.dtype))
            start += n
        self.touched = sum(1 for n in counts if n)
        self.touched_sum, self.calls = self.touched_sum + self.touched, self.calls + 1
        return out

    def grouped_experts(self, x, chosen, order, token, weight):
        counts = torch.zeros(len(self.down), dtype=torch.long, device=x.device).scatter_add_(
            0, chosen, torch.ones_like(chosen))  # (bincount reads its range on the host)
        ends = counts.cumsum(0).to(torch.int32)  # each expert's slots end here, sorted
        gate, up = torch._grouped_mm(x[token], self.gate_up.transpose(1, 2),
                                     offs=ends).chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, self.down.transpose(1, 2), offs=ends)
        self.tally += torch.stack((counts.gt(0).sum(), torch.ones_like(counts[0])))
        return torch.zeros_like(x).index_add_(0, token, y * weight[order, None].to(y.dtype))


class Block(nn.Module):
    """Pre-norm block: causal self-attention with grouped K/V heads, then the MLP (or, in a
    mixture of experts, the routed experts)."""

    def __init__(self, cfg, moe=False):
        super().__init__()
        h = cfg.hidden
        self.heads, self.kv_heads, self.kv_dim = cfg.heads, cfg.n_kv_heads, cfg.kv_dim
        self.head_dim, self.q_dim = cfg.head_dim, cfg.q_dim
        self.ln1 = norm_layer(cfg)
        self.qkv = Linear(h, cfg.q_dim + 2 * cfg.kv_dim)
        self.proj = Linear(cfg.q_dim, h)
        self.ln2 = norm_layer(cfg)
        self.gated = cfg.mlp == "gated"
        self.moe = MoE(cfg) if moe else None
        if not moe:
            self.fc = Linear(h, (2 if self.gated else 1) * cfg.ffn)  # (gate; up)
            self.out = Linear(cfg.ffn, h)

    def forward(self, x, cache, at):
        # x (B, T, h); cache (2, B_cache, KVH, S_max, D); at: the StepLayout
        index, positions, spans, mask, rope = at
        B, T, h = x.shape
        H, KVH = self.heads, self.kv_heads
        D, G = self.head_dim, H // KVH  # head width; query heads per K/V head
        q, k, v = self.qkv(self.ln1(x)).split([self.q_dim, self.kv_dim, self.kv_dim], dim=2)
        q = q.view(B, T, H, D).transpose(1, 2)                         # (B, H, T, D)
        k, v = (t.view(B, T, KVH, D).transpose(1, 2) for t in (k, v))  # (B, KVH, T, D)
        if rope is not None:
            q, k = rotate(q, rope), rotate(k, rope)
        # write this step's K/V at each row's own positions: cache[row, :, pos] = (KVH, D)
        cache[0][index[:, None], :, positions] = k.transpose(1, 2)
        cache[1][index[:, None], :, positions] = v.transpose(1, 2)
        if spans is None:  # prefill: attend among the new tokens only (from an empty row), or
            # also to the row's cached prefix (a mask: each token sees the keys up to its own)
            if mask is not None:
                keys = mask.shape[-1]
                k, v = cache[0][index, :, :keys], cache[1][index, :, :keys]  # (B, KVH, keys, D)
            if G > 1:
                k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        else:  # decode (T tokens a row, each row at its own positions: one, or a verify
            # pass's last token and drafts): each span of rows reads a view of its own cached
            # keys; the G query heads of a K/V head attend as G x T rows of one query
            q = q.reshape(B, KVH, G * T, D)
            masks = mask or [None] * len(spans)
            parts = [F.scaled_dot_product_attention(
                q[i:j], cache[0, row:row + j - i, :, :n], cache[1, row:row + j - i, :, :n],
                attn_mask=m) for (i, j, row, n), m in zip(spans, masks)]
            y = (parts[0] if len(parts) == 1 else torch.cat(parts)).reshape(B, H, T, D)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, self.q_dim))
        if self.moe is not None:
            return x + self.moe(self.ln2(x))
        if self.gated:
            gate, up = self.fc(self.ln2(x)).chunk(2, dim=-1)
            return x + self.out(F.silu(gate) * up)
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class StepLayout(NamedTuple):
    """Where a step's tokens sit, the same for every block: index (B,) the cache row of each
    batch row; positions (B, T); spans: see attention_spans (None for a prefill); mask: with
    spans, None or a mask for each span (G x T query rows a K/V head, keys: see ragged_step);
    without, None or (B, 1, T, keys) for a prefill after a cached prefix; rope: None or
    (cos, sin)."""
    index: torch.Tensor
    positions: torch.Tensor
    spans: list
    mask: torch.Tensor
    rope: tuple


class Transformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        # (tables given, not drawn: drawing on the meta device imports torch._dynamo, 2 s)
        self.tok_embed = nn.Embedding(cfg.vocab, cfg.hidden,
                                      _weight=torch.empty(cfg.vocab, cfg.hidden))
        if cfg.positions == "learned":
            self.pos_embed = nn.Embedding(cfg.max_positions, cfg.hidden, _weight=torch.empty(
                cfg.max_positions, cfg.hidden))
        self.blocks = nn.ModuleList(Block(cfg, moe=i >= cfg.layers - cfg.moe_layers)
                                    for i in range(cfg.layers))
        self.ln_f = norm_layer(cfg)
        self.lm_head = Linear(cfg.hidden, cfg.vocab)
        if cfg.tied:
            self.lm_head.weight = self.tok_embed.weight
        self.register_buffer("inv_freq", rope_frequencies(cfg), persistent=False)

    def forward(self, tokens, positions, cache, rows=None, spans=None, mask=None):
        """tokens, positions (B, T) -> a prefill's logits of each row's last token (B, vocab);
        a step over spans (a decode, a verify pass) its logits of every token (B, T, vocab).

        rows: the cache row of each batch row (default: rows 0..B-1); spans: None for a prefill
        into empty rows, else the step's attention spans (see attention_spans) and their masks.
        """
        index = torch.arange(len(tokens), device=tokens.device) if rows is None else rows
        x, rope = self.tok_embed(tokens), None
        if self.cfg.positions == "learned":
            x = x + self.pos_embed(positions)
        else:
            angles = positions[:, None, :, None].float() * self.inv_freq  # (B, 1, T, D/2)
            rope = angles.cos(), angles.sin()
        at = StepLayout(index, positions, spans, mask, rope)
        for layer, block in enumerate(self.blocks):
            x = block(x, cache[layer], at)
        return self.lm_head(self.ln_f(x if spans else x[:, -1]))


def rope_frequencies(cfg):
    """theta^(-2i/D) for i < D/2: the rotary angle per position of each pair of dimensions."""
    D = cfg.head_dim
    return cfg.rope_theta ** (-torch.arange(0, D, 2, dtype=torch.float32, device="cpu") / D)


class PostProxy(nn.Module):
    """The model the post's A and B figures fit (--arch post): per token, `layers` square
    h x h matmuls in a row, and nothing else: no attention, KV cache, norms, embeddings or LM
    head. Its FLOPs are the post's 2 L h^2 per token; its weights, L h^2."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(Linear(cfg.hidden, cfg.hidden) for _ in range(cfg.layers))

    def forward(self, x):  # (..., h) -> (..., h)
        for layer in self.layers:
            x = layer(x)
        return x


def build_model(cfg, device, seed=0, weight_first_rows=0):
    """Random weights from a fixed seed, scaled so activations stay O(1) in fp16. The model is
    laid out on the meta device and allocated once, on the device and in its own dtype (an 8B
    model never exists in fp32 on the host). weight_first_rows: see linear."""
    with torch.device("meta"):
        model = PostProxy(cfg) if cfg.arch == "post" else Transformer(cfg)
    for module in model.modules():  # (by hand: Module.to_empty imports sympy, 1-2 s)
        for name, p in module.named_parameters(recurse=False):
            module._parameters[name] = nn.Parameter(torch.empty(
                p.shape, device=device, dtype=DTYPES[cfg.dtype]))
        for name, b in module.named_buffers(recurse=False):
            module._buffers[name] = torch.empty(b.shape, device=device, dtype=b.dtype)
    if cfg.arch == "transformer" and cfg.tied:  # (each module was given its own copy)
        model.lm_head.weight = model.tok_embed.weight
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # (a Linear's (out, in), an expert stack's (experts, out, in))
                p.normal_(0.0, 0.02 if "embed" in name else p.shape[-1] ** -0.5, generator=g)
            else:  # a norm's weight (and LayerNorm's bias)
                p.fill_(0.0 if name.endswith("bias") else 1.0)
        if hasattr(model, "inv_freq"):
            model.inv_freq = rope_frequencies(cfg).to(device)
    grouped = cfg.experts and torch.device(device).type == "cuda" and grouped_mm_works(
        torch.device(device), DTYPES[cfg.dtype])
    for module in model.modules():
        if isinstance(module, (Linear, MoE)):
            module.weight_first_rows = weight_first_rows
        if isinstance(module, MoE):
            module.set_grouped(bool(grouped))
    return model.eval()


def new_kv_cache(cfg, batch, max_len, device, seed=0, tile=256):
    """(layers, 2, batch, kv_heads, max_len, head_dim), filled with random values, never zeros.

    One random (kv_heads, tile, head_dim) block is copied across the cache: a copy runs at
    memory speed where drawing gigabytes of random numbers on a CPU takes many seconds.
    """
    shape = (cfg.layers, 2, batch, cfg.n_kv_heads, max_len, cfg.head_dim)
    g = torch.Generator(device="cpu").manual_seed(seed)
    block = torch.randn(cfg.n_kv_heads, min(tile, max_len), cfg.head_dim, generator=g)
    block = block.to(device=device, dtype=DTYPES[cfg.dtype])
    cache = torch.empty(shape, device=device, dtype=block.dtype)
    for start in range(0, max_len, tile):
        part = cache[..., start:start + tile, :]
        part.copy_(block[:, :part.shape[-2]])
    return cache


def prefill(model, cache, tokens, rows=None, start=0):
    """Run prompts (B, T) into cache rows; logits of the last tokens (B, vocab).

    rows: the cache row of each prompt (default: the first B rows). start: the tokens each row
    holds already (a cached prefix): the prompts' rest runs at positions start..start+T-1,
    attending to the prefix too.
    """
    B, T = tokens.shape
    positions = torch.arange(start, start + T, device=tokens.device).expand(B, T)
    if not start:
        return model(tokens, positions, cache, rows)
    keys = torch.arange(start + T, device=tokens.device)
    mask = (keys <= positions[:, :, None])[:, None]  # (B, 1, T, keys)
    if rows is None:
        rows = torch.arange(B, device=tokens.device)
    return model(tokens, positions, cache, rows, None, mask)


def attention_spans(rows, positions, width=1):
    """Group a decode's batch rows for attention: [(i, j, first cache row, keys), ...].

    A span is a run of batch rows i..j-1 whose cache rows are consecutive and whose positions
    are equal, so it attends to a view of the cache (rows row..row+j-i-1, the first `keys`
    positions: up to a row's last new token, `width` a row) with no padding: each row reads
    exactly its own context. One span when every row is at the same position (A and B, a
    static batch).
    """
    spans, i = [], 0
    for j in range(1, len(rows) + 1):
        if j == len(rows) or rows[j] != rows[j - 1] + 1 or positions[j] != positions[i]:
            spans.append((i, j, rows[i], positions[i] + width))
            i = j
    return spans


def decode_step(model, cache, tokens, positions, rows=None, pad=False):
    """One new token per row (B,); logits (B, vocab).

    positions: an int when every row is at the same position (one attention span, no host
    values read: what a CUDA graph captures), or a sequence of each row's own position.
    rows: the cache row of each token (default 0..B-1), a list or a tensor.
    pad: rows at different positions in consecutive cache rows attend in one call, padded to
    the longest row and masked, instead of one call per span: it reads the padding, but on a
    GPU one kernel beats dozens of tiny launches.
    """
    B, device = len(tokens), tokens.device
    if isinstance(positions, int) and rows is None:  # the timed path of A and B: one span
        return model(tokens[:, None], torch.full((B, 1), positions, device=device), cache,
                     None, [(0, B, 0, positions + 1)])[:, 0]
    positions = [positions] * B if isinstance(positions, int) else positions
    return ragged_step(model, cache, tokens[:, None], positions, rows, pad)[:, 0]


def ragged_step(model, cache, tokens, positions, rows=None, pad=False):
    """T tokens a row (B, T), row b's at positions p_b..p_b+T-1 (positions: each row's p_b),
    each attending to its row's cached keys and to its own tokens before it: a decode step
    (T = 1), or speculative decoding's verify pass (a row's last token and its T - 1 drafts).
    rows, pad: as decode_step's. -> logits of each token (B, T, vocab)."""
    (B, T), device = tokens.shape, tokens.device
    row_list = list(range(B)) if rows is None else [int(r) for r in rows]
    first = [int(p) for p in positions]
    position_tensor = torch.tensor(first, device=device)[:, None] + torch.arange(T, device=device)
    index = None if rows is None else torch.as_tensor(row_list, device=device)
    G = model.cfg.heads // model.cfg.n_kv_heads  # (a K/V head's query rows: G x T, g major)
    spans, masks = attention_spans(row_list, first, T), None
    if pad and len(spans) > 1 and row_list == list(range(row_list[0], row_list[0] + B)):
        keys = max(first) + T  # (each row's keys up to each of its tokens, the rest padding)
        spans = [(0, B, row_list[0], keys)]
        visible = torch.arange(keys, device=device) <= position_tensor[:, :, None]
        masks = [visible[:, None] if T == 1 else  # (B, 1, 1, keys): broadcast over G
                 visible[:, None].repeat(1, 1, G, 1)]  # (B, 1, G x T, keys)
    elif T > 1:  # (each span's new tokens see the keys up to their own)
        masks = [(torch.arange(n, device=device) <= torch.arange(n - T, n, device=device)[
            :, None]).repeat(G, 1) for _, _, _, n in spans]  # (G x T, keys)
    return model(tokens, position_tensor, cache, index, spans, masks)


def random_tokens(cfg, shape, device, n=8, seed=0):
    """A few fresh random token tensors to cycle through, so no call reuses the last input."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randint(cfg.vocab, shape, generator=g).to(device) for _ in range(n)]


def random_activations(cfg, shape, device, n=8, seed=0):
    """A few fresh random (shape..., hidden) inputs for the post's proxy, in its dtype."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(*shape, cfg.hidden, generator=g).to(device, DTYPES[cfg.dtype])
            for _ in range(n)]


@functools.lru_cache(maxsize=4)
def grouped_mm_works(device, dtype):
    """Whether torch._grouped_mm (the MoE layer's grouped formulation) runs here in this dtype
    and agrees with a matmul per group over uneven groups, one of them empty: one tiny call.
    (On CUDA it needs a recent torch, sm90 or later and bfloat16; some builds run it
    elsewhere.)"""
    if not hasattr(torch, "_grouped_mm"):
        return False
    g = torch.Generator(device="cpu").manual_seed(3)
    x = torch.randn(7, 32, generator=g).to(device, dtype)
    w = torch.randn(3, 48, 32, generator=g).to(device, dtype)
    try:
        got = torch._grouped_mm(x, w.transpose(1, 2),
                                offs=torch.tensor([3, 3, 7], dtype=torch.int32, device=device))
    except Exception:  # (no kernel for this device or dtype: the loop runs instead)
        return False
    want = torch.cat((x[:3] @ w[0].T, x[3:] @ w[2].T))
    return bool(torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2))
