"""
NN_40_serving.py -- inference serving, measured.

The runnable companion to the post "Inference serving: throughput, latency and empty seats".
It measures, on your GPU (or your CPU), the post's three claims:

  A  decode batch sweep   a bigger decode batch barely lengthens anyone's wait, because a
                          decode step is bound by reading the weights, not by arithmetic
  B  prefill vs decode    the same device runs prefill near its arithmetic peak and decode
                          hundreds of times below it (arithmetic intensity ~ tokens per read)
  C  static vs continuous static batching leaves seats empty until a batch's longest request
                          ends; refilling a freed seat at once (continuous) fills them

A and B run a real decoder-only transformer (random weights, nothing downloaded) with a static
KV cache; C is a pure Python/NumPy simulation that touches no torch device.

    python NN_40_serving.py                    # A, B, C; CUDA if present, else a CPU preset
    python NN_40_serving.py --experiments C    # the simulation alone
    python NN_40_serving.py --quick            # a smoke run of everything
    python NN_40_serving.py --help             # every flag

It prints a banner and one table per experiment, and writes OUT/results.json and the figures
(OUT defaults to ./figures).
"""

# -----------------------------------------------------------------------------
# imports

import argparse
import dataclasses
import datetime
import heapq
import json
import math
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# -----------------------------------------------------------------------------
# configuration


class UsageError(Exception):
    """A mistake the user can fix: printed as one line, exit status 2."""


@dataclass(frozen=True)
class ModelConfig:
    layers: int = 12
    hidden: int = 2048
    heads: int = 16
    vocab: int = 32000
    max_positions: int = 8192  # rows of the learned position table = longest sequence
    dtype: str = "float16"

    @property
    def head_dim(self):
        return self.hidden // self.heads

    @property
    def dtype_bytes(self):
        return DTYPES[self.dtype].itemsize


DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

# PyTorch's fp16 matmul on CPU is ~1000x slower than bf16 (0.0004 vs 0.41 TFLOP/s for a 2048^3
# product on a 2-core dev machine), so on CPU every model field the user leaves unset comes from
# this smaller preset instead of the post's GPU model.
CPU_PRESET = ModelConfig(layers=4, hidden=1024, heads=8, vocab=8192, max_positions=4096,
                         dtype="bfloat16")

EXPERIMENTS = "ABC"
LENGTH_MEDIAN, LENGTH_SIGMA, LENGTH_MAX = 70, 1.0, 2048  # the default output-length law (C)


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig
    experiments: str = EXPERIMENTS
    device: str = None            # "cuda" or "cpu"; None when only C runs
    batch_sizes: tuple = (1, 8, 32, 128, 256)
    context: int = 128            # tokens already in each row's KV cache when a decode step runs
    contexts: tuple = (128,)      # A sweeps every batch size at each of these contexts
    graphs: str = "eager"         # "eager", "graph" or "both": CUDA graphs for decode (CUDA only)
    peak_bandwidth_gbs: float = None  # replace the measured ceilings
    peak_tflops: float = None
    prefill_lengths: tuple = (512, 2048)
    decode_batches: tuple = (1, 32)
    requests: int = 600
    slots: int = 32
    seed: int = 0
    lengths_file: str = None
    warmup: int = 3               # untimed calls at each shape
    reps: int = 50                # timed calls at each shape (fewer if a call is slow)
    time_budget_s: float = 2.0    # per shape: stop repeating after this, but keep >= 5 calls
    out: str = "figures"
    figures: bool = True
    lang: str = "en"
    quick: bool = False
    preset_note: str = ""


# -----------------------------------------------------------------------------
# workload: generated lengths of the requests (pure NumPy)


def lognormal_lengths(n, seed, median=LENGTH_MEDIAN, sigma=LENGTH_SIGMA, max_len=LENGTH_MAX):
    """n generated lengths from a log-normal law (median, sigma of log), rounded, in [1, max]."""
    rng = np.random.default_rng(seed)
    draws = rng.lognormal(math.log(median), sigma, size=n)
    return np.clip(np.rint(draws), 1, max_len).astype(np.int64)


def read_lengths_file(path):
    """One positive integer per line; blank lines and '#' comments are allowed."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as e:
        raise UsageError(f"cannot read lengths file {path}: {e.strerror}")
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not a text file")
    lengths = []
    for lineno, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value <= 0:
            raise UsageError(f"{path}:{lineno}: expected a positive integer, got {text!r}")
        lengths.append(value)
    if not lengths:
        raise UsageError(f"{path}: no lengths in the file")
    return np.array(lengths, dtype=np.int64)


# -----------------------------------------------------------------------------
# simulation: slot-steps of static and continuous batching (pure NumPy, no torch)
# A request of length L holds its slot for exactly L decode steps. Static batching takes the
# requests in order in groups of `slots` and runs each group until its longest request ends.
# Continuous batching gives a slot freed after step t to the next waiting request at step t+1.


def occupied_per_step(starts, lengths, steps):
    """Occupied slots at each step 0..steps-1, from each request's first step and length."""
    delta = np.bincount(starts, minlength=steps + 1) - np.bincount(starts + lengths,
                                                                   minlength=steps + 1)
    return np.cumsum(delta)[:steps]


