"""Placements of the user's model: the pool flags, a placement checked before anything runs,
each role priced and budgeted on its own card, the KV link, and the disaggregated run beside
colocated replicas on as many cards."""
import json

import numpy as np
import pytest

from nn40.accounting import kv_bytes_per_token
from nn40.cli import parse_args
from nn40.config import GPUS, MODELS
from nn40.errors import UsageError
from nn40.placement import (
    Role, check_roles, colocated_twin, disaggregation_study, placement_link, role_limits,
    run_roles)
from nn40.profiles import run_profile
from nn40.stages import PipelineCosts, stage_model
from nn40.workload import Requests
from test_cli import expect_usage_error, run_main

POOLS = ["--experiments", "C", "--gpu", "h100", "--model", "llama-3.1-8b",
         "--prefill-replicas", "1", "--decode-replicas", "1"]


@pytest.mark.parametrize("flags, fragment", [
    (["--kv-link-gbs", "10"], "give --prefill-replicas and --decode-replicas"),
    (["--kv-layerwise"], "give --prefill-replicas and --decode-replicas"),
    (["--kv-link", "pcie"], "give --prefill-replicas and --decode-replicas"),
    (["--prefill-tp", "2", "--gpu", "h100"], "--prefill-tp: a pool's"),
    (["--decode-gpu", "h200", "--gpu", "h100"], "--decode-gpu: a pool's"),
    (["--prefill-replicas", "1"], "needs both pools"),
    (["--decode-replicas", "2"], "needs both pools"),
    (["--prefill-replicas", "1", "--decode-replicas", "1"], "give --gpu"),
    (["--pp-micro-batches", "2"], "applies to --replay-distserve"),
    (["--pp", "2"], "--pp prices a named card"),
    (POOLS[4:] + ["--gpu", "h100", "--ep", "2"], "--ep"),
    (POOLS[2:] + ["--experiments", "A"], "add C to --experiments"),
])
def test_the_pool_flags_are_refused_where_nothing_reads_them(flags, fragment, capsys,
                                                              tmp_path):
    expect_usage_error(["--out", str(tmp_path), *flags], capsys, fragment)


@pytest.mark.parametrize("flags, fragment", [
    (["--prefill-tp", "3"], "TP must divide"),
    (["--decode-pp", "33"], "PP at most its 32 layers"),
    (["--kv-link", "nvlink", "--gpu", "rtx-4090"], "has no NVLink"),
    (["--kv-link", "nvlink", "--decode-gpu", "rtx-4090"], "has no NVLink"),  # (either end)
    (["--kv-tokens", "3000"], "--kv-tokens: the pools price each role's card"),
    (["--peak-tflops", "100"], "--peak-tflops: the pools"),
    (["--kv-policy", "reserve"], "--kv-policy reserve: the pools"),
    (["--decode-gpu", "rtx-5080", "--model", "llama-3.1-70b", "--tp", "8"],
     "decode pool at TP 8 x PP 1"),
    (["--kv-link-gbs", "0"], "expected a number"),
])
def test_a_placement_that_cannot_run_is_one_line(flags, fragment, capsys, tmp_path):
    expect_usage_error(["--out", str(tmp_path), *POOLS, *flags], capsys, fragment)


@pytest.mark.parametrize("mode", ["--replay-distserve", "--placement-search"])
def test_the_distserve_modes_refuse_the_pool_flags(mode, capsys):
    expect_usage_error([mode, "somewhere", "--prefill-replicas", "1", "--decode-replicas", "1",
                        "--pp", "2"], capsys, "--pp, --prefill-replicas, --decode-replicas "
                        "would not be read")


def test_the_roles_default_to_the_runs_tp_pp_and_card():
    run = parse_args(POOLS + ["--tp", "2", "--decode-pp", "2", "--prefill-gpu", "h200",
                              "--prefill-replicas", "3"])
    assert run_roles(run) == [Role("prefill", 3, 2, 1, "h200"), Role("decode", 1, 2, 2, "h100")]
    assert [r.gpus for r in run_roles(run)] == [6, 4]
    # colocated on as many cards: whole replicas of --tp x --pp
    assert colocated_twin(run, 10) == [Role("colocated", 5, 2, 1, "h100")]
    with pytest.raises(UsageError, match="too few"):
        colocated_twin(parse_args(POOLS + ["--tp", "8"]), 7)


