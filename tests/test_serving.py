"""Experiment C in seconds: arrivals, schedulers, traces, metrics."""
import os

import numpy as np
import pytest

import NN_40_serving as S
from nn40.config import GPUS, PUBLISHED_CSV
from nn40.kv import KVBudget, PagedBlocks
from nn40.loop import simulate_serving
from nn40.metrics import serving_metrics
from nn40.pricing import ENGINE_PROFILES, StepCosts, card_costs, card_kv_tokens, fit_step_costs
from nn40.published import predict_published, read_published, row_model
from nn40.replicas import Replica, SCHEDULERS, SimulationStalled
from nn40.slot_steps import simulate_slots
from nn40.workload import Requests, arrival_times, lognormal_lengths, read_trace
from conftest import TRACES

COSTS = StepCosts(tokens=(1, 64, 1024), seconds=(0.010, 0.012, 0.100), kv_token_s=1e-7,
                    source="test")


def poisson_requests(n, rate, seed=0, prompt=32):
    rng = np.random.default_rng(seed)
    output = lognormal_lengths(n, seed)
    return Requests(arrival_times(n, rate, 1.0, rng), np.full(n, prompt), output)


def test_one_slot_is_a_fifo_queue_lindley():
    req = poisson_requests(300, rate=20.0)
    sim = simulate_serving(req, Replica(1, COSTS, "continuous"))
    previous_finish = 0.0
    for i in range(len(req.output)):
        assert sim["times"].start[i] == max(req.arrival_s[i], previous_finish)
        previous_finish = sim["times"].finish[i]


def test_all_at_zero_reproduces_the_step_counts():
    lengths = lognormal_lengths(600, 3)
    req = Requests(np.zeros(600), np.full(600, 50), lengths)
    zero_prefill = StepCosts((1, 2), (0.0, 0.0), 0.0, "free prefill")
    for costs in (zero_prefill, COSTS):  # step counts do not depend on the prices
        for policy in ("static", "continuous"):
            sim = simulate_serving(req, Replica(32, costs, policy))
            assert sim["steps"] == simulate_slots(lengths, 32, policy)["steps"]


def test_chunked_with_an_unlimited_budget_equals_continuous():
    req = poisson_requests(400, rate=50.0)
    a = simulate_serving(req, Replica(16, COSTS, "continuous"))
    b = simulate_serving(req, Replica(16, COSTS, "chunked", 10**9))
    for key in ("start", "first_token", "finish"):
        np.testing.assert_array_equal(getattr(a["times"], key), getattr(b["times"], key))
    assert a["steps"] == b["steps"]


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_tokens_are_conserved_and_times_ordered(scheduler):
    req = poisson_requests(300, rate=30.0, prompt=700)
    sim = simulate_serving(req, Replica(8, COSTS, scheduler, 256))
    # every slot-step holds a request that is prefilling or emitting a token
    assert np.all(req.arrival_s <= sim["times"].start)
    assert np.all(sim["times"].start < sim["times"].first_token)
    assert np.all(sim["times"].first_token <= sim["times"].finish)
    if scheduler != "chunked":  # one prefill step + (output - 1) decode steps per request
        assert round(sim["occupancy"] * sim["steps"] * 8) == req.output.sum()


def test_chunked_prefill_bounds_each_step():
    # a long prompt arrives while others decode: chunked spreads it over several steps
    req = Requests(np.array([0.0, 0.0, 0.05]), np.array([10, 10, 4000]),
                     np.array([400, 400, 5]))
    whole = simulate_serving(req, Replica(4, COSTS, "continuous"))
    chunked = simulate_serving(req, Replica(4, COSTS, "chunked", 512))
    # the decoders' worst stall: the whole 4000-token prefill vs at most 512 tokens a step
    assert whole["longest_step_s"] == pytest.approx(COSTS.pass_s(4000) + COSTS.pass_s(2, 2 * 60),
                                                    rel=0.05)
    assert chunked["longest_step_s"] < COSTS.pass_s(512, 4000) + COSTS.pass_s(2, 2 * 400)
    assert chunked["longest_step_s"] < 0.5 * whole["longest_step_s"]
    # the long prompt waits longer
    assert chunked["times"].first_token[2] > whole["times"].first_token[2]