def static_starts(lengths, slots):
    """First step of every request under static batching, and the makespan."""
    n_groups = -(-len(lengths) // slots)
    padded = np.zeros(n_groups * slots, dtype=np.int64)
    padded[:len(lengths)] = lengths
    group_steps = padded.reshape(n_groups, slots).max(axis=1)
    group_start = np.concatenate([[0], np.cumsum(group_steps)[:-1]])
    return np.repeat(group_start, slots)[:len(lengths)], int(group_steps.sum())


def continuous_starts(lengths, slots):
    """First step of every request under continuous batching, and the makespan."""
    free_at = [0] * min(slots, len(lengths))  # step at which each slot next becomes free
    starts = np.empty(len(lengths), dtype=np.int64)
    for i, length in enumerate(lengths.tolist()):
        start = heapq.heappop(free_at)
        starts[i] = start
        heapq.heappush(free_at, start + length)
    return starts, max(free_at)


def simulate_slots(lengths, slots, policy):
    """Steps, occupancy and occupied slots per step of one policy ('static' or 'continuous')."""
    starts, steps = {"static": static_starts, "continuous": continuous_starts}[policy](lengths,
                                                                                     slots)
    return {"steps": steps,
            "occupancy": float(lengths.sum() / (steps * slots)),
            "occupied": occupied_per_step(starts, lengths, steps)}


# -----------------------------------------------------------------------------
# accounting: FLOPs and bytes of one forward step (the one source of truth for A, B and MBU/MFU)
# Per layer the block holds 12 h^2 matmul weights (qkv 3h^2, proj h^2, fc 4h^2, out 4h^2) and two
# LayerNorms (4h); the model adds a final LayerNorm (2h), an untied LM head (h V) and two
# embedding tables (token V h, position P h) of which a step reads only the rows it looks up.
# A step runs `new_tokens` tokens in each of `batch` rows whose cache already holds `context`
# tokens, and computes logits for the last token of each row only (as servers do).


def param_count(cfg):
    h = cfg.hidden
    return cfg.layers * (12 * h * h + 4 * h) + 2 * h + h * cfg.vocab + (cfg.vocab
                                                                        + cfg.max_positions) * h


def kv_bytes_per_token(cfg):
    """K and V of one token in every layer."""
    return cfg.layers * 2 * cfg.hidden * cfg.dtype_bytes


def step_cost(cfg, batch, new_tokens, context):
    """FLOPs and bytes of one forward step.

    flops: 2 per multiply-add of every matmul (weights, and attention's QK^T and PV over the
           keys each query may see: its row's cached context plus the new tokens up to itself)
    bytes: weights read once (matmuls, norms, looked-up embedding rows) + the KV cache read
           (the cached context of every row) + the KV written (the new tokens) + activations
           (each matmul's input and output once, and the logits): a lower bound on traffic.
    """
    h, L, e = cfg.hidden, cfg.layers, cfg.dtype_bytes
    tokens = batch * new_tokens
    keys_seen = new_tokens * context + new_tokens * (new_tokens + 1) // 2  # per row, per layer
    matmul_flops = 2 * tokens * L * 12 * h * h + 2 * batch * h * cfg.vocab
    attention_flops = 4 * h * L * batch * keys_seen
    weight_bytes = (L * (12 * h * h + 4 * h) + 2 * h + h * cfg.vocab + 2 * tokens * h) * e
    kv_read_bytes = batch * context * kv_bytes_per_token(cfg)
    kv_write_bytes = tokens * kv_bytes_per_token(cfg)
    activation_bytes = (L * 18 * h * tokens + batch * cfg.vocab) * e
    return {"flops": matmul_flops + attention_flops,
            "matmul_flops": matmul_flops,
            "attention_flops": attention_flops,
            "weight_bytes": weight_bytes,
            "kv_read_bytes": kv_read_bytes,
            "kv_write_bytes": kv_write_bytes,
            "activation_bytes": activation_bytes,
            "bytes": weight_bytes + kv_read_bytes + kv_write_bytes + activation_bytes}


def memory_needed_bytes(cfg, batch, cache_len, new_tokens):
    """Device memory a step needs beyond the weights: its KV cache and peak activations.

    Activations are counted generously (the widest intermediate, the logits in fp32, and a
    full attention score matrix in case the kernel materialises it).
    """
    e = cfg.dtype_bytes
    tokens = batch * new_tokens
    kv = batch * cache_len * kv_bytes_per_token(cfg)
    activations = (tokens * 10 * cfg.hidden * e + batch * cfg.vocab * 4
                   + batch * cfg.heads * new_tokens * cache_len * 4)
    return kv + activations


# -----------------------------------------------------------------------------
# model: a decoder-only transformer with a static KV cache
# The cache is one preallocated tensor (layers, 2, batch, heads, max_len, head_dim); each row
# writes its new K/V at its own positions, so shapes never change between steps.


class Block(nn.Module):
    """Pre-norm block: causal multi-head self-attention, then a 4x MLP."""

    def __init__(self, cfg):
        super().__init__()
        h = cfg.hidden
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.proj = nn.Linear(h, h, bias=False)
        self.ln2 = nn.LayerNorm(h)
        self.fc = nn.Linear(h, 4 * h, bias=False)
        self.out = nn.Linear(4 * h, h, bias=False)

    def forward(self, x, cache, rows, index, positions, kv_len, mask):
        # x (B, T, h); cache (2, B_cache, H, S_max, D); index (B,) the cache row of each batch
        # row (rows is None when those are simply the first B rows); positions (B, T)
        B, T, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=2)
        q, k, v = (t.view(B, T, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        # write this step's K/V at each row's own positions: cache[row, :, pos] = (H, D)
        cache[0][index[:, None], :, positions] = k.transpose(1, 2)
        cache[1][index[:, None], :, positions] = v.transpose(1, 2)
        if kv_len is None:  # prefill from an empty row: attend among the new tokens only
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # decode: attend to the first kv_len cached keys (the mask hides a row's future)
            keys, values = cache[:, :B, :, :kv_len] if rows is None else \
                cache[:, :, :, :kv_len].index_select(1, rows)
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, h))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class Transformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok_embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos_embed = nn.Embedding(cfg.max_positions, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, tokens, positions, cache, rows=None, kv_len=None, mask=None):
        """tokens, positions (B, T) -> logits of each row's last token (B, vocab)."""
        index = torch.arange(len(tokens), device=tokens.device) if rows is None else rows
        x = self.tok_embed(tokens) + self.pos_embed(positions)
        for layer, block in enumerate(self.blocks):
            x = block(x, cache[layer], rows, index, positions, kv_len, mask)
        return self.lm_head(self.ln_f(x[:, -1]))


def build_model(cfg, device, seed=0):
    """Random weights from a fixed seed, scaled so activations stay O(1) in fp16."""
    torch.manual_seed(seed)
    model = Transformer(cfg)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=0.02 if "embed" in name else p.shape[1] ** -0.5)
    return model.to(device=device, dtype=DTYPES[cfg.dtype]).eval()


def new_kv_cache(cfg, batch, max_len, device, seed=0, tile=256):
    """(layers, 2, batch, heads, max_len, head_dim), filled with random values, never zeros.

    One random (heads, tile, head_dim) block is copied across the cache: a copy runs at memory
    speed where drawing gigabytes of random numbers on a CPU takes many seconds.
    """
    shape = (cfg.layers, 2, batch, cfg.heads, max_len, cfg.head_dim)
    g = torch.Generator(device="cpu").manual_seed(seed)
    block = torch.randn(cfg.heads, min(tile, max_len), cfg.head_dim, generator=g)
    block = block.to(device=device, dtype=DTYPES[cfg.dtype])
    cache = torch.empty(shape, device=device, dtype=block.dtype)
    for start in range(0, max_len, tile):
        part = cache[..., start:start + tile, :]
        part.copy_(block[:, :part.shape[-2]])
    return cache


def prefill(model, cache, tokens, rows=None):
    """Run whole prompts (B, T) into empty cache rows; logits of the last tokens (B, vocab).

    rows: the cache row of each prompt (default: the first B rows).
    """
    B, T = tokens.shape
    positions = torch.arange(T, device=tokens.device).expand(B, T)
    return model(tokens, positions, cache, rows)


