"""Runs first time on any machine: the dtype probe, portable memory facts, bounded timing,
failures that keep what finished, and the CUDA control flow under stand-ins for torch.cuda."""
import collections
import contextlib
import dataclasses
import json
import math
import time
import types

import pytest
import torch

import NN_40_serving as S
import torch.nn.functional as F
import os
import sys
import nn40.device
import nn40.experiment_ab
import nn40.model
from nn40.accounting import param_count, flops_and_bytes
from nn40.cli import parse_args
from nn40.config import MODELS, ModelConfig
from nn40.device import (
    DTYPE_PREFERENCE, LAYOUT_ROWS, PROBE_DROP, PROBE_DTYPES, PROBE_EARLY_ROUNDS, PROBE_NOISE,
    PROBE_PREFILL_OUT, PROBE_ROUNDS, ProbeShape, VIEW_ELEMENTS_MAX, check_cuda_arch,
    choose_dtype, device_memory, fits, free_memory_bytes, interleaved_ms, kv_view_elements,
    out_of_memory, probe_dtypes, probe_layouts, probe_shapes, with_probed_dtype,
    with_probed_layout)
from nn40.errors import UsageError
from nn40.experiment_ab import (
    Bench, CEILING_MATMUL_SHARE, decode_row, kv_device_check, measure_ceilings, roofline_row,
    run_decode_sweep)
from nn40.host import busy, cpu_clock, load_between, windows_available_bytes
from nn40.memory import kv_budget_bytes
from nn40.model import (
    Linear, MoE, build_model, decode_step, grouped_mm_works, new_kv_cache, prefill)
from nn40.pricing import measured_costs
from nn40.settings import RunConfig
from nn40.tables import cell, describe, load_warnings, machine_warnings, ridge_text, roofline_notes
from nn40.text_ko import TEXT
from nn40.timing import OpLog, capture_blocker, cuda_graph, time_region
from nn40 import host

TINY = ModelConfig(layers=1, hidden=64, heads=4, vocab=128, max_positions=64, dtype="float32")
CPU = torch.device("cpu")


# --- the dtype probe ---------------------------------------------------------------------
# Stand-in times by (type, rows): the probe's rules on a clock the test controls.

SHAPES = [ProbeShape(1, 64, 4, 1, 1.0), ProbeShape(8, 64, 4, 1, 1.0),
          ProbeShape(256, 1024, 1, 1, 16.0)]


def stand_in_clock(monkeypatch, table, cold_ms=300.0, burst=None):
    """call_ms by the type and rows of the F.linear fn runs: table[dtype][shape index] ms,
    cold_ms for the first call of each (type, rows) (a kernel's set-up), and burst: {(dtype,
    rows, nth call): ms} for a call another process slowed. -> the (dtype, rows) of each call"""
    ran, seen, real_linear = [], collections.Counter(), F.linear

    def linear(x, w):
        ran.append((str(x.dtype).removeprefix("torch."), x.shape[0]))
        return real_linear(x, w)

    def call_ms(fn):
        fn()
        key = ran[-1]
        seen[key] += 1
        if seen[key] == 1:
            return cold_ms
        rows = [s.rows for s in SHAPES].index(key[1])
        return (burst or {}).get((*key, seen[key]), table[key[0]][rows])
    monkeypatch.setattr(F, "linear", linear)
    monkeypatch.setattr(nn40.device, "call_ms", call_ms)
    return ran


def probed(monkeypatch, table, **clock):
    stand_in_clock(monkeypatch, table, **clock)
    rounds = probe_dtypes(64, SHAPES)
    return rounds, choose_dtype(rounds, SHAPES)


@pytest.mark.parametrize("table, chosen", [
    # AVX-512 BF16: bf16 fast, fp16 ~1000x slower at a prefill's size
    ({"float32": [2, 2, 4], "bfloat16": [1, 1, 1], "float16": [1, 1, 1000]}, "bfloat16"),
    # AVX2 alone: both 2-byte types on slow paths at a prefill's size
    ({"float32": [2, 2, 4], "bfloat16": [1, 1, 40], "float16": [1, 1, 50]}, "float32"),
    # within DTYPE_PREFERENCE of float32 (1.09x over the weighted total): half the bytes pays
    ({"float32": [1, 1, 1], "bfloat16": [1.09, 1.09, 1.09], "float16": [9, 9, 9]}, "bfloat16"),
    # past it by more than the noise (1.1 x 1.1): float32
    ({"float32": [1, 1, 1], "bfloat16": [1.25, 1.25, 1.25], "float16": [9, 9, 9]}, "float32"),
    # two 2-byte types within the noise: the first of PROBE_DTYPES', whichever led
    ({"float32": [2, 2, 2], "bfloat16": [1, 1, 1.05], "float16": [1, 1, 1]}, "bfloat16"),
    ({"float32": [2, 2, 2], "bfloat16": [1, 1, 1], "float16": [0.5, 0.5, 0.5]}, "float16"),
    # the prefill weighs 16x a decode (the model's weights over the probe's): float32 twice as
    # fast there beats a 2-byte type twice as fast at both decodes
    ({"float32": [2, 2, 1], "bfloat16": [1, 1, 2], "float16": [1, 1, 9]}, "float32"),
])
def test_the_probe_chooses_the_type_its_warm_rounds_say(table, chosen, monkeypatch):
    assert DTYPE_PREFERENCE == 1.1 and PROBE_NOISE == 0.1
    rounds, probe = probed(monkeypatch, table)  # (a 300 ms first call of each: never counted)
    assert probe["chosen"] == chosen
    assert rounds["float32"] == [[table["float32"][i]] * PROBE_ROUNDS for i in range(3)]


