"""Every numeric flag fed extreme values: a run, or one clear line and exit 2; never a traceback."""
import pytest

import NN_40_serving as S
import dataclasses
from nn40.cli import build_parser, parse_args
from nn40.config import ENGINE_CPU, RATES
from nn40.settings import RUN_GROUP, RUN_GROUPS, RunConfig, experiment_letters

VALUES = ["0", "-1", "1e-300", "1e-9", "1e300", "nan", "inf", str(10**20), "", "abc"]

TINY = ["--device", "cpu", "--layers", "1", "--hidden", "64", "--heads", "4", "--vocab", "128",
        "--dtype", "float32", "--max-positions", "512", "--batch-sizes", "1,4", "--context", "8",
        "--contexts", "8", "--prefill-lengths", "16", "--decode-batches", "1,2", "--warmup", "1",
        "--reps", "3", "--no-figures"]
C_ONLY = ["--experiments", "C", "--requests", "40", "--slots", "4", "--rates", "5", "--jobs", "1",
          "--no-figures"]
CONTEXTS = {  # the experiments each flag acts on, as small as they come
    "A": TINY + ["--experiments", "A"],
    "AB": TINY + ["--experiments", "AB"],
    "C": C_ONLY,
    "C on a card": C_ONLY + ["--gpu", "h100"],
    "C, experts": C_ONLY + ["--gpu", "h100", "--model", "qwen3-30b-a3b"],
    "C, prefixes": C_ONLY + ["--enable-prefix-caching", "--turns", "2", "--prefix-len", "32"],
    "C, host": C_ONLY + ["--enable-prefix-caching", "--turns", "2", "--prefix-len", "32",
                         "--host-kv-gb", "1"],
    "C, disk": C_ONLY + ["--enable-prefix-caching", "--turns", "2", "--prefix-len", "32",
                         "--host-kv-gb", "1", "--disk-kv-gb", "10"],
    "C, pools": C_ONLY + ["--gpu", "h100", "--prefill-replicas", "1", "--decode-replicas", "1"],
    "C, speculating": C_ONLY + ["--gpu", "h100", "--speculative-config", '{"method": "eagle3"}'],
    "D": TINY + ["--experiments", "D", "--engine-requests", "4", "--prompt-len", "8"],
}
FLAGS = {
    "--layers": "A", "--hidden": "A", "--heads": "A", "--vocab": "A", "--max-positions": "A",
    "--batch-sizes": "A", "--context": "A", "--contexts": "A", "--peak-bandwidth-gbs": "AB",
    "--peak-tflops": "AB", "--prefill-lengths": "AB", "--decode-batches": "AB", "--warmup": "A",
    "--reps": "A", "--requests": "C", "--slots": "C", "--seed": "C", "--prompt-len": "C",
    "--trace-limit": "C", "--rate": "C", "--burstiness": "C", "--rates": "C",
    "--chunk-tokens": "C", "--slo-ttft-ms": "C", "--slo-tpot-ms": "C", "--kv-memory-gb": "C",
    "--block-tokens": "C", "--watermark": "C", "--jobs": "C", "--max-output": "C",
    "--engine-requests": "D", "--dpi": "C", "--predict-sigma": "C", "--max-wait-s": "C",
    "--kv-heads": "A", "--ffn-hidden": "A", "--engine-slots": "D", "--engine-shrink": "D",
    "--replicas": "C", "--slo-attainment": "C", "--target-rate": "C", "--tp": "C on a card",
    "--kv-tokens": "C", "--head-dim": "A", "--experts": "C", "--experts-per-token": "C",
    "--expert-ffn": "A", "--expert-skew": "C, experts", "--ep": "C, experts",
    "--host-kv-gb": "C, prefixes", "--disk-kv-gb": "C, host", "--disk-kv-gbs": "C, disk",
    "--prefix-len": "C, prefixes", "--num-prefixes": "C, prefixes",
    "--prefix-share": "C, prefixes", "--prefix-zipf": "C, prefixes", "--turns": "C, prefixes",
    "--think-time-s": "C, prefixes",
    "--kv-link-gbs": "C, pools", "--kv-link-latency-us": "C, pools", "--pp-micro-batches": "C",
    "--pp": "C on a card", "--prefill-replicas": "C, pools", "--decode-replicas": "C, pools",
    "--prefill-tp": "C, pools", "--decode-tp": "C, pools", "--prefill-pp": "C, pools",
    "--decode-pp": "C, pools",
    "--gpu-budget": "C, pools", "--kv-fraction": "C on a card",
    "--num-speculative-tokens": "C, speculating", "--acceptance-rate": "C, speculating",
    "--acceptance-rates": "C, speculating", "--acceptance-length": "C, speculating",
}