def decode_step(model, cache, tokens, positions, rows=None, kv_len=None):
    """One new token per row (B,); logits (B, vocab).

    positions: an int when every row is at the same position (no mask: all cached keys are
    visible), or a (B,) tensor of each row's own position. kv_len bounds the keys read
    (default: the furthest row's position + 1); pass it to keep shapes static for a CUDA graph
    and to avoid a device sync.
    """
    B = len(tokens)
    if isinstance(positions, int):
        kv_len, mask = positions + 1, None
        positions = torch.full((B, 1), positions, device=tokens.device)
    else:
        kv_len = int(positions.max()) + 1 if kv_len is None else kv_len
        positions = positions[:, None]
        mask = (torch.arange(kv_len, device=tokens.device) <= positions)[:, None, None, :]
    return model(tokens[:, None], positions, cache, rows, kv_len, mask)


# -----------------------------------------------------------------------------
# timing: one primitive for every measured region


def percentile_summary(samples_ms):
    p10, p50, p90 = np.percentile(samples_ms, [10, 50, 90])
    return {"median_ms": float(p50), "p10_ms": float(p10), "p90_ms": float(p90),
            "n": len(samples_ms)}


def time_region(fn, device, warmup, reps, budget_s):
    """Median and p10/p90 of fn() in ms after `warmup` untimed calls.

    CUDA: events around each call. CPU: perf_counter. Repeats `reps` times or until `budget_s`
    of timed calls, whichever comes first, but at least 5 times. Warm-up stops early once it
    has spent a third of the budget (a slow shape needs one call to warm, not three).
    """
    cuda = device.type == "cuda"
    t0 = time.perf_counter()
    for i in range(warmup):  # at least one call; no more than budget_s / 3 of them
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        if time.perf_counter() - t0 > budget_s / 3:
            break
    samples, spent = [], 0.0
    while len(samples) < reps and (spent < budget_s or len(samples) < 5):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        samples.append(ms)
        spent += ms / 1e3
    return percentile_summary(samples)


def random_tokens(cfg, shape, device, n=8, seed=0):
    """A few fresh random token tensors to cycle through, so no call reuses the last input."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randint(cfg.vocab, shape, generator=g).to(device) for _ in range(n)]


def cycle(items):
    state = {"i": 0}

    def next_item():
        state["i"] += 1
        return items[state["i"] % len(items)]
    return next_item


# -----------------------------------------------------------------------------
# device facts


def resolve_device(name):
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available to PyTorch here")
    return torch.device(name)


def device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} threads)"


def free_memory_bytes(device):
    """Memory free for new allocations on the device."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def fits(cfg, device, batch, cache_len, new_tokens, margin=0.9):
    """(fits, needed_bytes, free_bytes) for one step's cache and activations, before allocating."""
    needed = memory_needed_bytes(cfg, batch, cache_len, new_tokens)
    free = free_memory_bytes(device)
    return needed <= margin * free, needed, free


def gib(n_bytes):
    return f"{n_bytes / 2**30:.2f} GiB"


# -----------------------------------------------------------------------------
# experiments A and B (device code)


class Bench:
    """The model on its device, the measured ceilings, and the timing settings of A and B."""

    def __init__(self, run, device, log):
        self.run, self.cfg, self.device, self.log = run, run.model, device, log
        weight_bytes = param_count(self.cfg) * self.cfg.dtype_bytes
        if weight_bytes > 0.9 * free_memory_bytes(device):
            raise UsageError(f"the model's weights need {gib(weight_bytes)} but the device has "
                             f"{gib(free_memory_bytes(device))} free; use smaller --layers/--hidden")
        self.model = build_model(self.cfg, device, seed=run.seed)
        self.modes = ("eager", "graph") if run.graphs == "both" else (run.graphs,)

    def time(self, fn, mode="eager"):
        """Time fn() as it is (eager) or replayed from a CUDA graph captured from it."""
        if mode == "graph":
            fn = cuda_graph(fn)
        return time_region(fn, self.device, self.run.warmup, self.run.reps, self.run.time_budget_s)

    def time_decode(self, batch, context, mode="eager"):
        """One decode step of `batch` rows, each with `context` cached tokens.

        Each call first copies fresh random tokens into a static input buffer (one tiny copy,
        in both modes), so a CUDA graph replays on new inputs.
        """
        cache = new_kv_cache(self.cfg, batch, context + 1, self.device)
        next_tokens = cycle(random_tokens(self.cfg, (batch,), self.device, seed=batch))
        tokens = next_tokens().clone()

        def step():
            tokens.copy_(next_tokens())
            return decode_step(self.model, cache, tokens, context)
        timing = self.time(step, mode)
        del cache
        return timing

    def time_prefill(self, tokens):
        cache = new_kv_cache(self.cfg, 1, tokens, self.device)
        next_prompt = cycle(random_tokens(self.cfg, (1, tokens), self.device, seed=tokens))
        timing = self.time(lambda: prefill(self.model, cache, next_prompt()))
        del cache
        return timing

    def linear_chain(self, mode):
        """The model's own matmul weights as a bare chain of F.linear calls at batch 1.

        The same weight bytes a batch-1 decode step reads, with nothing else around them: the
        rate a decode step could reach if the model added no work of its own.
        """
        linears = [m for m in self.model.modules() if isinstance(m, nn.Linear)]
        g = torch.Generator(device="cpu").manual_seed(1)
        inputs = [torch.randn(1, m.in_features, generator=g).to(self.device, m.weight.dtype)
                  for m in linears]

        def chain():
            for x, m in zip(inputs, linears):
                F.linear(x, m.weight)
        timing = self.time(chain, mode)
        weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
        s = timing["median_ms"] / 1e3
        return {"mode": mode, "step_ms": timing["median_ms"], "p10_ms": timing["p10_ms"],
                "p90_ms": timing["p90_ms"], "reps": timing["n"], "bytes": weight_bytes,
                "gbs": weight_bytes / s / 1e9}

    def skip_reason(self, batch, cache_len, new_tokens):
        ok, needed, free = fits(self.cfg, self.device, batch, cache_len, new_tokens)
        if ok:
            return None
        return f"does not fit: needs {gib(needed)}, {gib(free)} free"