def test_a_burst_on_the_tie_loser_or_near_the_preference_does_not_flip_the_choice(monkeypatch):
    # float16 clearly fastest (0.5x float32, bfloat16 0.7x): a burst in one of its calls at
    # every shape moves no median, and the choice stays float16
    table = {"float32": [2, 2, 2], "bfloat16": [1.4, 1.4, 1.4], "float16": [1, 1, 1]}
    burst = {("float16", s.rows, 4): 2.5 for s in SHAPES}
    assert probed(monkeypatch, table)[1]["chosen"] == "float16"
    assert probed(monkeypatch, table, burst=burst)[1]["chosen"] == "float16"
    # bfloat16 1.15x float32's time: within the noise of float32's 1.1 preference, so the
    # fixed order keeps the 2-byte type, whichever side of 1.1 the median falls
    for ratio in (1.09, 1.15):
        table = {"float32": [1, 1, 1], "bfloat16": [ratio] * 3, "float16": [9, 9, 9]}
        probe = probed(monkeypatch, table)[1]
        assert probe["chosen"] == "bfloat16" and probe["tied_with"] == ["float32"]
    table = {"float32": [1, 1, 1], "bfloat16": [1.25] * 3, "float16": [9, 9, 9]}
    assert probed(monkeypatch, table)[1]["chosen"] == "float32"


def test_the_types_take_turns_in_a_rotated_order(monkeypatch):
    order = []
    monkeypatch.setattr(nn40.device, "call_ms", lambda fn: order.append(fn()) or 1.0)
    interleaved_ms({"a": lambda: "a", "b": lambda: "b", "c": lambda: "c"}, rounds=3)
    assert order == list("abc") + list("abc") + list("bca") + list("cab")  # (warm, 3 rounds)


def test_a_cold_call_or_a_burst_in_one_turn_does_not_decide(monkeypatch):
    table = {"float32": [2, 2, 2], "bfloat16": [1, 1, 1], "float16": [1.5, 1.5, 1.5]}
    # the old probe's failure: bfloat16's one cold call at one row timed as its speed
    rounds, probe = probed(monkeypatch, table, cold_ms=300.0)
    assert probe["chosen"] == "bfloat16" and rounds["bfloat16"][0] == [1] * PROBE_ROUNDS
    # a burst of other work during bfloat16's turn in one round, at every shape
    burst = {("bfloat16", s.rows, 3): 10.0 for s in SHAPES}
    rounds, probe = probed(monkeypatch, table, burst=burst)
    assert probe["chosen"] == "bfloat16" and max(rounds["bfloat16"][2]) == 10.0
    assert probe["vs_float32"]["bfloat16"]["median"] == pytest.approx(0.5)
    assert probe["margin"] == pytest.approx(1.5)  # (float16 0.75 over bfloat16's 0.5)
    assert probe["tied_with"] == []


def test_a_type_far_behind_leaves_the_probe_and_float32_never_does(monkeypatch):
    table = {"float32": [5, 5, 5], "bfloat16": [1, 30, 30], "float16": [1, 1, 30]}
    ran = stand_in_clock(monkeypatch, table)
    rounds = probe_dtypes(64, SHAPES)
    # bfloat16 out at 8 rows (30x the fastest call), float16 at the prefill (6x float32's)
    assert [len(rounds[d]) for d in PROBE_DTYPES] == [3, 1, 2]
    assert ("bfloat16", 256) not in ran and ("float32", 256) in ran
    # (at 8 rows: its warm call, PROBE_EARLY_ROUNDS timed ones and as many confirming, no
    # more)
    assert ran.count(("bfloat16", 8)) == (1 + 2 * PROBE_EARLY_ROUNDS) * 4  # (four weights a
    # call)
    probe = choose_dtype(rounds, SHAPES)
    assert probe["vs_float32"]["bfloat16"] is None and probe["vs_float32"]["float16"] is None
    assert probe["chosen"] == "float32" and probe["margin"] is None
    # a real probe, tiny: every type timed at every shape, each timing a real one
    monkeypatch.undo()
    rounds = probe_dtypes(64, SHAPES[:2])
    assert all(len(r) == 2 and all(len(ms) == PROBE_ROUNDS and min(ms) > 0 for ms in r)
               for d, r in rounds.items() if d == "float32")


def test_other_work_slowing_a_types_first_calls_does_not_drop_it(monkeypatch):
    """Contention over bfloat16's first two timed calls at every shape (10x: past PROBE_DROP):
    the confirming rounds find it fast, it stays, and it is chosen; with the confirmation
    left out (the two calls decide) it leaves, and float32 is chosen."""
    table = {"float32": [2, 2, 2], "bfloat16": [1, 1, 1], "float16": [1.5, 1.5, 9]}
    burst = {("bfloat16", s.rows, call): 10.0 for s in SHAPES for call in (2, 3)}
    rounds, probe = probed(monkeypatch, table, burst=burst)
    assert probe["chosen"] == "bfloat16" and len(rounds["bfloat16"]) == len(SHAPES)
    assert all(len(ms) == PROBE_ROUNDS for ms in rounds["bfloat16"])
    monkeypatch.undo()
    monkeypatch.setattr(nn40.device, "far_behind", lambda ms, timed: [
        name for name in timed if name != "float32"
        and min(ms[name][:PROBE_EARLY_ROUNDS]) > PROBE_DROP * min(min(v) for v in ms.values())])
    assert probed(monkeypatch, table, burst=burst)[1]["chosen"] == "float32"