def test_a_stage_holds_its_share_of_the_layers():
    cfg = MODELS["llama-3.1-70b"]
    assert stage_model(cfg, 1) is cfg
    assert stage_model(cfg, 3).layers == 27 and stage_model(cfg, 80).layers == 1  # (80 / 3 up)
    check_roles(cfg, [Role("colocated", 1, 1, 2, "h100")])  # 73 GB a card: fits
    with pytest.raises(UsageError, match="give more TP or PP"):
        check_roles(cfg, [Role("colocated", 1, 1, 1, "h100")])  # 141 GB of weights a card
    with pytest.raises(UsageError, match="no room for a KV cache"):  # (73 GB, 80 GB cards)
        check_roles(cfg, [Role("colocated", 1, 1, 2, "h100")],
                    profile=run_profile(parse_args(POOLS + ["--engine-profile", "sglang"])))
    with pytest.raises(UsageError, match="past the budget of 7"):
        check_roles(cfg, [Role("prefill", 1, 4, 1, "h100"), Role("decode", 1, 4, 1, "h100")],
                    gpus=7)
    # K/V heads: TP divides them, or is a multiple of them (copies), not neither
    check_roles(MODELS["llama-3.1-8b"], [Role("colocated", 1, 8, 1, "h100")])  # 8 K/V heads
    qwen = MODELS["qwen2.5-7b"]  # 28 heads, 4 K/V heads
    with pytest.raises(UsageError, match="K/V"):
        check_roles(qwen, [Role("colocated", 1, 14, 1, "h100")])


def test_the_links_a_placement_takes():
    def link(*flags):
        run = parse_args(POOLS + list(flags))
        return placement_link(run, run_roles(run))
    assert link().name == "NVLink 4" and link().bytes_per_s == 450e9
    assert link().latency_s == 0.0  # (inside a node)
    assert link("--prefill-replicas", "5", "--decode-replicas", "4").name == "NDR InfiniBand"
    assert link("--decode-gpu", "h200").name == "NDR InfiniBand"  # (a node of one kind)
    assert link("--kv-link", "pcie").bytes_per_s == 64e9
    assert link("--kv-link", "pcie", "--decode-gpu", "a100-80gb").bytes_per_s == 32e9  # (slower)
    assert link("--kv-link", "ethernet-100g").bytes_per_s == 12.5e9
    assert link("--kv-link", "ethernet-100g").latency_s == 2e-6
    assert link("--kv-link-gbs", "7", "--kv-link-latency-us", "30").latency_s == pytest.approx(30e-6)
    assert link("--kv-layerwise").layers == 32


def test_a_roles_limits_are_its_engines_on_its_card_unless_given():
    run = parse_args(POOLS + ["--engine-profile", "vllm", "--decode-gpu", "rtx-4090",
                              "--decode-tp", "1"])
    profile = run_profile(run)
    prefill, decode = run_roles(run)
    assert role_limits(run, prefill, profile) == (1024, 8192)  # (vLLM on an H100)
    assert role_limits(run, decode, profile) == (256, 2048)    # (and on a 24 GB card)
    given = parse_args(POOLS + ["--engine-profile", "vllm", "--decode-gpu", "rtx-4090",
                                "--slots", "64"])
    assert role_limits(given, run_roles(given)[1], profile) == (64, 2048)


def one_request_study(*flags, prompt=1000, output=10):
    run = parse_args(POOLS + list(flags))
    req = Requests(np.zeros(1), np.array([prompt]), np.array([output]))
    return run, disaggregation_study(run, req)[0]


def test_one_request_takes_the_colocated_time_and_its_kvs_crossing():
    # a request alone: its prefill and its decode steps are priced as a colocated replica
    # prices them (same card, same TP), so the disaggregated run is as fast to its first
    # token, and its end is later by the KV's crossing: 1,000 tokens x 128 KiB over 1 GB/s
    # and 300 us of latency
    _, P = one_request_study("--kv-link-gbs", "1", "--kv-link-latency-us", "300")
    split, joint = P["disaggregated"], P["colocated"]
    crossing = 1000 * kv_bytes_per_token(MODELS["llama-3.1-8b"]) / 1e9 + 300e-6
    assert P["kv_bytes_per_token"] == 131_072
    assert split["ttft_s"]["p50"] == pytest.approx(joint["ttft_s"]["p50"], rel=1e-12)
    assert split["e2e_s"]["p50"] - joint["e2e_s"]["p50"] == pytest.approx(crossing, rel=1e-9)
    assert split["kv_transfer"]["bytes"] == 1000 * 131_072 and split["kv_transfer"]["sends"] == 1
    assert split["gpus"] == joint["gpus"] == 2
    assert split["pools"]["prefill"]["requests"] == split["pools"]["decode"]["requests"] == 1


