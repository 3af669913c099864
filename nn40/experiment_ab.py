"""Experiments A and B: decode against batch and context, prefill against decode (device code)

Each row is a timing (time_region) joined to its accounting (flops_and_bytes) under the measured
ceilings: rates, intensity, MBU, MFU and the bound.
"""
import itertools

import numpy as np
import torch
import torch.nn as nn

from nn40.accounting import (
    dense_twin, experts_touched, kv_bytes_per_token, kv_crossover_batch, moe_step_bytes,
    param_count, flops_and_bytes)
from nn40.device import (
    SDPA_BACKENDS, VIEW_ELEMENTS_MAX, device_name, engine_attention, fits, kv_view_elements,
    out_of_memory)
from nn40.host import one_line
from nn40.model import (
    DTYPES, MoE, build_model, decode_step, linear, new_kv_cache, prefill, random_activations,
    random_tokens)
from nn40.pricing import measured
from nn40.tables import LAUNCH_BOUND_SHARE, describe
from nn40.text_ko import TEXT
from nn40.timing import attention_kernel, capture_blocker, cuda_graph, time_region


class Bench:
    """The model on its device, the measured ceilings, and the timing settings of A and B."""

    def __init__(self, run, device):
        self.run, self.cfg, self.device = run, run.hardware.model, device
        self.model = build_model(self.cfg, device, seed=run.workload.seed,
                                 weight_first_rows=run.hardware.weight_first_rows)
        graphs = run.measurement.graphs
        self.modes = ("eager", "graph") if graphs == "both" else (graphs,)

    def time(self, step, mode="eager", budget_s=None, feed=None):
        """Time feed() + step(), step as it is (eager) or replayed from a CUDA graph captured
        from it. feed, which copies fresh inputs into the buffers step reads, runs eagerly
        before every call, outside any graph: a graph replays the copies it captured, from
        the tensors it captured, so inside one every replay would see the same input."""
        run, failed = step, None
        if mode == "graph":  # (one that cannot be captured is timed eagerly, and says why)
            failed = capture_blocker(step)
            try:
                run = step if failed else cuda_graph(step)
            except RuntimeError as e:
                failed = one_line(e)

        def fn():
            if feed is not None:
                feed()
            run()
        timed = self.run.measurement
        timing = time_region(fn, self.device, timed.warmup, timed.reps,
                             budget_s or timed.time_budget_s)
        if failed:
            timing["graph_failed"] = failed
        timing["ran"] = "eager" if failed or mode == "eager" else "graph"  # (the mode it ran in)
        return timing

    def time_decode(self, batch, context, mode="eager", budget_s=None, low=None, pad=False):
        """One decode step of `batch` rows, each with `context` cached tokens (the post's proxy:
        `batch` tokens through its matmuls). Fresh random tokens are copied into a static input
        buffer before each step (one tiny copy, in both modes). low: the rows' contexts spread
        evenly from low to `context` instead (as in D's continuous engine), attended per span
        of rows at one position, or (pad) in one call padded to the longest row."""
        if self.cfg.arch == "post":
            inputs = random_activations(self.cfg, (batch,), self.device, seed=batch)
            x, next_x = inputs[0].clone(), itertools.cycle(inputs)
            return self.time(lambda: self.model(x), mode, budget_s,
                             feed=lambda: x.copy_(next(next_x)))
        cache = new_kv_cache(self.cfg, batch, context + 1, self.device)
        next_tokens = itertools.cycle(random_tokens(self.cfg, (batch,), self.device, seed=batch))
        tokens = next(next_tokens).clone()
        positions = context if low is None else \
            np.linspace(low, context, batch).round().astype(int).tolist()
        return self.time(lambda: decode_step(self.model, cache, tokens, positions, pad=pad),
                         mode, budget_s,
                         feed=lambda: tokens.copy_(next(next_tokens)))

    def time_prefill(self, tokens, batch=1, budget_s=None, mode="eager"):
        """A prefill of `batch` prompts of `tokens` tokens each into empty cache rows (the
        post's proxy: batch x tokens tokens through its matmuls), fresh prompts copied into a
        static input buffer before each, as for decode (so it can replay from a graph too)."""
        if self.cfg.arch == "post":
            inputs = random_activations(self.cfg, (batch, tokens), self.device, seed=tokens)
            x, next_x = inputs[0].clone(), itertools.cycle(inputs)
            return self.time(lambda: self.model(x), mode, budget_s,
                             feed=lambda: x.copy_(next(next_x)))
        cache = new_kv_cache(self.cfg, batch, tokens, self.device)
        prompts = random_tokens(self.cfg, (batch, tokens), self.device, seed=tokens)
        prompt, next_prompt = prompts[0].clone(), itertools.cycle(prompts)
        return self.time(lambda: prefill(self.model, cache, prompt), mode, budget_s,
                         feed=lambda: prompt.copy_(next(next_prompt)))

    def linear_chain(self, mode):
        """The model's own matmul weights as a bare chain of linear() calls at batch 1.

        The same weight bytes a batch-1 decode step reads, with nothing else around them: the
        rate a decode step could reach if the model added no work of its own.
        """
        linears = [m for m in self.model.modules() if isinstance(m, nn.Linear)]
        g = torch.Generator(device="cpu").manual_seed(1)
        inputs = [torch.randn(1, m.in_features, generator=g).to(self.device, m.weight.dtype)
                  for m in linears]

        def chain():
            for x, m in zip(inputs, linears):
                linear(x, m.weight, m.weight_first_rows)
        timing = self.time(chain, mode)
        weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
        s = timing["median_ms"] / 1e3
        return {"mode": mode, "ran": timing["ran"], "step_ms": timing["median_ms"],
                "p10_ms": timing["p10_ms"], "p90_ms": timing["p90_ms"], "reps": timing["n"],
                "bytes": weight_bytes, "gbs": weight_bytes / s / 1e9}

    def skip_reason(self, batch, cache_len, new_tokens, margin=0.9, view=None):
        """None when the step fits the device's memory and its attention's views index in 32
        bits, else why not. view: the (rows, keys) the step's attention views, where fewer
        than the cache holds (default: all `batch` rows at `cache_len`)."""
        ok, needed, free = fits(self.cfg, self.device, batch, cache_len, new_tokens, margin)
        if not ok:
            return {"kind": "does_not_fit", "needed_gib": needed / 2**30,
                    "free_gib": free / 2**30}
        elements = kv_view_elements(self.cfg, *(view or (batch, cache_len)))
        if elements > VIEW_ELEMENTS_MAX:
            return {"kind": "view_too_large", "elements": elements, "limit": VIEW_ELEMENTS_MAX}
        return None