def test_the_probe_times_the_shapes_the_run_makes():
    run = parse_args(["--device", "cpu", "--experiments", "AB", "--batch-sizes", "1,8",
                        "--contexts", "64,128", "--prefill-lengths", "512",
                        "--decode-batches", "1,32"])
    shapes = probe_shapes(run, 1024)
    assert [(s.rows, s.calls) for s in shapes] == [(1, 3), (8, 2), (32, 1), (512, 1)]
    assert [s.weight for s in shapes] == [3.0, 2.0, 1.0, 16.0]  # (2^24 / (1024 x 1024))
    assert shapes[-1].out == PROBE_PREFILL_OUT and shapes[0].out * 1024 == 2**22


def test_the_probe_sets_the_dtype_only_when_none_is_given(monkeypatch):
    monkeypatch.setattr(nn40.device, "probe_dtypes", lambda width, shapes: {
        "float32": [[1.0] * 5] * len(shapes), "bfloat16": [], "float16": []})
    run = parse_args(["--device", "cpu", "--experiments", "A"])
    assert not run.hardware.dtype_given and "dtype=" not in " ".join(run.hardware.preset)
    probed_run, info = with_probed_dtype(run)
    assert probed_run.hardware.model.dtype == "float32" and info["chosen"] == "float32"
    assert info["margin"] is None  # (no other type finished)
    given = parse_args(["--device", "cpu", "--experiments", "A", "--dtype", "bfloat16"])
    assert with_probed_dtype(given) == (given, None)
    alone = parse_args(["--experiments", "C"])  # no device: nothing to probe
    assert with_probed_dtype(alone) == (alone, None)


