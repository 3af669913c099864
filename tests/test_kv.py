"""C's KV-cache study: reservation vs paged blocks against a memory budget."""
import ast
import math
import pathlib

import numpy as np
import pytest

import NN_40_serving as S
import nn40.device
from nn40.accounting import kv_bytes_per_token
from nn40.config import ModelConfig
from nn40.kv import (
    KVBudget, KVManager, KV_MANAGERS, PrefixCache, Seq, check_kv_budget, kv_manager,
    plain_twin)
from nn40.loop import ServingSim, simulate_serving
from nn40.pools import Fleet, simulate_fleet
from nn40.pricing import StepCosts
from nn40.queues import Ledger
from nn40.replicas import DecodeBatch, Replica, SCHEDULERS
from nn40.runs import kv_metrics
from nn40.workload import Requests, arrival_times, lognormal_lengths
from test_cli import run_main, said

COSTS = StepCosts(tokens=(1, 64, 1024), seconds=(0.010, 0.012, 0.100), kv_token_s=1e-7,
                    source="test")


def requests(n=300, seed=0, prompt=64, rate=None):
    rng = np.random.default_rng(seed)
    output = lognormal_lengths(n, seed)
    arrival = arrival_times(n, rate, 1.0, rng)
    return Requests(arrival, np.full(n, prompt), output)


def test_whole_blocks_by_hand():
    paged = kv_manager(KVBudget("paged", 100, block_tokens=4))
    assert paged.blocks(np.array([1, 4, 5, 8, 9])).tolist() == [4, 4, 8, 8, 12]
    assert kv_manager(KVBudget("reserve", 100)).blocks(7) == 7
    assert kv_manager(KVBudget("paged", 1000, 16, watermark=0.01)).watermark == 0 * 16
    assert kv_manager(KVBudget("paged", 16_000, 16, watermark=0.01)).watermark == 10 * 16
    assert kv_manager(KVBudget("reserve", 16_000, 16, watermark=0.01)).watermark == 0


def paged_decoders(b, steps, contexts, capacity=10**6):
    """A paged cache whose decoders hold these contexts at the simulation's step `steps`, each
    admitted with its context cached and joining a DecodeBatch there."""
    paged, batch = kv_manager(KVBudget("paged", capacity, b)), DecodeBatch()
    for i, ctx in enumerate(contexts):
        seq = Seq(i, i, 0, 1, num_cached=ctx)
        paged.admit(seq, paged.need(ctx, ctx, 0, 0))
        batch.join([seq], steps)
        paged.join(seq)
    return paged


@pytest.mark.parametrize("b", [1, 3, 16])
@pytest.mark.parametrize("k", [1, 2, 5, 40])
def test_paged_runs_against_step_by_step(b, k):
    # decoders holding these contexts run k steps, step j taking a + e (j - 1) s: the blocks
    # they take and the integral of allocated tokens against summing every step (a decoder's
    # blocks hold its written tokens: all but its newest, whose KV its next step writes)
    contexts, s0, a, e = [1, 2, 3, 15, 16, 17, 100, 100], 7, 0.5, 0.01
    paged = paged_decoders(b, s0, contexts)
    assert paged.total == sum(paged.blocks(c - 1) for c in contexts)
    integral = paged.advance(s0, [], k, a, e)
    by_step = [sum(paged.blocks(c + j - 1) for c in contexts) for j in range(1, k + 1)]
    assert paged.total == by_step[-1]
    assert integral == pytest.approx(sum((a + e * (j - 1)) * x
                                         for j, x in enumerate(by_step, 1)), rel=1e-12)
    # the most steps that fit a budget: every budget between the first and the last step's
    for capacity in range(by_step[0], by_step[-1] + 1):
        want = max(j for j, x in enumerate(by_step, 1) if x <= capacity)
        assert paged_decoders(b, s0, contexts, capacity).max_steps(s0, [], k) == want, capacity


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("policy", ["reserve", "paged"])
def test_unlimited_memory_equals_the_plain_scheduler(policy, scheduler):
    req = requests(rate=40.0)
    kv = KVBudget(policy, math.inf, 16, int(req.output.max()))
    plain = simulate_serving(req, Replica(16, COSTS, scheduler, 256))
    limited = simulate_serving(req, Replica(16, COSTS, scheduler, 256, kv=kv))
    assert limited["steps"] == plain["steps"] and limited["kv"]["preemptions"] == 0
    for key in ("start", "first_token", "finish"):
        np.testing.assert_array_equal(getattr(limited["times"], key),
                                      getattr(plain["times"], key))


