"""Device facts: which device, which dtype, how much memory, which attention backends

Probes and checks made before anything large is allocated; calls the accounting.
"""
import dataclasses
import functools
import collections
import os
import platform
import time
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from nn40.accounting import (
    dense_twin, kv_bytes_per_token, memory_needed_bytes, param_count, weight_bytes)
from nn40.config import CPU_PRESET
from nn40.errors import UsageError
from nn40.host import free_host_memory_bytes, gib
from nn40.memory import DeviceMemory
from nn40.model import DTYPES, linear


def resolve_device(name):
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available to PyTorch here")
    return torch.device(name)


# On CPU the matmul speed of each type depends on the chip: with AVX-512 BF16 (recent Xeons)
# bfloat16 is fast and float16 ~1000x slower; with AVX2 alone (most laptops, AMD before Zen 4)
# both 2-byte types fall back to paths 5-60x slower than float32 at a prefill's sizes, though
# not always at a decode's. So unless --dtype is given, the run takes the type a probe measures
# fastest over the shapes the run itself makes, a 2-byte type unless float32 beats it by more
# than DTYPE_PREFERENCE (half the bytes of weights and KV cache, and what GPUs serve in).
# A type's first call at a shape sets up its kernel and is never timed; the types take turns
# round by round (the order rotated), so a burst of other work falls on all of them alike, and
# each is compared with float32 within a round. Types within the rounds' noise of each other
# are tied, and a tie goes to the first of PROBE_DTYPES' 2-byte types: one answer per machine.
PROBE_DTYPES = ("float32", "bfloat16", "float16")

DTYPE_PREFERENCE = 1.1

PROBE_ROUNDS = 5  # timed rounds at each shape (the median taken, p10/p90 kept)

PROBE_EARLY_ROUNDS = 2  # rounds after which a type far behind may leave: as many again
# confirm it (all its calls slow), so sustained contention over two calls drops nothing

PROBE_NOISE = 0.1  # scores this close (relative) are tied, and a fixed order decides

PROBE_DROP = 4.0  # a 2-byte type this much slower than the best at a shape is out (float32,
# never on a slow path, is always timed whole): its larger shapes are never run

PROBE_DECODE_WEIGHTS = 4  # a decode product reads four weights of 2^22 elements (64 MB in
# float32, 32 MB in a 2-byte type: past a laptop's cache in both, as a model's weights are)

PROBE_PREFILL_OUT = 1024  # a prefill product: one weight of this many output features


class ProbeShape(NamedTuple):
    rows: int      # tokens through the product (a decode's batch, a prefill's prompt)
    out: int       # output features of each weight
    weights: int   # weights multiplied in turn
    calls: int     # the run's timed shapes this product stands for
    weight: float  # its share of the run's time: calls x the model's weights over the probe's