def without_wall_times(value):
    """How long each simulation took is the one thing that may differ between runs."""
    if isinstance(value, dict):
        return {k: without_wall_times(v) for k, v in value.items()
                if k not in ("simulation_s", "wall_s")}
    return value


def test_same_seed_same_results_with_any_jobs(tmp_path, capsys):
    args = ["--experiments", "C", "--rate", "50", "--no-figures", "--requests", "200",
            "--rates", "20,40"]
    a = S.main(args + ["--out", str(tmp_path / "a"), "--jobs", "1"])["C"]
    b = S.main(args + ["--out", str(tmp_path / "b"), "--jobs", "2"])["C"]  # worker processes
    a, b = without_wall_times(a), without_wall_times(b)
    assert a["schedulers"] == b["schedulers"] and a["rate_sweep"] == b["rate_sweep"]
    assert a["kv"] == b["kv"] and a["seed_spread"] == b["seed_spread"]
    assert all(m["iterations"] > 0 for m in a["schedulers"].values())


def test_serving_json_contract_and_request_csv(tmp_path, capsys):
    csv_path = tmp_path / "requests.csv"
    results = S.main(["--experiments", "C", "--rate", "40", "--requests", "100", "--out",
                      str(tmp_path), "--save-requests", str(csv_path), "--slo-ttft-ms", "500",
                      "--slo-tpot-ms", "50", "--rates", "10,30"])
    for name in SCHEDULERS:
        m = results["C"]["schedulers"][name]
        for key in ("throughput_rps", "output_tokens_per_s", "occupancy", "goodput_rps"):
            assert m[key] >= 0
        for key in ("ttft_s", "tpot_s", "e2e_s"):
            assert set(m[key]) == {"mean", "p50", "p90", "p99"}
            assert m[key]["p50"] <= m[key]["p90"] <= m[key]["p99"]
    lines = csv_path.read_text().splitlines()
    assert lines[0] == "scheduler,id,arrival,prompt,output,start,first_token,finish"
    assert len(lines) == 1 + 3 * 100
    for name in ("latency_cdf.png", "rate_sweep.png", "occupancy.png"):
        assert (tmp_path / name).exists()


TRACE_FILES = ["sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
               "AzureLLMInferenceTrace_conv.csv",
               "bwb_stats_llama2_tokenizer_filtered_v2.csv"]


@pytest.mark.parametrize("name", TRACE_FILES)
def test_shared_traces_parse(name):
    path = os.path.join(TRACES, name)
    if not os.path.exists(path):
        pytest.skip("shared traces are not beside the project")
    prompt, output, times = read_trace(path, limit=500)
    assert len(prompt) == len(output) == 500 and prompt.min() >= 1 and output.min() >= 1
    if name.startswith("Azure"):
        assert times[0] == 0 and np.all(np.diff(times) >= 0)
        assert times[1] == pytest.approx(4.3145790, abs=1e-6)  # 18:15:50.9951690 - 46.6805900
    else:
        assert times is None


def test_azure_trace_with_its_timestamps(tmp_path, capsys):
    path = os.path.join(TRACES, TRACE_FILES[1])
    if not os.path.exists(path):
        pytest.skip("shared traces are not beside the project")
    results = S.main(["--experiments", "C", "--trace", path, "--trace-limit", "300", "--rate",
                      "trace", "--slots", "16", "--out", str(tmp_path), "--no-figures",
                      "--rates", "2"])
    assert results["C"]["requests"] == 300 and "static" not in results["C"]


