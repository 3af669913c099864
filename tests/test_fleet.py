"""Replicas behind a router, and how many a load needs at an SLO."""
import math

import numpy as np
import pytest

import NN_40_serving as S
import nn40.capacity
from nn40.capacity import SLO, capacity_one, fewest_replicas, fleet_summary
from nn40.config import CAPACITY_SEEDS, ModelConfig
from nn40.errors import UsageError
from nn40.kv import KVBudget
from nn40.loop import simulate_serving
from nn40.pools import Fleet, Pool, simulate_fleet, simulate_pools
from nn40.pricing import StepCosts, analytic_costs
from nn40.queues import queue_order
from nn40.replicas import Replica, SCHEDULERS
from nn40.routers import ROUTERS
from nn40.runs import every_nth, kv_metrics
from nn40.tables_c import counted
from nn40.text_ko import TEXT
from nn40.workload import Requests, arrival_times, lognormal_lengths
from test_cli import expect_usage_error, run_main, said

COSTS = analytic_costs(ModelConfig(), 960.0, 105.5)
UNIT = StepCosts((1, 2), (1.0, 1.0), 0.0, "every pass 1 s")


def poisson(n, rate, seed=1, prompt=128):
    return Requests(arrival_times(n, rate, 1.0, np.random.default_rng(seed)),
                      np.full(n, prompt), lognormal_lengths(n, seed))


def same(a, b):
    """The same record (every request's times and steps) and the same steps."""
    return all(np.array_equal(x, y) for x, y in zip(a["times"], b["times"])) and \
        a["steps"] == b["steps"]


@pytest.mark.parametrize("router", ROUTERS)
@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("policy", [None, "paged", "reserve"])
def test_one_replica_is_the_plain_simulation(router, scheduler, policy):
    req = poisson(1500, 95.0)
    kv = None if policy is None else KVBudget(policy, 60_000, 16, 2048,
                                                0.01 if policy == "paged" else 0.0)
    plain = simulate_serving(req, Replica(32, COSTS, scheduler, 512, kv=kv))
    fleet = simulate_fleet(req, Replica(32, COSTS, scheduler, 512, kv=kv), Fleet(1, router))
    assert same(plain, fleet)


def test_one_replica_with_an_order_and_preemption_is_the_plain_simulation():
    req = poisson(800, 120.0, prompt=600)
    kv = KVBudget("paged", 12_000, 16)
    order = queue_order("predicted", req.output, 0.8, 3, max_wait_s=0.5)
    plain = simulate_serving(req, Replica(32, COSTS, "chunked", 256, kv=kv, order=order))
    fleet = simulate_fleet(req, Replica(32, COSTS, "chunked", 256, kv=kv, order=order),
                             Fleet(1, "least-kv"))
    assert plain["kv"]["preemptions"] > 0 and same(plain, fleet)


@pytest.mark.parametrize("n", [2, 3, 5])
def test_round_robin_is_independent_replicas_of_every_nth_request(n):
    req = poisson(2000, 60.0 * n)
    kv = KVBudget("paged", 40_000, 16, watermark=0.01)
    fleet = simulate_fleet(req, Replica(16, COSTS, "continuous", 512, kv=kv),
                             Fleet(n, "round-robin"))
    for i in range(n):
        alone = simulate_serving(every_nth(req, n, i),
                                   Replica(16, COSTS, "continuous", 512, kv=kv))
        for key in ("start", "first_token", "finish"):
            np.testing.assert_array_equal(getattr(alone["times"], key),
                                          getattr(fleet["times"], key)[i::n])
    assert [p["requests"] for p in fleet["per_replica"]] == [len(range(i, 2000, n))
                                                            for i in range(n)]


def test_a_fleet_keeps_its_replicas_memory_metrics():
    req = poisson(1200, 3 * 120.0, prompt=600)
    kv = KVBudget("paged", 12_000, 16)
    replica = Replica(32, COSTS, "continuous", 512, kv=kv)
    fleet = fleet_summary(req, simulate_fleet(req, replica, Fleet(3, "round-robin")),
                            None, None, kv)
    alone = [kv_metrics(r, simulate_serving(r, replica), kv)
             for r in (every_nth(req, 3, i) for i in range(3))]
    assert fleet["preemptions"] == sum(m["preemptions"] for m in alone) > 0
    assert fleet["recomputed_tokens"] == sum(m["recomputed_tokens"] for m in alone)
    for key in ("peak_concurrency", "max_allocated_tokens"):
        assert fleet[key] == max(m[key] for m in alone)
    used = [m["utilization"] for m in alone]  # (held over allocated, summed: between theirs)
    assert min(used) <= fleet["utilization"] <= max(used)
    assert "utilization" not in fleet_summary(  # (no KV budget: no memory to report)
        req, simulate_fleet(req, Replica(32, COSTS, "continuous", 512), Fleet(3)), None, None)


