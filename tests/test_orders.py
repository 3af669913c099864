"""The order of the waiting queue: who takes a free seat, by hand, by invariant and end to end."""
import numpy as np
import pytest

from nn40.experiment_c import orders_steps
from nn40.kv import KVBudget
from nn40.loop import simulate_serving
from nn40.pricing import StepCosts
from nn40.queues import ORDERS, kendall_tau, queue_order
from nn40.replicas import Replica
from nn40.slot_steps import simulate_slots
from nn40.workload import Requests, arrival_times, lognormal_lengths
from test_cli import run_main, said

UNIT = StepCosts((1, 2), (1.0, 1.0), 0.0, "every pass 1 s")


def serve(arrival, output, order, slots=1, max_wait_s=None, sigma=0.0, scheduler="continuous"):
    req = Requests(np.array(arrival, float), np.full(len(output), 4), np.array(output))
    return simulate_serving(req, Replica(slots, UNIT, scheduler, order=queue_order(
        order, req.output, sigma, 0, max_wait_s)))


def admission_sequence(sim):
    return np.argsort(sim["times"].start, kind="stable").tolist()


@pytest.mark.parametrize("order, sequence", [
    ("fcfs", [0, 1, 2, 3]), ("sjf", [0, 2, 3, 1]), ("longest", [0, 1, 3, 2]),
    ("predicted", [0, 2, 3, 1]),  # (sigma 0: the predictions are the truth)
])
def test_who_takes_the_seat_by_hand(order, sequence):
    # one slot; A (5 tokens) runs from t=0: a prefill pass, then 4 decode passes, to t=5. B (3),
    # C (1) and D (2) arrive meanwhile, so all three wait when the seat frees at t=5
    sim = serve([0.0, 0.5, 0.6, 0.7], [5, 3, 1, 2], order)
    assert admission_sequence(sim) == sequence
    assert sim["times"].start[sequence[1]] == 5.0  # the seat is refilled at once, whoever takes it
    finish = {0: 5.0}
    t = 5.0
    for r in sequence[1:]:
        t += [5, 3, 1, 2][r]
        finish[r] = t
    assert sim["times"].finish.tolist() == [finish[r] for r in range(4)]


def test_ties_go_by_arrival():
    sim = serve([0.0] * 5, [5, 2, 2, 7, 2], "sjf")
    assert admission_sequence(sim) == [1, 2, 4, 0, 3]
    sim = serve([0.0] * 5, [5, 7, 2, 7, 2], "longest")
    assert admission_sequence(sim) == [1, 3, 0, 2, 4]


def test_static_batches_form_in_the_queues_order():
    # two slots: the first batch is the two shortest, and it runs until its longer one ends
    sim = serve([0.0] * 4, [5, 1, 6, 2], "sjf", slots=2, scheduler="static")
    assert sim["times"].start.tolist() == [2.0, 0.0, 2.0, 0.0] and sim["steps"] == 2 + 6


def test_orders_are_not_preemptive():
    # a long request admitted first keeps its seat when shorter ones arrive behind it
    sim = serve([0.0, 0.1, 0.2], [6, 1, 1], "sjf")
    assert sim["times"].start[0] == 0.0 and sim["times"].finish[0] == 6.0
    assert sim["times"].start[1:].tolist() == [6.0, 7.0]


def test_the_starvation_guard_by_hand():
    # one slot; A (3 tokens) runs to t=3. L (10 tokens) arrives at 0.1, and a short request
    # (1 token) arrives every second from 0.2: shortest first keeps L waiting until they stop.
    # With a guard of 3 s, L (waiting 2.9 s at t=3) loses the seat at t=3 to the short one
    # that has waited longest, and takes it at t=4, having waited 3.9 s.
    shorts = [0.2 + i for i in range(8)]
    arrival = [0.0, 0.1] + shorts
    output = [3, 10] + [1] * len(shorts)
    starved = serve(arrival, output, "sjf")
    assert starved["times"].start[1] == 3.0 + len(shorts)  # after every short request
    guarded = serve(arrival, output, "sjf", max_wait_s=3.0)
    assert guarded["times"].start[1] == 4.0 and guarded["times"].start[2] == 3.0
    assert guarded["times"].start[3] == 14.0  # the next short waits for L's ten steps
    fcfs = serve(arrival, output, "fcfs")
    assert fcfs["times"].start[1] == 3.0
    # the guard's price: the short requests wait longer than under pure shortest first
    waits = {name: (sim["times"].start - np.array(arrival))[2:].mean()
             for name, sim in (("sjf", starved), ("guarded", guarded))}
    assert waits["guarded"] > waits["sjf"]