@pytest.mark.parametrize("content, fragment", [
    ("a,b\n1,2\n", "no recognised columns"),
    ("num_prefill_tokens,num_decode_tokens\n5,7\n-3,4\n", "line 3: the prompt's tokens"),
    ("num_prefill_tokens,num_decode_tokens\n5,seven\n", "line 2: the output's tokens 'seven' is not a number"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\r\n2023-11-16 18:15:46.6805900,3,4\r\n"
     "2023-11-16 18:15:45.0000000,3,4\r\n", "line 3: a timestamp earlier"),
])
def test_bad_traces(tmp_path, capsys, content, fragment):
    from test_cli import expect_usage_error
    path = tmp_path / "trace.csv"
    path.write_bytes(content.encode())
    err = expect_usage_error(["--experiments", "C", "--trace", str(path)], capsys, fragment)
    assert "trace.csv" in err


@pytest.mark.parametrize("args, fragment", [
    (["--rate", "0"], "expected a number"),
    (["--rate", "-2"], "expected a number"),
    (["--chunk-tokens", "0"], "positive integer"),
    (["--rate", "trace"], "no timestamps"),
    (["--cost", "measured"], "needs experiment A"),
])
def test_bad_serving_flags(args, fragment, capsys):
    from test_cli import expect_usage_error
    expect_usage_error(["--experiments", "C"] + args, capsys, fragment)


def test_step_costs_fit_by_hand():
    # f(1) = 10 ms, f(4) = 16 ms; a cached token costs 2 µs at batch 1 and 1 µs at batch 4
    def row(batch, context, kv_s, f):
        return {"batch": batch, "context": context, "step_ms": 1e3 * (f + kv_s * batch * context)}
    decode = [row(1, 100, 2e-6, 0.010), row(1, 500, 2e-6, 0.010),
              row(4, 100, 1e-6, 0.016), row(4, 500, 1e-6, 0.016)]
    costs = fit_step_costs(decode, [{"tokens": 64, "step_ms": 50.0}], 100, 0.0, "hand")
    assert costs.tokens == (1, 4, 64)
    np.testing.assert_allclose(costs.seconds, (0.010, 0.016, 0.050))
    # the knots price their own passes (the fit asked for these shapes' prices on the way)
    assert (costs.pass_s(1), costs.pass_s(4)) == pytest.approx((0.010, 0.016))
    np.testing.assert_allclose([s for _, s in costs.kv_by_batch], (2e-6, 1e-6))
    # batch 2 sits a third of the way from 1 to 4 in both f and the cost of a cached token
    assert costs.pass_s(2, 1000) == pytest.approx(0.012 + 1000 * (2e-6 - 1e-6 / 3))
    # a run of 3 decode steps of 2 rows, caches growing from 1000 tokens
    assert costs.run_s(2, 1000, 3) == pytest.approx(
        sum(costs.pass_s(2, 1000 + 2 * j) for j in range(3)))


UNIT = StepCosts((1, 2), (1.0, 1.0), 0.0, "every pass 1 s")


def test_latency_definitions_by_hand():
    # A (prompt 4, output 3) arrives at 0, B (prompt 2, output 2) at 0.5; 2 slots, 1 s a pass.
    # step 1 [0, 1]: prefill A (its first token at 1). step 2 [1, 3]: B is admitted, a prefill
    # pass for B and a decode pass for A (2 s; B's first token at 3). step 3 [3, 4]: both
    # decode their last token.
    req = Requests(np.array([0.0, 0.5]), np.array([4, 2]), np.array([3, 2]))
    sim = simulate_serving(req, Replica(2, UNIT, "continuous"))
    times = sim["times"]
    assert times.first_token.tolist() == [1.0, 3.0] and times.finish.tolist() == [4.0, 4.0]
    m = serving_metrics(req, sim)
    assert m["ttft_s"]["mean"] == (1.0 + 2.5) / 2  # first token - arrival
    assert m["e2e_s"]["mean"] == (4.0 + 3.5) / 2   # finish - arrival
    # TPOT, as vLLM defines it: (finish - first token) / (output - 1)
    assert m["tpot_s"]["mean"] == ((4 - 1) / 2 + (4 - 3) / 1) / 2
    assert sim["steps"] == 3 and m["occupancy"] == (1 + 2 + 2) / (3 * 2)
    assert m["makespan_s"] == 4.0 and m["throughput_rps"] == 2 / 4.0
    assert m["output_tokens_per_s"] == 5 / 4.0
    # the record the metrics summarise: the same times, by request
    assert times.ttft().tolist() == [1.0, 2.5] and times.e2e().tolist() == [4.0, 3.5]
    assert times.tpot().tolist() == [1.5, 1.0] and times.finish_step.tolist() == [3, 3]
    assert times.first_step.tolist() == [1, 2] and times.start.tolist() == [0.0, 1.0]


