"""main([...]) end to end on CPU, and every bad input: one line, exit 2, no traceback."""
import json
import os
import re
import string

import pytest
import torch

import NN_40_serving as S
import nn40.device
from nn40.accounting import dense_twin, memory_needed_bytes, weight_bytes
from nn40.cli import parse_args
from nn40.host import write_atomic
from nn40.pricing import measured
from nn40.text_ko import TEXT


def said(phrase, printed):
    """Whether a run printed the phrase, wherever a line wrapped it (at 100 columns)."""
    return re.search(r"\s+".join(map(re.escape, phrase.split(" "))), printed) is not None


def run_main(args, capsys):
    results = S.main(args)
    return results, capsys.readouterr()


def test_end_to_end_tiny_run(tiny_args, tmp_path, capsys):
    results, out = run_main(tiny_args, capsys)
    for title in ("A  decode batch sweep", "B  prefill vs decode", "C  static vs continuous"):
        assert title in out.out
    saved = json.loads((tmp_path / "results.json").read_text())
    model = saved["config"]["model"]
    assert (model["layers"], model["hidden"], model["heads"], model["vocab"], model["dtype"]) \
        == (1, 64, 4, 128, "float32")
    assert [(r["context"], r["batch"]) for r in saved["A"]["rows"]] == [(8, 1), (8, 4), (16, 1),
                                                                          (16, 4)]
    assert {r["mode"] for r in saved["A"]["rows"]} == {"eager"}  # CPU: no CUDA graphs
    # one stated attention policy for every experiment, and the kernel each ran
    assert saved["A"]["sdpa_backends"] == saved["B"]["sdpa_backends"] == \
        ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]
    assert saved["A"]["kernels"] == saved["B"]["kernels"] == \
        ["_scaled_dot_product_flash_attention_for_cpu"]
    assert said("attention kernels: _scaled_dot_product_flash_attention_for_cpu", out.out)
    for r in saved["A"]["rows"]:
        assert r["step_ms"] > 0 and r["tokens_per_s"] > 0 and r["p10_ms"] <= r["p90_ms"]
        assert r["bound"] in ("memory", "compute", "overhead")  # (a tiny model: overhead)
        assert r["mbu"] > 0 and r["mfu"] > 0
    phases = [(r["phase"], r["tokens"], r["batch"]) for r in saved["B"]["rows"]]
    assert phases == [("prefill", 16, 1), ("decode", 1, 1), ("decode", 1, 2)]
    for r in saved["B"]["rows"]:
        for key in ("step_ms", "us_per_token", "tflops", "intensity"):
            assert r[key] > 0
    for policy in ("static", "continuous"):
        C = saved["C"][policy]
        assert C["steps"] == len(C["occupied"]) and 0 < C["occupancy"] <= 1
    assert saved["C"]["speedup"] == pytest.approx(saved["C"]["static"]["steps"]
                                                  / saved["C"]["continuous"]["steps"])
    ceilings = saved["environment"]["ceilings"]
    assert ceilings["bandwidth_gbs"] > 0 and ceilings["matmul_tflops"] > 0
    assert saved["B"]["linear_chain"][0]["gbs"] > 0
    for name in ("occupancy.png", "decode_batch.png", "prefill_decode.png", "roofline.png",
                 "decode_context.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert results["C"]["speedup"] == saved["C"]["speedup"]


def test_simulation_alone_touches_no_device(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(nn40.device, "resolve_device", lambda name: pytest.fail("device probed"))
    results, out = run_main(["--experiments", "C", "--out", str(tmp_path), "--no-figures"],
                            capsys)
    assert "A" not in results and "device" not in results["environment"]
    assert not list(tmp_path.glob("*.png"))
    # the post's setting and lengths: 600 requests, 32 slots, its table
    C = results["C"]
    assert C["requests"] == 600 and C["slots"] == 32
    assert (C["static"]["steps"], C["continuous"]["steps"]) == (9602, 2444)
    assert said("9,602", out.out) and said("20.3%", out.out) and said("79.9%", out.out)
    assert said("3.93x", out.out)


def english_phrases(template):
    """The runs of English words in a template's literal text."""
    literals = "".join(literal for literal, *_ in string.Formatter().parse(template))
    return re.findall(r"[A-Za-z][A-Za-z ']{3,}[A-Za-z]", literals)


def between_banner_and_files(printed):
    """What a run printed less the date, the command line, the versions and the files written
    (each maybe wrapped over lines)."""
    lines = printed.strip().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("python ")) + 1
    end = max(i for i, line in enumerate(lines) if line.startswith("저장: "))
    return "\n".join(lines[start:end])


def assert_no_english(printed):
    """No English phrase of any template in what was printed (flag names are names: kept)."""
    printed = re.sub(r"--[a-z-]+", "", printed)
    for key, english in TEXT["en"].items():
        for phrase in english_phrases(english):
            if phrase not in TEXT["ko"][key]:  # (kept as they are: units, acronyms, names)
                assert phrase not in printed, (key, phrase)


def test_every_printed_line_is_korean_under_ko(tiny_args, tmp_path, capsys):
    _, out = run_main(tiny_args + ["--lang", "ko", "--engine-requests", "6", "--max-positions",
                                   "4096", "--slo-ttft-ms", "100", "--experiments", "ABCD"],
                      capsys)
    assert said("정적 배칭", out.out) and said("슬롯 점유율", out.out) and said("속도 향상", out.out)
    # all but the date, the command line, the versions and the files written
    assert_no_english(between_banner_and_files(out.out))
    assert english_phrases("static batching (batch {batch})") == ["static batching", "batch"]


def test_a_named_model_on_a_card_and_the_catalog_in_korean(tmp_path, capsys):
    _, out = run_main(["--lang", "ko", "--experiments", "C", "--model", "llama-3-8b", "--gpu",
                       "rtx-5080", "--requests", "60", "--rates", "5", "--rate", "20",
                       "--no-figures", "--out", str(tmp_path)], capsys)
    assert said("카드: 1 x RTX 5080", out.out) and said("들어가지 않아", out.out)
    assert_no_english(between_banner_and_files(out.out))
    _, out = run_main(["--catalog", "--lang", "ko"], capsys)
    assert said("들어가지 않음", out.out)
    assert_no_english(out.out)


def test_lengths_file_drives_c(tmp_path, capsys):
    path = tmp_path / "lengths.txt"
    path.write_text("5\n1\n1\n1\n")
    results, _ = run_main(["--experiments", "C", "--slots", "2", "--lengths-file", str(path),
                           "--out", str(tmp_path), "--no-figures"], capsys)
    assert results["C"]["static"]["steps"] == 6 and results["C"]["continuous"]["steps"] == 5


def expect_usage_error(args, capsys, *fragments):
    with pytest.raises(SystemExit) as exit_info:
        S.main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    err = "\n".join(line for line in err.splitlines()  # (a search's progress, logged before)
                     if not re.match(r" *\[\d\d:\d\d:\d\d\] C capacity: ", line))
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    for fragment in fragments:
        assert fragment in err
    return err


@pytest.mark.parametrize("args, fragment", [
    (["--experiments", "CX"], "unknown experiment"),
    (["--slots", "0"], "positive integer"),
    (["--requests", "-3"], "positive integer"),
    (["--batch-sizes", "1,two"], "positive integers"),
    (["--batch-sizes", "4,0"], "positive integers"),
    (["--context", "1.5"], "positive integer"),
    (["--lang", "fr"], "--lang"),
    (["--no-such-flag"], "unrecognized"),
])
def test_bad_flags(args, fragment, capsys):
    expect_usage_error(args, capsys, fragment)


def test_bad_lengths_files(tmp_path, capsys):
    missing = tmp_path / "missing.txt"
    expect_usage_error(["--experiments", "C", "--lengths-file", str(missing)], capsys,
                       "missing.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing here\n\n")
    expect_usage_error(["--experiments", "C", "--lengths-file", str(empty)], capsys, "no lengths")
    bad = tmp_path / "bad.txt"
    bad.write_text("12\n7\nseven\n")
    expect_usage_error(["--experiments", "C", "--lengths-file", str(bad)], capsys, "bad.txt:3")
    negative = tmp_path / "negative.txt"
    negative.write_text("12\n-4\n")
    expect_usage_error(["--experiments", "C", "--lengths-file", str(negative)], capsys,
                       "negative.txt:2")


def test_unwritable_output(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    expect_usage_error(["--experiments", "C", "--out", str(blocker / "sub")], capsys,
                       "cannot write")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present here")
def test_cuda_without_cuda(capsys):
    expect_usage_error(["--device", "cuda"], capsys, "no CUDA")


def test_rows_that_do_not_fit_are_marked(tiny_args, tmp_path, capsys, monkeypatch):
    # pretend the device has 64 MiB free: batch 4 at context 8 fits, batch 4096 does not
    monkeypatch.setattr(nn40.device, "free_memory_bytes", lambda device: 64 * 2**20)
    args = tiny_args + ["--experiments", "A", "--batch-sizes", "4,4096", "--context", "4000",
                        "--contexts", "4000", "--max-positions", "4096"]
    results, out = run_main(args, capsys)
    fitted, skipped = results["A"]["rows"]
    assert "step_ms" in fitted and skipped["skipped"]["needed_gib"] > 64 / 1024
    assert said("does not fit", out.out)


def test_model_too_large_for_memory(tiny_args, capsys, monkeypatch):
    monkeypatch.setattr(nn40.device, "free_memory_bytes", lambda device: 2**20)
    expect_usage_error(tiny_args + ["--experiments", "A"], capsys, "weights need")


def test_a_mixture_and_its_dense_twin_must_fit_together(tiny_args, capsys, monkeypatch):
    moe = ["--experiments", "A", "--mlp", "gated", "--experts", "8", "--experts-per-token", "2"]
    run = parse_args(tiny_args + moe)
    alone = weight_bytes(run.hardware.model) \
        + memory_needed_bytes(run.hardware.model, 1, run.measurement.context + 1, 1)
    twin = weight_bytes(dense_twin(run.hardware.model))
    # room for the mixture alone but not for its dense twin beside it: refused before A runs
    monkeypatch.setattr(nn40.device, "free_memory_bytes", lambda device: (alone + twin / 2) / 0.9)
    expect_usage_error(tiny_args + moe, capsys, "its weights and its dense twin's need")


def test_context_past_the_position_table(tiny_args, capsys):
    expect_usage_error(tiny_args + ["--experiments", "A", "--context", "100",
                                    "--max-positions", "64"], capsys, "max-positions")


def test_ctrl_c_prints_finished_tables(tiny_args, tmp_path, capsys, monkeypatch):
    def interrupt(run, req, log, costs, kv):
        raise KeyboardInterrupt
    monkeypatch.setattr(S, "run_batching_sim", interrupt)
    with pytest.raises(SystemExit) as exit_info:
        S.main(tiny_args + ["--experiments", "AC"])
    assert exit_info.value.code == 130
    captured = capsys.readouterr()
    assert "A  decode batch sweep" in captured.out and "interrupted" in captured.err
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["interrupted"] and "A" in saved and "C" not in saved


def test_write_atomic_leaves_no_partial_file(tmp_path):
    target = tmp_path / "results.json"
    target.write_text("old")

    class Boom:
        def __str__(self):
            raise RuntimeError

    with pytest.raises(TypeError):
        write_atomic(str(target), Boom())
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["results.json"]


def test_write_atomic_gives_a_plain_files_mode(tmp_path):
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    write_atomic(str(tmp_path / "atomic.txt"), "x")
    assert (tmp_path / "atomic.txt").stat().st_mode == plain.stat().st_mode


def test_arch_post_runs_a_and_b_on_the_proxy(tiny_args, tmp_path, capsys):
    args = [a for a in tiny_args]
    results, out = run_main(args + ["--arch", "post", "--no-figures"], capsys)
    assert set(results) >= {"A", "B"} and not set(results) & {"C", "D"}
    assert results["config"]["model"]["arch"] == "post"
    assert results["A"]["contexts"] == [8]  # no KV cache: one context is all there is
    assert said("the post's proxy, 1 square 64 x 64 float32 matmuls per token", out.out)
    for row in measured(results["B"]["rows"]):  # FLOPs = 2 L h^2 per token
        tokens = row["tokens"] * row["batch"]
        assert row["flops"] == 2 * 64 * 64 * tokens
        assert row["tflops"] == pytest.approx(row["flops"] / row["step_ms"] * 1e3 / 1e12)


@pytest.mark.parametrize("experiments", ["ABC", "D", "AC"])
def test_arch_post_refuses_c_and_d(experiments, capsys):
    expect_usage_error(["--arch", "post", "--experiments", experiments], capsys,
                       "only A and B run on it")