def routed(router, arrival, output, replicas=2, prompt=None, kv=None):
    prompt = np.full(len(output), 4) if prompt is None else np.array(prompt)
    req = Requests(np.array(arrival, float), prompt, np.array(output))
    return simulate_fleet(req, Replica(1, UNIT, "continuous", kv=kv), Fleet(replicas, router))


def test_least_requests_by_hand():
    # one slot each, 1 s a pass. A (6 tokens) at 0 -> replica 0 (ties: the lowest), runs to 6.
    # B (9) at 0.5: 0 holds A, 1 is empty -> 1, starts at once, runs to 9.5. C (1) at 0.7: both
    # hold one -> 0, queued behind A: 6 to 7. D (2) at 0.9: 0 holds A + C, 1 holds B -> 1,
    # after B: 9.5. E (1) at 7.5: 0 is empty again, 1 holds B + D -> 0, at once
    fleet = routed("least-requests", [0.0, 0.5, 0.7, 0.9, 7.5], [6, 9, 1, 2, 1])
    assert fleet["replica"].tolist() == [0, 1, 0, 1, 0]
    assert fleet["times"].start.tolist() == [0.0, 0.5, 6.0, 9.5, 7.5]
    assert fleet["times"].finish.tolist() == [6.0, 9.5, 7.0, 11.5, 8.5]


def test_round_robin_by_hand():
    # three replicas, one slot each, 1 s a pass: the first request to replica 0, then 1, 2, 0,
    # 1; the fourth (2 tokens, at 0.9) waits on replica 0 behind the first (6 tokens, to 6.0)
    fleet = routed("round-robin", [0.0, 0.5, 0.7, 0.9, 7.5], [6, 9, 1, 2, 1], replicas=3)
    assert fleet["replica"].tolist() == [0, 1, 2, 0, 1]
    assert fleet["times"].start.tolist() == [0.0, 0.5, 0.7, 6.0, 9.5]
    assert fleet["times"].finish.tolist() == [6.0, 9.5, 1.7, 8.0, 10.5]


def test_a_replica_that_empties_between_arrivals_is_read_as_it_is_then():
    # one slot each, 1 s a pass. L (10 tokens) at 0 -> replica 0; S (2 tokens) at 0.1 -> 1,
    # done at 2.1. C at 3.0: replica 1 has emptied (read as it is at 3.0, not as it was at
    # 0.1, when it held S and tied with 0, whose tie goes to the lowest index) -> 1, at once
    for router in ("least-requests", "least-kv"):
        fleet = routed(router, [0.0, 0.1, 3.0], [10, 2, 1])
        assert fleet["replica"].tolist() == [0, 1, 1], router
        assert fleet["times"].start.tolist() == [0.0, 0.1, 3.0] and fleet["times"].finish[1] == 2.1


def test_least_kv_counts_the_prompts_waiting():
    # one slot each. A (prompt 100) at 0 -> 0; B (300) at 0.1 -> 1 (empty); C (250) at 0.2 ->
    # 0 (100 against 300), where it waits behind A. F at 0.3: replica 0 has committed A's 100
    # and C's 250 waiting, 350 against 300 -> 1 (counting only what runs would say 0)
    fleet = routed("least-kv", [0.0, 0.1, 0.2, 0.3], [20, 20, 20, 1],
                   prompt=[100, 300, 250, 10])
    assert fleet["replica"].tolist() == [0, 1, 0, 1]
    # and what runs counts its prompt before its prefill has run: at 0.2, A's and B's passes
    # are both under way; replica 0's 100 < 300 is what sends C there
    kv = KVBudget("paged", 10_000, 16)
    paged = routed("least-kv", [0.0, 0.1, 0.2, 0.3], [20, 20, 20, 1],
                   prompt=[100, 300, 250, 10], kv=kv)
    assert paged["replica"].tolist() == [0, 1, 0, 1]


def test_power_of_two_by_hand():
    # seed 0's draws over 4 replicas, two distinct replicas for every request:
    # (3, 1) (2, 0) (2, 1) (1, 0) (1, 2) (0, 1). Nobody finishes within 0.5 s, so the loads
    # only grow: 0-0 tie -> 3; 0-0 -> 2; 2 has 1, 1 has 0 -> 1; 1 has 1, 0 has 0 -> 0;
    # 1-1 tie -> 1 (the first drawn); 0 has 1, 1 has 2 -> 0
    n, replicas = 6, 4
    first = np.random.default_rng(0).integers(replicas, size=n)
    second = (first + 1 + np.random.default_rng(1).integers(replicas - 1, size=n)) % replicas
    assert list(zip(first.tolist(), second.tolist())) == [(3, 1), (2, 0), (2, 1), (1, 0),
                                                          (1, 2), (0, 1)]
    fleet = routed("power-of-two", [0.0, 0.1, 0.2, 0.3, 0.4, 0.5], [50] * n, replicas=replicas)
    assert fleet["replica"].tolist() == [3, 2, 1, 0, 1, 0]