def test_two_reservations_fit_by_hand():
    # 4 requests (prompt 4, output 4) reserving 4 + 4 tokens in a budget of 16: two at a time;
    # each pair takes a prefill step and 3 decode steps
    req = Requests(np.zeros(4), np.full(4, 4), np.full(4, 4))
    sim = simulate_serving(req, Replica(4, COSTS, "continuous",
                                            kv=KVBudget("reserve", 16, 1, 4)))
    assert sim["steps"] == 8 and sim["kv"]["peak_running"] == 2
    assert sim["times"].start.tolist() == [0, 0, sim["times"].finish[0], sim["times"].finish[0]]


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_reserve_never_holds_more_than_the_budget(scheduler):
    req = requests()
    kv = KVBudget("reserve", 8_000, 16, 2048)
    sim = simulate_serving(req, Replica(32, COSTS, scheduler, 256, kv=kv))
    t, held, alloc, running = np.array(sim["kv"]["series"]).T
    assert alloc.max() <= kv.capacity_tokens and sim["kv"]["max_alloc"] <= kv.capacity_tokens
    assert (held <= alloc).all()
    assert sim["kv"]["peak_running"] == 8_000 // (64 + 2048)  # three reservations fit
    np.testing.assert_array_equal(sim["generated"], req.output)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_paged_stays_within_the_budget_and_a_block_per_request(scheduler):
    req = requests()
    kv = KVBudget("paged", 3_000, 16)
    sim = simulate_serving(req, Replica(32, COSTS, scheduler, 256, kv=kv))
    t, held, alloc, running = np.array(sim["kv"]["series"]).T
    assert alloc.max() <= kv.capacity_tokens
    assert (held <= alloc).all() and (alloc - held < kv.block_tokens * np.maximum(running, 1)).all()
    assert sim["kv"]["preemptions"] > 0  # the budget binds: this case exercises preemption
    # preemption loses no work: every request emits exactly its output length
    np.testing.assert_array_equal(sim["generated"], req.output)
    times = sim["times"]
    assert np.all(times.first_token <= times.finish) and not np.isnan(times.finish).any()


def test_paged_packs_more_requests_than_reserve():
    req = requests(prompt=128)
    kv = {p: KVBudget(p, 20_000, 16, 2048) for p in ("reserve", "paged")}
    sims = {p: simulate_serving(req, Replica(64, COSTS, "continuous", kv=kv[p])) for p in kv}
    assert sims["reserve"]["kv"]["peak_running"] == 20_000 // (128 + 2048)
    assert sims["paged"]["kv"]["peak_running"] > 3 * sims["reserve"]["kv"]["peak_running"]
    assert sims["paged"]["times"].finish.max() < sims["reserve"]["times"].finish.max()
    used = {p: kv_metrics(req, sims[p], kv[p])["utilization"] for p in kv}
    assert used["reserve"] < 0.3 < 0.9 < used["paged"]