def test_the_guard_takes_the_longest_waiting_first():
    # with every request past the guard, the queue is served in arrival order (FCFS)
    output = [4, 9, 1, 8, 2, 7]
    fcfs = serve([0.0, 0.1, 0.2, 0.3, 0.4, 0.5], output, "fcfs")
    guarded = serve([0.0, 0.1, 0.2, 0.3, 0.4, 0.5], output, "sjf", max_wait_s=1e-6)
    np.testing.assert_array_equal(guarded["times"].start, fcfs["times"].start)


@pytest.mark.parametrize("order", ["sjf", "predicted", "longest"])
def test_every_admission_takes_the_best_request_that_has_arrived(order):
    # one slot under Poisson arrivals: at each start time, the request admitted has the lowest
    # key (ties: the earliest) among those that have arrived and not yet started
    rng = np.random.default_rng(1)
    n = 300
    output = lognormal_lengths(n, 4)
    req = Requests(arrival_times(n, 0.02, 1.0, rng), np.full(n, 8), output)
    o = queue_order(order, output, 0.8, 5)
    sim = simulate_serving(req, Replica(1, UNIT, "continuous", order=o))
    started = np.zeros(n, bool)
    for r in np.argsort(sim["times"].start, kind="stable"):
        waiting = np.flatnonzero((req.arrival_s <= sim["times"].start[r]) & ~started)
        assert r == min(waiting, key=lambda i: (o.keys[i], i))
        started[r] = True


def test_fcfs_is_the_plain_simulation():
    req = Requests(arrival_times(400, 30.0, 1.0, np.random.default_rng(2)), np.full(400, 64),
                     lognormal_lengths(400, 2))
    kv = KVBudget("paged", 2_500, 16)
    plain = simulate_serving(req, Replica(16, UNIT, "chunked", 128, kv=kv))
    fcfs = simulate_serving(req, Replica(16, UNIT, "chunked", 128, kv=kv, order=queue_order(
        "fcfs", req.output, max_wait_s=0.5)))  # (a guard changes nothing in arrival order)
    for key in ("start", "first_token", "finish"):
        np.testing.assert_array_equal(getattr(plain["times"], key),
                                      getattr(fcfs["times"], key))
    assert plain["kv"]["preemptions"] == fcfs["kv"]["preemptions"] > 0


@pytest.mark.parametrize("name", ["fcfs", "sjf", "longest", "predicted"])
def test_the_reordered_post_table_against_a_sorted_queue(name):
    lengths = lognormal_lengths(600, 3)
    order = queue_order(name, lengths, 0.8, 7)
    table = orders_steps(lengths, 32, [order])[name]
    # the plain reference: the post's slot model on the lengths sorted by the order's keys
    ranked = np.arange(600) if order.keys is None else \
        np.array(sorted(range(600), key=lambda i: (order.keys[i], i)))
    for policy in ("static", "continuous"):
        plain = simulate_slots(lengths[ranked], 32, policy)
        assert table[policy]["steps"] == plain["steps"]
        assert table[policy]["occupancy"] == pytest.approx(plain["occupancy"])
    # and the serving simulation's own steps, request by request, with every pass free
    req = Requests(np.zeros(600), np.full(600, 1), lengths)
    sim = simulate_serving(req, Replica(32, StepCosts((1, 2), (0.0, 0.0), 0.0, "free"),
                                            "continuous", order=order))
    assert sim["steps"] == table["continuous"]["steps"]
    assert sim["times"].finish_step.mean() == pytest.approx(table["continuous"]["mean_finish_step"])


def test_the_orders_table():
    # the post's 600 lengths in 32 slots: shortest first halves the mean finish; longest first
    # fills the seats (the drain at the end is gone)
    lengths = lognormal_lengths(600, 3)
    t = orders_steps(lengths, 32, [queue_order(n, lengths) for n in ("fcfs", "sjf",
                                                                           "longest")])
    assert (t["fcfs"]["continuous"]["steps"], round(t["fcfs"]["continuous"]["mean_finish_step"])) \
        == (2444, 971)
    assert (t["sjf"]["static"]["steps"], t["sjf"]["continuous"]["steps"]) == (3065, 2975)
    assert round(t["sjf"]["continuous"]["mean_finish_step"]) == 576
    assert (t["longest"]["continuous"]["steps"], round(100 * t["longest"]["continuous"][
        "occupancy"], 1)) == (1955, 99.9)


