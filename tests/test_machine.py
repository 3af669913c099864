"""When the machine lied: ceilings that moved, a ridge under 1 FLOP/byte, MBU or MFU over 100%,
each warned about from stand-in ceilings on both sides of its threshold."""
import re

import pytest

import NN_40_serving as S
from nn40.accounting import flops_and_bytes
from nn40.config import ModelConfig
from nn40.experiment_ab import roofline_row
from nn40.tables import describe, machine_warnings
from nn40.tables_c import engine_machine_text
from nn40.text_ko import TEXT


def ceilings(bandwidth=100.0, tflops=1.0):
    return {"bandwidth_gbs": bandwidth, "matmul_tflops": tflops,
            "ridge_flop_per_byte": tflops * 1e3 / bandwidth}


def kinds(results):
    return [w["kind"] for w in machine_warnings(results)]


@pytest.mark.parametrize("end, warned", [
    (ceilings(100.0 * 1.24, 1.24), False), (ceilings(100.0 * 1.26, 1.26), True),  # together
    (ceilings(100.0 * 0.76, 0.76), False), (ceilings(100.0 * 0.74, 0.74), True),
    (ceilings(100.0 * 0.74, 0.76), False), (ceilings(100.0 * 1.3, 0.7), False),
    (ceilings(100.0 * 1.31), False), (ceilings(100.0 * 1.49), False),  # one alone
    (ceilings(100.0 * 1.51), True), (ceilings(100.0 * 0.49), True),
    (ceilings(tflops=0.73), False), (ceilings(tflops=1.49), False),
    (ceilings(tflops=1.51), True), (ceilings(tflops=0.45), True),
])
def test_ceilings_that_moved_together_or_far_alone_warn(end, warned):
    # both by more than a quarter the same way (a busy machine slows copies and matmuls
    # alike), or one by more than half; one alone within that is the measurement's spread
    results = {"environment": {"ceilings": ceilings(), "ceilings_end": end}}
    assert ("warn_moved" in kinds(results)) == warned
    results["D"] = {"machine": {"before": ceilings(), "after": end}}
    assert ("warn_engine" in kinds(results)) == warned
    text = engine_machine_text(TEXT["en"], results["D"])[0]
    assert ("moved between D's pricing and its run" in text) == warned


@pytest.mark.parametrize("tflops, warned", [(0.099, True), (0.101, False)])
def test_a_ridge_under_one_flop_per_byte_warns(tflops, warned):
    results = {"environment": {"ceilings": ceilings(100.0, tflops)}}  # ridge 0.99 or 1.01
    assert kinds(results) == (["warn_ridge"] if warned else [])


@pytest.mark.parametrize("share, warned", [(1.01, True), (1.0, False)])
def test_mfu_or_mbu_over_100_percent_warns(share, warned):
    c = ceilings()
    timing = {"median_ms": 10.0, "p10_ms": 9.0, "p90_ms": 11.0, "n": 5}
    cfg = ModelConfig(layers=1, hidden=64, heads=4, vocab=128, dtype="float32")
    cost = flops_and_bytes(cfg, 1, 1, 8)
    c["bandwidth_gbs"] = cost["bytes"] / 0.010 / 1e9 / share  # (MBU = share)
    row = roofline_row(cfg, c, timing, (1, 1, 8))
    assert ("mbu" in row.get("above_ceiling", ())) == warned
    results = {"environment": {"ceilings": {**c, "ridge_flop_per_byte": 10.0}},
               "A": {"rows": [row]}}
    assert ("warn_above" in kinds(results)) == warned
    if warned:
        text = describe(TEXT["en"], machine_warnings(results)[0])
        assert "MBU over 100%" in text and "re-run --experiments AB" in text


def test_a_quiet_run_warns_of_nothing():
    assert machine_warnings({"environment": {"ceilings": ceilings(),
                                               "ceilings_end": ceilings(110.0, 0.9)}}) == []
    assert machine_warnings({"environment": {}}) == []  # (C alone: no ceilings)


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_a_figure_that_cannot_be_saved_fails_in_one_line(jobs, tmp_path, capsys, monkeypatch):
    import json
    import matplotlib.figure

    def full_disk(self, *args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full_disk)
    with pytest.raises(SystemExit) as e:
        S.main(["--experiments", "C", "--requests", "60", "--slots", "4", "--rates", "5",
                "--jobs", jobs, "--out", str(tmp_path)])
    err = [line for line in capsys.readouterr().err.splitlines()  # (less the progress log)
           if not re.match(r" *\[\d\d:\d\d:\d\d\] ", line)]
    assert e.value.code == 1 and len(err) == 1 and "Traceback" not in err[0]
    assert "the figures failed (OSError: [Errno 28] No space left on device)" in err[0]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["failed"]["experiment"] == "figures" and saved["C"]["speedup"] > 1


def test_a_run_removes_the_figures_it_did_not_draw(tmp_path, capsys):
    import json
    stale = [tmp_path / "moe_batching.png", tmp_path / "engine.svg", tmp_path / "capacity.png"]
    mine = tmp_path / "notes.png"  # (not a name the script gives a figure: kept)
    for path in stale + [mine]:
        path.write_bytes(b"old")
    S.main(["--experiments", "C", "--requests", "60", "--slots", "4", "--rates", "5",
            "--jobs", "1", "--out", str(tmp_path)])
    assert not any(p.exists() for p in stale) and mine.exists()
    saved = json.loads((tmp_path / "results.json").read_text())
    assert "occupancy.png" in saved["figures"]["written"]
    assert saved["figures"]["not_drawn"]["capacity.png"].startswith("needs an SLO")
    assert saved["figures"]["not_drawn"]["engine.png"] == "needs experiment D"


def test_a_run_that_draws_no_figures_keeps_the_older_ones_and_names_them(tmp_path, capsys):
    import json
    older = tmp_path / "occupancy.png"
    older.write_bytes(b"old")
    S.main(["--experiments", "C", "--requests", "60", "--slots", "4", "--no-figures",
            "--out", str(tmp_path)])
    assert older.read_bytes() == b"old"
    assert "kept from an older run (this one drew none): occupancy.png" in capsys.readouterr().out
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["figures"]["older"] == ["occupancy.png"]
