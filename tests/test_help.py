"""--help by task, one style of default, vLLM's spellings as aliases of the same flags."""
import argparse

import pytest

import NN_40_serving as S
from nn40.cli import HELP_WIDTH, build_parser, parse_args
from nn40.host import OUTPUT_WIDTH, columns, fit_lines
from nn40.tables import table
from nn40.tables_c import counted
from nn40.text_ko import TEXT

C = ["--experiments", "C", "--gpu", "h100"]
ALIASES = [  # (ours, vLLM's): the same RunConfig field from either
    (["--rate", "7"], ["--request-rate", "7"]),
    (["--requests", "90"], ["--num-prompts", "90"]),
    (["--slots", "256"], ["--max-num-seqs", "256"]),
    (["--chunk-tokens", "2048"], ["--max-num-batched-tokens", "2048"]),
    (["--block-tokens", "32"], ["--block-size", "32"]),
    (["--kv-dtype", "fp8"], ["--kv-cache-dtype", "fp8"]),
    (["--tp", "2"], ["--tensor-parallel-size", "2"]),
    (["--slo-ttft-ms", "1000", "--slo-tpot-ms", "50"], ["--goodput", "ttft:1000", "tpot:50"]),
    (["--slo-attainment", "0.99"], ["--slo-attainment", "p99"]),
    (["--slo-attainment", "0.99"], ["--slo-attainment", "99%"]),
]


@pytest.mark.parametrize("ours, theirs", ALIASES)
def test_every_vllm_alias_parses_to_the_same_setting(ours, theirs):
    plain, alias = parse_args(C + ours), parse_args(C + theirs)
    assert alias == plain
    assert alias != parse_args(C)  # (the flag changed something)


def test_help_fits_a_page_in_groups_by_task(capsys):
    with pytest.raises(SystemExit) as e:
        S.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    # (a page: 180 lines since the disk tier's three flags joined)
    assert len(lines) <= 180 and max(map(len, lines)) <= HELP_WIDTH
    for group in ("workload", "model and hardware", "scheduler and KV cache", "placement",
                  "SLOs and capacity", "measurement", "engine check (D", "output", "recipes"):
        assert f"\n{group}" in text, group
    assert "llama-3-8b,llama" not in text and "rtx-3090,rtx" not in text  # (see --catalog)
    model = next(line for line in lines if line.startswith("model and hardware"))
    assert "probe" in model and "bfloat16" not in model  # (on CPU a probe decides)


def test_every_flag_has_help_and_every_value_its_default():
    for action in build_parser()._actions:
        assert action.help, action.option_strings
        if action.nargs != 0:
            assert action.help.endswith(")") and "(default: " in action.help, \
                action.option_strings


def test_capacity_flags_run_the_simulation_alone():
    assert parse_args(["--slo-ttft-ms", "500"]).measurement.experiments == "C"
    assert parse_args(["--goodput", "tpot:50", "--target-rate", "9"]).measurement.experiments \
        == "C"
    assert parse_args(["--slo-ttft-ms", "500", "--experiments", "CD",
                         "--device", "cpu"]).measurement.experiments == "CD"


@pytest.mark.parametrize("argv, message", [
    (["--goodput", "e2el:500"], "C's SLOs are ttft:MS and tpot:MS"),
    (["--goodput", "ttft:-3"], "--goodput ttft:-3"),
    (["--slo-attainment", "p0"], "a percentile (p99)"),
    (["--slo-attainment", "101%"], "a percentile (p99)"),
])
def test_bad_vllm_spellings_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        S.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_quick_run_fits_a_terminal_and_ends_in_the_three_claims(tmp_path, capsys):
    results = S.main(["--quick", "--out", str(tmp_path), "--no-figures", "--jobs", "1"])
    out = capsys.readouterr().out
    wide = [line for line in out.splitlines() if len(line) > OUTPUT_WIDTH]
    assert not wide, wide[:3]
    summary = out.split(TEXT["en"]["summary"])[1]
    # each claim in the words its numbers allow: the post's where they agree, else "not"
    prefill = max((r for r in results["B"]["rows"] if r["phase"] == "prefill"),
                  key=lambda r: r["tokens"])
    ahead = results["C"]["speedup"] > 1 and results["D"]["verdict"]["measured"] > 1
    claims = ["1. decode is bound by bytes" if results["A"]["rows"][1]["throughput_vs_1"] >= 2
              else "1. decode did not batch nearly free here",
              "2. prefill is bound by arithmetic" if prefill["bound"] == "compute"
              else "2. prefill was not bound by arithmetic here",
              "3. continuous batching fills the seats" if ahead
              else "3. continuous batching was not ahead here"]
    for claim in claims:
        assert claim in " ".join(summary.split())
    assert "TTFT p99 s" not in out and "TTFT mean s" not in out  # (TTFT in ms everywhere)


def test_a_wide_table_splits_under_its_labels():
    T = TEXT["en"]
    rows = [["static batching", "x" * 40, "1.0", "y" * 40], ["continuous", "2", "3", "4"]]
    text = table(T, rows, ["policy", "steps", "seconds", "req_s"])
    assert max(map(len, text.splitlines())) <= OUTPUT_WIDTH
    parts = text.split("\n\n")
    assert len(parts) == 2 and all("policy" in p and "continuous" in p for p in parts)
    wrapped = fit_lines("  word" * 60).splitlines()
    assert len(wrapped) == 4 and max(map(len, wrapped)) <= OUTPUT_WIDTH
    assert all(line.startswith("    word") for line in wrapped[1:])  # (two past its indent)
    assert " ".join(wrapped).split() == ["word"] * 60


def test_plurals_in_the_capacity_answer():
    T = TEXT["en"]
    assert counted(T, 1, "replica") == "1 replica" and counted(T, 2, "gpu") == "2 GPUs"


@pytest.mark.parametrize("lang", ["en", "ko"])
def test_a_table_as_rendered_fits_before_any_wrapping(lang):
    # A's columns at the reference run's widths: tabulate pads each header by two, so a split
    # that sums the cells' widths alone leaves rows of 108 columns for the prose wrapper to break
    T = TEXT[lang]
    cols = ["mode", "batch", "step_ms", "tokens_per_s", "throughput_vs_1", "wait_vs_1", "gbs",
            "mbu", "mfu", "bound"]
    rows = [["eager", "128", "143.888", "890", "15.6", "8.22", "3.0", "17%", "44.1%", "compute"]]
    text = table(T, rows, cols)
    assert max(map(columns, text.splitlines())) <= OUTPUT_WIDTH
    assert all(len(part.splitlines()) == 3 for part in text.split("\n\n"))  # (head, rule, row)