def test_the_probe_is_printed_and_recorded(tiny_args, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(nn40.device, "probe_dtypes", lambda width, shapes: {
        "float32": [[2.0] * 5] * len(shapes), "bfloat16": [[80.0] * 5] * len(shapes),
        "float16": [[9.0] * 5]})
    args = [a for a in tiny_args if a not in ("--dtype", "float32")]
    results = S.main(args + ["--experiments", "A", "--no-figures"])
    out = " ".join(capsys.readouterr().out.split())  # (lines wrapped at 100 columns)
    assert results["config"]["model"]["dtype"] == "float32"
    probe = results["environment"]["dtype_probe"]
    assert probe["chosen"] == "float32" and probe["margin"] == pytest.approx(40 / 1.1)
    assert "dtype: float32, the fastest here by a probe" in out
    assert "bfloat16 40.00x (p10-p90 40.00-40.00)" in out
    assert "float16 out (over 4x the best at a shape)" in out
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["environment"]["dtype_probe"]["vs_float32"]["float16"] is None
    assert saved["environment"]["load"]["probes"]["wall_s"] > 0
    assert set(saved["environment"]["load"]) == {"probes", "A"}


# --- the load beside the run ----------------------------------------------------------------


def test_the_load_beside_the_run_is_the_machines_busy_time_less_its_own(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    # 10 s of wall on 2 CPUs: the machine busy 15 s, this process 5 s of it, 1 s stolen
    load = load_between((0.0, 0.0, 100.0, 0.0), (10.0, 5.0, 115.0, 1.0))
    assert load["others_share"] == pytest.approx(0.5) and load["steal_share"] == 0.05
    assert busy(load) and not busy({**load, "others_share": 0.1})
    assert busy({**load, "others_share": 0.0, "steal_share": 0.3})  # (the hypervisor's)
    # on 16 CPUs two busy processes are 12.5%, under a quarter, yet a whole CPU: busy
    assert busy({**load, "cpus": 16, "others_share": 0.125, "steal_share": 0.0})
    assert not busy({**load, "cpus": 16, "others_share": 0.05, "steal_share": 0.0})
    assert not busy(load_between((0.0, 0.0, None, None), (1.0, 1.0, None, None)))
    results = {"environment": {"load": {"probes": {**load, "others_share": 0.0},
                                        "A": load, "B": {**load, "others_share": 0.6}}}}
    warning = next(w for w in machine_warnings(results) if w["kind"] == "warn_busy")
    assert warning["stages"] == "A, B" and warning["others"] == 0.6
    text = describe(TEXT["en"], warning)
    assert "other processes used 60% of its 2 CPUs and the hypervisor took 5%" in text
    assert "60%" in describe(TEXT["ko"], warning)
    wall, own, machine, stolen = cpu_clock()  # (this machine: Linux or not, it answers)
    assert wall > 0 and own > 0 and (machine is None or machine >= own / 4)


def test_the_machines_busy_time_is_read_from_proc_stat(tmp_path, monkeypatch):
    # user nice system idle iowait irq softirq steal guest: busy is user + nice + system +
    # irq + softirq (idle and iowait are not), steal apart
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 20 30 5000 70 8 2 40 9 0\ncpu0 1 2 3 4\n")
    hz = os.sysconf("SC_CLK_TCK")
    _, _, machine, stolen = cpu_clock(str(stat))
    assert machine == pytest.approx(160 / hz) and stolen == pytest.approx(40 / hz)
    assert cpu_clock(str(tmp_path / "none"))[2:] == (None, None)
    unknown = {"probes": load_between((0.0, 0.0, None, None), (1.0, 1.0, None, None))}
    assert load_warnings(unknown) == [{"kind": "note_load", "stages": "probes"}]
    assert "whether other programs slowed probes is not known" in describe(
        TEXT["en"], load_warnings(unknown)[0])


def test_a_ridge_under_one_is_printed_as_its_figures_not_zero():
    assert ridge_text(0.0412) == "0.041" and ridge_text(0.5) == "0.5"
    assert ridge_text(8.05) == "8"
    assert ridge_text(120.4) == "120"


# --- memory facts, any OS -------------------------------------------------------------------


def no_meminfo(monkeypatch):
    real_open = open

    def fake_open(path, *args, **kwargs):
        if path == "/proc/meminfo":
            raise OSError("no /proc here")
        return real_open(path, *args, **kwargs)
    monkeypatch.setattr("builtins.open", fake_open)


def test_free_memory_on_macos_falls_back_to_physical_pages(monkeypatch):
    no_meminfo(monkeypatch)
    monkeypatch.setattr(sys, "platform", "darwin")

    def sysconf(name):  # macOS: no SC_AVPHYS_PAGES
        if name == "SC_AVPHYS_PAGES":
            raise ValueError("unrecognized configuration name")
        return {"SC_PHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}[name]
    monkeypatch.setattr(os, "sysconf", sysconf)
    assert free_memory_bytes(CPU) == 1000 * 4096


def test_free_memory_on_windows_asks_windows(monkeypatch):
    no_meminfo(monkeypatch)
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.delattr(os, "sysconf")  # Windows has none
    monkeypatch.setattr(host, "windows_available_bytes", lambda: 8 * 2**30)
    assert free_memory_bytes(CPU) == 8 * 2**30


def test_free_memory_unknown_is_infinite_not_an_error(monkeypatch):
    no_meminfo(monkeypatch)
    monkeypatch.setattr(sys, "platform", "plan9")
    monkeypatch.delattr(os, "sysconf")
    assert free_memory_bytes(CPU) == math.inf
    assert fits(TINY, CPU, 1, 8, 1)[0]


def test_windows_memory_reads_globalmemorystatusex():
    if not hasattr(__import__("ctypes"), "windll"):
        assert windows_available_bytes() == math.inf  # (not Windows: no windll)
    else:
        assert 0 < windows_available_bytes() < math.inf


# --- timing bounded by time -----------------------------------------------------------------


@pytest.mark.parametrize("sleep_s, budget_s, expect", [(0.0, 1.0, 12), (0.06, 0.1, 3),
                                                       (0.12, 0.1, 1)])
def test_a_slow_call_is_timed_fewer_times_and_says_so(sleep_s, budget_s, expect):
    calls = []

    def fn():
        calls.append(1)
        time.sleep(sleep_s)
    timing = time_region(fn, CPU, warmup=2, reps=12, budget_s=budget_s)
    assert timing["n"] == expect and timing["few_reps"] == (expect < 5)
    warm = len(calls) - timing["n"]
    assert 1 <= warm <= 2


def test_the_ceilings_matmul_grows_until_it_takes_tens_of_ms(monkeypatch):
    sizes = []

    def fake_time_region(fn, device, warmup, reps, budget_s):
        sizes.append(None)
        if len(sizes) == 1:  # the copy
            return {"median_ms": 1.0, "p10_ms": 1.0, "p90_ms": 1.0, "n": 5}
        n = 256 * 2 ** (len(sizes) - 2)
        tflops = 0.25 if n == 1024 else 0.2  # (a matmul library best at one size)
        return {"median_ms": 2 * n ** 3 / (tflops * 1e12) * 1e3, "n": 5}
    monkeypatch.setattr(nn40.experiment_ab, "time_region", fake_time_region)
    run = RunConfig.of(model=TINY, warmup=1, reps=3, time_budget_s=2.0)
    ceilings = measure_ceilings(run, CPU, log=lambda m: None)
    # 256: 0.17 ms, 512: 1.3, 1024: 8.6, 2048: 85.9 ms >= 50 ms (a 40th of the 2 s budget):
    # stops there, keeps the best
    assert len(sizes) == 1 + 4 and CEILING_MATMUL_SHARE * run.measurement.time_budget_s == 0.05
    assert ceilings["matmul_source"]["n"] == 1024
    assert ceilings["matmul_tflops"] == pytest.approx(0.25)


# --- roofline labels ---------------------------------------------------------------------------


CEILINGS = {"bandwidth_gbs": 100.0, "matmul_tflops": 10.0, "ridge_flop_per_byte": 100.0}


def timing_ms(ms):
    return {"median_ms": ms, "p10_ms": ms, "p90_ms": ms, "n": 5, "few_reps": False}


def test_a_step_above_a_ceiling_is_flagged_not_printed(tiny_args, capsys):
    cost = flops_and_bytes(TINY, 1, 1, 8)
    fast_ms = 1e3 * cost["bytes"] / 200e9  # twice the 100 GB/s ceiling
    row = roofline_row(TINY, CEILINGS, timing_ms(fast_ms), (1, 1, 8))
    assert row["above_ceiling"] == ["mbu"] and row["mbu"] == pytest.approx(2.0)
    T = TEXT["en"]
    assert cell(T, row, "mbu", ".0%") == "> ceiling" and cell(T, row, "mfu", ".1%") != ""
    results = {"config": {"time_budget_s": 2.0}}
    assert T["above_ceiling_note"] in roofline_notes(T, results, [row])


def test_a_step_far_below_both_roofs_is_launch_or_overhead_bound():
    cost = flops_and_bytes(TINY, 1, 1, 8)
    slow_ms = 1e3 * cost["bytes"] / 10e9  # 10% of the bandwidth, far less of the FLOP rate
    assert roofline_row(TINY, CEILINGS, timing_ms(slow_ms), (1, 1, 8))["bound"] == "overhead"
    assert roofline_row(TINY, CEILINGS, timing_ms(slow_ms), (1, 1, 8), cuda=True)["bound"] \
        == "launch"
    fair_ms = 1e3 * cost["bytes"] / 50e9  # half the bandwidth: memory-bound as ever
    assert roofline_row(TINY, CEILINGS, timing_ms(fair_ms), (1, 1, 8))["bound"] == "memory"


def test_a_view_past_2_31_elements_is_skipped_before_allocation(monkeypatch):
    post = ModelConfig()  # A's largest CUDA row: batch 256, 4,096 cached tokens + 1
    assert kv_view_elements(post, 256, 4097) == 256 * 16 * 4097 * 128 > 2**31 - 1
    assert kv_view_elements(post, 128, 4097) <= 2**31 - 1
    monkeypatch.setattr(nn40.experiment_ab, "fits", lambda *a, **k: (True, 0, 0))
    bench = types.SimpleNamespace(cfg=post, device=CPU)
    reason = Bench.skip_reason(bench, 256, 4097, 1)
    assert reason["kind"] == "view_too_large" and reason["elements"] == 2_148_007_936
    assert Bench.skip_reason(bench, 128, 4097, 1) is None
    assert "32-bit" in describe(TEXT["en"], reason)


# --- failures keep what finished -----------------------------------------------------------------


def test_a_late_failure_keeps_the_finished_experiments(tiny_args, tmp_path, capsys, monkeypatch):
    def broken(bench, ceilings, log):
        raise RuntimeError("CUDA error: an illegal memory access\nmore detail")
    monkeypatch.setattr(nn40.experiment_ab, "run_prefill_decode", broken)
    with pytest.raises(SystemExit) as exit_info:
        S.main(tiny_args + ["--experiments", "ABC", "--no-figures"])
    assert exit_info.value.code == 1
    captured = capsys.readouterr()
    assert "A  decode batch sweep" in captured.out
    err = [line for line in captured.err.splitlines() if "error:" in line]
    assert len(err) == 1 and "experiment B failed (RuntimeError: CUDA error: an illegal " \
        "memory access)" in err[0] and "Traceback" not in captured.err
    saved = json.loads((tmp_path / "results.json").read_text())
    assert "A" in saved and "B" not in saved and "C" not in saved
    assert saved["failed"] == {"experiment": "B", "error": "RuntimeError: CUDA error: an "
                                                             "illegal memory access"}


def test_a_row_out_of_memory_is_skipped_and_the_rest_run(tiny_args, capsys, monkeypatch):
    real = Bench.time_decode

    def time_decode(self, batch, context, *args, **kwargs):
        if batch == 4:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, batch, context, *args, **kwargs)
    monkeypatch.setattr(Bench, "time_decode", time_decode)
    results = S.main(tiny_args + ["--experiments", "A", "--no-figures"])
    rows = {(r["context"], r["batch"]): r for r in results["A"]["rows"]}
    assert rows[8, 4]["skipped"]["kind"] == "out_of_memory" and "step_ms" in rows[8, 1]
    assert "skipped: out of memory (OutOfMemoryError: CUDA out of memory" in \
        capsys.readouterr().out


def test_host_allocation_failure_counts_as_out_of_memory():
    assert out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you "
                                        "tried to allocate 1000 bytes"))
    assert out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert not out_of_memory(RuntimeError("shape mismatch"))