def cuda_graph(fn):
    """Capture fn() into a CUDA graph (after warming it on a side stream); return a replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay  # the bound method keeps the graph (and its memory pool) alive


def measure_ceilings(run, device, log):
    """The device's limits in the run's dtype: copy bandwidth and square-matmul throughput.

    Bandwidth: dst.copy_(src) over a buffer far past the last-level cache, counting bytes read
    plus written. Matmul: a large square product of random (never zero) operands.
    --peak-bandwidth-gbs / --peak-tflops replace a measurement.
    """
    dtype = DTYPES[run.model.dtype]
    cuda = device.type == "cuda"
    ceilings = {}
    if run.peak_bandwidth_gbs:
        ceilings.update(bandwidth_gbs=run.peak_bandwidth_gbs, bandwidth_source="given")
    else:
        n_bytes = (2 if cuda else 0.25) * 2**30
        src = torch.randn(int(n_bytes // 4), device=device)  # fp32: the copy moves bytes
        dst = torch.empty_like(src)
        timing = time_region(lambda: dst.copy_(src), device, run.warmup, run.reps,
                             run.time_budget_s)
        ceilings.update(bandwidth_gbs=2 * n_bytes / (timing["median_ms"] / 1e3) / 1e9,
                        bandwidth_source=f"measured: copy of {gib(n_bytes)}")
        del src, dst
    if run.peak_tflops:
        ceilings.update(matmul_tflops=run.peak_tflops, matmul_source="given")
    else:
        n = 8192 if cuda else 2048
        g = torch.Generator(device="cpu").manual_seed(2)
        a, b = (torch.randn(n, n, generator=g).to(device, dtype) for _ in range(2))
        timing = time_region(lambda: a @ b, device, run.warmup, run.reps, run.time_budget_s)
        ceilings.update(matmul_tflops=2 * n**3 / (timing["median_ms"] / 1e3) / 1e12,
                        matmul_source=f"measured: {n}x{n}x{n} {run.model.dtype} matmul")
        del a, b
    ceilings["ridge_flop_per_byte"] = ceilings["matmul_tflops"] * 1e3 / ceilings["bandwidth_gbs"]
    log(f"ceilings: {ceilings['bandwidth_gbs']:.1f} GB/s, {ceilings['matmul_tflops']:.2f} "
        f"TFLOP/s")
    return ceilings


def roofline_row(cfg, ceilings, timing, batch, new_tokens, context):
    """Timing + the accounting of the step it timed: rates, intensity, MBU, MFU and bound.

    MBU = achieved bytes/s (weights + KV cache + activations, the step_cost model) / measured
    bandwidth; MFU = achieved FLOP/s / measured matmul rate. The bound is the side of the
    ridge point (peak FLOP/s / peak bytes/s) the step's intensity falls on.
    """
    cost = step_cost(cfg, batch, new_tokens, context)
    s = timing["median_ms"] / 1e3
    tokens = batch * new_tokens
    intensity = cost["flops"] / cost["bytes"]
    return {"step_ms": timing["median_ms"], "p10_ms": timing["p10_ms"],
            "p90_ms": timing["p90_ms"], "reps": timing["n"],
            "tokens_per_s": tokens / s, "us_per_token": s * 1e6 / tokens,
            "tflops": cost["flops"] / s / 1e12, "gbs": cost["bytes"] / s / 1e9,
            "mbu": cost["bytes"] / s / 1e9 / ceilings["bandwidth_gbs"],
            "mfu": cost["flops"] / s / 1e12 / ceilings["matmul_tflops"],
            "intensity": intensity,
            "bound": "memory" if intensity < ceilings["ridge_flop_per_byte"] else "compute",
            "flops": cost["flops"], "bytes": cost["bytes"]}


def kv_crossover_batch(cfg, context):
    """Smallest batch whose KV-cache reads per decode step exceed the weight reads."""
    cost = step_cost(cfg, 1, 1, context)
    kv_per_row = cost["kv_read_bytes"]
    return math.floor(cost["weight_bytes"] / kv_per_row) + 1 if kv_per_row else None


def decode_row(bench, ceilings, batch, context, mode):
    row = {"batch": batch, "context": context, "mode": mode}
    reason = bench.skip_reason(batch, context + 1, 1)
    if reason:
        row["skipped"] = reason
    else:
        row.update(roofline_row(bench.cfg, ceilings, bench.time_decode(batch, context, mode),
                                batch, 1, context))
    return row


def run_decode_sweep(bench, ceilings, log):
    """A: decode step time and throughput against batch size, at each context, each mode."""
    run = bench.run
    rows = []
    for context in run.contexts:
        for mode in bench.modes:
            for batch in run.batch_sizes:
                rows.append(decode_row(bench, ceilings, batch, context, mode))
                log(f"A context {context} {mode} batch {batch}: " + row_progress(rows[-1]))
            group = [r for r in rows if r["context"] == context and r["mode"] == mode]
            base = next((r for r in group if r["batch"] == 1 and "skipped" not in r), None)
            for r in measured(group):
                if base:
                    r["throughput_vs_1"] = r["tokens_per_s"] / base["tokens_per_s"]
                    r["wait_vs_1"] = r["step_ms"] / base["step_ms"]
    crossover = {str(c): kv_crossover_batch(bench.cfg, c) for c in run.contexts}
    return {"context": run.context, "contexts": list(run.contexts), "modes": list(bench.modes),
            "kv_crossover_batch": crossover, "rows": rows}


def run_prefill_decode(bench, ceilings, log):
    """B: prefill of whole prompts against decode of one token alone and in a batch."""
    run = bench.run
    rows = []
    for tokens in run.prefill_lengths:
        row = {"phase": "prefill", "tokens": tokens, "batch": 1, "context": 0, "mode": "eager"}
        reason = bench.skip_reason(1, tokens, tokens)
        if reason:
            row["skipped"] = reason
        else:
            row.update(roofline_row(bench.cfg, ceilings, bench.time_prefill(tokens), 1, tokens,
                                    0))
        rows.append(row)
        log(f"B prefill {tokens}: " + row_progress(row))
    chain = []
    for mode in bench.modes:
        # the bare chain right before the decodes, so both see the machine in the same state
        chain.append(bench.linear_chain(mode))
        log(f"B linear chain {mode}: {chain[-1]['step_ms']:.3f} ms, {chain[-1]['gbs']:.1f} GB/s")
        for batch in run.decode_batches:
            rows.append({"phase": "decode", "tokens": 1,
                         **decode_row(bench, ceilings, batch, run.context, mode)})
            log(f"B decode {mode} x{batch}: " + row_progress(rows[-1]))
    return {"rows": rows, "linear_chain": chain}


def row_progress(row):
    if "skipped" in row:
        return row["skipped"]
    return f"{row['step_ms']:.3f} ms (p10 {row['p10_ms']:.3f}, p90 {row['p90_ms']:.3f}, " \
           f"{row['reps']} reps)"


# -----------------------------------------------------------------------------
# experiment C (pure simulation)


def request_lengths(run):
    if run.lengths_file:
        return read_lengths_file(run.lengths_file)
    return lognormal_lengths(run.requests, run.seed)


def seed_spread(run, n_seeds=100):
    """Occupancy and speedup over many seeds of the default law: how much one draw says."""
    stats = []
    for seed in range(n_seeds):
        lengths = lognormal_lengths(run.requests, seed)
        static = static_starts(lengths, run.slots)[1]
        continuous = continuous_starts(lengths, run.slots)[1]
        total = lengths.sum() / run.slots
        stats.append((total / static, total / continuous, static / continuous))
    p10, p50, p90 = np.percentile(np.array(stats), [10, 50, 90], axis=0)
    keys = ("static_occupancy", "continuous_occupancy", "speedup")
    return {"seeds": n_seeds, **{k: {"p10": float(a), "p50": float(b), "p90": float(c)}
                                 for k, a, b, c in zip(keys, p10, p50, p90)}}


def run_batching_sim(run, log):
    """C: static vs continuous batching over the same requests."""
    lengths = request_lengths(run)
    result = {"requests": len(lengths), "slots": run.slots,
              "source": run.lengths_file or f"log-normal (median {LENGTH_MEDIAN}, sigma "
                                            f"{LENGTH_SIGMA}, max {LENGTH_MAX}), seed {run.seed}",
              "lengths": {"median": float(np.median(lengths)), "mean": float(lengths.mean()),
                          "max": int(lengths.max()), "total": int(lengths.sum())}}
    for policy in ("static", "continuous"):
        sim = simulate_slots(lengths, run.slots, policy)
        result[policy] = {"steps": sim["steps"], "occupancy": sim["occupancy"],
                          "occupied": sim["occupied"].tolist()}
    result["speedup"] = result["static"]["steps"] / result["continuous"]["steps"]
    if not run.lengths_file:
        result["seed_spread"] = seed_spread(run)
    log(f"C: static {result['static']['steps']} steps, continuous "
        f"{result['continuous']['steps']} steps")
    return result


# -----------------------------------------------------------------------------
# reporting: banner, tables, results.json

HEADERS = {
    "en": {"batch": "batch", "step_ms": "step ms (= wait)", "tokens_per_s": "tokens/s",
           "throughput_vs_1": "throughput vs 1", "wait_vs_1": "wait vs 1",
           "row": "one step", "mode": "mode", "gbs": "GB/s", "mbu": "MBU",
           "mfu": "MFU", "bound": "bound",
           "A_contexts": "A  where the KV cache takes over: decode step ms ({mode})", "us_per_token": "µs / token", "tflops": "TFLOP/s",
           "intensity": "FLOP/byte", "policy": "policy", "steps": "total steps",
           "occupancy": "slot occupancy", "speedup": "speedup",
           "prefill": "prefill ({tokens} tokens)", "decode": "decode (batch {batch})",
           "static": "static batching", "continuous": "continuous batching",
           "A": "A  decode batch sweep (context {context} tokens)",
           "B": "B  prefill vs decode", "C": "C  static vs continuous batching "
                                              "({requests} requests, {slots} slots)"},
    "ko": {"batch": "배치 크기", "step_ms": "한 스텝 ms (= 대기)", "tokens_per_s": "처리량 (토큰/초)",
           "throughput_vs_1": "처리량 배율", "wait_vs_1": "대기 배율",
           "row": "한 스텝", "mode": "방식", "gbs": "GB/s", "mbu": "MBU",
           "mfu": "MFU", "bound": "병목",
           "A_contexts": "A  KV 캐시가 주도하는 지점: 디코드 한 스텝 ms ({mode})", "us_per_token": "토큰당 µs", "tflops": "실제 성능 TFLOP/s",
           "intensity": "산술 강도", "policy": "방식", "steps": "총 스텝",
           "occupancy": "슬롯 점유율", "speedup": "속도 향상",
           "prefill": "프리필 (질문 {tokens}토큰)", "decode": "디코드 (묶음 {batch})",
           "static": "정적 배칭", "continuous": "연속 배칭",
           "A": "A  디코드 배치 크기 (문맥 {context}토큰)",
           "B": "B  프리필 대 디코드", "C": "C  정적 대 연속 배칭 (요청 {requests}개, 슬롯 {slots}개)"},
}


def cell(row, key, fmt):
    if key == "step_ms" and "skipped" in row:
        return row["skipped"]
    return format(row[key], fmt) if key in row else ""


def format_tables(results, lang="en"):
    """The tables of every finished experiment, as one string."""
    from tabulate import tabulate
    H = HEADERS[lang]
    out = []
    if "A" in results:
        A = results["A"]
        cols = [("mode", "s"), ("batch", "d"), ("step_ms", ".3f"), ("tokens_per_s", ",.0f"),
                ("throughput_vs_1", ".1f"), ("wait_vs_1", ".2f")] + ROOFLINE_COLUMNS
        table = [[cell(r, k, f) for k, f in cols] for r in A["rows"]
                 if r["context"] == A["context"]]
        out += [H["A"].format(**A), tabulate(table, [H[k] for k, _ in cols], stralign="right")]
        if len(A["contexts"]) > 1:
            out += [H["A_contexts"].format(mode=A["modes"][-1]), context_table(A, H)]
    if "B" in results:
        cols = [("mode", "s"), ("step_ms", ".3f"), ("us_per_token", ".1f"), ("tflops", ".2f"),
                ("intensity", ".1f")] + ROOFLINE_COLUMNS
        table = [[H[r["phase"]].format(**r)] + [cell(r, k, f) for k, f in cols]
                 for r in results["B"]["rows"]]
        out += [H["B"], tabulate(table, [H["row"]] + [H[k] for k, _ in cols],
                                 stralign="right"), chain_text(results["B"])]
    if "C" in results:
        C = results["C"]
        table = [[H[p], f"{C[p]['steps']:,}", f"{100 * C[p]['occupancy']:.1f}%"]
                 for p in ("static", "continuous")]
        out += [H["C"].format(**C), tabulate(table, [H["policy"], H["steps"], H["occupancy"]],
                                             stralign="right"),
                f"{H['speedup']}: {C['speedup']:.2f}x   (lengths: {C['source']}; median "
                f"{C['lengths']['median']:.0f}, mean {C['lengths']['mean']:.1f}, max "
                f"{C['lengths']['max']:,})"]
        if "seed_spread" in C:
            s = C["seed_spread"]
            out.append(f"over {s['seeds']} seeds of the same law, p50 (p10-p90): static "
                       + spread_text(s["static_occupancy"], pct=True) + ", continuous "
                       + spread_text(s["continuous_occupancy"], pct=True) + ", speedup "
                       + spread_text(s["speedup"]))
    return "\n\n".join(out)


ROOFLINE_COLUMNS = [("gbs", ",.1f"), ("mbu", ".0%"), ("mfu", ".1%"), ("bound", "s")]


def context_table(A, H):
    """Decode step ms by batch (rows) and context (columns), in the fastest mode measured."""
    from tabulate import tabulate
    mode = A["modes"][-1]
    by_key = {(r["batch"], r["context"]): r for r in A["rows"] if r["mode"] == mode}
    batches = sorted({r["batch"] for r in A["rows"]})
    table = [[b] + [cell(by_key[b, c], "step_ms", ".3f") for c in A["contexts"]]
             for b in batches]
    crossover = ", ".join(f"{b} at context {c}" for c, b in A["kv_crossover_batch"].items())
    return (tabulate(table, [H["batch"]] + [f"ctx {c}: ms" for c in A["contexts"]],
                     stralign="right")
            + f"\nKV-cache reads exceed weight reads from batch {crossover}")


def chain_text(B):
    """How close decode at batch 1 comes to a bare chain of its own matmuls."""
    lines = []
    for chain in B["linear_chain"]:
        decode = next((r for r in measured(B["rows"]) if r["phase"] == "decode"
                       and r["batch"] == 1 and r["mode"] == chain["mode"]), None)
        text = (f"bare F.linear chain over the same {chain['bytes'] / 1e6:,.0f} MB of weights "
                f"({chain['mode']}, batch 1): {chain['step_ms']:.3f} ms, {chain['gbs']:.1f} GB/s")
        if decode:
            text += (f"; decode at batch 1 moves {decode['gbs']:.1f} GB/s = "
                     f"{decode['gbs'] / chain['gbs']:.0%} of it")
        lines.append(text)
    return "\n".join(lines)


def ceilings_line(ceilings, run):
    note = "" if run.device == "cuda" else "  (CPU: eager only; CUDA graphs need CUDA)"
    return (f"ceilings: {ceilings['bandwidth_gbs']:,.1f} GB/s ({ceilings['bandwidth_source']}), "
            f"{ceilings['matmul_tflops']:.2f} TFLOP/s ({ceilings['matmul_source']}); ridge "
            f"{ceilings['ridge_flop_per_byte']:.0f} FLOP/byte{note}")


def spread_text(s, pct=False):
    if pct:
        return f"{100 * s['p50']:.1f}% ({100 * s['p10']:.1f}-{100 * s['p90']:.1f}%)"
    return f"{s['p50']:.2f}x ({s['p10']:.2f}-{s['p90']:.2f}x)"


def environment(run, device, argv):
    env = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           "command": " ".join(["NN_40_serving.py"] + list(argv)),
           "python": platform.python_version(), "torch": torch.__version__,
           "numpy": np.__version__}
    if device is not None:
        env.update({"device": device_name(device), "device_type": device.type,
                    "cuda": torch.version.cuda if device.type == "cuda" else None,
                    "threads": torch.get_num_threads()})
    return env


def banner(results):
    env, cfg = results["environment"], results["config"]["model"]
    lines = [f"NN_40_serving  {env['date']}", f"command: {env['command']}",
             f"python {env['python']}, torch {env['torch']}, numpy {env['numpy']}"]
    if "device" in env:
        lines.append(f"device: {env['device']}" + (f", CUDA {env['cuda']}" if env["cuda"] else
                                                   f", {env['threads']} torch threads"))
        lines.append(f"model: {cfg['layers']} layers, hidden {cfg['hidden']}, {cfg['heads']} "
                     f"heads, vocab {cfg['vocab']}, {cfg['dtype']}: "
                     f"{cfg['params'] / 1e6:,.1f} M parameters, {gib(cfg['weight_bytes'])}")
        if results["config"].get("preset_note"):
            lines.append(results["config"]["preset_note"])
    return "\n".join(lines)


def write_atomic(path, data, mode="w"):
    """Write a file whole or not at all: a temporary file beside it, then a rename."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, mode, **({"encoding": "utf-8"} if "b" not in mode else {})) as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def to_json(results):
    def default(o):
        if isinstance(o, (np.integer,)):
            return int(o)
        if isinstance(o, (np.floating,)):
            return float(o)
        if isinstance(o, np.ndarray):
            return o.tolist()
        raise TypeError(type(o).__name__)
    return json.dumps(results, indent=1, ensure_ascii=False, default=default)