def test_iterations_do_not_grow_with_output_lengths():
    req = Requests(np.zeros(300), np.full(300, 64), lognormal_lengths(300, 1))
    long = Requests(req.arrival_s, req.prompt, req.output * 50)
    for scheduler in SCHEDULERS:
        short_sim = simulate_serving(req, Replica(16, COSTS, scheduler, 256))
        long_sim = simulate_serving(long, Replica(16, COSTS, scheduler, 256))
        assert long_sim["steps"] > 40 * short_sim["steps"]
        # (not equal: which requests end at the same step, and so share an event, differs)
        assert long_sim["iterations"] <= 1.2 * short_sim["iterations"] <= 1.2 * 6 * 300


def test_a_simulation_that_cannot_progress_raises(monkeypatch):
    # an allocator that never frees its blocks: the requests behind the first ones can never
    # be admitted, and the simulation must say so instead of looping
    monkeypatch.setattr(PagedBlocks, "release", lambda self, seq, ctx: None)
    req = poisson_requests(50, rate=100.0)
    with pytest.raises(SimulationStalled, match="stalled"):
        simulate_serving(req, Replica(4, COSTS, "continuous",
                                          kv=KVBudget("paged", 2_000, 16)))


@pytest.mark.parametrize("tp, isl, osl", [(1, 1000, 1000), (1, 128, 128), (8, 128, 2048),
                                          (1, 2048, 128)])
def test_the_max_load_closed_form_is_the_simulation_at_saturation(tp, isl, osl):
    # a published max-load row (Llama-3.1-70B in fp8 on H200s) priced by its closed form and
    # simulated: every request queued at t=0 on the Replica its engine's profile builds, each
    # reserving isl + osl tokens; output tokens/s over the middle half of the finishes. (Where
    # a prompt takes several chunks beside few rows, 20,000 tokens at tp 1, the closed form's
    # smooth step is 13% over the simulation's alternating ones.)
    rows, _ = read_published(PUBLISHED_CSV, "validation")
    row = next(r for r in rows if (r.model, r.gpu, r.weights, r.batch, r.tp, r.isl, r.osl)
               == ("llama-3.1-70b", "h200", "fp8", "max-load", tp, isl, osl))
    profile, cfg, card = ENGINE_PROFILES[row.engine], row_model(row), GPUS[row.gpu]
    kv_tokens = card_kv_tokens(cfg, card, profile, tp)
    replica = profile.replica(card_costs(cfg, card, profile, tp),
                              kv=KVBudget("reserve", kv_tokens, max_output=osl))
    assert (replica.slots, replica.chunk_tokens, replica.fused) == (2048, 8192, True)
    n = 8 * min(replica.slots, kv_tokens // (isl + osl))
    sim = simulate_serving(Requests(np.zeros(n), np.full(n, isl), np.full(n, osl)), replica)
    finish = np.sort(sim["times"].finish)
    lo, hi = finish[n // 4], finish[3 * n // 4]
    simulated = ((finish > lo) & (finish <= hi)).sum() * osl / (hi - lo)
    assert simulated == pytest.approx(predict_published(row, profile), rel=0.005)
