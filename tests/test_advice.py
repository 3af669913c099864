"""Advice that works: every error that suggests a value suggests one the script then accepts;
and the CPU probes' choices, pinned from stand-in times on both sides of each threshold."""
import re

import pytest

import nn40.device
from nn40.cli import parse_args
from nn40.config import CPU_PRESET, GPUS, MODELS
from nn40.device import DTYPE_PREFERENCE, PROBE_NOISE, with_probed_dtype
from nn40.errors import UsageError

SUGGESTION = re.compile(r"give (--[a-z-]+) (\d+)")


def refused(argv):
    try:
        parse_args(argv)
    except UsageError as e:
        return str(e)
    return None


def test_every_suggested_split_is_then_accepted():
    walked = 0
    for model in MODELS:
        for gpu in GPUS:
            for weights in ("bf16", "fp8", "int4"):
                for split in ([], ["--ep", "2"]):
                    argv = ["--experiments", "C", "--model", model, "--gpu", gpu,
                            "--weights", weights] + split
                    error = refused(argv)
                    for flag, value in SUGGESTION.findall(error or ""):
                        walked += 1
                        retry = argv + [flag, value]
                        assert refused(retry) is None, (retry, refused(retry))
    assert walked > 20  # (the walk met the advice it checks)


def test_deepseek_v3_in_int4_on_one_h100_is_told_a_tp_that_divides_its_heads():
    error = refused(["--experiments", "C", "--model", "deepseek-v3", "--weights", "int4",
                     "--gpu", "h100"])
    assert "give --tp 8 (it divides the 128 heads)" in error
    assert "--tp 5" in refused(["--experiments", "C", "--model", "deepseek-v3", "--weights",
                                "int4", "--gpu", "h100", "--tp", "5"])  # (5 does not divide)


@pytest.mark.parametrize("chosen, layers", [("float32", CPU_PRESET.layers // 2),
                                            ("bfloat16", CPU_PRESET.layers)])
def test_a_float32_run_of_the_cpu_preset_keeps_half_its_layers(chosen, layers, monkeypatch):
    # float32 reads twice a 2-byte type's bytes a layer: half the layers read the same bytes
    # (float32 must beat the 2-byte type by the preference and the noise beyond it)
    half = DTYPE_PREFERENCE * (1 + PROBE_NOISE) + (0.01 if chosen == "float32" else -0.01)
    monkeypatch.setattr(nn40.device, "probe_dtypes", lambda width, shapes: {
        "float32": [[1.0] * 5] * len(shapes), "bfloat16": [[half] * 5] * len(shapes),
        "float16": []})
    run = parse_args(["--device", "cpu", "--experiments", "A"])
    probed, info = with_probed_dtype(run)
    assert info["chosen"] == probed.hardware.model.dtype == chosen
    assert probed.hardware.model.layers == layers and f"layers={layers}" in probed.hardware.preset
    given = parse_args(["--device", "cpu", "--experiments", "A", "--layers", "3"])
    assert with_probed_dtype(given)[0].hardware.model.layers == 3  # (a layer count given stays)