# -----------------------------------------------------------------------------
# figures (drawn from the results dictionary alone)

RED, BLUE, GREY = "#d62728", "#1f77b4", "#7f7f7f"


def figure_note(results):
    env, cfg = results["environment"], results["config"]["model"]
    if "device" not in env:
        return f"simulation, {env['date'][:10]}"
    return (f"{env['device']}, {cfg['dtype']}, {cfg['layers']} layers x {cfg['hidden']} "
            f"({cfg['params'] / 1e6:,.0f} M params), {env['date'][:10]}")


def save_figure(fig, results, path):
    fig.text(0.99, 0.005, figure_note(results), ha="right", va="bottom", fontsize=7, color=GREY)
    buf = _png_bytes(fig)
    write_atomic(path, buf, mode="wb")


def _png_bytes(fig):
    import io
    import matplotlib.pyplot as plt
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=150)
    plt.close(fig)
    return buf.getvalue()


def plot_occupancy(results, path):
    import matplotlib.pyplot as plt
    C = results["C"]
    fig, axes = plt.subplots(2, 1, figsize=(8, 4.6), sharex=True, sharey=True)
    for ax, policy, color in zip(axes, ("static", "continuous"), (RED, BLUE)):
        occupied = np.asarray(C[policy]["occupied"])
        ax.fill_between(np.arange(len(occupied)), occupied, step="post", color=color, alpha=0.8,
                        linewidth=0)
        ax.set_ylim(0, C["slots"] * 1.05)
        ax.set_ylabel("occupied slots")
        ax.set_title(f"{policy} batching: {C[policy]['steps']:,} steps, "
                     f"{100 * C[policy]['occupancy']:.1f}% occupancy", fontsize=10, loc="left")
    axes[1].set_xlabel("decode step")
    fig.suptitle(f"{C['requests']} requests, {C['slots']} slots: continuous batching is "
                 f"{C['speedup']:.2f}x faster", fontsize=11)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    save_figure(fig, results, path)