# --- stand-ins for torch.cuda ------------------------------------------------------------------


class FakeEvent:
    records = 0

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self, stream=None):
        FakeEvent.records += 1
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


class FakeGraph:
    """torch.cuda.CUDAGraph: the capture logs the ops the step runs, a replay runs nothing."""
    captured = []

    def replay(self):
        pass


@contextlib.contextmanager
def fake_capture(graph):
    with OpLog() as log:
        yield
    FakeGraph.captured.append(log)


class FakeStream:
    current = []  # the streams torch.cuda.set_stream made current, in turn

    def wait_stream(self, other):
        pass

    @staticmethod
    def set_current(stream):
        FakeStream.current.append(stream)


def fake_mem_get_info(device=None):
    """torch 2.4's behaviour: a torch.device("cuda") without an index is a ValueError."""
    if isinstance(device, torch.device) and device.index is None:
        raise ValueError("Expected a cuda device with a specified index or an integer, but "
                         "got: cuda")
    return (40 * 2**30, 80 * 2**30)


@pytest.fixture
def fake_cuda(monkeypatch):
    """Enough of torch.cuda to run the CUDA control flow on CPU tensors."""
    FakeEvent.records, FakeGraph.captured, FakeStream.current = 0, [], []
    for name, value in {"is_available": lambda: True, "Event": FakeEvent,
                        "synchronize": lambda device=None: None, "Stream": FakeStream,
                        "stream": lambda s: contextlib.nullcontext(),
                        "current_stream": lambda: FakeStream(), "CUDAGraph": FakeGraph,
                        "graph": fake_capture, "current_device": lambda: 0,
                        "mem_get_info": fake_mem_get_info,
                        "memory_reserved": lambda device=None: 3 * 2**30,
                        "memory_allocated": lambda device=None: 2 * 2**30,
                        "get_device_name": lambda device=None: "Stand-in GPU",
                        "get_device_capability": lambda device=None: (9, 0),
                        "get_arch_list": lambda: ["sm_80", "sm_90"],
                        "set_stream": FakeStream.set_current,
                        "get_sync_debug_mode": lambda: 0,
                        "set_sync_debug_mode": lambda mode: None}.items():
        monkeypatch.setattr(torch.cuda, name, value)
    return types.SimpleNamespace(type="cuda", index=None)


def test_cuda_timing_uses_events_with_warmup_and_sample_counts(fake_cuda):
    calls = []
    timing = time_region(lambda: calls.append(1), fake_cuda, warmup=3, reps=7, budget_s=5.0)
    assert timing["n"] == 7 and len(calls) == 3 + 7
    assert FakeEvent.records == 2 * 7  # a start and an end event around every timed call