def probe_shapes(run, width):
    """The products the run makes, smallest first: decode at A's batches (at each context) and
    B's and D's decode batches, prefill at B's lengths and D's prompt. A prefill reads all the
    model's weights at its rows, a decode step all of them at its batch: each shape's time is
    scaled by the model's weights over the probe's, so the totals weigh each where the run
    spends its time."""
    timed, calls = run.measurement, collections.Counter()
    if "A" in timed.experiments:
        calls.update({("decode", b): len(timed.contexts) for b in timed.batch_sizes})
    if "B" in timed.experiments:
        calls.update([("decode", b) for b in timed.decode_batches])
        calls.update([("prefill", t) for t in timed.prefill_lengths])
    if "D" in timed.experiments:
        calls.update([("decode", run.engine.engine_slots),
                      ("prefill", run.engine.engine_prompt_len)])
    shapes = []
    for (phase, rows), n in sorted(calls.items(), key=lambda kv: kv[0][1]):
        out, weights = ((2**22 // width, PROBE_DECODE_WEIGHTS) if phase == "decode" else
                        (PROBE_PREFILL_OUT, 1))
        shapes.append(ProbeShape(rows, out, weights, n, n * 2**24 / (out * weights * width)))
    return shapes


def call_ms(fn):
    """One call of fn() in ms, on the host's clock (the probes run on CPU alone)."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def interleaved_ms(contenders, rounds=PROBE_ROUNDS, warm=True):
    """{name: fn} -> {name: [ms a round]}: each warmed with one untimed call (its kernel's
    set-up; warm=False: already done), then `rounds` rounds timing each once, the order
    rotated a step a round."""
    names = list(contenders)
    for name in names if warm else ():
        call_ms(contenders[name])
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(call_ms(contenders[name]))
    return times


def probe_dtypes(width, shapes):
    """F.linear in each type at each of shapes (see probe_shapes), smallest first, the types
    interleaved (see interleaved_ms). A 2-byte type whose PROBE_EARLY_ROUNDS calls at a shape
    are each PROBE_DROP times the fastest call there is timed as many rounds again with the
    others, and leaves the probe (its shape not counted) where every call is still that slow:
    a type on a 1000x slower path costs five calls, and other work slowing two calls of one
    type drops nothing. -> {dtype: [ms a round, per shape it finished]}"""
    g = torch.Generator(device="cpu").manual_seed(7)
    rounds = {name: [] for name in PROBE_DTYPES}
    timed = list(PROBE_DTYPES)
    for shape in shapes:
        ws = [torch.randn(shape.out, width, generator=g) * width ** -0.5
              for _ in range(shape.weights)]
        x = torch.randn(shape.rows, width, generator=g)
        cast = {name: ([w.to(DTYPES[name]) for w in ws], x.to(DTYPES[name])) for name in timed}
        fns = {name: functools.partial(lambda ws_, x_: [F.linear(x_, w) for w in ws_],
                                       *cast[name]) for name in timed}
        ms = interleaved_ms(fns, PROBE_EARLY_ROUNDS)
        if far_behind(ms, timed):  # (confirmed by as many rounds again, every type timed)
            again = interleaved_ms(fns, PROBE_EARLY_ROUNDS, warm=False)
            ms = {name: ms[name] + again[name] for name in timed}
            timed = [name for name in timed if name not in far_behind(ms, timed)]
        more = interleaved_ms({name: fns[name] for name in timed},
                              max(PROBE_ROUNDS - len(ms["float32"]), 0), warm=False)
        for name in timed:
            rounds[name].append(ms[name] + more[name])
    return rounds


def far_behind(ms, timed):
    """The 2-byte types among `timed` each of whose calls (ms: {type: [ms a call]}) took
    PROBE_DROP times the fastest call at the shape."""
    fastest = min(min(ms[name]) for name in timed)
    return [name for name in timed
            if name != "float32" and min(ms[name]) > PROBE_DROP * fastest]


def choose_dtype(rounds, shapes):
    """The type the probe's rounds say (see probe_dtypes), with how sure. Each type's score:
    its total a round (its shapes' ms, weighted) over float32's in the same round, the median
    of the rounds (a burst in one round moves no median); float32's score DTYPE_PREFERENCE, so
    a 2-byte type wins unless float32 is that much faster. Scores within PROBE_NOISE of the
    best are tied, and the first tied of PROBE_DTYPES' 2-byte types, then float32, is chosen.
    -> {"chosen", "vs_float32": {dtype: median, p10, p90 or None (left the probe)}, "noise",
    "tied_with": the other tied types, "margin": the best untied score over the chosen's}"""
    weight = np.array([s.weight for s in shapes])
    totals = {d: weight @ np.array(r) for d, r in rounds.items() if len(r) == len(shapes)}
    ratios = {d: totals[d] / totals["float32"] for d in totals}
    score = {d: DTYPE_PREFERENCE if d == "float32" else float(np.median(q))
             for d, q in ratios.items()}
    best = min(score.values())
    tied = [d for d in PROBE_DTYPES[1:] + PROBE_DTYPES[:1]
            if d in score and score[d] <= best * (1 + PROBE_NOISE)]
    chosen = tied[0]
    untied = [score[d] / score[chosen] for d in score if d not in tied]
    return {"chosen": chosen, "noise": PROBE_NOISE, "tied_with": tied[1:],
            "margin": min(untied, default=None),
            "vs_float32": {d: median_spread(ratios[d]) if d in ratios else None
                           for d in PROBE_DTYPES}}


def median_spread(values):
    p10, p50, p90 = np.percentile(values, [10, 50, 90])
    return {"median": float(p50), "p10": float(p10), "p90": float(p90)}


def with_probed_dtype(run):
    """On CPU with no --dtype, the run with the type probe_dtypes measures fastest here. In
    float32 the CPU preset (where it set the layers) keeps half its layers: a decode step then
    reads the bytes it reads in a 2-byte type, and the run takes the time it takes there."""
    if run.hardware.device != "cpu" or run.hardware.dtype_given:
        return run, None
    width = min(run.hardware.model.hidden, 1024)
    shapes = probe_shapes(run, width)
    rounds = probe_dtypes(width, shapes)
    probe = choose_dtype(rounds, shapes)
    chosen = probe["chosen"]
    model, preset = dataclasses.replace(run.hardware.model, dtype=chosen), run.hardware.preset
    if chosen == "float32" and f"layers={CPU_PRESET.layers}" in preset:
        layers = max(1, CPU_PRESET.layers // 2)
        model = dataclasses.replace(model, layers=layers)
        preset = tuple(f"layers={layers}" if p.startswith("layers=") else p for p in preset)
    return run.replace(model=model, preset=preset), {
        **probe, "preference": DTYPE_PREFERENCE, "rounds": PROBE_ROUNDS,
        "shapes": [s._asdict() for s in shapes],
        "ms": {d: [float(np.median(r)) for r in rounds[d]] for d in PROBE_DTYPES}}


LAYOUT_ROWS = (1, 2, 4, 8, 16, 32, 64)  # the rows probe_layouts times both layouts at


@functools.lru_cache(maxsize=8)
def probe_layouts(width, dtype):
    """F.linear against W x^T (see linear) at each of LAYOUT_ROWS over four weights of the
    model's width, 64 MB in float32 (past a CPU's caches, as a model's are), interleaved as
    the dtype probe's types are (see interleaved_ms). The turn: the row count up to which W x^T
    makes the median round's total least; a turn within PROBE_NOISE of the least total is
    tied, and the smallest tied wins (0: F.linear throughout). -> {"rows", "linear_ms",
    "weight_first_ms" (medians), "weight_first_rows", "margin"}"""
    g = torch.Generator(device="cpu").manual_seed(11)
    weights = [torch.randn(2**22 // width, width, generator=g).to(DTYPES[dtype])
               for _ in range(4)]
    linear_ms, first_ms = [], []
    for rows in LAYOUT_ROWS:
        x = torch.randn(rows, width, generator=g).to(DTYPES[dtype])
        ms = interleaved_ms({"linear": lambda: [F.linear(x, w) for w in weights],
                             "first": lambda: [linear(x, w, rows) for w in weights]})
        linear_ms.append(ms["linear"])
        first_ms.append(ms["first"])
    lin, first = np.array(linear_ms), np.array(first_ms)  # (rows, rounds)
    totals = {0: np.median(lin.sum(0))}
    for i, rows in enumerate(LAYOUT_ROWS):
        totals[rows] = np.median(first[:i + 1].sum(0) + lin[i + 1:].sum(0))
    best = min(totals.values())
    turn = min(r for r, t in totals.items() if t <= best * (1 + PROBE_NOISE))
    return {"rows": list(LAYOUT_ROWS), "linear_ms": np.median(lin, 1).tolist(),
            "weight_first_ms": np.median(first, 1).tolist(), "weight_first_rows": turn,
            "margin": float(min((t for r, t in totals.items() if r != turn),
                                default=totals[turn]) / totals[turn])}


def with_probed_layout(run):
    """On CPU, where a model is built, the run with the matmul layout probe_layouts measures
    fastest here (see linear). -> (run, the probe or None)"""
    if run.hardware.device != "cpu" or not set(run.measurement.experiments) & set("ABD"):
        return run, None
    probe = probe_layouts(min(run.hardware.model.hidden, 1024), run.hardware.model.dtype)
    return run.replace(weight_first_rows=probe["weight_first_rows"]), probe


def device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()} x {os.cpu_count()})"


def cuda_index(device):
    """The CUDA device's index: torch 2.3 and 2.4 refuse a torch.device("cuda") with none in
    mem_get_info (ValueError; fixed in 2.5), so it is always given."""
    return device.index if device.index is not None else torch.cuda.current_device()


def free_memory_bytes(device):
    """Memory free for new allocations on the device (on CUDA, with what PyTorch's caching
    allocator holds but does not use); math.inf when the host cannot tell."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(cuda_index(device))[0] + cached
    return free_host_memory_bytes()


def check_cuda_arch(device):
    """One line when this PyTorch has no kernels for the device (e.g. an RTX 5080, sm_120,
    under a build for CUDA before 12.8): kernels for its sm, or PTX of an older one to JIT."""
    major, minor = torch.cuda.get_device_capability(device)
    sm, archs = major * 10 + minor, torch.cuda.get_arch_list()
    ptx = [int(a[8:]) for a in archs if a.startswith("compute_") and a[8:].isdigit()]
    if archs and f"sm_{sm}" not in archs and not any(p <= sm for p in ptx):
        raise UsageError(f"this PyTorch ({torch.__version__}, CUDA {torch.version.cuda}) has no "
                         f"kernels for the {torch.cuda.get_device_name(device)} (sm_{sm}; it "
                         f"has {' '.join(archs)}): install a build for a newer CUDA (sm_120, "
                         "the RTX 50 series, needs CUDA 12.8 or later)")


# A layer's K (or V) view over a batch: batch x kv_heads x cached tokens x head_dim elements.
# Past 2^31 - 1 some attention kernels' 32-bit offsets overflow (A at batch 256 and 4,096
# tokens of context reaches 2^31 with the post's model), so such a row is skipped, not run.
VIEW_ELEMENTS_MAX = 2**31 - 1


def kv_view_elements(cfg, batch, cache_len):
    return 0 if cfg.arch == "post" else batch * cfg.n_kv_heads * cache_len * cfg.head_dim


def device_memory(device):
    """The DeviceMemory C's KV budget reads: a CUDA card's total bytes and name, or "cpu"."""
    if device.type != "cuda":
        return DeviceMemory("cpu")
    return DeviceMemory("cuda", torch.cuda.mem_get_info(cuda_index(device))[1],
                        device_name(device))


def fits(cfg, device, batch, cache_len, new_tokens, margin=0.9):
    """(fits, needed_bytes, free_bytes) for one step's cache and activations, before allocating."""
    needed = memory_needed_bytes(cfg, batch, cache_len, new_tokens)
    free = free_memory_bytes(device)
    return needed <= margin * free, needed, free


def check_memory(run, device, engine_lengths=None):
    """The model's weights with the least that A and B need (a batch-1 decode step) and, for
    D, its engine's KV cache, before anything is allocated: one line if it cannot fit. (A and B
    rows too large for what is left are marked as not fitting, not refused.)"""
    cfg = run.hardware.model
    weights = weight_bytes(cfg)
    need = weights + memory_needed_bytes(cfg, 1, run.measurement.context + 1, 1)
    what = "its weights"
    if cfg.experts and "A" in run.measurement.experiments:  # (A times its dense twin beside it)
        need += weight_bytes(dense_twin(cfg))
        what = "its weights and its dense twin's"
    if engine_lengths is not None:  # (a speculating engine's rows hold its drafts too)
        longest = run.engine.engine_prompt_len + int(engine_lengths.max()) + (
            run.scheduler.num_speculative_tokens if run.scheduler.speculative_method else 0)
        engine = weights + memory_needed_bytes(cfg, run.engine.engine_slots, longest,
                                               run.engine.engine_prompt_len) \
            + run.workload.num_prefixes * run.workload.prefix_len \
            * kv_bytes_per_token(cfg)  # (its prefix cache)
        if engine > need:
            need, what = engine, f"its weights and D's KV cache " \
                                 f"({run.engine.engine_slots} rows x {longest:,} tokens)"
    free = free_memory_bytes(device)
    if need > 0.9 * free:
        raise UsageError(f"the model ({cfg.name}, {param_count(cfg) / 1e9:.2f} B parameters): "
                         f"{what} need {gib(need)} but the device has {gib(free)} free; use a "
                         "smaller model or --slots, or --experiments C (it allocates nothing)")


def out_of_memory(error):
    """Whether an exception is an allocation the device (or host) could not make."""
    return isinstance(error, (torch.cuda.OutOfMemoryError, MemoryError)) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error))


# Every experiment's attention runs on backends that build no plan per shape: D's decode shapes
# change at nearly every step, and cuDNN's attention (PyTorch's first choice on Hopper from
# torch 2.5) plans each new shape, tens of ms to 0.4 s apiece, a cost D's step costs (timed on
# warmed shapes) never see; A, B and C's KV check run under the same policy, so that their
# tables compare the same kernels. Each records the kernels that ran.
SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def sdpa_policy():
    """A context in which scaled_dot_product_attention may use SDPA_BACKENDS alone."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([getattr(SDPBackend, name) for name in SDPA_BACKENDS])


def engine_attention(run, device):
    """Whether D's engine pads its decode attention: --engine-attention, or by default on CUDA,
    where one padded call beats a launch per span of rows."""
    return {"padded": True, "spans": False}.get(run.engine.engine_attention, device.type == "cuda")
