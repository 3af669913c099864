"""Speculative decoding's laws and draws (nn40/speculative.py): the acceptance identity on vLLM's
own baselines, the geometric law against them, each request's verify steps drawn from a law."""
import numpy as np
import pytest

from nn40.errors import UsageError
from nn40.speculative import (
    checked_rates, expected_length, extended, geometric_rates, rates_for_length, step_gains,
    verify_steps)


# vLLM's EAGLE-3 regression baselines (tests/v1/spec_decode/test_acceptance_length.py, MT-Bench,
# temperature 0, k = 3): per-position rates and the mean acceptance length it asserts beside them
VLLM_EAGLE3_BASELINES = {
    "llama3-8b-eagle3": ((0.7296, 0.5208, 0.3545), 2.60),
    "qwen3-8b-eagle3": ((0.6541, 0.3993, 0.2020), 2.26),
    "gpt-oss-20b-eagle3": ((0.7165, 0.5120, 0.3337), 2.56),
    "qwen3-30b-moe-vl-eagle3": ((0.2900, 0.0620, 0.0115), 1.35),
}


@pytest.mark.parametrize("name", VLLM_EAGLE3_BASELINES)
def test_the_acceptance_identity_on_vllms_baselines(name):
    # E = 1 + sum of the per-position rates: each baseline's length from its rates, to the
    # two decimals vLLM writes it with (the MoE-VL's, 1.3635 against 1.35, within the 15% its
    # test allows: its length and rates were measured apart)
    rates, length = VLLM_EAGLE3_BASELINES[name]
    assert expected_length(rates) == pytest.approx(length, abs=0.006 if "moe" not in name
                                                   else 0.015)


def test_a_geometric_law_fitted_on_the_first_position_is_off_by():
    # one rate (the first position's) raised to each position overstates the later positions
    # on every baseline: the length by 1.4% (gpt-oss-20b), 1.7% (Llama-3.1-8B), 2.6% (the
    # Qwen3 MoE-VL) and 4.7% (Qwen3-8B, whose acceptance falls fastest after the first)
    off = {name: expected_length(geometric_rates(rates[0], 3)) / expected_length(rates) - 1
           for name, (rates, _) in VLLM_EAGLE3_BASELINES.items()}
    assert off["llama3-8b-eagle3"] == pytest.approx(0.0172, abs=0.002)
    assert off["qwen3-8b-eagle3"] == pytest.approx(0.0472, abs=0.002)
    assert all(v > 0 for v in off.values())


def test_rates_for_a_length_and_back():
    for k, length in ((1, 1.5), (3, 2.6), (5, 3.0), (4, 5.0), (2, 1.0)):
        rates = rates_for_length(length, k)
        assert len(rates) == k and expected_length(rates) == pytest.approx(length, abs=1e-9)
    with pytest.raises(UsageError, match="from 1 to 4 tokens"):
        rates_for_length(4.5, 3)


def test_rates_are_checked_and_extended():
    assert checked_rates([0.7, 0.5]) == (0.7, 0.5)
    with pytest.raises(UsageError, match="never rises"):
        checked_rates([0.5, 0.7])
    with pytest.raises(UsageError, match="share from 0 to 1"):
        checked_rates([1.2])
    assert extended((0.8, 0.4), 4) == pytest.approx((0.8, 0.4, 0.2, 0.1))
    assert extended((0.85,), 3) == pytest.approx((0.85, 0.85 ** 2, 0.85 ** 3))
    assert extended((0.7, 0.5, 0.3), 2) == (0.7, 0.5)


def test_a_verify_step_gains_by_the_law():
    # P(gain = 1 + i) = a_i - a_(i+1): with rates 0.8, 0.5, 0.2 the gains 1..4 come 0.2, 0.3,
    # 0.3, 0.2 of the time, their mean 1 + 1.5
    gains = step_gains(np.random.default_rng(0).random(400_000), (0.8, 0.5, 0.2))
    shares = np.bincount(gains, minlength=5)[1:] / gains.size
    np.testing.assert_allclose(shares, (0.2, 0.3, 0.3, 0.2), atol=0.003)
    assert gains.mean() == pytest.approx(2.5, abs=0.01)


def test_verify_steps_by_hand_and_by_the_renewal_law():
    rng = np.random.default_rng(1)
    tokens = np.array([0, 1, 7, 8, 100])
    # every draft accepted: a step emits 2 (the last what is left); none: one a step
    np.testing.assert_array_equal(verify_steps(tokens, (1.0,), rng), [0, 1, 4, 4, 50])
    np.testing.assert_array_equal(verify_steps(tokens, (0.0, 0.0), rng), tokens)
    # many tokens: steps ~ N / E with the renewal variance N sigma^2 / E^3
    rates, n = (0.7296, 0.5208, 0.3545), 1000
    steps = verify_steps(np.full(20_000, n), rates, rng)
    gains = step_gains(rng.random(1_000_000), rates)
    mean, var = gains.mean(), gains.var()
    assert steps.mean() == pytest.approx(n / mean, rel=0.005)
    assert steps.std() == pytest.approx(np.sqrt(n * var / mean ** 3), rel=0.05)
    # a draw wider than its columns (steps past 32) continues where it stopped
    assert verify_steps(np.array([200]), (0.0,), rng, columns=32).tolist() == [200]


# C with speculative decoding, end to end: the issue's own command

import json  # noqa: E402

import NN_40_serving as S  # noqa: E402
from nn40.cli import parse_args  # noqa: E402