def test_power_of_two_keeps_the_replicas_even():
    # all at t=0, one slot each: every request joins a queue, and the less loaded of two
    # distinct replicas keeps the queues within a few of each other; a draw that could pick
    # the same replica twice (or one that ignored the loads) lets them drift apart by tens
    n, replicas = 24_000, 4
    req = Requests(np.zeros(n), np.full(n, 4), np.full(n, 1))
    for seed in range(3):
        fleet = simulate_fleet(req, Replica(1, UNIT, "continuous"),
                                 Fleet(replicas, "power-of-two", seed))
        counts = np.bincount(fleet["replica"], minlength=replicas)
        assert counts.sum() == n and counts.max() - counts.min() <= 4, counts


def test_least_kv_by_hand():
    # two requests of long prompts land on different replicas; a third goes to the replica
    # with fewer KV tokens committed (the shorter prompt's), although both hold one request
    fleet = routed("least-kv", [0.0, 0.1, 5.0], [20, 20, 1], prompt=[900, 100, 10])
    assert fleet["replica"].tolist() == [0, 1, 1]
    requests = routed("least-requests", [0.0, 0.1, 5.0], [20, 20, 1], prompt=[900, 100, 10])
    assert requests["replica"].tolist() == [0, 1, 0]  # (counts tie: the lowest index)


def test_a_replica_that_could_never_hold_a_request_gets_none():
    req = Requests(np.zeros(3), np.array([10, 5000, 10]), np.array([5, 5, 5]))
    with pytest.raises(UsageError) as error:
        simulate_fleet(req, Replica(8, UNIT, "continuous", kv=KVBudget("paged", 2_000, 16)),
                         Fleet(4))
    assert error.value.why["kind"] == "kv_too_long" and error.value.why["request"] == 1
    assert "cannot hold every request: request 1 alone needs" in S.error_text(error.value)


def test_the_bisection_finds_a_known_threshold(monkeypatch):
    # a synthetic attainment: every request within the SLO up to 37.3 requests/s, a third past
    monkeypatch.setattr(nn40.capacity, "attained", lambda req, rate, *a: 1.0 if rate <= 37.3 else 0.3)
    req, replica, slo = poisson(50, 1.0), Replica(8, COSTS), SLO(1.0, None, 0.9)
    rate, tried = capacity_one(req, replica, slo)
    assert 37.3 / 1.01 <= rate <= 37.3
    assert all((met == 1.0) == (r <= 37.3) for r, met in tried)
    # and the fewest replicas: 13 meet the SLO, 12 do not, from above and from below
    monkeypatch.setattr(nn40.capacity, "attained", lambda req, rate, replica, fleet, slo:
                        0.95 if fleet.replicas >= 13 else 0.5)
    for start in (1, 5, 13, 40):
        n, tried = fewest_replicas(req, replica, slo, Fleet(start), 100.0, start)
        assert n == 13 and tried[12] == 0.5 and tried[13] == 0.95
    monkeypatch.setattr(nn40.capacity, "attained", lambda *a: 0.5)
    assert fewest_replicas(req, replica, slo, Fleet(3), 100.0, 3)[0] is None


