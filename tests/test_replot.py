"""--replot redraws from a saved results.json without running anything."""
import json
import os

import pytest

import NN_40_serving as S
import nn40.device
import nn40.experiment_ab
import nn40.figures
from nn40.figures import FIGURES, draw_figures
from test_cli import expect_usage_error
from test_disagg import DISTSERVE


def test_replot_redraws_the_same_set(tiny_args, tmp_path, capsys, monkeypatch):
    S.main(tiny_args)
    drawn = sorted(p.name for p in tmp_path.glob("*.png"))
    # (every figure but the capacity search's, which needs an SLO, the experts', the prefix
    # study's, speculation's, the pools' and the placement search's)
    assert "phases.png" in drawn and len(drawn) == len(FIGURES) - 6
    monkeypatch.setattr(nn40.experiment_ab, "Bench",
                        lambda *a: pytest.fail("replot ran an experiment"))
    monkeypatch.setattr(nn40.device, "resolve_device",
                        lambda *a: pytest.fail("replot probed a device"))
    again = tmp_path / "again"
    result = S.main(["--replot", str(tmp_path / "results.json"), "--out", str(again),
                     "--format", "svg"])
    assert sorted(p.name for p in again.iterdir()) == [n.replace(".png", ".svg") for n in drawn]
    assert result["missing"] == {"capacity.svg": "needs an SLO (--slo-ttft-ms or --slo-tpot-ms)",
                                 "moe_batching.svg": "needs A on a mixture of experts (--experts)",
                                 "prefix_cache.svg": "needs --prefix-study",
                                 "speculation.svg": "needs --speculative-config",
                                 "disaggregation.svg": "needs --prefill-replicas, "
                                                       "--decode-replicas and an SLO",
                                 "placements.svg": "needs experiment placement_search"}


def test_replot_of_c_only_draws_c_and_says_so(tmp_path, capsys):
    S.main(["--experiments", "C", "--requests", "100", "--rates", "5,10", "--out",
            str(tmp_path)])
    capsys.readouterr()
    result = S.main(["--replot", str(tmp_path / "results.json"), "--out", str(tmp_path / "r")])
    assert sorted(result["written"]) == ["kv_memory.png", "latency_cdf.png", "occupancy.png",
                                         "rate_sweep.png", "who_waits.png"]
    out = capsys.readouterr().out
    assert "could not draw roofline.png: needs experiment A or B" in out


@pytest.mark.parametrize("content, fragment", [
    ("{not json", "not a JSON file"),
    ('["a", "list"]', "not a results.json"),
    ('{"environment": {}, "config": {}, "C": {"static": {}}}', "lacks a field"),
])
def test_replot_of_bad_files(tmp_path, capsys, content, fragment):
    path = tmp_path / "results.json"
    path.write_text(content)
    expect_usage_error(["--replot", str(path), "--out", str(tmp_path / "r")], capsys, fragment)


def test_replot_of_a_missing_file(tmp_path, capsys):
    expect_usage_error(["--replot", str(tmp_path / "nope.json")], capsys, "cannot read")


def test_no_figure_prints_a_raw_description(tiny_args, tmp_path, capsys, monkeypatch):
    """Every string drawn goes through the description renderer: no dict in any figure (the
    latency CDFs' title once printed "arrivals {'kind': 'arrivals_zero'}")."""
    S.main(tiny_args + ["--experiments", "ABCD", "--engine-requests", "8", "--no-figures"])
    slo = tmp_path / "slo"  # (and C with an SLO and a Poisson rate: the capacity figure too)
    S.main(["--experiments", "C", "--requests", "100", "--rate", "20", "--rates", "5",
            "--slo-ttft-ms", "500", "--no-figures", "--out", str(slo)])
    moe = tmp_path / "moe"  # (and A on a mixture of experts: its dense twin's figure)
    S.main(tiny_args + ["--experiments", "A", "--mlp", "gated", "--experts", "4",
                        "--experts-per-token", "2", "--no-figures", "--out", str(moe)])
    prefix = tmp_path / "prefix"  # (and C with a prefix cache's study)
    S.main(["--experiments", "C", "--requests", "100", "--rate", "20", "--rates", "5",
            "--prefix-len", "64", "--turns", "2", "--enable-prefix-caching", "--prefix-study",
            "--no-figures", "--out", str(prefix)])
    pools = tmp_path / "pools"  # (and a prefill and a decode pool, with an SLO)
    S.main(["--experiments", "C", "--gpu", "h100", "--model", "llama-3.1-8b", "--requests",
            "100", "--rate", "5", "--rates", "5", "--slo-ttft-ms", "500", "--prefill-replicas",
            "1", "--decode-replicas", "1", "--no-figures", "--out", str(pools)])
    spec = tmp_path / "spec"  # (and C speculating)
    S.main(["--experiments", "C", "--gpu", "h100", "--model", "llama-3.1-8b", "--requests",
            "100", "--rate", "5", "--speculative-config", '{"method": "eagle3"}',
            "--no-figures", "--out", str(spec)])
    placements = tmp_path / "placements"  # (and the placement search, where DistServe's are)
    runs = [tmp_path, slo, moe, prefix, pools, spec]
    if os.path.isdir(DISTSERVE):
        S.main(["--placement-search", DISTSERVE, "--gpu-budget", "2", "--jobs", "1",
                "--no-figures", "--out", str(placements)])
        runs.append(placements)
    texts = {}

    def collect(fig, results, path):
        import matplotlib.pyplot as plt
        import matplotlib.text
        texts[path] = [t.get_text() for t in fig.findobj(matplotlib.text.Text)]
        plt.close(fig)
    monkeypatch.setattr(nn40.figures, "save_figure", collect)
    for out in runs:
        saved = out / ("placement_search.json" if out == placements else "results.json")
        draw_figures(json.loads(saved.read_text()), str(out), jobs=1)
    assert {os.path.basename(p) for p in texts} == set(FIGURES) - (
        set() if placements in runs else {"placements.png"})
    for name, strings in texts.items():
        for text in strings:  # (no dict, no template left unfilled, no missing value)
            if text.startswith("$"):  # (a log axis's tick labels, in mathtext)
                continue
            assert not {"{", "}", "'kind'", "None", "nan"} & set(text.replace("{", " { ")
                                                                .replace("}", " } ").split()), \
                (name, text)
    assert any("arrivals all at t=0" in t for t in texts[str(tmp_path / "latency_cdf.png")])
    assert any("Poisson at 20 requests/s" in t for t in texts[str(slo / "latency_cdf.png")])