EAGLE3 = ["--experiments", "C", "--model", "llama-3.1-8b", "--gpu", "h100",
          "--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 3}']


def test_c_prints_the_speculating_run_beside_the_plain_one(tmp_path, capsys):
    S.main(EAGLE3 + ["--acceptance-rates", "0.73,0.52,0.35", "--rate", "4", "--no-figures",
                     "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "C  speculative decoding: eagle3" in out and "speculating" in out
    spec = json.loads((tmp_path / "results.json").read_text())["C"]["speculation"]
    assert spec["acceptance_length"] == pytest.approx(2.60)
    # at a light load a verify pass of 4 tokens costs about one of 1 (the weights read once):
    # TPOT falls by about E / (1 + the draft's share of a step), more than 1.5x
    assert spec["speedup"] > 1.5 and spec["speculative"]["tpot_s"]["p50"] < \
        spec["plain"]["tpot_s"]["p50"] / 1.5
    # a stream's chunks: one token each plain (ITL is TPOT), 2.6 a verify step speculating
    plain, fast = spec["plain"], spec["speculative"]
    assert plain["itl_s"]["mean"] == pytest.approx(plain["tpot_s"]["p50"], rel=0.02)
    assert 2.4 < fast["itl_s"]["mean"] / fast["tpot_s"]["p50"] < 2.8
    # the speedup falls with the concurrency (within the draws' noise) and turns below 1 with
    # 3 drafts, where the step is compute-bound and 4 tokens a decoder cost about 4 times one
    # while a step emits 2.6
    rows = spec["concurrency"]
    assert [row["concurrency"] for row in rows][:3] == [1, 2, 4] and rows[-1]["concurrency"] == 600
    speedups = [row["k"][2]["speedup"] for row in rows]
    assert all(b <= a * 1.02 for a, b in zip(speedups, speedups[1:])), speedups
    assert speedups[0] > 1.5 and speedups[-1] < 1.0
    below = spec["crossover"]["below_one"]
    assert [c["found"] for c in below] == [False, True, True]
    # fewer drafts pay less alone and lose less when the batch is full
    first, last = rows[0]["k"], rows[-1]["k"]
    assert first[0]["speedup"] < first[1]["speedup"] < first[2]["speedup"]
    assert last[0]["speedup"] > last[1]["speedup"] > last[2]["speedup"]


def test_each_methods_acceptance_and_draft():
    run = parse_args(EAGLE3)  # (no acceptance given: vLLM's EAGLE-3 baseline)
    assert run.scheduler.acceptance_rates == (0.7296, 0.5208, 0.3545)
    assert run.scheduler.acceptance_law == "eagle3"
    mtp = ["--model", "deepseek-v3", "--gpu", "h200", "--tp", "8", "--speculative-config",
           '{"method": "mtp", "num_speculative_tokens": 2}']
    run = parse_args(EAGLE3[:-4] + mtp)  # (DeepSeek-V3 ships one MTP module)
    assert run.scheduler.acceptance_rates == pytest.approx((0.85, 0.85 ** 2))
    with pytest.raises(UsageError, match="llama-3.1-8b ships none"):  # (Llama has no MTP)
        parse_args(EAGLE3[:-1] + mtp[-1:])
    run = parse_args(EAGLE3[:-1] + ['{"method": "ngram"}', "--acceptance-length", "1.8",
                                    "--num-speculative-tokens", "4"])
    assert run.scheduler.num_speculative_tokens == 4
    assert expected_length(run.scheduler.acceptance_rates) == pytest.approx(1.8)
    run = parse_args(EAGLE3[:-1] + [  # (vLLM's own EAGLE config: its head by name)
        '{"model": "yuhuili/EAGLE-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 3, '
        '"method": "eagle"}', "--acceptance-length", "2.5"])
    assert run.scheduler.speculative_method == "eagle" and \
        run.scheduler.num_speculative_tokens == 3
    run = parse_args(EAGLE3[:-1] + ['{"method": "ngram", "prompt_lookup_max": 4, '
                                    '"prompt_lookup_min": 2}', "--acceptance-rate", "0.4"])
    assert run.scheduler.acceptance_rates == pytest.approx((0.4,))
    run = parse_args(EAGLE3[:-1] + ['{"method": "draft_model", "model": "llama-3.2-1b"}',
                                    "--acceptance-rate", "0.6"])
    assert run.scheduler.speculative_model == "llama-3.2-1b"
    assert run.scheduler.acceptance_rates == pytest.approx((0.6,))


@pytest.mark.parametrize("args, says", [
    (EAGLE3[:-1] + ["{method: eagle3}"], "not JSON"),
    (EAGLE3[:-1] + ['["eagle3"]'], "a JSON object"),
    (EAGLE3[:-1] + ['{"method": "medusa"}'], "method 'medusa' is none of"),
    (EAGLE3[:-1] + ['{"method": "eagle3", "disable_by_batch_size": 4}'],
     "not disable_by_batch_size"),
    (EAGLE3[:-1] + ['{"method": "ngram", "model": "llama-3.2-1b"}'], "leave \"model\" out"),
    (EAGLE3[:-1] + ['{"method": "eagle3"}', "--acceptance-rates", ",".join(["0.5"] * 17)],
     "more drafts a step than"),
    (EAGLE3[:-1] + ['{"method": "eagle", "num_speculative_tokens": 3}', "--pp", "2"],
     "vLLM runs eagle3 alone on pipeline stages, not eagle"),
    (EAGLE3[:-1] + ['{"method": "eagle3", "num_speculative_tokens": 0}'], "from 1 to 16"),
    (EAGLE3[:-1] + ['{"method": "draft_model"}'], "names its draft by \"model\""),
    (EAGLE3[:-1] + ['{"method": "draft_model", "model": "lama-9"}'], "unknown model"),
    (EAGLE3[:-1] + ['{"method": "ngram"}'], "no published acceptance"),
    (EAGLE3 + ["--acceptance-rate", "0.5", "--acceptance-length", "2"], "one way"),
    (EAGLE3 + ["--acceptance-rates", "0.5,0.7,0.2"], "never rises"),
    (EAGLE3 + ["--acceptance-rates", "0.5,0.4"], "2 rate(s) for 3 drafts"),
    (EAGLE3 + ["--acceptance-length", "4.5"], "from 1 to 4 tokens"),
    (EAGLE3 + ["--num-speculative-tokens", "2"], "give one"),
    (["--experiments", "C", "--acceptance-rate", "0.5"], "add --speculative-config"),
    (EAGLE3[:4] + EAGLE3[6:], "give --gpu"),
    (EAGLE3[2:], "give --experiments C"),
])
def test_a_bad_speculation_is_one_line(args, says, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        S.main(args + ["--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert says in err, err


# Published runs, as checks (nothing is fitted on them): vLLM's own batch-1 runs of EAGLE on
# Llama-3-8B-Instruct, one H100, MT-Bench's 80 questions with max_num_seqs 1 (offline, so a
# request's prefill counts in its time), from vllm-project/vllm#16035 (2025-04-09, the V1
# EAGLE proposer, drafter lmsys/sglang-EAGLE-LLaMA3-Instruct-8B): plain 128.64 output tokens/s;
# k = 2: 175.49 tokens/s at an acceptance length of 1.89; k = 4: 165.65 at 2.08.
VLLM_EAGLE_BATCH_1 = [("llama-3-8b", "eagle", k, length, measured)
                      for k, length, measured in [(2, 1.89, 175.49 / 128.64),
                                                  (4, 2.08, 165.65 / 128.64)]]
# The same author's later runs (vllm-project/vllm#20780, July 2025): Llama-3.1-8B-Instruct at
# batch 1 on MT-Bench with yuhuili's EAGLE and EAGLE-3 heads for K = 2..7, the acceptance length
# and TPOT of each beside plain decoding's 7.07 ms (the card is not named; 7.07 ms reads the
# 16 GB of weights at 2.3 TB/s, an H100 SXM's class, as the author's #16937 runs on an H100).
VLLM_EAGLE_JULY_2025 = {"eagle": [(2, 2.10, 4.37), (3, 2.29, 4.29), (4, 2.39, 4.48),
                                  (5, 2.43, 4.71), (6, 2.45, 4.94), (7, 2.47, 5.20)],
                        "eagle3": [(2, 2.36, 4.32), (3, 2.79, 4.09), (4, 3.08, 4.05),
                                   (5, 3.32, 4.13), (6, 3.46, 4.20), (7, 3.54, 4.29)]}
# C prices each draft pass with the engine's whole fixed cost a step (1.05 ms under the vllm
# profile), as the April runs paid it; by July vLLM drafted EAGLE-1 at about 0.73 ms a pass in
# all (its step grows 0.73 ms a draft), so C is 11-22% slow on EAGLE-1 from K = 3 (EAGLE-3's
# passes, at about 1.0 ms, stay within 10%): those rows are expected to fail, strictly
FASTER_DRAFTING = "vLLM of July 2025 drafts EAGLE-1 faster than a pass priced with its step cost"
VLLM_EAGLE_BATCH_1 += [
    pytest.param("llama-3.1-8b", method, k, length, 7.07 / tpot, marks=[pytest.mark.xfail(
        strict=True, reason=FASTER_DRAFTING)] if method == "eagle" and k >= 3 else [])
    for method, rows in VLLM_EAGLE_JULY_2025.items() for k, length, tpot in rows]


@pytest.mark.parametrize("model, method, k, length, measured", VLLM_EAGLE_BATCH_1)
def test_vllms_batch_1_eagle_runs(model, method, k, length, measured):
    from nn40.config import GPUS
    from nn40.loop import simulate_serving
    from nn40.metrics import serving_metrics
    from nn40.pricing import ENGINE_PROFILES, card_costs
    from nn40.speculative_study import run_speculation, speculating
    from nn40.workload import Requests
    run = parse_args(["--experiments", "C", "--model", model, "--gpu", "h100",
                      "--engine-profile", "vllm", "--speculative-config",
                      f'{{"method": "{method}", "num_speculative_tokens": {k}}}',
                      "--acceptance-length", str(length)])
    profile = ENGINE_PROFILES["vllm"]
    plain = profile.replica(card_costs(run.hardware.model, GPUS["h100"], profile), slots=1)
    # MT-Bench's first turns (about 100 prompt tokens with the chat template) answered in up
    # to 256 tokens (the example's max_tokens), one request at a time
    req = Requests(np.zeros(80), np.full(80, 100), np.full(80, 256))
    tokens_s = [serving_metrics(req, simulate_serving(req, r))["output_tokens_per_s"]
                for r in (plain, speculating(plain, *run_speculation(run)))]
    # (#16035: C 1.37x and 1.19x; a draft pass priced without the engine's fixed cost a pass,
    # 1.66x and 1.63x: 22% and 26% fast. #20780: EAGLE-3 C +1 to +9%; EAGLE-1 -6% at K = 2,
    # -11 to -22% from K = 3)
    assert tokens_s[1] / tokens_s[0] == pytest.approx(measured, rel=0.10)


# SpecDecode-Bench (arXiv 2601.11580: vLLM 0.10.1, one H100, Llama-3.1-8B-Instruct, chain
# drafting of k = 3, every default optimisation on; the speedup is throughput with speculation
# over throughput without, at a batch of that many requests) says in its text: "for EAGLE on
# ShareGPT, going from batch 1 to 32 reduces speedup by 4.3% on the 8B model", and "by batch
# size 128, this drops to 1.21x for Llama-3.1-8B on GSM8K". The acceptance is its own published
# data (SpecDecode-Bench/simulator @2fdccbd, data/llama3.1-8B/combined_{sharegpt,gsm8k}.jsonl:
# each generated position's acc_len, the tokens a step from there would emit, bonus included):
# a 3-draft chain walked over them accepts by position 0.6215, 0.3811, 0.2516 on ShareGPT (310
# requests, 355 prompt and 728 generated tokens on average) and 0.6749, 0.4366, 0.2793 on GSM8K
# (300; 94 and 166). C says 0.963 of batch 1's speedup at 32 on ShareGPT (0.957 measured), but
# 0.98x at 128 on GSM8K against 1.21x: its verify pass of 512 tokens is compute-bound at the
# profile's matmul share, which the engine beat; that row is expected to fail, strictly.
SPECDECODE_BENCH = {"sharegpt": ((0.6215, 0.3811, 0.2516), 355, 728),
                    "gsm8k": ((0.6749, 0.4366, 0.2793), 94, 166)}


def specdecode_bench_speedup(dataset, batch):
    """C's throughput speedup of EAGLE (k = 3) on Llama-3.1-8B on an H100 under the vllm
    profile (speculation_methods.replicas), `batch` requests in flight (4 x batch, at least 40,
    all waiting at t=0) of the dataset's mean lengths."""
    import speculation_methods as M
    from nn40.loop import simulate_serving
    from nn40.metrics import serving_metrics
    rates, prompt, output = SPECDECODE_BENCH[dataset]
    req = M.waiting(max(4 * batch, 40), prompt, output)
    plain, fast = (serving_metrics(req, simulate_serving(req, r))["output_tokens_per_s"]
                   for r in M.replicas("eagle", rates, batch))
    return fast / plain


def test_specdecode_benchs_fall_from_batch_1_to_32():
    fall = specdecode_bench_speedup("sharegpt", 32) / specdecode_bench_speedup("sharegpt", 1)
    assert 1 - fall == pytest.approx(0.043, rel=0.3)  # (C: a fall of 3.7%)


@pytest.mark.xfail(strict=True, reason="C's verify pass of 512 tokens is dearer than vLLM's")
def test_specdecode_benchs_speedup_at_batch_128():
    assert specdecode_bench_speedup("gsm8k", 128) == pytest.approx(1.21, rel=0.15)


# The same figure read point by point (SpecDecode-Bench/specdecode-bench.github.io @fb0e242,
# assets/img/fig1.pdf, Figure 1 of arXiv 2601.11580: its values are vector paths, read against
# the gridlines to about 0.01; they agree with the text's 1.96x and 1.21x): EAGLE on
# Llama-3.1-8B at batch 1, 16, 64 and 128. C's level is 12-19% under the figure's at every
# batch (its draft passes are priced at the engine's whole fixed cost a pass, as vLLM's April
# 2025 runs paid it; vLLM 0.10.1 drafts faster, as the July 2025 rows above show), so the curve
# is checked by its shape: the speedup at each batch over the speedup at batch 1, within 15%
# (C: within 10% on both datasets).
SPECDECODE_BENCH_FIGURE = {"sharegpt": (1.68, 1.67, 1.54, 1.29),
                           "gsm8k": (1.73, 1.68, 1.47, 1.21)}


@pytest.mark.parametrize("dataset", SPECDECODE_BENCH_FIGURE)
@pytest.mark.parametrize("batch", [16, 64, 128])
def test_specdecode_benchs_curve_keeps_its_shape(dataset, batch):
    figure = dict(zip((1, 16, 64, 128), SPECDECODE_BENCH_FIGURE[dataset]))
    C = specdecode_bench_speedup(dataset, batch) / specdecode_bench_speedup(dataset, 1)
    assert C == pytest.approx(figure[batch] / figure[1], rel=0.15)


# The EAGLE-3 paper's SGLang table (arXiv 2503.01840 v3, Table 3, "conducted by the SGLang
# team"): SGLang v0.4.4 on one H100, Llama-3.1-8B-Instruct on MT-Bench, EAGLE-3 drafting a chain
# of 3, its throughput over SGLang's without speculation at each batch size. Its acceptance is
# not given; the same heads' on the same questions at K = 3 is (vLLM #20780 above: 2.79 tokens a
# step). MT-Bench's 80 questions of two turns each (benchmark/mtbench/bench_sglang_eagle.py:
# --parallel conversations at once): 160 requests of 100 prompt and 256 generated tokens, as the
# batch-1 rows above (C moves by a point or two at 600 and 600). SGLang caps a drafting server
# at 48 running requests (SGLangRules.DRAFTING_RUNNING), which C keeps: at 56 and 64 C gives
# 1.36x against 1.34x and 1.38x. From 16 to 48 SGLang's speedup falls faster than C's (1.48x to
# 1.32x against C's 1.83x to 1.75x): SGLang turns its overlap scheduler off when it speculates
# (srt/server_args.py turns it off for the EAGLE family: "Overlap scheduler is disabled because
# of using eagle speculative decoding"; its docs call the overlapped version, spec v2,
# experimental), so the host's work each step, which the plain server hides behind the GPU's,
# adds to every verify step, more as the batch grows.
# C prices no host work a step that an overlap scheduler hides: those rows fail, strictly.
EAGLE3_SGLANG_TABLE = {2: 1.81, 4: 1.82, 8: 1.62, 16: 1.48, 24: 1.39, 32: 1.32, 48: 1.38,
                       56: 1.34, 64: 1.38}
NO_OVERLAP = "SGLang speculates without its overlap scheduler; C prices no host time a step"


@pytest.mark.parametrize("batch", [pytest.param(b, marks=pytest.mark.xfail(
    strict=True, reason=NO_OVERLAP)) if 16 <= b <= 48 else b for b in EAGLE3_SGLANG_TABLE])
def test_the_eagle3_papers_sglang_speedup_by_batch(batch):
    from nn40.config import GPUS
    from nn40.kv import KVBudget
    from nn40.loop import simulate_serving
    from nn40.metrics import serving_metrics
    from nn40.pricing import ENGINE_PROFILES, SGLangRules, card_costs, card_kv_tokens
    from nn40.speculative_study import run_speculation, speculating
    from nn40.workload import Requests
    run = parse_args(["--experiments", "C", "--model", "llama-3.1-8b", "--gpu", "h100",
                      "--engine-profile", "sglang", "--speculative-config",
                      '{"method": "eagle3", "num_speculative_tokens": 3}',
                      "--acceptance-length", "2.79"])
    cfg, card, profile = run.hardware.model, GPUS["h100"], ENGINE_PROFILES["sglang"]
    kv = KVBudget("paged", card_kv_tokens(cfg, card, profile), 16)
    plain, drafting = (profile.replica(card_costs(cfg, card, profile), slots=slots,
                                       chunk_tokens=8192, kv=kv)
                       for slots in (batch, min(batch, SGLangRules.DRAFTING_RUNNING)))
    req = Requests(np.zeros(160), np.full(160, 100), np.full(160, 256))
    plain_s, fast_s = (serving_metrics(req, simulate_serving(req, r))["output_tokens_per_s"]
                       for r in (plain, speculating(drafting, *run_speculation(run))))
    assert fast_s / plain_s == pytest.approx(EAGLE3_SGLANG_TABLE[batch], rel=0.15)


def test_the_capacity_answer_speculates_where_plain_decoding_cannot(tmp_path, capsys):
    # a TPOT bound of 8 ms: one plain decode step of Llama-3.1-8B on an H100 takes about 8.7 ms,
    # so no rate meets it without speculation (C alone refuses), and EAGLE-3 meets it
    tight = ["--engine-profile", "vllm", "--slo-ttft-ms", "500", "--slo-tpot-ms", "8",
             "--target-rate", "40", "--no-figures", "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as e:
        S.main(EAGLE3[:4] + ["--gpu", "h100"] + tight)
    assert e.value.code == 2 and "no arrival rate meets the SLO" in capsys.readouterr().err
    S.main(EAGLE3 + tight)
    out = capsys.readouterr().out
    cap = json.loads((tmp_path / "results.json").read_text())["C"]["capacity"]
    assert cap["plain_misses"] and cap["speculating"] == {"method": "eagle3", "k": 3}
    assert cap["one_replica"]["rate_rps"] > 40 and cap["answer"]["replicas"] == 1
    assert "without speculation no arrival rate meets the SLO" in out


def test_a_decode_pool_speculates(tmp_path, capsys):
    # the decode pool (and the colocated replicas beside it) speculate, the prefill pool not:
    # TPOT falls in both, TTFT out of the prefill pool hardly moves
    pools = ["--experiments", "C", "--model", "llama-3.1-8b", "--gpu", "h100",
             "--prefill-replicas", "1", "--decode-replicas", "1", "--rate", "4", "--requests",
             "200", "--no-figures"]
    got = {}
    for name, extra in (("plain", []), ("eagle3", EAGLE3[-2:])):
        S.main(pools + extra + ["--out", str(tmp_path / name)])
        got[name] = json.loads((tmp_path / name / "results.json").read_text())["C"]["placement"]
    capsys.readouterr()
    for kind in ("disaggregated", "colocated"):
        plain, spec = got["plain"][kind]["tpot_s"]["p50"], got["eagle3"][kind]["tpot_s"]["p50"]
        assert spec < plain / 1.4, (kind, plain, spec)
    ttft = [got[name]["disaggregated"]["ttft_s"]["p50"] for name in ("plain", "eagle3")]
    assert ttft[1] == pytest.approx(ttft[0], rel=0.1)


@pytest.mark.parametrize("policy, block", [("prefix", 16), ("radix", 1)])
def test_a_prefix_cache_keeps_speculating_decoders_books(policy, block):
    # speculating decoders in a prefix cache (their blocks' account fluid, the cache's free
    # queue in whole blocks): every token generated, under preemption too, and once all have
    # left the memory is all back, every block in the free queue
    from nn40.kv import KVBudget
    from nn40.loop import ServingSim
    from nn40.pricing import StepCosts
    from nn40.replicas import Replica
    from nn40.speculative import Speculation, SpeculativeCosts
    from nn40.workload import PrefixWorkload, Requests, arrival_times, shared_prompts
    costs, preempted = StepCosts((1, 16, 256), (0.01, 0.012, 0.03), 1e-6, "made up"), 0
    for seed in range(10):
        rng = np.random.default_rng(seed)
        base = Requests(arrival_times(120, 50.0, 1.0, rng), rng.integers(5, 60, 120),
                        rng.integers(1, 80, 120))
        req = shared_prompts(base, PrefixWorkload(64, 3, 0.8, 1.0, 2, 0.0), rng)
        kv = KVBudget(policy, 600, block, 0, 0.0)
        spec = Speculation("eagle3", 3, (0.73, 0.52, 0.35), "given", 6, seed=seed)
        sim = ServingSim(req, Replica(int(rng.integers(2, 9)), SpeculativeCosts(costs, None, 3),
                                      "chunked", 64, kv, speculation=spec))
        result = sim.serve()
        np.testing.assert_array_equal(result["generated"], req.output)
        assert sim.kv.total == 0 and sim.kv.fluid_rate == 0 and sim.kv.pending == 0
        assert sim.kv.free.blocks() == 600 // block
        preempted += result["kv"]["preemptions"]
    assert preempted > 50


def test_a_drafts_weights_and_kv_by_hand():
    # what each draft keeps on an H100 beside Llama-3.1-8B (bf16; h 4096, K/V 1024 wide, MLP
    # 14336): EAGLE's head one layer and its fc (2h -> h), the target's embedding and LM head
    # shared; EAGLE-3's one layer whose q, K, V also read the embedding (2h wide), its fc (3h ->
    # h) and its own LM head over 32,000 draft tokens; both one layer of K and V a token
    from nn40.config import MODELS
    from nn40.speculative import draft_config, draft_memory
    cfg, h = MODELS["llama-3.1-8b"], 4096
    layer = 2 * h * h + 2 * h * 1024 + 3 * h * 14336 + 2 * h  # (and its two norms)
    eagle = draft_memory("eagle", draft_config("eagle", cfg))
    assert eagle.weight_bytes == 2 * (layer + h + 2 * h * h)  # (+ the final norm, the fc)
    eagle3 = draft_memory("eagle3", draft_config("eagle3", cfg))
    assert eagle3.weight_bytes == 2 * (layer + h + 3 * h * h + h * (h + 2048) + 32000 * h)
    assert eagle.kv_bytes_per_token == eagle3.kv_bytes_per_token == 2 * 1024 * 2
    # a draft model keeps all of itself: Llama-3.2-1B's 2.47 GB and 16 layers of K and V
    small = draft_memory("draft_model", draft_config("draft_model", cfg, "llama-3.2-1b"))
    assert small.weight_bytes == pytest.approx(2.4716e9, rel=1e-4)
    assert small.kv_bytes_per_token == 16 * 2 * 512 * 2
    assert draft_memory("ngram", draft_config("ngram", cfg)) == (0.0, 0.0, "ngram")
    # at TP 2 each card holds half of a head's matmuls, all of its norms
    half = draft_memory("eagle", draft_config("eagle", cfg), tp=2)
    assert half.weight_bytes == pytest.approx(eagle.weight_bytes / 2, rel=1e-3)


@pytest.mark.parametrize("profile", ["vllm", "tensorrt-llm"])
def test_the_draft_takes_its_share_of_the_kv_cache(profile):
    # vLLM's one cache: the draft's weights come off what the engine leaves the cache (vLLM
    # subtracts them as it does the target's; the fraction rule takes its fraction of what is
    # left) and each cached token holds the draft's K and V beside the target's
    from nn40.config import GPUS, MODELS
    from nn40.pricing import ENGINE_PROFILES, DraftMemory, card_kv_terms
    cfg, card, rules = MODELS["llama-3.1-8b"], GPUS["h100"], ENGINE_PROFILES[profile]
    plain = card_kv_terms(cfg, card, rules)
    heavy = card_kv_terms(cfg, card, rules, draft=DraftMemory(2e9, 0.0))
    share = rules.kv_fraction if rules.rules == "fraction" else 1.0
    assert plain["kv"] - heavy["kv"] == pytest.approx(2e9 * share)
    assert heavy["weights"] == plain["weights"] and heavy["draft_weights"] == 2e9
    wide = card_kv_terms(cfg, card, rules, draft=DraftMemory(0.0, 131072.0))  # (as much again)
    assert wide["tokens"] == plain["kv"] // (2 * 131072) // 16 * 16 if profile != \
        "tensorrt-llm" else wide["tokens"] == int(plain["kv"] // (2 * 131072))


def test_sglang_reserves_the_draft_memory_apart():
    # SGLang on an H100 (81,559 MiB): mem_fraction_static (81,559 - 13,440) / 81,559 = 0.835,
    # 2,048 MiB more reserved for an EAGLE-type head (0.810), 6,144 for a draft model (0.760),
    # none for an n-gram lookup; the draft's weights and its pool of as many tokens live in that
    # reserve, so the target's cache is sized by its own bytes a token; and it runs 48 requests
    from nn40.config import GPUS, MODELS
    from nn40.pricing import CUDA_CONTEXT_GIB, ENGINE_PROFILES, ENGINE_RULES, DraftMemory, \
        card_kv_terms
    cfg, card, profile = MODELS["llama-3.1-8b"], GPUS["h100"], ENGINE_PROFILES["sglang"]
    for method, fraction in ((None, 0.835), ("ngram", 0.835), ("eagle3", 0.81),
                             ("draft_model", 0.76)):
        terms = card_kv_terms(cfg, card, profile, draft=DraftMemory(2e9, 65536.0, method))
        kv = fraction * (card.memory_bytes - CUDA_CONTEXT_GIB * 2**30) - terms["weights"]
        assert terms["fraction"] == fraction and "draft_weights" not in terms
        assert terms["tokens"] == kv // 131072 // 16 * 16
        running = ENGINE_RULES["sglang"].defaults(profile, cfg, card, 1, 1, method)[0]
        assert (running == 48) == (method in ("eagle3", "draft_model"))


def test_the_speculating_replica_keeps_the_cache_its_draft_leaves(tmp_path):
    # C's run: the plain replica's cache against the speculating one's, a draft model taking a
    # quarter of it (Llama-3.2-1B's KV is a quarter of Llama-3.1-8B's a token, and its 2.5 GB)
    S.main(EAGLE3[:-1] + ['{"method": "draft_model", "model": "llama-3.2-1b", '
                          '"num_speculative_tokens": 2}', "--acceptance-length", "2",
                          "--requests", "60", "--no-figures", "--out", str(tmp_path)])
    memory = json.loads((tmp_path / "results.json").read_text())["C"]["speculation"]["memory"]
    plain, spec = memory["kv_tokens"]
    assert 0.74 < spec / plain < 0.78
    # an n-gram lookup keeps nothing on the card; --kv-tokens sets the cache whatever the draft
    for flags in (['{"method": "ngram"}', "--acceptance-length", "1.5"],
                  ['{"method": "eagle3"}', "--kv-tokens", "50000"]):
        S.main(EAGLE3[:-1] + flags + ["--requests", "60", "--no-figures", "--out",
                                      str(tmp_path / flags[0][12:17])])
        memory = json.loads((tmp_path / flags[0][12:17] / "results.json").read_text())
        plain, spec = memory["C"]["speculation"]["memory"]["kv_tokens"]
        assert plain == spec


def test_a_draft_that_leaves_no_cache_is_one_line(tmp_path, capsys):
    # Llama-3.1-8B drafting for itself on a 24 GB card: 2 x 16 GB of weights
    with pytest.raises(SystemExit) as e:
        S.main(["--experiments", "C", "--model", "llama-3.1-8b", "--gpu", "rtx-4090",
                "--speculative-config", '{"method": "draft_model", "model": "llama-3.1-8b"}',
                "--acceptance-length", "2", "--out", str(tmp_path)])
    assert e.value.code != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no KV cache fits on RTX 4090" in err[0], err


def test_mtp_needs_the_models_own_module(tmp_path):
    # a config.json's num_nextn_predict_layers says whether the model ships MTP modules
    shape = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 1024,
             "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 32000,
             "max_position_embeddings": 4096, "intermediate_size": 2816}
    for layers in (1, 0):
        path = tmp_path / f"m{layers}" / "config.json"
        path.parent.mkdir()
        path.write_text(json.dumps({**shape, "num_nextn_predict_layers": layers}))
        argv = ["--experiments", "C", "--model-config", str(path), "--gpu", "h100",
                "--speculative-config", '{"method": "mtp"}']
        if layers:
            assert parse_args(argv).hardware.model.mtp_layers == 1
        else:
            with pytest.raises(UsageError, match="ships none"):
                parse_args(argv)


def test_itl_is_the_gap_between_chunks_by_hand():
    # an answer of 5 tokens, every pass 1 s: plain, its first token at 1 s then one a step, 4
    # gaps of 1 s; speculating one draft always accepted (an n-gram lookup: no draft pass), its
    # 4 tokens in 2 verify steps of 2: the stream's 2 gaps are 1 s each, TPOT 0.5 s
    from nn40.loop import simulate_serving
    from nn40.metrics import itl_mean_s
    from nn40.pricing import StepCosts
    from nn40.replicas import Replica
    from nn40.speculative import Speculation, SpeculativeCosts
    from nn40.workload import Requests
    req, costs = Requests(np.zeros(1), np.array([4]), np.array([5])), \
        StepCosts((1, 2), (1.0, 1.0), 0.0, "every pass 1 s")
    plain = simulate_serving(req, Replica(1, costs))
    assert "chunks" not in plain and itl_mean_s(plain) == 1.0
    spec = Speculation("ngram", 1, (1.0,), "given", 1, seed=0)
    fast = simulate_serving(req, Replica(1, SpeculativeCosts(costs, None, 1), speculation=spec))
    assert fast["chunks"].tolist() == [2] and fast["times"].finish.tolist() == [3.0]
    assert itl_mean_s(fast) == 1.0 and fast["times"].tpot().tolist() == [0.5]


def test_a_run_of_one_token_answers_has_nothing_to_speculate(tmp_path, capsys):
    # every answer's one token comes out of its prefill: no decode, no speedup to print or draw
    lengths = tmp_path / "ones.txt"
    lengths.write_text("1\n" * 20)
    S.main(EAGLE3 + ["--lengths-file", str(lengths), "--out", str(tmp_path / "out")])
    assert "nothing to speculate" in capsys.readouterr().out
    spec = json.loads((tmp_path / "out" / "results.json").read_text())["C"]["speculation"]
    assert spec["speedup"] is None


@pytest.mark.parametrize("profile, scale", [("vllm", 1 + 4096 / 131072), ("sglang", 1.0)])
def test_a_host_tier_carries_the_drafts_kv_where_the_cache_does(profile, scale):
    # vLLM's offloading copies every layer's blocks, the EAGLE-3 head's K and V (4,096 bytes a
    # token) beside Llama-3.1-8B's (131,072): the host tier holds 1/scale as many tokens and
    # loads each scale times slower; SGLang's draft pool is its own, the host tier the target's
    from nn40.kv import KVBudget
    from nn40.replicas import Replica
    from nn40.speculative_study import run_speculation, speculating
    run = parse_args(EAGLE3 + ["--engine-profile", profile])
    spec, draft, cache = run_speculation(run)
    assert cache.scale == pytest.approx(scale)
    plain = Replica(8, None, kv=KVBudget("prefix", 10**6, 16, host_tokens=64_000,
                                         host_token_s=1e-6))
    kv = speculating(plain, spec, draft, cache).kv
    assert kv.capacity_tokens == cache.tokens < 10**6
    assert kv.host_tokens == int(64_000 / scale) and kv.host_token_s == pytest.approx(1e-6 * scale)


def test_speculating_pools_are_checked_and_searched_at_pp_1_but_eagle3():
    # a decode pool on another card whose draft leaves it no cache: one line before anything
    # runs; the cheapest-placement search tries speculating pools at PP 1 alone but for
    # EAGLE-3, which vLLM runs on pipeline stages (C refuses --pp with the others), its
    # prefill pool at PP 2 still
    from nn40.cheapest import role_shapes
    from nn40.workload import Requests
    pools = ["--prefill-replicas", "1", "--decode-replicas", "1"]
    with pytest.raises(UsageError, match="no KV cache fits on RTX 4090"):
        parse_args(EAGLE3[:-1] + ['{"method": "draft_model", "model": "llama-3.1-8b"}',
                                  "--acceptance-length", "2", "--decode-gpu", "rtx-4090"] + pools)
    req = Requests(np.zeros(20), np.full(20, 512), np.full(20, 256))
    for method, stages in (("eagle", {1}), ("eagle3", {1, 2})):
        run = parse_args(["--experiments", "C", "--model", "llama-3.1-70b", "--gpu", "h100",
                          "--tp", "2", "--speculative-config", f'{{"method": "{method}"}}',
                          "--acceptance-length", "2"] + pools)
        assert {pp for _, pp in role_shapes(run, req, "decode", "h100")} == stages
        assert 2 in {pp for _, pp in role_shapes(run, req, "prefill", "h100")}


def test_a_verify_step_on_pipeline_stages_by_hand():
    # 2 stages of 0.5 s + 0.1 s a query token (no hops), 3 drafts a step (4 query tokens a
    # decoder), a draft pass 0.2 s + 0.01 s a row. 3 decoders: micro-batches of 2 and 1
    # decoders, whole; the heaviest runs 8 query tokens, 0.5 + 0.8 = 1.3 s a cycle; the last
    # stage drafts for each micro-batch in turn: 2 x 3 passes of 2 rows, 6 x 0.22 = 1.32 s.
    # One decoder alone: its 4 tokens whole in one micro-batch (not 2 and 2), 0.5 + 0.4, and
    # one micro-batch to draft for
    from nn40.speculative import SpeculativeCosts
    from nn40.stages import PipelineCosts
    from nn40.pricing import StepCosts
    inner = StepCosts((1, 2), (0.6, 0.7), 0.0, "0.5 s + 0.1 s a token")
    draft = StepCosts((1, 2), (0.21, 0.22), 0.0, "0.2 s + 0.01 s a row")
    verify = PipelineCosts(inner, 2, row_tokens=4)
    assert verify.micro_batch(12, 1200) == (8, 800)
    costs = SpeculativeCosts(verify, draft, 3)
    assert costs.run_price((), 12, 0, 1)[1] == pytest.approx(1.3 + 1.32)
    assert costs.run_price((), 4, 0, 1)[1] == pytest.approx(0.9 + 3 * 0.21)  # (one drafts)
    assert PipelineCosts(inner, 2).micro_batch(4, 0)[0] == 2  # (the rule seeded: 2 and 2)


def test_eagle3_runs_on_pipeline_stages_end_to_end(tmp_path, capsys):
    # C's main run with --pp 2 speculates with EAGLE-3; its verify keeps each decoder's
    # tokens whole in a micro-batch (speculating sets the stages' row_tokens)
    from nn40.experiment_c import c_replicas
    from nn40.runs import run_step_costs
    from nn40.speculative_study import run_speculation, speculating
    from nn40.workload import Requests
    run = parse_args(EAGLE3 + ["--model", "llama-3.1-70b", "--tp", "4", "--pp", "2",
                               "--acceptance-length", "2.6"])
    serve, _ = c_replicas(run, Requests(np.zeros(1), np.ones(1, int), np.ones(1, int)),
                          run_step_costs(run.hardware, {}))
    spec = speculating(serve, *run_speculation(run))
    assert spec.costs.verify.row_tokens == 4 and spec.costs.verify.pp == 2
    S.main(EAGLE3 + ["--model", "llama-3.1-70b", "--tp", "4", "--pp", "2",
                     "--acceptance-length", "2.6", "--rate", "4", "--no-figures",
                     "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "speedup at this load" in out and "as 2 pipeline stages" in out


def test_speculation_by_method():
    # tests/speculation_methods.py: at one request in flight an n-gram lookup (no draft pass)
    # speeds up by about its acceptance length (1 + 0.1602 + 0.1283 + 0.1065 = 1.395), the
    # EAGLE heads by less than theirs (their three passes); every method falls with the load
    import speculation_methods as M
    rows = [M.speedups(method, rates) for _, method, rates in M.METHODS]
    eagle3, eagle, ngram = rows
    assert ngram[0] == pytest.approx(1.395, rel=0.02)
    assert eagle3[0] > eagle[0] > ngram[0] > 1 and eagle3[0] < 2.60 and eagle[0] < 2.25
    assert all(r[-1] < r[0] for r in rows)


@pytest.mark.parametrize("profile, scale", [("vllm", 1 + 4096 / 131072), ("sglang", 1.0)])
def test_kv_memory_gb_is_shared_with_the_draft_where_the_engine_shares_it(profile, scale):
    # --kv-memory-gb 10 for the cache: vLLM's holds the EAGLE-3 head's K and V in it too (each
    # token 4,096 bytes more than Llama-3.1-8B's 131,072), SGLang's keeps the draft's apart
    from nn40.speculative_study import run_speculation
    run = parse_args(EAGLE3 + ["--engine-profile", profile, "--kv-memory-gb", "10"])
    assert run_speculation(run)[2].tokens == int(10e9 / scale // 131072)


@pytest.mark.parametrize("policy, block", [("paged", 16), ("prefix", 16), ("radix", 1)])
def test_a_speculating_decode_pool_stays_within_its_cache(policy, block, monkeypatch):
    # a request handed to a speculating decode pool is admitted for a decode step at once, no
    # step between to preempt for it: its admission must cover that step's growth (up to
    # k + 1 tokens in the fluid account), or the cache allocates past its capacity (and a
    # prefix cache takes more blocks than its free queue has)
    from nn40 import kv as K
    from nn40.kv import KVBudget
    from nn40.pools import Pool, simulate_pools
    from nn40.pricing import StepCosts
    from nn40.replicas import Replica
    from nn40.speculative import Speculation, SpeculativeCosts
    from nn40.workload import PrefixWorkload, Requests, arrival_times, shared_prompts
    over = []

    def checked(advance):
        def run(self, *args):
            integral = advance(self, *args)
            if self.total > self.capacity + 1e-9:
                over.append((self.total, self.capacity))
            return integral
        return run

    def take(self, blocks, _take=K.PrefixCache.take):
        if blocks > 0 and self.preempts and self.free.blocks() < blocks:
            over.append((blocks, self.free.blocks()))
        return _take(self, blocks)
    monkeypatch.setattr(K.PagedBlocks, "advance", checked(K.PagedBlocks.advance))
    monkeypatch.setattr(K.PrefixCache, "advance", checked(K.PrefixCache.advance))
    monkeypatch.setattr(K.PrefixCache, "take", take)
    costs, waited = StepCosts((1, 16, 256), (0.01, 0.012, 0.03), 1e-6, "made up"), 0
    for seed in range(8):
        rng = np.random.default_rng(seed)
        req = Requests(arrival_times(150, 50.0, 1.0, rng), rng.integers(5, 60, 150),
                       rng.integers(2, 80, 150))
        if policy != "paged":
            req = shared_prompts(req, PrefixWorkload(64, 3, 0.8, 1.0, 2, 0.0), rng)
        spec = Speculation("eagle3", 3, (0.73, 0.52, 0.35), "given", 6, seed=seed)
        prefill = Replica(4, costs, "chunked", 64, KVBudget(policy, 4000, block, 0, 0.0))
        decode = Replica(int(rng.integers(4, 16)), SpeculativeCosts(costs, None, 3), "chunked",
                         64, KVBudget(policy, 400, block, 0, 0.0), speculation=spec)
        result = simulate_pools(req, [Pool("prefill", prefill), Pool("decode", decode)],
                                path=["prefill", "decode"])
        np.testing.assert_array_equal(result["generated"], req.output)
        waited += result["hand_off"]["waited"]
    assert not over, over[:3]
    assert waited > 100  # (the decode pool's cache is what the hand-offs wait for)


def test_a_speculating_request_alone_by_hand():
    # EAGLE-3 at k = 3 holds 6 tokens beyond its own (3 drafts, 3 lookahead), 16-token blocks:
    # vLLM's blocks at its longest (written prompt + output - 1 and the slots) or the fluid
    # account's (its prompt's blocks with the slots, then output - 1 tokens; handed to a decode
    # pool, at least k + 1, as its first step, a verify step, may take), whichever is more
    from nn40.kv import KVBudget, kv_manager
    from nn40.speculative import Speculation
    spec = Speculation("eagle3", 3, (0.73, 0.52, 0.35), "given", 6)
    kv = kv_manager(KVBudget("paged", 10_000, 16)).for_speculation(spec)
    handed = kv_manager(KVBudget("paged", 10_000, 16)).for_speculation(spec, handed=True)
    prompt, output = np.array([20, 20, 26, 26, 20]), np.array([10, 2, 2, 7, 1])
    # vLLM's: 20 + 9 + 6 = 35 -> 48 | 20 + 1 + 6 = 27 -> 32 | 26 + 1 + 6 -> 48 | 26 + 6 + 6 -> 48
    # the fluid account's: 20 + 6 -> 32, + 9 = 41 | 32 + 1 = 33 (handed: + 4 = 36) | 32 + 1 |
    # 32 + 6; a request that never decodes: its prompt's last chunk with the slots, 26 -> 32
    np.testing.assert_array_equal(kv.alone(prompt, output), [48, 33, 48, 48, 32])
    np.testing.assert_array_equal(handed.alone(prompt, output), [48, 36, 48, 48, 32])
    plain = kv_manager(KVBudget("paged", 10_000, 16))
    np.testing.assert_array_equal(plain.alone(prompt, output), [32, 32, 32, 32, 32])