def test_every_numeric_flag_is_listed():
    numeric = {a.option_strings[0] for a in build_parser()._actions
               if a.type not in (None, str, experiment_letters) and not a.choices
               and not hasattr(a.type, "resolves")}
    assert numeric == set(FLAGS)


def bounds():
    """(flag, value) at each end of every numeric flag's range: these are accepted, so each
    must run or be refused later, by a check of memory or of the clock."""
    for action in build_parser()._actions:
        flag = action.option_strings[0]
        if flag in FLAGS and flag != "--rate":  # (--rate's type also takes "trace")
            yield from ((flag, f"{v:g}" if isinstance(v, float) else str(v))
                        for v in action.type.bounds)
    yield from (("--rate", f"{v:g}") for v in RATES)


@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("flag", sorted(FLAGS))
def test_extreme_flag_values(flag, value, tmp_path, capsys):
    run_and_check(flag, value, tmp_path, capsys)


@pytest.mark.parametrize("flag, value", sorted(set(bounds())))
def test_flag_values_at_the_bounds(flag, value, tmp_path, capsys):
    run_and_check(flag, value, tmp_path, capsys)


def run_and_check(flag, value, tmp_path, capsys):
    args = CONTEXTS[FLAGS[flag]] + ["--out", str(tmp_path), flag, value]
    if flag == "--dpi":  # (figures drawn)
        args.remove("--no-figures")
    try:
        S.main(args)
        code = 0
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code in (0, 2), (flag, value, code)
    assert "Traceback" not in err
    if code == 2:
        assert len(err.strip().splitlines()) == 1 and "error" in err, err


def test_the_run_is_its_flags_groups_each_frozen():
    # each field in exactly one group; of and replace take fields by their own names
    run = parse_args(C_ONLY + ["--gpu", "h100", "--slo-ttft-ms", "500", "--order", "sjf"])
    assert (run.scheduler.slots, run.hardware.gpu, run.slo.slo_ttft_s) == (4, "h100", 0.5)
    assert (run.workload.requests, run.scheduler.order, run.measurement.jobs) == (40, "sjf", 1)
    names = [f for group in RUN_GROUPS.values() for f in dataclasses.fields(group)]
    assert len(names) == len({f.name for f in names}) == len(run.flat())
    moved = run.replace(slots=8, rate=2.0)
    assert (moved.scheduler.slots, moved.workload.rate, run.scheduler.slots) == (8, 2.0, 4)
    assert moved.hardware is run.hardware  # (the groups it did not touch, as they were)
    assert RunConfig.of(model=run.hardware.model, slots=4).scheduler.order == "fcfs"
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.scheduler.slots = 1
    with pytest.raises(TypeError, match="no field sloots"):
        RunConfig.of(model=run.hardware.model, sloots=4)
    with pytest.raises(TypeError, match="^RunConfig has no field sloots$"):
        run.replace(slots=8, sloots=4)


# each flag group's fields (its dests that are RunConfig fields; the model's shape flags, --goodput
# and the output group's modes are not) in the one config group of its title's first word, save
# the shared prefixes': the workload's prompts that repeat, the scheduler's cache that keeps them
FLAG_GROUPS = {"workload": {"workload"}, "shared": {"workload", "scheduler"},
               "model": {"hardware"}, "scheduler": {"scheduler"}, "speculative": {"scheduler"},
               "placement": {"placement"},
               "SLOs": {"slo"},
               "measurement": {"measurement"}, "engine": {"engine"}, "output": {"output"}}


def test_each_flag_group_fills_its_config_group():
    groups = [g for g in build_parser()._action_groups if g._group_actions]
    assert [g.title.split()[0].rstrip(":") for g in groups] == list(FLAG_GROUPS)
    for group in groups:
        filled = {RUN_GROUP[a.dest] for a in group._group_actions if a.dest in RUN_GROUP}
        assert filled == FLAG_GROUPS[group.title.split()[0].rstrip(":")], group.title


@pytest.mark.parametrize("args, engine", [
    (["--device", "cpu"], (ENGINE_CPU["requests"], ENGINE_CPU["slots"], ENGINE_CPU["prompt_len"],
          ENGINE_CPU["shrink"])),
    (["--quick", "--device", "cpu"], (16, 4, 8, 16)),
    (["--experiments", "C", "--requests", "50", "--slots", "6", "--prompt-len", "20",
      "--prefix-len", "64"], (50, 6, 64 + 20, 1)),
    (["--experiments", "C", "--engine-requests", "7", "--engine-slots", "3", "--engine-shrink",
      "2"], (7, 3, 128, 2)),
])
def test_the_engine_is_resolved_once_by_run_config(args, engine):
    # on CPU, with --quick, C alone (the run's own sizes) or as given: set in one place
    run = parse_args(args)
    got = run.engine
    assert (got.engine_requests, got.engine_slots, got.engine_prompt_len,
            got.engine_shrink) == engine