def test_free_memory_passes_an_index_to_mem_get_info(fake_cuda):
    # torch 2.3 and 2.4 refuse torch.device("cuda") in mem_get_info (fixed in 2.5)
    with pytest.raises(ValueError):
        torch.cuda.mem_get_info(torch.device("cuda"))
    assert free_memory_bytes(torch.device("cuda")) == 40 * 2**30 + 2**30
    run = RunConfig.of(model=TINY)
    budget, source = kv_budget_bytes(run, device_memory(torch.device("cuda")))
    assert source["kind"] == "memory_cuda" and budget == pytest.approx(
        0.9 * 80 * 2**30 - param_count(TINY) * 4)


def test_cuda_defaults_from_parse_args(fake_cuda):
    run = parse_args([])
    assert run.hardware.device == "cuda" and run.measurement.graphs == "both"
    assert run.measurement.contexts == (128, 1024, 4096) and run.hardware.model == MODELS["post"]
    assert (run.engine.engine_requests, run.engine.engine_slots, run.engine.engine_prompt_len,
            run.engine.engine_shrink) == (600, 32, 128, 1)
    assert with_probed_dtype(run) == (run, None)  # no probe on CUDA: float16 as the post


@torch.inference_mode()
def test_a_graph_captured_decode_step_never_syncs_with_the_host(fake_cuda):
    cfg = ModelConfig(layers=2, hidden=64, heads=4, kv_heads=2, vocab=97, max_positions=64,
                        dtype="float32", mlp="gated", norm="rms", positions="rope")
    model = build_model(cfg, CPU)
    cache = new_kv_cache(cfg, 4, 17, CPU)
    tokens = torch.randint(cfg.vocab, (4,))
    cuda_graph(lambda: decode_step(model, cache, tokens, 16))  # A's and B's timed step
    assert FakeGraph.captured[-1].attention() and FakeGraph.captured[-1].host_syncs() == []
    # the check can fail: rows at several positions read their positions from the host
    cuda_graph(lambda: decode_step(model, cache, tokens, [3, 8, 8, 16]))
    assert FakeGraph.captured[-1].host_syncs()


MOE = dataclasses.replace(TINY, layers=2, heads=4, kv_heads=2, mlp="gated", norm="rms",
                          positions="rope", experts=8, experts_per_token=2, expert_ffn=32)


def test_the_stand_in_sees_the_host_syncs_cuda_would():
    # .tolist() and int() record no aten op on a CPU, and bincount reads its input's range on the
    # host on CUDA: each is a host sync, as CUDA would see it
    x = torch.tensor([3, 1, 1])
    with OpLog() as log:
        x.tolist(), int(x[0]), torch.bincount(x)
    assert {"tolist", "__int__", "bincount"} <= set(log.host_syncs())
    with OpLog() as log:
        x[0].item()
    assert log.host_syncs()


@torch.inference_mode()
def test_an_moe_step_is_captured_only_in_its_grouped_form(fake_cuda):
    model = build_model(MOE, CPU, seed=2)
    cache = new_kv_cache(MOE, 4, 17, CPU)
    tokens = torch.randint(MOE.vocab, (4,))
    step = lambda: decode_step(model, cache, tokens, 16)  # noqa: E731 (A's timed step)
    why = capture_blocker(step)  # the loop reads each expert's count on the host
    assert why.startswith("host syncs:") and "bincount" in why and "tolist" in why
    if not grouped_mm_works(CPU, torch.float32):
        pytest.skip("torch._grouped_mm does not run here")
    for m in model.modules():
        if isinstance(m, MoE):
            m.set_grouped(True)
    assert capture_blocker(step) is None
    cuda_graph(step)
    assert FakeGraph.captured[-1].host_syncs() == []


def test_a_step_that_cannot_be_captured_is_never_captured_and_says_why(fake_cuda):
    run = RunConfig.of(model=MOE, device="cpu", warmup=1, reps=5, time_budget_s=10.0)
    bench = Bench(run, CPU)
    with torch.inference_mode():
        timing = bench.time_decode(2, 8, mode="graph")
        dense = Bench(run.replace(model=TINY), CPU).time_decode(2, 8, mode="graph")
    assert FakeGraph.captured and len(FakeGraph.captured) == 1  # the dense step's alone
    assert timing["ran"] == "eager" and "bincount" in timing["graph_failed"]
    assert dense["ran"] == "graph" and "graph_failed" not in dense


def test_a_capture_that_raises_leaves_the_caller_stream_current(fake_cuda, monkeypatch):
    @contextlib.contextmanager
    def failing_capture(graph):
        yield
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
    caller = FakeStream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: caller)
    monkeypatch.setattr(torch.cuda, "graph", failing_capture)
    with pytest.raises(RuntimeError, match="operation not permitted"):
        cuda_graph(lambda: None)
    assert FakeStream.current[-1:] == [caller]