def test_pipeline_stages_are_priced_as_the_run_prices_them():
    # PP 2 on each role: the replica's prices are pipeline stages of the card's prices
    run, P = one_request_study("--pp", "2")
    assert P["disaggregated"]["gpus"] == 4 and P["colocated"]["placement"].startswith(
        "2 x colocated TP1 PP2")
    from nn40.placement import role_replica
    replica = role_replica(run, run_roles(run)[0], np.array([10]))
    assert isinstance(replica.costs, PipelineCosts) and replica.costs.pp == 2


def long_prompts(n, prompt, output, rate, seed=0):
    rng = np.random.default_rng(seed)
    return Requests(np.cumsum(rng.exponential(1 / rate, n)), np.full(n, prompt),
                    np.full(n, output))


def test_disaggregation_keeps_long_prompts_off_the_decoders():
    # The lesson of the public runs (ankdeshm/dynamo_disaag_serving_gke, Llama-3.1-70B on 8
    # H200s: 1 prefill + 1 decode replica of TP4 against one aggregated TP8, 8k prompts and
    # 200 outputs: p99 TPOT 100 ms disaggregated, 1,107 ms aggregated; its setups differ, so
    # the direction is the check, not the size): 8k-token prompts arriving while others
    # decode stall a colocated replica's decoders for a prefill's time; a decode pool never
    # sees them
    run = parse_args(["--experiments", "C", "--gpu", "h200", "--model", "llama-3.1-70b",
                      "--tp", "4", "--prefill-replicas", "1", "--decode-replicas", "1"])
    P, _ = disaggregation_study(run, long_prompts(300, 8000, 200, 1.2))
    split, joint = P["disaggregated"], P["colocated"]
    assert joint["tpot_s"]["p99"] > 1.5 * split["tpot_s"]["p99"]
    assert split["tpot_s"]["p99"] < 1.1 * split["tpot_s"]["p50"]  # (steady, no stalls)


def test_short_prompts_waste_a_prefill_pool():
    # and the other side of it (the same runs at 1k in, 1k out: disaggregated served 3.5
    # requests/s against 12.0 aggregated): with short prompts the prefill replica idles
    # while the decode replica is the bottleneck, and colocated replicas on as many cards
    # serve more
    run = parse_args(["--experiments", "C", "--gpu", "h200", "--model", "llama-3.1-70b",
                      "--tp", "4", "--prefill-replicas", "1", "--decode-replicas", "1"])
    P, _ = disaggregation_study(run, long_prompts(400, 1000, 1000, 1e6))
    split, joint = P["disaggregated"], P["colocated"]
    assert joint["throughput_rps"] > 1.3 * split["throughput_rps"]
    assert split["pools"]["prefill"]["busy"] < 0.5 < 0.8 < split["pools"]["decode"]["busy"]


def test_the_disaggregated_run_end_to_end(tmp_path, capsys):
    out = tmp_path / "out"
    results, printed = run_main(POOLS + ["--requests", "200", "--rate", "4", "--slo-ttft-ms",
                                         "200", "--slo-tpot-ms", "40", "--no-figures",
                                         "--out", str(out)], capsys)
    P = results["C"]["placement"]
    assert P["disaggregated"]["placement"] == \
        "1 x prefill TP1 PP1 H100 SXM + 1 x decode TP1 PP1 H100 SXM"
    assert P["colocated"]["placement"] == "2 x colocated TP1 PP1 H100 SXM"
    for kind in ("disaggregated", "colocated"):
        assert 0 <= P[kind]["slo_attained"] <= 1 and P[kind]["goodput_per_gpu"] == \
            pytest.approx(P[kind]["goodput_rps"] / 2)
    assert "disaggregated serving on 2 cards beside colocated replicas" in printed.out
    assert "KV moved" in printed.out and "NVLink 4" in printed.out
    saved = json.loads((out / "results.json").read_text())
    assert saved["C"]["placement"]["link"]["gbs"] == 450.0
    assert saved["config"]["prefill_replicas"] == 1
    # the SLO met against the rate, both placements (DistServe's figure), from shares of the
    # capacity study's one replica times the colocated replicas
    curve = P["curve"]
    one = results["C"]["capacity"]["one_replica"]["rate_rps"]
    assert curve["rates_rps"] == pytest.approx([2 * one * s for s in (0.25, 0.5, 0.75, 1.0, 1.25,
                                                                      1.5, 2.0)])
    assert all(0 <= met <= 1 for kind in ("disaggregated", "colocated") for met in curve[kind])
    assert curve["colocated"][0] >= curve["colocated"][-1]  # (more load, fewer in time)
    from nn40.figures import plot_disaggregation
    assert plot_disaggregation(saved, str(tmp_path / "d.png")) is None
    assert (tmp_path / "d.png").stat().st_size > 10_000
    assert "needs --prefill-replicas" in plot_disaggregation({"C": {}}, str(tmp_path / "e.png"))