def measured(rows):
    return [r for r in rows if "skipped" not in r]


def plot_decode_batch(results, path):
    import matplotlib.pyplot as plt
    A = results["A"]
    if not any(r["context"] == A["context"] for r in measured(A["rows"])):
        return False
    fig, ax = plt.subplots(figsize=(8, 4.2))
    ax2 = ax.twinx()
    for mode, style in zip(A["modes"], ("--", "-") if len(A["modes"]) == 2 else ("-",)):
        rows = [r for r in measured(A["rows"]) if r["context"] == A["context"]
                and r["mode"] == mode]
        batch = [r["batch"] for r in rows]
        ax.plot(batch, [r["step_ms"] for r in rows], "o" + style, color=RED,
                label=f"step time = each user's wait ({mode})")
        ax.fill_between(batch, [r["p10_ms"] for r in rows], [r["p90_ms"] for r in rows],
                        color=RED, alpha=0.15, linewidth=0)
        ax2.plot(batch, [r["tokens_per_s"] for r in rows], "s" + style, color=BLUE,
                 label=f"tokens/s ({mode})")
    ax.set_xscale("log", base=2)
    batches = sorted({r["batch"] for r in measured(A["rows"])})
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("decode batch size")
    ax.set_ylabel("step time (ms; band: p10-p90)", color=RED)
    ax2.set_ylabel("throughput (tokens/s)", color=BLUE)
    ax.set_ylim(bottom=0)
    ax2.set_ylim(bottom=0)
    ax.set_title(f"A: one decode step for the whole batch (context {A['context']} tokens per "
                 "row)", fontsize=10)
    fig.legend(loc="upper left", bbox_to_anchor=(0.1, 0.88), fontsize=8)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    save_figure(fig, results, path)


