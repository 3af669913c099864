"""Timing: one primitive for every measured region, and the ops a region ran
"""
import contextlib
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from nn40.host import one_line


def percentile_summary(samples_ms):
    p10, p50, p90 = np.percentile(samples_ms, [10, 50, 90])
    return {"median_ms": float(p50), "p10_ms": float(p10), "p90_ms": float(p90),
            "mean_ms": float(np.mean(samples_ms)), "n": len(samples_ms)}


SLOW_CALL_SHARE = 0.2  # a call over this share of a shape's time budget is timed fewer times


def time_region(fn, device, warmup, reps, budget_s):
    """Median and p10/p90 of fn() in ms after `warmup` untimed calls.

    CUDA: events around each call. CPU: perf_counter. Repeats `reps` times or until `budget_s`
    of timed calls, whichever comes first, but at least 5 times; 3 times where one call takes
    over SLOW_CALL_SHARE of the budget and once where it takes the whole budget, so that no
    shape takes minutes ("few_reps" says so). Warm-up stops early once it has spent a third of
    the budget (a slow shape needs one call to warm, not three).
    """
    cuda = device.type == "cuda"
    t0, slowest_s = time.perf_counter(), 0.0
    for i in range(warmup):
        t_call = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        slowest_s = max(slowest_s, time.perf_counter() - t_call)
        if time.perf_counter() - t0 > budget_s / 3:
            break
    samples, spent = [], 0.0
    while len(samples) < reps:
        least = 5 if slowest_s <= SLOW_CALL_SHARE * budget_s else 3 if slowest_s <= budget_s \
            else 1
        if spent >= budget_s and len(samples) >= least:
            break
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t_call = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t_call) * 1e3
        samples.append(ms)
        spent += ms / 1e3
        slowest_s = max(slowest_s, ms / 1e3)
    summary = percentile_summary(samples)
    summary["few_reps"] = len(samples) < min(5, reps)
    return summary


def cuda_graph(fn):
    """Capture fn() into a CUDA graph (after warming it on a side stream); return a replay.
    The caller stream is current again afterwards whatever happens: torch.cuda.graph leaves
    its capture stream current where ending the capture raises. (A failed capture can leave
    the caching allocator mid-capture for the rest of the process on torch up to 2.11, so
    Bench.time begins none that capture_blocker refuses.)"""
    caller = torch.cuda.current_stream()
    stream = torch.cuda.Stream()
    stream.wait_stream(caller)
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    caller.wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    finally:
        torch.cuda.set_stream(caller)
    return graph.replay  # the bound method keeps the graph (and its memory pool) alive


def capture_blocker(fn):
    """Why a CUDA graph cannot capture fn(), or None: one call under torch.cuda's sync debug
    mode "error" (a host sync raises, as it would break a capture), its ops logged (where a
    stand-in for torch.cuda runs, or none is available, the host syncs are seen there)."""
    debug = torch.cuda.is_available()  # (the sync debug mode needs CUDA; the ops log does not)
    previous = torch.cuda.get_sync_debug_mode() if debug else None
    try:
        with OpLog() as log:
            if debug:
                torch.cuda.set_sync_debug_mode("error")
            try:
                fn()
            finally:
                if debug:
                    torch.cuda.set_sync_debug_mode(previous)
    except RuntimeError as e:
        return one_line(e)
    syncs = sorted(set(log.host_syncs()))
    return f"host syncs: {', '.join(syncs)}" if syncs else None


class OpLog:
    """The aten ops run inside it, by name (PyTorch's profiler, CPU-side events only), and the
    tensor methods that read a value on the host (HostReads): which attention kernel ran
    (PyTorch picks one per shape), and whether a step reads a device value on the host."""

    def __enter__(self):
        self.profile, self.methods = torch.autograd.profiler.profile(), HostReads()
        with quiet_stderr():  # (recent builds print a line to fd 2 as a profile starts)
            self.profile.__enter__()
        self.methods.__enter__()
        return self

    def __exit__(self, *exc):
        self.methods.__exit__(*exc)
        with quiet_stderr():  # (and as it stops)
            self.profile.__exit__(*exc)
        events = self.profile.function_events
        self.ops = [e.name.removeprefix("aten::") for e in events] + self.methods.seen
        self.host_ops = [e.name.removeprefix("aten::") for e in events
                         if not device_side(e)] + self.methods.seen

    def attention(self):
        """The attention kernels that ran (those named *attention*, less the dispatcher)."""
        return sorted({op for op in self.ops if "attention" in op
                       and op != "scaled_dot_product_attention"})

    def host_syncs(self):
        return [op for op in self.host_ops if op in HOST_SYNC_OPS]


def device_side(event):
    """Whether a profiled op runs inside one whose CUDA kernel reads its inputs on the device
    (DEVICE_SIDE_OPS), where a CPU fallback reads them on the host."""
    while event.cpu_parent is not None:
        event = event.cpu_parent
        if event.name.removeprefix("aten::") in DEVICE_SIDE_OPS:
            return True
    return False


@contextlib.contextmanager
def quiet_stderr():
    """File descriptor 2 sent to the null device for the block (C++ code prints there)."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


class HostReads(torch.overrides.TorchFunctionMode):
    """The tensor methods run inside it that hand a tensor's values to Python (.tolist(),
    .item(), int(), bool(), ...): on a CPU they record no aten op, on CUDA each syncs."""
    METHODS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__")

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in self.METHODS:
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


# ops that read a device value on the host (a CUDA graph cannot capture them; eagerly they stall
# the stream): .item() and .tolist(), data-dependent shapes (bincount reads its input's range),
# a tensor made from host values
HOST_SYNC_OPS = {"item", "_local_scalar_dense", "nonzero", "masked_select", "unique",
                 "_unique2", "lift_fresh", "lift_fresh_copy", "bincount",
                 *HostReads.METHODS}

DEVICE_SIDE_OPS = {"_grouped_mm"}  # (its CPU fallback reads the group ends with .item())


def attention_kernel(device, dtype, query_shape, keys, causal=False, padded=False):
    """The attention kernel PyTorch runs for a query of query_shape (batch, heads, queries,
    head_dim) over `keys` keys under the backends allowed now: one call on random tensors of
    the shape (at most 8 rows), its ops logged."""
    batch, heads, queries, head_dim = query_shape
    g = torch.Generator(device="cpu").manual_seed(5)
    b = min(batch, 8)
    q = torch.randn(b, heads, queries, head_dim, generator=g).to(device, dtype)
    k, v = (torch.randn(b, heads, keys, head_dim, generator=g).to(device, dtype)
            for _ in range(2))
    mask = torch.ones(b, 1, 1, keys, dtype=torch.bool, device=device) if padded else None
    with OpLog() as log:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    return log.attention()