def test_a_request_that_cannot_fit_is_named():
    req = Requests(np.zeros(2), np.array([10, 500]), np.array([5, 5]))
    assert check_kv_budget(req, KVBudget("paged", 300, 16)) == {
        "kind": "kv_too_long", "request": 1, "needs": 512, "block": 16, "prompt": 500,
        "output": 5, "holds": 300}
    assert check_kv_budget(req, KVBudget("reserve", 10_000, 16, max_output=4))["kind"] \
        == "kv_max_output"
    assert check_kv_budget(req, KVBudget("paged", 512, 16)) is None
    # at its longest a request has written all but its last token: 508 + 5 - 1 fill 512
    alone = Requests(np.zeros(2), np.array([508, 509]), np.array([5, 5]))
    assert check_kv_budget(alone, KVBudget("paged", 512, 16))["needs"] == 528
    assert check_kv_budget(Requests(np.zeros(1), np.array([508]), np.array([5])),
                           KVBudget("paged", 512, 16)) is None
    one = Requests(np.zeros(1), np.array([508]), np.array([5]))
    sim = simulate_serving(one, Replica(1, COSTS, kv=KVBudget("paged", 512, 16)))
    assert sim["kv"]["max_alloc"] == 512 and sim["kv"]["preemptions"] == 0


def test_a_budget_below_a_prompt_marks_the_kv_rows_and_keeps_the_rest(tmp_path, capsys):
    # the post's model holds 98,304 bytes of KV per token: 10 MB is 101 tokens < a 128 prompt
    results, out = run_main(["--experiments", "C", "--kv-memory-gb", "0.01", "--no-figures",
                             "--requests", "100", "--rates", "5", "--out", str(tmp_path)], capsys)
    C = results["C"]
    assert set(C["kv"]["unfit"]) == {"reserve", "paged"} and "paged" not in C["kv"]
    assert C["kv"]["unfit"]["paged"]["needs"] > C["kv"]["budget_tokens"] == 101
    # (the longest request is named: the post's 1,327 tokens, request 9)
    assert said("paged: does not fit, so not simulated: request 9 alone needs 1,456 tokens",
                out.out)
    assert said("static batching", out.out) and C["schedulers"]["continuous"]["steps"] > 0
    assert C["who_waits"]["kv_policy"] is None  # (it runs unlimited instead)


def test_a_lengths_file_with_one_huge_request_loses_only_the_kv_rows(tmp_path, capsys):
    # a new user's file: one output of 175,208 tokens, more than the RTX 5080 budget holds
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(["40"] * 50 + ["175208"]) + "\n")
    results, out = run_main(["--experiments", "C", "--lengths-file", str(path), "--no-figures",
                             "--out", str(tmp_path), "--rates", "5"], capsys)
    C = results["C"]
    # (both: the 51st request starts when the first 32 have ended, at step 40)
    assert C["static"]["steps"] == C["continuous"]["steps"] == 40 + 175208
    assert C["kv"]["unfit"]["paged"]["request"] == 50
    # (a reservation holds the longest output for every request: the first is named)
    assert (C["kv"]["unfit"]["reserve"]["request"], C["kv"]["unfit"]["reserve"]["output"]) == \
        (0, 175208)
    assert said("C  who waits", out.out) and said("does not fit", out.out)