def plot_prefill_decode(results, path):
    import matplotlib.pyplot as plt
    rows = measured(results["B"]["rows"])
    if not rows:
        return False
    labels = [f"prefill\n{r['tokens']} tokens" if r["phase"] == "prefill"
              else f"decode\nbatch {r['batch']}\n{r['mode']}" for r in rows]
    colors = [RED if r["phase"] == "prefill" else BLUE for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    bars = ax.bar(labels, [r["tflops"] for r in rows], color=colors)
    ax.set_yscale("log")
    ax.set_ylabel("achieved TFLOP/s (log)")
    for bar, r in zip(bars, rows):
        ax.annotate(f"{r['tflops']:.3g} TFLOP/s\n{r['intensity']:.0f} FLOP/byte",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                    va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.set_ylim(top=ax.get_ylim()[1] * 3)
    ax.set_title("B: achieved TFLOP/s of prefill and decode on the same device", fontsize=10)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    save_figure(fig, results, path)


def plot_roofline(results, path):
    """Achieved TFLOP/s against arithmetic intensity, under the two measured ceilings."""
    import matplotlib.pyplot as plt
    ceil = results["environment"]["ceilings"]
    points = []
    if "A" in results:
        points += [(r, f"A b{r['batch']}", BLUE) for r in measured(results["A"]["rows"])
                   if r["context"] == results["A"]["context"]]
    if "B" in results:
        points += [(r, f"prefill {r['tokens']}" if r["phase"] == "prefill" else
                    f"B decode b{r['batch']}", RED) for r in measured(results["B"]["rows"])]
    if not points:
        return False
    fig, ax = plt.subplots(figsize=(8, 4.8))
    xs = [r["intensity"] for r, _, _ in points] + [ceil["ridge_flop_per_byte"]]
    x = np.geomspace(min(xs) / 2, max(xs) * 2, 200)
    ax.plot(x, np.minimum(ceil["matmul_tflops"], ceil["bandwidth_gbs"] * x / 1e3), color=GREY,
            label=f"roofline: {ceil['bandwidth_gbs']:,.0f} GB/s, "
                  f"{ceil['matmul_tflops']:.3g} TFLOP/s")
    for r, label, color in points:
        marker = "o" if r.get("mode", "eager") == "eager" else "^"
        ax.scatter(r["intensity"], r["tflops"], color=color, marker=marker, zorder=3,
                   facecolors="none" if marker == "o" and color == BLUE else color)
        ax.annotate(f"{label} {r.get('mode', 'eager')}", (r["intensity"], r["tflops"]),
                    fontsize=7, xytext=(4, -3 if marker == "o" else 4),
                    textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte, log)")
    ax.set_ylabel("achieved TFLOP/s (log)")
    ax.set_title("roofline: each A and B step against the measured ceilings "
                 "(o eager, ^ CUDA graph)", fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    save_figure(fig, results, path)


def plot_decode_context(results, path):
    """Decode step time and tokens/s against batch at each context: where the KV cache rules."""
    import matplotlib.pyplot as plt
    A = results["A"]
    mode = A["modes"][-1]
    if not measured(A["rows"]):
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 4))
    colors = plt.get_cmap("viridis")(np.linspace(0, 0.85, len(A["contexts"])))
    for context, color in zip(A["contexts"], colors):
        rows = [r for r in measured(A["rows"]) if r["context"] == context and r["mode"] == mode]
        batch = [r["batch"] for r in rows]
        ax1.plot(batch, [r["step_ms"] for r in rows], "o-", color=color, label=f"context "
                                                                             f"{context}")
        ax2.plot(batch, [r["tokens_per_s"] for r in rows], "o-", color=color)
        cross = A["kv_crossover_batch"][str(context)]
        if cross and batch and cross <= max(batch):
            ax1.axvline(cross, color=color, linestyle=":", linewidth=1)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("decode batch size")
    ax1.set_ylabel("step time (ms)")
    ax2.set_ylabel("tokens/s")
    ax1.legend(fontsize=8)
    ax1.set_title("step time (dotted: KV reads = weight reads)", fontsize=9)
    ax2.set_title("throughput", fontsize=9)
    fig.suptitle(f"A: decode at several contexts ({mode})", fontsize=10)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    save_figure(fig, results, path)


FIGURES = {"occupancy.png": ("C", plot_occupancy),
           "decode_batch.png": ("A", plot_decode_batch),
           "prefill_decode.png": ("B", plot_prefill_decode),
           "roofline.png": ("AB", plot_roofline),
           "decode_context.png": ("A", plot_decode_context)}


def draw_figures(results, out_dir):
    import matplotlib
    matplotlib.use("Agg")
    written = []
    for name, (experiment, plot) in FIGURES.items():
        if any(e in results for e in experiment):
            if plot(results, os.path.join(out_dir, name)) is not False:
                written.append(name)
    return written


# -----------------------------------------------------------------------------
# command line


def int_list(text):
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got "
                                         f"{text!r}")
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def positive_float(text):
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def nonnegative_int(text):
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def experiment_letters(text):
    letters = "".join(text.replace(",", "").upper().split())
    unknown = sorted(set(letters) - set(EXPERIMENTS))
    if not letters or unknown:
        raise argparse.ArgumentTypeError(f"unknown experiment {''.join(unknown) or text!r}; "
                                         f"choose from {EXPERIMENTS}")
    return "".join(e for e in EXPERIMENTS if e in letters)


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, no usage dump
        raise UsageError(message)