def test_replicas_and_capacity_end_to_end(tmp_path, capsys):
    results, out = run_main(["--experiments", "C", "--requests", "2000", "--rate", "200",
                             "--replicas", "3", "--slo-ttft-ms", "500", "--slo-tpot-ms", "20",
                             "--target-rate", "300", "--rates", "50", "--out", str(tmp_path)],
                            capsys)
    C = results["C"]
    assert C["requests"] == 667 and C["share_of"] == 3  # one replica's share, every 3rd
    fleet = C["replicas"]
    assert fleet["replicas"] == 3 and fleet["requests"] == 2000
    for router, m in fleet["routers"].items():
        assert {"ttft_s", "tpot_s", "e2e_s", "goodput_rps", "slo_attained", "per_replica",
                "utilization", "preemptions", "peak_concurrency"} <= set(m)
        assert sum(p["requests"] for p in m["per_replica"]) == 2000
        assert m["balance"]["requests_min"] <= 2000 / 3 <= m["balance"]["requests_max"]
    cap = C["capacity"]
    one = cap["one_replica"]["rate_rps"]
    assert 0 < one < 1e4 and len(cap["one_replica"]["rates_rps"]) == CAPACITY_SEEDS
    for router, r in cap["routers"].items():
        assert r["attainment"] >= 0.9 and (r["below"] is None or r["below"] < 0.9)
        assert r["replicas"] >= 1
    for text in ("C  3 replicas of 32 slots behind each router", "C  capacity at the SLO",
                 "C  replicas needed for 300 requests/s", "answer: "):
        assert said(text, out.out)
    # the question's answer first, in words, with the workload and limits it assumes
    fewest = min(r["replicas"] for r in cap["routers"].values())
    T, first = TEXT["en"], out.out.split("C  static vs continuous")[0]
    assert said(f"answer: 300 requests/s of the post's model with TTFT <= 500 ms, TPOT <= 20 ms "
                f"for 90% of requests need {counted(T, fewest, 'replica')} "
                f"({counted(T, fewest, 'gpu')})", first)
    assert said("assuming Poisson arrivals; prompts of 128 tokens", first)
    assert said("32 sequences a replica and 512 tokens a step (the post's, as its table)", first)
    assert (tmp_path / "capacity.png").stat().st_size > 10_000


@pytest.mark.parametrize("args, fragment", [
    (["--replicas", "0"], "positive integer"),
    (["--replicas", "2000"], "up to 1,024"),
    (["--target-rate", "100"], "give the SLO"),
    (["--router", "random"], "--router"),
    (["--target-rate", "1e9", "--slo-ttft-ms", "1000"], "even 1,024 replicas cannot"),
    (["--target-rate", "10", "--slo-ttft-ms", "1e-3"], "no arrival rate meets the SLO"),
])
def test_bad_replica_and_capacity_flags(args, fragment, capsys):
    expect_usage_error(["--experiments", "C", "--requests", "200", "--no-figures"] + args,
                       capsys, fragment)


def test_capacity_under_an_order_of_the_queue(tmp_path, capsys):
    # the capacity searches serve the run's requests cycled: their order is drawn for those
    # (one drawn for the run's own requests would index past their end)
    results, _ = run_main(["--experiments", "C", "--requests", "300", "--order", "sjf",
                           "--slo-ttft-ms", "500", "--target-rate", "200", "--router",
                           "round-robin", "--rates", "50", "--no-figures", "--out",
                           str(tmp_path)], capsys)
    cap = results["C"]["capacity"]
    assert 0 < cap["one_replica"]["rate_rps"] < math.inf
    assert cap["routers"]["round-robin"]["attainment"] >= 0.9


def test_a_prefill_pool_hands_each_request_to_a_decode_pool_at_its_first_token():
    # prefill pool: one slot, 1.5 s a pass; decode pool: two slots, 1 s a pass. A (prompt 4,
    # 3 tokens) at 0: prefilled 0-1.5, its first token at 1.5, then it enters the decode pool
    # holding 5 tokens and decodes two steps, 1.5-2.5-3.5. B (2 tokens) at 0.5 waits for the
    # prefill slot: 1.5-3.0. It enters the decode pool at 3.0, within A's second step, and
    # joins at the next step boundary, 3.5: its last token at 4.5
    req = Requests(np.array([0.0, 0.5]), np.array([4, 4]), np.array([3, 2]))
    slow = StepCosts((1, 2), (1.5, 1.5), 0.0, "every pass 1.5 s")
    pools = [Pool("prefill", Replica(1, slow)), Pool("decode", Replica(2, UNIT))]
    sim = simulate_pools(req, pools, ["prefill", "decode"])
    times = sim["times"]
    assert times.start.tolist() == [0.0, 1.5] and times.first_token.tolist() == [1.5, 3.0]
    assert times.finish.tolist() == [3.5, 4.5]
    decode = sim["pools"]["decode"]["per_replica"][0]
    assert decode["requests"] == 2 and decode["output_tokens"] == 3 and decode["steps"] == 3
    assert sim["pools"]["prefill"]["per_replica"][0]["steps"] == 2
    # a one-token request ends in the prefill pool; paged memory is kept across both pools
    kv = KVBudget("paged", 64, 4)
    pools = [Pool("prefill", Replica(1, slow, kv=kv)), Pool("decode", Replica(2, UNIT,
                                                                                     kv=kv))]
    req = Requests(np.array([0.0, 0.5]), np.array([4, 4]), np.array([1, 3]))
    sim = simulate_pools(req, pools, ["prefill", "decode"])
    assert sim["times"].finish.tolist() == [1.5, 5.0] and sim["generated"].tolist() == [1, 3]
    assert sim["pools"]["decode"]["replica"].tolist() == [-1, 0] and sim["kv"]["max_alloc"] == 8