def timed_or_skipped(row, time_it):
    """row updated with time_it() (-> its fields), or marked skipped where the device ran out
    of memory (the caching allocator's spare blocks given back before the next row)."""
    try:
        row.update(time_it())
    except Exception as e:
        if not out_of_memory(e):
            raise
        row["skipped"] = {"kind": "out_of_memory", "error": one_line(e)}
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return row


CEILING_MATMUL_SHARE = 1 / 40  # the ceilings' matmul grows until one product takes this share

# of a shape's time budget: 50 ms by default, 5 ms with --quick
CEILING_MATMUL_N = {"cuda": (1024, 16384), "cpu": (256, 4096)}  # (first, largest) size


def measure_ceilings(run, device, log):
    """The device's limits in the run's dtype: copy bandwidth and square-matmul throughput.

    Bandwidth: dst.copy_(src) over a buffer far past the last-level cache, counting bytes read
    plus written. Matmul: square products of random (never zero) operands, doubled in size
    until one takes CEILING_MATMUL_SHARE of the time budget (or the largest size is reached),
    each timed, the fastest
    rate kept: large enough to be fast, small enough to be timed in seconds on any device, and
    the best of several sizes (a CPU's matmul library is faster at some than at others).
    --peak-bandwidth-gbs / --peak-tflops replace a measurement.
    """
    dtype = DTYPES[run.hardware.model.dtype]
    cuda = device.type == "cuda"
    ceilings = {}
    if run.hardware.peak_bandwidth_gbs:
        ceilings.update(bandwidth_gbs=run.hardware.peak_bandwidth_gbs,
                        bandwidth_source={"kind": "given"})
    else:
        n_bytes = (2 if cuda else 0.25) * 2**30
        # fp32: the copy moves bytes. (On CPU a random 4 MB block is tiled across it: drawing
        # 0.25 GiB of normal numbers there takes 0.6 s, a copy of them 0.03 s.)
        n = int(n_bytes // 4)
        src = torch.randn(n, device=device) if cuda else torch.randn(2**20).repeat(n // 2**20)
        dst = torch.empty_like(src)
        timing = time_region(lambda: dst.copy_(src), device, run.measurement.warmup,
                             run.measurement.reps, run.measurement.time_budget_s)
        ceilings.update(bandwidth_gbs=2 * n_bytes / (timing["median_ms"] / 1e3) / 1e9,
                        bandwidth_source={"kind": "measured_copy", "gib": n_bytes / 2**30})
        del src, dst
    if run.hardware.peak_tflops:
        ceilings.update(matmul_tflops=run.hardware.peak_tflops, matmul_source={"kind": "given"})
    else:
        g = torch.Generator(device=device).manual_seed(2)  # (drawn where they are multiplied)
        n, largest = CEILING_MATMUL_N[device.type]
        best = (0.0, n)
        while True:
            a, b = (torch.randn(n, n, generator=g, device=device).to(dtype) for _ in range(2))
            timing = time_region(lambda: a @ b, device, run.measurement.warmup,
                                 run.measurement.reps, run.measurement.time_budget_s / 2)
            best = max(best, (2 * n**3 / (timing["median_ms"] / 1e3) / 1e12, n))
            del a, b
            if n >= largest or timing["median_ms"] / 1e3 >= CEILING_MATMUL_SHARE * \
                    run.measurement.time_budget_s:
                break
            n *= 2
        ceilings.update(matmul_tflops=best[0], matmul_source={
            "kind": "measured_matmul", "n": best[1], "dtype": run.hardware.model.dtype})
    ceilings["ridge_flop_per_byte"] = ceilings["matmul_tflops"] * 1e3 / ceilings["bandwidth_gbs"]
    log(f"ceilings: {ceilings['bandwidth_gbs']:.1f} GB/s, {ceilings['matmul_tflops']:.3g} "
        f"TFLOP/s")
    return ceilings


def roofline_row(cfg, ceilings, timing, shape, cuda=False):
    """Timing + the accounting of the step it timed, of shape (batch, new tokens a row,
    context): rates, intensity, MBU, MFU and bound.

    MBU = achieved bytes/s (weights + KV cache + activations, the flops_and_bytes model) / measured
    bandwidth; MFU = achieved FLOP/s / measured matmul rate. The bound is the side of the
    ridge point (peak FLOP/s / peak bytes/s) the step's intensity falls on.
    """
    batch, new_tokens, context = shape
    cost = flops_and_bytes(cfg, batch, new_tokens, context)
    s = timing["median_ms"] / 1e3
    tokens = batch * new_tokens
    intensity = cost["flops"] / cost["bytes"]
    mbu = cost["bytes"] / s / 1e9 / ceilings["bandwidth_gbs"]
    mfu = cost["flops"] / s / 1e12 / ceilings["matmul_tflops"]
    bound = "memory" if intensity < ceilings["ridge_flop_per_byte"] else "compute"
    row = {"step_ms": timing["median_ms"], "p10_ms": timing["p10_ms"],
           "p90_ms": timing["p90_ms"], "reps": timing["n"],
           "few_reps": timing.get("few_reps", False),
           "tokens_per_s": tokens / s, "us_per_token": s * 1e6 / tokens,
           "tflops": cost["flops"] / s / 1e12, "gbs": cost["bytes"] / s / 1e9,
           "mbu": mbu, "mfu": mfu, "intensity": intensity,
           "bound": ("launch" if cuda else "overhead") if max(mbu, mfu) < LAUNCH_BOUND_SHARE
           else bound,
           "flops": cost["flops"], "bytes": cost["bytes"]}
    above = [k for k in ("mbu", "mfu") if row[k] > 1.0]
    if above:  # a ceiling measured too low, or an accounting that counts too much
        row["above_ceiling"] = above
    for key in ("graph_failed", "ran"):
        if key in timing:
            row[key] = timing[key]
    return row


def decode_row(bench, ceilings, batch, context, mode):
    row = {"batch": batch, "context": context, "mode": mode}
    reason = bench.skip_reason(batch, context + 1, 1)
    if reason:
        row["skipped"] = reason
        return row
    moe = [m for m in bench.model.modules() if isinstance(m, MoE)]
    for layer in moe:
        layer.reset_tally()
    row = timed_or_skipped(row, lambda: roofline_row(
        bench.cfg, ceilings, bench.time_decode(batch, context, mode), (batch, 1, context),
        bench.device.type == "cuda"))
    if moe and "skipped" not in row:  # (every timed step's mean, and the bytes it read)
        read, calls = np.sum([m.tallies() for m in moe], axis=0)
        touched = float(read / calls)
        row.update(experts_touched=touched, experts_expected=experts_touched(bench.cfg, batch),
                   bytes_read=moe_step_bytes(bench.cfg, batch, context, touched))
    return row


def prefill_row(bench, ceilings, tokens, mode):
    row = {"phase": "prefill", "tokens": tokens, "batch": 1, "context": 0, "mode": mode}
    reason = bench.skip_reason(1, tokens, tokens)
    if reason:
        row["skipped"] = reason
        return row
    return timed_or_skipped(row, lambda: roofline_row(
        bench.cfg, ceilings, bench.time_prefill(tokens, mode=mode), (1, tokens, 0),
        bench.device.type == "cuda"))


def run_decode_sweep(bench, ceilings, log):
    """A: decode step time and throughput against batch size, at each context, each mode."""
    run = bench.run
    rows = []
    for context in run.measurement.contexts:
        for mode in bench.modes:
            for batch in run.measurement.batch_sizes:
                rows.append(decode_row(bench, ceilings, batch, context, mode))
                log(f"A context {context} {mode} batch {batch}: " + row_progress(rows[-1]))
            group = [r for r in rows if r["context"] == context and r["mode"] == mode]
            base = next((r for r in group if r["batch"] == 1 and "skipped" not in r), None)
            for r in measured(group):
                if base:
                    r["throughput_vs_1"] = r["tokens_per_s"] / base["tokens_per_s"]
                    r["wait_vs_1"] = r["step_ms"] / base["step_ms"]
                if base and "bytes_read" in r:  # (a mixture of experts: the bytes it read)
                    r["bytes_vs_1"] = r["bytes_read"] / base["bytes_read"]
    crossover = {str(c): kv_crossover_batch(bench.cfg, c) for c in run.measurement.contexts}
    largest = max(measured(rows), key=lambda r: r["batch"] * r["context"], default=None)
    twin = dense_twin_sweep(bench, ceilings, rows, log) if bench.cfg.experts else {}
    return {"context": run.measurement.context, "contexts": list(run.measurement.contexts),
            "modes": list(bench.modes),
            "kv_crossover_batch": crossover, "rows": rows, **twin, **attention_policy(
                largest and decode_kernel(bench, largest["batch"], largest["context"] + 1))}


def dense_twin_sweep(bench, ceilings, rows, log):
    """A for a mixture of experts: its dense twin (see dense_twin) timed at the same batches,
    at A's context in A's last mode, each in the mode the MoE row really ran in (eager where
    the MoE step could not be captured), its time beside the MoE row's (dense_twin_ms) only
    where both ran in one mode."""
    run, mode = bench.run, bench.modes[-1]
    twin = Bench(run.replace(model=dense_twin(bench.cfg)), bench.device)
    moe_rows = {r["batch"]: r for r in rows
                if r["context"] == run.measurement.context and r["mode"] == mode}
    by_batch = {}
    for batch in run.measurement.batch_sizes:
        ran = moe_rows.get(batch, {}).get("ran", mode)
        row = by_batch[batch] = decode_row(twin, ceilings, batch, run.measurement.context, ran)
        log(f"A dense twin {ran} batch {batch}: " + row_progress(row))
    for r in moe_rows.values():
        twin_row = by_batch.get(r["batch"], {})
        if "step_ms" in twin_row and twin_row.get("ran") == r.get("ran"):
            r["dense_twin_ms"] = twin_row["step_ms"]
    return {"dense_twin": {"model": twin.cfg.name, "ffn": twin.cfg.ffn,
                           "params": param_count(twin.cfg), "rows": list(by_batch.values())}}


def decode_kernel(bench, batch, keys, pad=False):
    """The attention kernel of a decode step over `keys` cached tokens (None: no attention)."""
    cfg = bench.cfg
    if cfg.arch == "post":
        return None
    return attention_kernel(bench.device, DTYPES[cfg.dtype], (
        batch, cfg.n_kv_heads, cfg.heads // cfg.n_kv_heads, cfg.head_dim), keys, padded=pad)


def prefill_kernel(bench, tokens):
    cfg = bench.cfg
    if cfg.arch == "post":
        return None
    return attention_kernel(bench.device, DTYPES[cfg.dtype],
                            (1, cfg.heads, tokens, cfg.head_dim), tokens, causal=True)


def attention_policy(*kernels):
    """What results.json says of an experiment's attention: the backends allowed and the
    kernels that ran at its largest shapes."""
    return {"sdpa_backends": list(SDPA_BACKENDS),
            "kernels": sorted({k for ks in kernels if ks for k in ks})}


def run_prefill_decode(bench, ceilings, log):
    """B: prefill of whole prompts against decode of one token alone and in a batch."""
    run = bench.run
    rows = []
    for mode in bench.modes:  # (C prices prefill and decode from one mode: both are timed in each)
        for tokens in run.measurement.prefill_lengths:
            rows.append(prefill_row(bench, ceilings, tokens, mode))
            log(f"B prefill {mode} {tokens}: " + row_progress(rows[-1]))
    chain = []
    for mode in bench.modes:
        # the bare chain right before the decodes, so both see the machine in the same state
        chain.append(bench.linear_chain(mode))
        log(f"B linear chain {mode}: {chain[-1]['step_ms']:.3f} ms, {chain[-1]['gbs']:.1f} GB/s")
        for batch in run.measurement.decode_batches:
            rows.append({"phase": "decode", "tokens": 1,
                         **decode_row(bench, ceilings, batch, run.measurement.context, mode)})
            log(f"B decode {mode} x{batch}: " + row_progress(rows[-1]))
    longest = max((r["tokens"] for r in measured(rows) if r["phase"] == "prefill"), default=None)
    return {"rows": rows, "linear_chain": chain, **attention_policy(
        longest and prefill_kernel(bench, longest),
        decode_kernel(bench, max(run.measurement.decode_batches), run.measurement.context + 1))}


def row_progress(row):
    if "skipped" in row:
        return describe(TEXT["en"], row["skipped"])
    return f"{row['step_ms']:.3f} ms (p10 {row['p10_ms']:.3f}, p90 {row['p90_ms']:.3f}, " \
           f"{row['reps']} reps)"


def kv_device_check(bench, kv):
    """Allocate the KV cache C's budget holds, as rows of the longest sequence that fits (at
    least one row per request running at the peak of the continuous schedule), and time one
    decode step over the first rows, each at the context its request had at the peak."""
    cfg, contexts = bench.cfg, kv["peak"]["contexts"]
    batch = len(contexts)
    row_tokens = min(kv["budget_tokens"] // batch, cfg.max_positions)
    n_rows = max(batch, kv["budget_tokens"] // row_tokens)
    positions = [min(c, row_tokens - 1) for c in contexts]  # (a context is the tokens whose KV
    # is written: the position each row's next decode writes, its newest token's)
    clamped = sum(c >= row_tokens for c in contexts)
    check = {"device": device_name(bench.device), "rows": n_rows, "batch": batch,
             "row_tokens": row_tokens, "bytes": n_rows * row_tokens * kv_bytes_per_token(cfg),
             "clamped_rows": clamped, "max_context": max(contexts)}
    # the whole cache must fit (the budget has its margin); the step's views span its first
    # `batch` rows (each view's strides run over a whole row of row_tokens)
    reason = bench.skip_reason(n_rows, row_tokens, 1, margin=1.0, view=(batch, row_tokens))
    if reason:
        check["skipped"] = reason
        return check
    pad = engine_attention(bench.run, bench.device)  # (attending as D's engine does)
    check.update(attention="padded" if pad else "spans",
                 kernel=decode_kernel(bench, batch, max(positions) + 1, pad))

    def time_it():
        cache = new_kv_cache(cfg, n_rows, row_tokens, bench.device)
        next_tokens = itertools.cycle(random_tokens(cfg, (batch,), bench.device, seed=batch))
        timing = time_region(lambda: decode_step(bench.model, cache, next(next_tokens),
                                                 positions, pad=pad),
                             bench.device, bench.run.measurement.warmup,
                             min(bench.run.measurement.reps, 10),
                             bench.run.measurement.time_budget_s)
        return {"step_ms": timing["median_ms"], "p10_ms": timing["p10_ms"],
                "p90_ms": timing["p90_ms"]}
    return timed_or_skipped(check, time_it)