@torch.inference_mode()
def test_moe_rows_and_their_dense_twin_compare_in_the_mode_they_ran(fake_cuda, monkeypatch):
    run = RunConfig.of(model=MOE, device="cpu", graphs="both", batch_sizes=(1, 4), context=8,
                         contexts=(8,), warmup=1, reps=3, time_budget_s=5.0)
    A = run_decode_sweep(Bench(run, CPU), CEILINGS, lambda line: None)
    graph_rows = [r for r in A["rows"] if r["mode"] == "graph"]
    assert all(r["ran"] == "eager" and "graph_failed" in r for r in graph_rows)
    twin = A["dense_twin"]["rows"]
    assert [(r["mode"], r["ran"]) for r in twin] == [("eager", "eager")] * 2
    assert all(r["dense_twin_ms"] > 0 for r in graph_rows)
    # where the twin ran in another mode than the MoE row, no ratio is taken
    real = decode_row
    monkeypatch.setattr(nn40.experiment_ab, "decode_row",
                        lambda bench, *a: {**real(bench, *a), "ran": "graph"}
                        if not bench.cfg.experts else real(bench, *a))
    A = run_decode_sweep(Bench(run, CPU), CEILINGS, lambda line: None)
    assert not any("dense_twin_ms" in r for r in A["rows"])


@torch.inference_mode()
def test_graph_mode_times_prefill_too_and_feeds_fresh_prompts(fake_cuda, monkeypatch):
    run = RunConfig.of(model=TINY, device="cpu", graphs="both", warmup=1, reps=5,
                         time_budget_s=10.0)
    bench = Bench(run, CPU)
    seen = []
    real_prefill = prefill

    def spy(model, cache, tokens, rows=None):
        seen.append(tokens.clone())
        return real_prefill(model, cache, tokens, rows)
    monkeypatch.setattr(nn40.experiment_ab, "prefill", spy)
    # (replay = the step itself)
    monkeypatch.setattr(nn40.experiment_ab, "cuda_graph", lambda step: step)
    timing = bench.time_prefill(16, mode="graph")
    assert timing["n"] == 5 and "graph_failed" not in timing
    assert len({tuple(t.flatten().tolist()) for t in seen}) > 1  # a fresh prompt each call


def test_a_failed_capture_is_timed_eagerly_and_says_so(fake_cuda, monkeypatch):
    def broken(step):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(nn40.experiment_ab, "cuda_graph", broken)
    run = RunConfig.of(model=TINY, device="cpu", warmup=1, reps=5, time_budget_s=10.0)
    bench = Bench(run, CPU)
    with torch.inference_mode():
        timing = bench.time_decode(2, 8, mode="graph")
    assert timing["n"] == 5 and timing["graph_failed"].startswith("RuntimeError: operation")
    row = roofline_row(TINY, CEILINGS, timing, (2, 1, 8))
    assert cell(TEXT["en"], {**row, "mode": "graph"}, "mode", "s") == \
        "eager (graph failed)"


def test_c_prices_decode_and_prefill_from_one_mode():
    def row(phase, mode, ms, **shape):
        return {"phase": phase, "mode": mode, "step_ms": ms, **shape}
    A = {"modes": ["eager", "graph"], "context": 128, "rows": [
        {"batch": b, "context": 128, "mode": m, "step_ms": ms}
        for b, m, ms in ((1, "eager", 3.0), (8, "eager", 3.5), (1, "graph", 1.0),
                         (8, "graph", 1.2))]}
    B = {"rows": [row("prefill", "eager", 9.0, tokens=512), row("prefill", "graph", 6.0,
                                                                  tokens=512)]}
    results = {"A": A, "B": B, "environment": {
        "device": "GPU", "ceilings": {"bandwidth_gbs": 1000.0}}}
    costs = measured_costs(ModelConfig(), results)
    assert costs.source["mode"] == "graph"
    assert dict(zip(costs.tokens, costs.seconds))[512] == pytest.approx(6.0e-3)