def build_parser():
    p = ArgumentParser(prog="NN_40_serving.py", description=__doc__.split("\n\n")[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experiments", type=experiment_letters, default=EXPERIMENTS,
                   help="which experiments to run, e.g. AB or C (default: ABC)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    m = p.add_argument_group("model (on CPU, unset fields come from the CPU preset: 4 layers, "
                             "hidden 1024, 8 heads, vocab 8192, bfloat16)")
    m.add_argument("--layers", type=positive_int, help="default 12")
    m.add_argument("--hidden", type=positive_int, help="default 2048")
    m.add_argument("--heads", type=positive_int, help="default 16")
    m.add_argument("--vocab", type=positive_int, help="default 32000")
    m.add_argument("--max-positions", type=positive_int, help="longest sequence (default 8192)")
    m.add_argument("--dtype", choices=list(DTYPES), help="default float16")
    a = p.add_argument_group("A and B")
    a.add_argument("--batch-sizes", type=int_list, default=(1, 8, 32, 128, 256),
                   help="A: decode batch sizes (default 1,8,32,128,256)")
    a.add_argument("--context", type=positive_int, default=128,
                   help="tokens already in each row's KV cache at a decode step (default 128)")
    a.add_argument("--contexts", type=int_list,
                   help="A: contexts to sweep (default: --context and 1024, 4096 on CUDA; "
                        "--context and 1024 on CPU)")
    a.add_argument("--graphs", choices=["on", "off", "both"],
                   help="decode steps replayed from CUDA graphs (on), eager (off) or both "
                        "side by side (default: both on CUDA, off on CPU)")
    a.add_argument("--peak-bandwidth-gbs", type=positive_float,
                   help="use this memory bandwidth instead of measuring a copy")
    a.add_argument("--peak-tflops", type=positive_float,
                   help="use this matmul throughput instead of measuring one")
    a.add_argument("--prefill-lengths", type=int_list, default=(512, 2048),
                   help="B: prompt lengths (default 512,2048)")
    a.add_argument("--decode-batches", type=int_list, default=(1, 32),
                   help="B: decode batch sizes (default 1,32)")
    a.add_argument("--warmup", type=nonnegative_int, default=3, help="untimed calls per shape")
    a.add_argument("--reps", type=positive_int, default=50, help="timed calls per shape (at most)")
    c = p.add_argument_group("C")
    c.add_argument("--requests", type=positive_int, default=600)
    c.add_argument("--slots", type=positive_int, default=32)
    c.add_argument("--seed", type=nonnegative_int, default=0)
    c.add_argument("--lengths-file", metavar="PATH",
                   help="generated lengths, one positive integer per line ('#' comments)")
    o = p.add_argument_group("output")
    o.add_argument("--out", default="figures", help="directory for results.json and figures")
    o.add_argument("--no-figures", action="store_true")
    o.add_argument("--lang", default="en", help="table headers: en or ko")
    o.add_argument("--quick", action="store_true", help="shrink every experiment (smoke run)")
    return p


def parse_args(argv):
    """argv -> RunConfig: the device resolved (when A or B runs), CPU preset and --quick applied."""
    args = build_parser().parse_args(argv)
    device = resolve_device(args.device) if set("AB") & set(args.experiments) else None
    if args.lang not in HEADERS:
        raise UsageError(f"--lang {args.lang!r}: choose from {', '.join(HEADERS)}")
    fields = {f: getattr(args, f) for f in ("layers", "hidden", "heads", "vocab",
                                            "max_positions", "dtype")}
    on_cpu = device is not None and device.type == "cpu"
    if args.quick and on_cpu and fields["layers"] is None:
        fields["layers"] = 2
    model = dataclasses.replace(CPU_PRESET if on_cpu else ModelConfig(),
                                **{f: v for f, v in fields.items() if v is not None})
    preset = [f"{f}={getattr(CPU_PRESET, f)}" for f, v in fields.items() if v is None]
    note = ("CPU preset (fp16 matmul is ~1000x slower than bf16 on CPU): " + ", ".join(preset)
            if on_cpu and preset else "")
    if model.hidden % model.heads:
        raise UsageError(f"--hidden {model.hidden} is not divisible by --heads {model.heads}")
    cuda = device is not None and device.type == "cuda"
    if args.graphs in ("on", "both") and device is not None and not cuda:
        raise UsageError(f"--graphs {args.graphs}: CUDA graphs need a CUDA device")
    graphs = {"on": "graph", "off": "eager", "both": "both", None: "both" if cuda else "eager"}
    contexts = args.contexts or ((args.context, 1024, 4096) if cuda else (args.context, 1024))
    run = dict(experiments=args.experiments, device=device and device.type,
               batch_sizes=args.batch_sizes, context=args.context,
               contexts=tuple(sorted(set(contexts) | {args.context})),
               graphs=graphs[args.graphs], peak_bandwidth_gbs=args.peak_bandwidth_gbs,
               peak_tflops=args.peak_tflops,
               prefill_lengths=args.prefill_lengths, decode_batches=args.decode_batches,
               requests=args.requests, slots=args.slots, seed=args.seed,
               lengths_file=args.lengths_file, warmup=args.warmup, reps=args.reps,
               out=args.out, figures=not args.no_figures, lang=args.lang, quick=args.quick,
               preset_note=note)
    longest = max(max(run["contexts"]) + 1, max(run["prefill_lengths"]))
    if device is not None and longest > model.max_positions:
        raise UsageError(f"a sequence of {longest} tokens exceeds --max-positions "
                         f"{model.max_positions}")
    if args.quick:  # every experiment small enough for a smoke run
        run.update(batch_sizes=tuple(b for b in args.batch_sizes if b <= 32) or (1,),
                   context=min(args.context, 64), contexts=(min(args.context, 64),),
                   prefill_lengths=tuple(max(1, t // 8) for t in args.prefill_lengths),
                   warmup=min(args.warmup, 1), reps=min(args.reps, 5))
        run["time_budget_s"] = 0.3
    return RunConfig(model=model, **run)


def prepare_out_dir(path):
    """Create OUT and prove it is writable before any experiment runs."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise UsageError(f"cannot write to output directory {path}: {e.strerror}")


def main(argv=None):
    """Run the chosen experiments; print tables; write results.json and figures. -> results."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return _main(argv)
    except UsageError as e:
        print(f"NN_40_serving.py: error: {e}", file=sys.stderr)
        raise SystemExit(2)


def log(message):
    print(f"  [{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _main(argv):
    run = parse_args(argv)
    device = run.device and torch.device(run.device)
    if run.lengths_file and "C" in run.experiments:
        read_lengths_file(run.lengths_file)  # fail before any long measurement
    prepare_out_dir(run.out)
    cfg = run.model
    results = {"environment": environment(run, device, argv),
               "config": {"model": {**dataclasses.asdict(cfg), "params": param_count(cfg),
                                    "weight_bytes": param_count(cfg) * cfg.dtype_bytes},
                          **{k: v for k, v in dataclasses.asdict(run).items() if k != "model"}}}
    print(banner(results), flush=True)
    interrupted = False
    try:
        with torch.inference_mode():
            if device:
                bench = Bench(run, device, log)
                ceilings = measure_ceilings(run, device, log)
                results["environment"]["ceilings"] = ceilings
                print(ceilings_line(ceilings, run), flush=True)
                if "A" in run.experiments:
                    results["A"] = run_decode_sweep(bench, ceilings, log)
                if "B" in run.experiments:
                    results["B"] = run_prefill_decode(bench, ceilings, log)
        if "C" in run.experiments:
            results["C"] = run_batching_sim(run, log)
    except KeyboardInterrupt:
        interrupted = True
        results["interrupted"] = True
    print("\n" + format_tables(results, run.lang) + "\n", flush=True)
    write_atomic(os.path.join(run.out, "results.json"), to_json(results))
    if run.figures and not interrupted:
        written = draw_figures(results, run.out)
        print(f"wrote {os.path.join(run.out, 'results.json')} and {', '.join(written)}")
    if interrupted:
        print("interrupted: the tables above are the experiments that finished",
              file=sys.stderr)
        raise SystemExit(130)
    return results


if __name__ == "__main__":
    main()