def test_kv_results_and_figure(tmp_path, capsys):
    results, out = run_main(["--experiments", "C", "--requests", "200", "--kv-memory-gb", "1",
                             "--slots", "64", "--out", str(tmp_path)], capsys)
    kv = results["C"]["kv"]
    assert kv["budget_tokens"] == int(1e9 // kv_bytes_per_token(ModelConfig()))
    for policy in ("reserve", "paged"):
        for name in SCHEDULERS:
            m = kv[policy][name]
            assert {"utilization", "peak_concurrency", "mean_concurrency", "preemptions",
                    "max_allocated_tokens", "throughput_rps"} <= set(m)
            assert m["max_allocated_tokens"] <= kv["budget_tokens"]
    assert said("C  KV cache: 1.00 GB (--kv-memory-gb)", out.out)
    assert (tmp_path / "kv_memory.png").stat().st_size > 10_000


def test_the_budget_is_allocated_on_the_device(tiny_args, capsys):
    results, out = run_main(tiny_args + ["--experiments", "AC", "--no-figures"], capsys)
    check = results["C"]["kv"]["device_check"]
    assert check["batch"] == len(results["C"]["kv"]["peak"]["contexts"]) <= 4
    assert check["step_ms"] > 0 and said("allocated the budget's KV cache", out.out)


def test_a_budget_the_device_cannot_hold_is_marked(tiny_args, capsys, monkeypatch):
    monkeypatch.setattr(nn40.device, "free_memory_bytes", lambda device: 64 * 2**20)
    results, out = run_main(tiny_args + ["--experiments", "AC", "--kv-memory-gb", "5",
                                         "--no-figures"], capsys)
    check = results["C"]["kv"]["device_check"]
    assert check["bytes"] > 4e9 and check["skipped"]["kind"] == "does_not_fit"
    assert said("does not fit", out.out)


def test_memory_averages_by_hand():
    # one request, prompt 4, output 6, every pass 1 s: a prefill step (4 tokens written, the
    # emitted one's KV not yet), then a closed-form run of 5 decode steps, each writing the
    # token before the one it emits; held 4, 5, ..., 9 tokens
    req = Requests(np.zeros(1), np.array([4]), np.array([6]))
    unit = StepCosts((1, 2), (1.0, 1.0), 0.0, "unit")
    paged = simulate_serving(req, Replica(1, unit, "continuous",
                                              kv=KVBudget("paged", 100, 4)))
    assert paged["steps"] == 6 and paged["times"].finish[0] == 6.0
    assert paged["kv"]["held_s"] == 4 + 5 + 6 + 7 + 8 + 9
    assert paged["kv"]["alloc_s"] == 4 + 8 + 8 + 8 + 8 + 12  # blocks of 4 as it grows
    reserve = KVBudget("reserve", 100, max_output=10)
    sim = simulate_serving(req, Replica(1, unit, "continuous", kv=reserve))
    assert sim["kv"]["alloc_s"] == 6 * (4 + 10)
    m = kv_metrics(req, sim, reserve)
    assert m["utilization"] == pytest.approx(39 / 84)
    assert m["fragmentation"] == pytest.approx(4 * 6 / 84)  # 4 reserved tokens never used
    assert m["mean_concurrency"] == 1.0 and m["peak_concurrency"] == 1


def test_memory_integrals_are_exact_per_step():
    # one request, prompt 4, output 6, a pass costs 1 s + 0.5 s per cached token: a prefill
    # step (1 s, then 4 tokens held), then one run of 5 decode steps over 5..9 cached tokens
    # (3.5, 4, 4.5, 5, 5.5 s; then 5..9 held: each writes the token it reads last); each step
    # weighs what it holds by its own time
    req = Requests(np.zeros(1), np.array([4]), np.array([6]))
    costs = StepCosts((1, 2), (1.0, 1.0), 0.5, "linear")
    sim = simulate_serving(req, Replica(1, costs, "continuous", kv=KVBudget("paged", 100, 4)))
    assert sim["times"].finish[0] == 1 + 3.5 + 4 + 4.5 + 5 + 5.5
    assert sim["kv"]["held_s"] == pytest.approx(1 * 4 + 3.5 * 5 + 4 * 6 + 4.5 * 7 + 5 * 8
                                                + 5.5 * 9)
    assert sim["kv"]["alloc_s"] == pytest.approx(1 * 4 + 3.5 * 8 + 4 * 8 + 4.5 * 8 + 5 * 8
                                                 + 5.5 * 12)  # blocks of 4 for 4..9 tokens


def test_the_newest_request_is_preempted():
    # A then B (prompt 2, output 5 each) in 8 tokens of blocks of 1: after the prefill (2 + 2
    # written) and two decode steps (3 + 3, 4 + 4), the next step needs 10: B, the newer, is
    # preempted (its 2 prompt + 3 generated tokens to recompute, the newest unwritten too, as
    # vLLM recomputes every token) and waits until A has finished
    req = Requests(np.zeros(2), np.array([2, 2]), np.array([5, 5]))
    sim = simulate_serving(req, Replica(2, StepCosts((1, 2), (1.0, 1.0), 0.0, "unit"),
                                            "continuous", kv=KVBudget("paged", 8, 1)))
    assert sim["kv"]["preemptions"] == 1 and sim["kv"]["recomputed_tokens"] == 5
    # A decodes alone to its end at 5 s; B is prefilled again (5 tokens) and ends at 7 s
    assert sim["times"].finish.tolist() == [5.0, 7.0] and sim["steps"] == 7
    assert sim["times"].first_token.tolist() == [1.0, 1.0]  # B keeps its first token
    np.testing.assert_array_equal(sim["generated"], req.output)


def test_the_watermark_keeps_blocks_free_at_admission():
    # two prompts of 46 tokens in 100 tokens of blocks of 1: without a watermark both fit
    # (46 + 46); keeping 10% free, the second waits for the first (46 + 46 + 10 > 100)
    req = Requests(np.zeros(2), np.array([46, 46]), np.array([1, 1]))
    for watermark, together in ((0.0, 2), (0.1, 1)):
        kv = KVBudget("paged", 100, 1, watermark=watermark)
        sim = simulate_serving(req, Replica(2, COSTS, "continuous", kv=kv))
        assert sim["kv"]["peak_running"] == together


def test_the_watermark_stops_chunked_prefill_thrashing():
    # long prompts in a small cache: admitted on their first chunk, prompts are preempted by
    # their own next chunks; admitted on their whole prompt (vLLM's rule), they are not
    req = requests(n=200, prompt=1500, rate=20.0)
    runs = {w: simulate_serving(req, Replica(32, COSTS, "chunked", 256, kv=KVBudget(
                "paged", 12_000, 16, watermark=w)))
            for w in (0.0, 0.01)}
    naive, vllm = runs[0.0]["kv"]["preemptions"], runs[0.01]["kv"]["preemptions"]
    assert naive > 5 * max(vllm, 1)
    assert runs[0.01]["times"].finish.max() < runs[0.0]["times"].finish.max()
    for sim in runs.values():
        assert sim["iterations"] <= 6 * 200 + 3 * sim["kv"]["preemptions"]


class StaticRows(KVManager):
    """A static cache (gpt-fast's, D's engine's): each request takes a row of block_tokens."""
    tracks = True

    def __init__(self, kv):
        self.capacity, self.block = kv.capacity_tokens, kv.block_tokens

    def need(self, prompt, cached, chunk, to_prefill):
        return self.block

    def admit(self, seq, need):
        seq.allocated = need
        self.total += need

    def release(self, seq, ctx):
        self.total -= seq.allocated


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_a_new_kv_manager_is_one_class_and_one_registry_line(monkeypatch, scheduler):
    monkeypatch.setitem(KV_MANAGERS, "rows", StaticRows)
    rng = np.random.default_rng(0)
    req = Requests(arrival_times(60, 50.0, 1.0, rng), np.full(60, 64), rng.integers(1, 100, 60))
    kv = KVBudget("rows", 3 * 200, block_tokens=200)
    replica = Replica(8, COSTS, scheduler, 128, kv=kv)
    sim = simulate_serving(req, replica)
    assert sim["kv"]["peak_running"] == 3 and sim["kv"]["max_alloc"] == 600  # three rows
    np.testing.assert_array_equal(sim["generated"], req.output)
    t, held, alloc, running = np.array(sim["kv"]["series"]).T
    assert (held <= alloc).all() and (alloc == 200 * running).all()
    assert 0 < kv_metrics(req, sim, kv)["utilization"] < 1
    fleet = simulate_fleet(req, replica, Fleet(2, "least-kv"))
    assert set(fleet["replica"].tolist()) == {0, 1} and not np.isnan(fleet["times"].finish).any()


@pytest.mark.parametrize("policy", ["reserve", "paged"])
def test_a_request_admitted_part_way_holds_its_cache_and_prefills_the_rest(policy):
    # alone: 64 prompt tokens at 20 a step take 4 steps; with 48 cached, the other 16 take one,
    # priced over the 48 cached; paged, its blocks for the 48 are taken at admission
    kv = KVBudget(policy, 10**6, 16, 8)
    one, part = (Requests(np.zeros(1), np.array([64]), np.array([8]), cached=c)
                 for c in (None, np.array([48])))
    cold, warm = (simulate_serving(r, Replica(8, COSTS, "chunked", 20, kv=kv))
                  for r in (one, part))
    assert (cold["times"].first_step[0], warm["times"].first_step[0]) == (4, 1)
    assert warm["times"].first_token[0] == pytest.approx(COSTS.pass_s(16, 48))
    assert warm["steps"] == cold["steps"] - 3 and warm["generated"][0] == 8
    assert warm["kv"]["max_alloc"] == cold["kv"]["max_alloc"] == (80 if policy == "paged" else 72)
    # many, arriving over time: every token emitted, and less held than computing it all
    req = requests(n=40, prompt=64, rate=20.0)
    part = Requests(req.arrival_s, req.prompt, req.output, cached=np.full(40, 48))
    kv = KVBudget(policy, 10**6, 16, 2048)
    cold, warm = (simulate_serving(r, Replica(8, COSTS, "chunked", 20, kv=kv))
                  for r in (req, part))
    np.testing.assert_array_equal(warm["generated"], req.output)
    assert np.mean(warm["times"].first_token - req.arrival_s) < np.mean(cold["times"].first_token
                                                                  - req.arrival_s)


def test_a_request_prefilled_elsewhere_decodes_from_its_first_step():
    # its prompt (100) and first token prefilled elsewhere: it arrives holding 101 tokens and
    # decodes its other 9, one a step, in blocks of 16 that grow to hold 110
    req = Requests(np.zeros(1), np.array([100]), np.array([10]))
    ledger = Ledger(req)
    ledger.to_prefill[0] = ledger.cached[0] = 101
    ledger.remaining[0], ledger.first_token[0] = 9, -1.0
    sim = ServingSim(req, Replica(4, COSTS, "continuous", kv=KVBudget("paged", 512, 16)),
                       ledger=ledger).serve()
    times = sim["times"]
    assert sim["steps"] == 9 and times.finish_step[0] == 9 and times.first_token[0] == -1.0
    assert sim["kv"]["max_alloc"] == 112 and sim["generated"][0] == 9
    assert times.finish[0] == pytest.approx(sum(COSTS.pass_s(1, 101 + j) for j in range(9)))


def kind_tests(source):
    """Lines of `source` that compare with a KV policy's name or isinstance a manager class."""
    names, classes = set(KV_MANAGERS), {c.__name__ for c in KV_MANAGERS.values()}
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            named = [node.left, *node.comparators]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
            named = list(ast.walk(node.args[1]))
        else:
            continue
        if any(isinstance(x, ast.Constant) and x.value in names or
               isinstance(x, ast.Name) and x.id in classes for x in named):
            out.append(node.lineno)
    return out


def test_no_code_asks_which_kv_manager_it_holds():
    root = pathlib.Path(S.__file__).parent
    for path in [root / "NN_40_serving.py", *sorted((root / "nn40").glob("*.py"))]:
        assert kind_tests(path.read_text(encoding="utf-8")) == [], path.name
    # (the check sees both ways of asking)
    assert kind_tests("if kv.policy == 'paged': pass\nisinstance(a, (Reservation, int))") == [1, 2]


def test_a_caching_policy_finds_its_plain_twin_through_the_registry(monkeypatch):
    assert plain_twin("prefix") == "paged" and plain_twin("paged") is None

    class Other(PrefixCache):  # a second caching policy that no plain policy names
        pass
    monkeypatch.setitem(KV_MANAGERS, "prefix-other", Other)
    assert plain_twin("prefix-other") is None  # (no StopIteration: the callers skip it)