def test_an_unsupported_gpu_architecture_is_one_line(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (12, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "RTX 5080")
    with pytest.raises(UsageError, match="no kernels for the RTX 5080 .sm_120.*CUDA 12.8"):
        check_cuda_arch(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_90", "compute_90"])
    check_cuda_arch(torch.device("cuda"))  # PTX of an older sm: JIT-compiled, runs
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_90", "sm_120"])
    check_cuda_arch(torch.device("cuda"))


def test_rows_that_do_not_fit_the_gpu_are_skipped_before_allocating(fake_cuda, monkeypatch):
    monkeypatch.setattr(nn40.device, "free_memory_bytes", lambda device: 2**30)
    bench = types.SimpleNamespace(cfg=ModelConfig(), device=torch.device("cuda"))
    reason = Bench.skip_reason(bench, 256, 4097, 1)
    assert reason["kind"] == "does_not_fit" and reason["free_gib"] == 1.0
    assert Bench.skip_reason(bench, 1, 129, 1) is None


@torch.inference_mode()
def test_the_kv_device_check_counts_the_view_its_decode_reads(monkeypatch):
    # a budget of 40 M tokens as 625,000 rows of 64: the whole cache is 2.56e9 elements of K
    # a layer, past 32 bits, but the decode of the peak's 3 rows views 3 rows alone
    bench = Bench(RunConfig.of(model=TINY, device="cpu", warmup=1, reps=3,
                                   time_budget_s=1.0), CPU)
    kv = {"budget_tokens": 40_000_000, "peak": {"contexts": [20, 30, 40]}}
    monkeypatch.setattr(nn40.device, "free_memory_bytes", lambda device: math.inf)
    real = new_kv_cache  # (the check's 625,000 rows as the 3 the step reads)
    monkeypatch.setattr(nn40.experiment_ab, "new_kv_cache",
                        lambda cfg, rows, n, device: real(cfg, 3, n, device))
    check = kv_device_check(bench, kv)
    assert (check["rows"], check["row_tokens"]) == (625_000, 64)
    assert kv_view_elements(TINY, check["rows"], 64) > VIEW_ELEMENTS_MAX
    assert "skipped" not in check and check["step_ms"] > 0
    monkeypatch.setattr(nn40.experiment_ab, "VIEW_ELEMENTS_MAX", kv_view_elements(TINY, 3, 64) - 1)
    assert kv_device_check(bench, kv)["skipped"]["kind"] == "view_too_large"


def test_the_ceilings_draw_their_operands_on_the_device(monkeypatch):
    drawn, real = [], torch.randn

    def randn(*shape, **kwargs):
        drawn.append(kwargs.get("device"))
        return real(*shape, **kwargs)
    monkeypatch.setattr(torch, "randn", randn)
    run = RunConfig.of(model=TINY, device="cpu", warmup=1, reps=3, time_budget_s=0.05,
                         peak_bandwidth_gbs=10.0)
    measure_ceilings(run, CPU, lambda line: None)
    assert drawn and all(d == CPU for d in drawn)  # (no operand drawn elsewhere and moved)


# --- the matmul layout: W x^T where F.linear is slow at a few rows ----------------------------

@torch.inference_mode()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_first_linear_equals_f_linear(dtype):
    g = torch.Generator().manual_seed(5)
    w = torch.randn(48, 32, generator=g).to(dtype)
    for shape in [(1, 32), (3, 32), (2, 3, 32), (5, 1, 32), (70, 32)]:
        x = torch.randn(*shape, generator=g).to(dtype)
        got = nn40.model.linear(x, w, weight_first_rows=64)
        assert got.shape == (*shape[:-1], 48)
        torch.testing.assert_close(got, torch.nn.functional.linear(x, w))


@torch.inference_mode()
def test_a_model_in_either_layout_computes_the_same():
    cfg = ModelConfig(layers=2, hidden=64, heads=8, kv_heads=2, vocab=97, max_positions=64,
                        dtype="float32", mlp="gated", ffn_hidden=96, norm="rms",
                        positions="rope", experts=8, experts_per_token=2, expert_ffn=32)
    tokens = torch.randint(0, 97, (3, 9), generator=torch.Generator().manual_seed(2))
    logits = []
    for rows in (0, 64):
        model = build_model(cfg, "cpu", seed=4, weight_first_rows=rows)
        assert all(m.weight_first_rows == rows for m in model.modules()
                   if isinstance(m, (Linear, MoE)))
        cache = new_kv_cache(cfg, 3, 10, "cpu")
        prefill(model, cache, tokens)
        logits.append(decode_step(model, cache, tokens[:, 0], 9))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)


def layout_clock(monkeypatch, linear_ms, first_ms):
    """call_ms by the layout and rows the fn runs: linear_ms[i] and first_ms[i] at the i-th
    of LAYOUT_ROWS (a 300 ms cold first call of each never counted)."""
    ran, seen = [], collections.Counter()
    real_linear, real_first = F.linear, nn40.model.linear
    monkeypatch.setattr(F, "linear", lambda x, w: ran.append(("linear", x.shape[0]))
                        or real_linear(x, w))
    monkeypatch.setattr(nn40.device, "linear", lambda x, w, rows: ran.append(("first", x.shape[0]))
                        or real_first(x, w, rows))

    def call_ms(fn):
        fn()
        seen[ran[-1]] += 1
        layout, rows = ran[-1]
        i = LAYOUT_ROWS.index(rows)
        return 300.0 if seen[ran[-1]] == 1 else (linear_ms if layout == "linear" else first_ms)[i]
    monkeypatch.setattr(nn40.device, "call_ms", call_ms)


def test_the_layout_probe_keeps_w_xt_up_to_the_rows_it_wins(monkeypatch):
    # F.linear 1 ms at 1 row, then 2 ms; W x^T 1.1 ms at 1 row, 0.5 ms to 8, then 3 ms: W x^T
    # up to 8 rows makes the least total (1.1 + 3 x 0.5 + 3 x 2 = 8.6 ms against 13), the
    # next up to 16 rows (9.6 ms, 1.12x: past the noise)
    layout_clock(monkeypatch, [1] + [2] * 6, [1.1, 0.5, 0.5, 0.5, 3, 3, 3])
    probe = probe_layouts.__wrapped__(64, "float32")
    assert probe["linear_ms"] == [1, 2, 2, 2, 2, 2, 2]
    assert probe["weight_first_rows"] == 8 and probe["margin"] == pytest.approx(9.6 / 8.6)
    # where W x^T never wins, F.linear throughout; where it always does, up to 64 rows; where
    # it wins by less than the noise, F.linear (the smallest turn of those tied)
    for linear_ms, first_ms, rows in ((1, 1, 0), (2, 1, 64), (1, 0.95, 0)):
        layout_clock(monkeypatch, [linear_ms] * 7, [first_ms] * 7)
        assert probe_layouts.__wrapped__(64, "float32")["weight_first_rows"] == rows


def test_the_layout_probe_runs_on_cpu_where_a_model_is_built(monkeypatch, tiny_args, capsys):
    probe = {"rows": [1, 2], "linear_ms": [1.0, 2.0], "weight_first_ms": [1.0, 1.0],
             "weight_first_rows": 2}
    monkeypatch.setattr(nn40.device, "probe_layouts", lambda width, dtype: probe)
    run = parse_args(["--device", "cpu", "--experiments", "A"])
    assert with_probed_layout(run) == (run.replace(weight_first_rows=2), probe)
    alone = parse_args(["--experiments", "C"])
    assert with_probed_layout(alone) == (alone, None)
    results = S.main(tiny_args + ["--experiments", "A", "--no-figures"])
    assert results["environment"]["layout_probe"] == probe
    assert "matmuls: W x^T up to 2 rows, F.linear beyond" in capsys.readouterr().out
    assert results["config"]["weight_first_rows"] == 2