def test_a_pipeline_of_stages_in_the_main_run(tmp_path, capsys):
    # --pp in the main run: the colocated replica's prices are stages, its card holds half
    # the layers (so twice the KV tokens of the same model on one card, less its weights)
    one = parse_args(["--experiments", "C", "--gpu", "h100", "--model", "llama-3.1-8b"])
    two = parse_args(["--experiments", "C", "--gpu", "h100", "--model", "llama-3.1-8b",
                      "--pp", "2"])
    from nn40.memory import kv_budget_bytes
    assert kv_budget_bytes(two, None)[0] > 2 * kv_budget_bytes(one, None)[0]
    results, _ = run_main(["--experiments", "C", "--gpu", "h100", "--model", "llama-3.1-8b",
                           "--pp", "2", "--no-figures", "--out", str(tmp_path)], capsys)
    assert results["C"]["cost_model"]["pp"] == 2
    assert GPUS["h100"].link == "NVLink 4"


# the cheapest placement of each kind for a target rate


CHEAP = ["--experiments", "C", "--gpu", "h100", "--model", "llama-3.1-8b", "--prefill-replicas",
         "1", "--decode-replicas", "1", "--requests", "200", "--slo-ttft-ms", "300",
         "--slo-tpot-ms", "20", "--jobs", "1"]