def test_kendall_tau_by_hand():
    assert kendall_tau([1, 2, 3], [10, 20, 30]) == 1.0
    assert kendall_tau([1, 2, 3], [3, 2, 1]) == -1.0
    # 6 pairs: (2, 3) disagree, the other five agree: (5 - 1) / 6
    assert kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)
    # tau-b with a tie in x: 3 pairs, (a, b) tied in x; n_x = 2, n_y = 3, agree 2
    assert kendall_tau([1, 1, 2], [1, 2, 3]) == pytest.approx(2 / np.sqrt(2 * 3))
    lengths = lognormal_lengths(3000, 3)
    taus = [kendall_tau(lengths, queue_order("predicted", lengths, s, 1).keys)
            for s in (0.0, 0.4, 0.8, 1.6)]
    assert taus[0] == pytest.approx(1.0, abs=1e-3) and taus == sorted(taus, reverse=True)


def test_who_waits_end_to_end(tmp_path, capsys):
    results, out = run_main(["--experiments", "C", "--requests", "300", "--rate", "90",
                             "--rates", "50", "--out", str(tmp_path), "--order", "predicted"],
                            capsys)
    C = results["C"]
    assert C["order"]["name"] == "predicted" and 0.3 < C["order"]["kendall_tau"] < 0.8
    assert set(C["orders"]) == {"fcfs", "sjf", "predicted", "longest", "sjf_guarded",
                                "predicted_guarded"}
    assert set(C["orders_steps"]) == set(ORDERS)
    for name, m in C["orders"].items():
        assert sum(b["count"] for b in m["by_length"]) == 300
        assert m["max_wait_s"] == max(b["max_wait_s"] for b in m["by_length"])
        assert m["ttft_s"]["p50"] <= m["ttft_s"]["p99"]
    w = C["who_waits"]
    assert w["guard_source"] == "guard_fcfs" and w["kv_policy"] == "paged"
    # the guard caps the longest wait that shortest-first leaves the long requests
    assert C["orders"]["sjf_guarded"]["max_wait_s"] <= C["orders"]["sjf"]["max_wait_s"]
    for text in ("C  the same table in each order of the queue", "C  who waits:",
                 "shortest predicted + guard", "queue: shortest predicted first"):
        assert said(text, out.out)
    assert (tmp_path / "who_waits.png").stat().st_size > 10_000


def test_a_guard_given_is_used(tmp_path, capsys):
    results, out = run_main(["--experiments", "C", "--requests", "100", "--rates", "50",
                             "--max-wait-s", "0.25", "--no-figures", "--out", str(tmp_path)],
                            capsys)
    assert results["C"]["who_waits"]["guard_s"] == 0.25
    assert results["C"]["order"] == {"name": "fcfs", "max_wait_s": 0.25}
    assert said("goes first (--max-wait-s)", out.out)


def test_a_request_exactly_at_the_guard_goes_first():
    # one slot, 1 s a pass: A (3 tokens) runs to t=3.0. L (10 tokens) arrives at 1.0, S (1
    # token) at 1.5. At 3.0 L has waited exactly the guard's 2.0 s: it goes first (a wait of
    # max_wait_s is enough), though shortest first would take S
    sim = serve([0.0, 1.0, 1.5], [3, 10, 1], "sjf", max_wait_s=2.0)
    assert sim["times"].start.tolist() == [0.0, 3.0, 13.0]
    just_below = serve([0.0, 1.0, 1.5], [3, 10, 1], "sjf", max_wait_s=2.0 + 1e-9)
    assert just_below["times"].start.tolist() == [0.0, 4.0, 3.0]


@pytest.mark.parametrize("sigma", [0.5, 2.0])
def test_predicted_lengths_carry_log_normal_noise_of_sigma(sigma):
    # each prediction is the true length times e^N(0, sigma^2): the log-ratio has mean 0 and
    # standard deviation sigma (a variance used in its place would give 0.25 or 4.0)
    output = lognormal_lengths(200_000, 7)
    order = queue_order("predicted", output, sigma, seed=11)
    noise = np.log(np.array(order.keys) / output)
    assert abs(noise.mean()) < 0.01 * sigma and noise.std() == pytest.approx(sigma, rel=0.01)
    assert order.sigma == sigma
    assert queue_order("predicted", output, sigma, seed=12).keys != order.keys  # (a draw)