def test_the_rate_matching_rule_by_hand():
    from nn40.cheapest import rate_matching
    from nn40.placement import role_replica
    run = parse_args(CHEAP + ["--target-rate", "30"])
    req = Requests(np.zeros(4), np.array([100, 300, 200, 200]), np.array([50, 150, 100, 100]))
    pre, dec = Role("prefill", 1, 1, 1, "h100"), Role("decode", 1, 2, 1, "h100")
    rule = rate_matching(run, req, pre, dec)
    # a prefill replica: its chunk of 200-token prompts a pass
    costs = role_replica(run, pre, req.output)
    n = costs.chunk_tokens // 200
    assert rule["context_rps"] == pytest.approx(n / costs.costs.pass_s(n * 200, 0,
                                                                       n * 200 * 201 / 2))
    # a decode replica: the largest batch whose step (each row 250 tokens cached) is within
    # 20 ms, one more is past it; it completes that batch's requests every 99 steps
    d = role_replica(run, dec, req.output).costs
    b = rule["batch"]
    assert d.pass_s(b, b * 250) <= 0.020 < d.pass_s(b + 1, (b + 1) * 250)
    assert rule["generation_rps"] == pytest.approx(b / (99 * d.pass_s(b, b * 250)))
    assert rule["prefill_replicas"] == -(-30 // rule["context_rps"])
    assert rule["decode_replicas"] == -(-30 // rule["generation_rps"])
    assert rule["gpus"] == rule["prefill_replicas"] + 2 * rule["decode_replicas"]
    # TensorRT-LLM's form: output tokens/s a card of a rate-matched pair
    ratio = rule["generation_rps"] / rule["context_rps"]
    assert rule["output_tokens_per_s_per_gpu"] == pytest.approx(
        rule["generation_rps"] * 100 / (1 * ratio + 2))
    assert rule["feasible"]
    tight = rate_matching(parse_args(CHEAP + ["--target-rate", "30", "--slo-tpot-ms", "1"]),
                          req, pre, dec)
    assert not tight["feasible"] and tight["batch"] == 1  # (a step alone is past 1 ms)


def test_the_rate_matching_rule_on_pipeline_stages_by_hand():
    # PP 2 a role: a prefill replica's budget twice the engine's (a step's for each of its two
    # micro-batches), half its prompts in the heaviest micro-batch; a decode step of b rows
    # is the cycle of b / 2 (rounded up)
    from nn40.cheapest import rate_matching
    from nn40.placement import role_replica
    run = parse_args(CHEAP + ["--target-rate", "30", "--slo-tpot-ms", "40"])
    req = Requests(np.zeros(4), np.array([100, 300, 200, 200]), np.array([50, 150, 100, 100]))
    pre, dec = Role("prefill", 1, 1, 2, "h100"), Role("decode", 1, 1, 2, "h100")
    rule = rate_matching(run, req, pre, dec)
    p = role_replica(run, pre, req.output)
    assert p.chunk_tokens == 2 * role_replica(run, Role("prefill", 1, 1, 1, "h100"),
                                              req.output).chunk_tokens
    n = p.chunk_tokens // 200
    half = -(-n // 2)
    assert rule["context_rps"] == pytest.approx(n / p.costs.pass_s(half * 200, 0,
                                                                   half * 200 * 201 / 2))
    d, b = role_replica(run, dec, req.output).costs, rule["batch"]
    rows = -(-b // 2)
    assert rule["step_s"] == pytest.approx(d.pass_s(rows, rows * 250)) and \
        rule["step_s"] <= 0.040


def test_the_counts_found_meet_the_slo_and_one_fewer_misses():
    from nn40.capacity import SLO, unit_rate
    from nn40.cheapest import attainments, fewest_pools
    run = parse_args(CHEAP + ["--target-rate", "40"])
    slo = SLO(0.3, 0.02, 0.9)
    req = Requests(np.zeros(200), np.full(200, 2000), np.full(200, 100))
    base = unit_rate(run, req, 1000, 5)[0]
    roles = [Role("prefill", 1, 1, 1, "h100"), Role("decode", 1, 1, 1, "h100")]
    found, tried = fewest_pools(run, base, roles, slo, (1, 1), 64)
    counts = tuple(r.replicas for r in found)
    assert tried[counts] >= 0.9 and max(counts) > 1
    for i in (0, 1):
        if counts[i] > 1:
            fewer = [r._replace(replicas=n - (j == i)) for j, (r, n) in
                     enumerate(zip(roles, counts))]
            assert attainments(run, base, fewer, slo)[0] < 0.9
    none, _ = fewest_pools(run, base, roles, slo, (1, 1), 2)  # (two cards cannot)
    assert none is None


def test_the_cheapest_placement_end_to_end(tmp_path, capsys):
    results, printed = run_main(CHEAP + ["--target-rate", "20", "--no-figures", "--out",
                                         str(tmp_path)], capsys)
    R = results["C"]["placements"]
    found = [r for r in R["rows"] if r["found"]]
    assert {r["kind"] for r in found} == {"colocated", "disaggregated"}
    win = R["best"][R["answer"]]
    assert win["gpus"] == min(r["gpus"] for r in found) and win["attainment"] >= 0.9
    assert "answer: " in printed.out and "the rate-matching rule for that pair" in printed.out
    assert R["simulations"] == sum(r["simulations"] for r in R["rows"]) > 0
    assert all(r["search_s"] >= 0 for r in R["rows"]) and R["wall_s"] > 0
    assert f"{R['simulations']:,} simulations, " in printed.out
    # a budget of one card: no pair of pools, and colocated on one card at most
    results, printed = run_main(CHEAP + ["--target-rate", "20", "--gpu-budget", "1",
                                         "--no-figures", "--out", str(tmp_path / "b")], capsys)
    R = results["C"]["placements"]
    assert list(R["best"]) == ["colocated"] and R["best"]["colocated"]["gpus"] == 1
    assert all(r["gpus"] == 1 for r in R["rows"] if r["found"])
    assert "no placement of the other kind serves the rate" in printed.out
    assert "answer: colocated, 1 x colocated TP1 PP1 H100 SXM: 1 GPU" in printed.out


SEARCH = CHEAP[:6] + CHEAP[10:]  # (CHEAP without its pools)


def test_the_placement_search_alone_is_the_cheapest_placements(tmp_path, capsys):
    # --placement-search with no DIR: the same search for the run's own model and card, with
    # no placement of the user's run beside it; a budget bounds it
    assert "--prefill-replicas" not in SEARCH and "--gpu" in SEARCH
    alone, printed = run_main(SEARCH + ["--placement-search", "--target-rate", "20",
                                        "--no-figures", "--out", str(tmp_path / "a")], capsys)
    pools, _ = run_main(CHEAP + ["--target-rate", "20", "--no-figures", "--out",
                                 str(tmp_path / "b")], capsys)
    assert "placement" not in alone["C"] and "placement" in pools["C"]
    strip = [[{k: r[k] for k in ("kind", "placement", "gpus", "attainment")}
              for r in R["C"]["placements"]["rows"]] for R in (alone, pools)]
    assert strip[0] == strip[1] and "answer: " in printed.out
    budget, _ = run_main(SEARCH + ["--placement-search", "--target-rate", "20", "--gpu-budget",
                                   "1", "--no-figures", "--out", str(tmp_path / "c")], capsys)
    assert list(budget["C"]["placements"]["best"]) == ["colocated"]


@pytest.mark.parametrize("flags, fragment", [
    (SEARCH + ["--placement-search"], "give --target-rate and --slo-ttft-ms"),
    (SEARCH[:8] + ["--placement-search", "--target-rate", "20"],  # (no SLO)
     "give --target-rate and --slo-ttft-ms"),
    (SEARCH + ["--placement-search", "--target-rate", "20", "--prefill-tp", "2"],
     "--prefill-tp: --placement-search tries each role's TP and PP itself"),
    (SEARCH + ["--placement-search", "--target-rate", "20", "--kv-tokens", "5000"],
     "--kv-tokens: the pools price"),
    (SEARCH[:2] + SEARCH[4:] + ["--placement-search", "--target-rate", "20"], "give --gpu"),
    (["--experiments", "AB"] + SEARCH[2:] + ["--placement-search", "--target-rate", "20"],
     "add C to --experiments"),
])
def test_a_placement_search_it_cannot_run_is_one_line(flags, fragment, capsys, tmp_path):
    expect_usage_error(["--out", str(tmp_path), *flags], capsys, fragment)


def test_the_gpu_budget_is_refused_without_a_placement_search(capsys, tmp_path):
    expect_usage_error(["--experiments", "C", "--gpu", "h100", "--gpu-budget", "8", "--out",
                        str(tmp_path)], capsys, "--gpu-budget bounds the cheapest placements")


def test_the_cheapest_placements_on_a_local_dask_cluster(tmp_path, capsys):
    # the same searches on Dask's workers: the same answer as on worker processes
    pytest.importorskip("distributed")
    here, _ = run_main(CHEAP + ["--target-rate", "20", "--no-figures", "--out",
                                str(tmp_path / "a")], capsys)
    dask, _ = run_main(CHEAP + ["--target-rate", "20", "--cluster", "local", "--jobs", "2",
                                "--no-figures", "--out", str(tmp_path / "b")], capsys)
    strip = [{k: r[k] for k in ("kind", "placement", "gpus", "attainment")}
             for r in here["C"]["placements"]["rows"]]
    assert strip == [{k: r[k] for k in ("kind", "placement", "gpus", "attainment")}
                     for r in dask["C"]["placements"]["rows"]]
    expect_usage_error(["--experiments", "C", "--gpu", "h100", "--prefill-replicas", "1",
                        "--decode-replicas", "1", "--cluster", "local", "--out",
                        str(tmp_path / "c")], capsys, "--cluster runs")


def test_a_prefix_cache_in_the_pools_counts_each_prompt_once(tmp_path, capsys):
    # shared system prompts: the prefill pool's caches find them as colocated replicas' do;
    # the decode pool, handed each prompt's KV whole, queries nothing of its own (its lookups
    # counted too would double the queried tokens)
    results, printed = run_main(POOLS + ["--enable-prefix-caching", "--prefix-len", "512",
                                         "--num-prefixes", "2", "--turns", "2", "--rate", "4",
                                         "--requests", "200", "--no-figures", "--out",
                                         str(tmp_path)], capsys)
    P = results["C"]["placement"]
    split, joint = (P[k]["prefix_cache"] for k in ("disaggregated", "colocated"))
    assert split["queried_tokens"] == joint["queried_tokens"] > 0
    assert split["hit_ratio"] > 0.3 and joint["hit_ratio"] > 0.3
    assert f"{100 * split['hit_ratio']:.1f}%" in printed.out  # (the pools' table's hit column)
