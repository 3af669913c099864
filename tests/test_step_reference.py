"""The event loop against the plain step-by-step simulator (step_reference.py) on random small
cases: every scheduler, every KV policy and none, orders, fused steps, prompts part-cached."""
import math

import numpy as np
import pytest

import dataclasses
from nn40.kv import KVBudget, check_kv_budget, kv_manager
from nn40.loop import simulate_serving
from nn40.pricing import StepCosts
from nn40.queues import queue_order
from nn40.replicas import DecodeTokens, Replica, SCHEDULERS
from nn40.speculative import Speculation, SpeculativeCosts
from nn40.workload import Requests
from step_reference import simulate_steps


def random_case(seed, scheduler, policy, decode_tokens=DecodeTokens()):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 16))
    prompt, output = rng.integers(1, 40, n), rng.integers(1, 30, n)
    cached = np.where(rng.random(n) < 0.3, rng.integers(0, prompt), 0) if seed % 2 else None
    req = Requests(np.sort(rng.exponential(0.02, n).cumsum() * (seed % 3 > 0)), prompt,
                     output, cached)
    costs = StepCosts((1, 16, 256), tuple(np.sort(rng.uniform(0.001, 0.03, 3))),
                        float(rng.uniform(0, 1e-4)), "random", pair_s=float(rng.uniform(0, 1e-6)))
    kv = None
    if policy:
        block = int(rng.integers(1, 9)) * decode_tokens.gains  # (a block holds whole steps)
        kv = KVBudget(policy, 0, block, int(output.max()), float(rng.choice([0.0, 0.05])))
        alone = kv_manager(dataclasses.replace(kv, capacity_tokens=math.inf))
        least = int(alone.blocks(prompt + alone.output_held(output)).max())
        kv = dataclasses.replace(kv, capacity_tokens=least * float(rng.uniform(1.0, 4.0)))
        while check_kv_budget(req, kv):
            kv = dataclasses.replace(kv, capacity_tokens=kv.capacity_tokens + block)
    # (a priority order under a KV budget only with every request waiting at t=0: while the
    # head of the line waits for memory the loop takes in an arrival at the next event, where
    # a step-by-step scheduler would rank it at the next step and may admit it first)
    name = rng.choice(["fcfs", "sjf", "longest"])
    order = queue_order(name if policy is None or seed % 3 == 0 else "fcfs", output)
    return req, Replica(int(rng.integers(1, 5)), costs, scheduler, int(rng.integers(4, 48)), kv,
                        order, bool(rng.integers(2)), decode_tokens=decode_tokens)


# a decode step's tokens a decoder (runs, gains): plain decoding, a verify step whose drafts
# are all rejected, and steps that gain 2 and 4 (every draft accepted)
DECODES = [DecodeTokens(1, 1), DecodeTokens(3, 1), DecodeTokens(2, 2), DecodeTokens(5, 4)]


@pytest.mark.parametrize("decode", DECODES, ids=lambda d: f"runs{d.runs}-gains{d.gains}")
@pytest.mark.parametrize("policy", [None, "reserve", "paged"])
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_the_event_loop_equals_the_step_by_step_simulator(scheduler, policy, decode):
    for seed in range(40):
        req, replica = random_case(seed, scheduler, policy, decode)
        assert_same_run(req, replica, (seed, replica), policy)


def assert_same_run(req, replica, where, policy, exact=("preemptions", "max_alloc",
                                                      "peak_running")):
    """The loop's run and the step-by-step one: steps and every request's steps exact, times
    to 1e-9; with a KV budget the memory's `exact` counts equal, its integrals (and the rest
    of its counts) to 1e-9, every token generated."""
    got, want = simulate_serving(req, replica), simulate_steps(req, replica)
    assert got["steps"] == want["steps"], where
    for key in ("first_step", "finish_step"):
        assert getattr(got["times"], key).tolist() == want[key], (where, key)
    for key in ("start", "first_token", "finish"):
        np.testing.assert_allclose(getattr(got["times"], key), want[key], rtol=1e-9,
                                   err_msg=str(where))
    if replica.speculation is not None:  # (each request's stream chunks: its ITL's)
        assert got["chunks"].tolist() == want["chunks"], where
    if policy:
        mem = got["kv"]
        for key in ("preemptions", "max_alloc", "peak_running", "held_s", "alloc_s"):
            if key in exact:
                assert mem[key] == want[key], (where, key)
            else:
                assert mem[key] == pytest.approx(want[key], rel=1e-9), (where, key)
        np.testing.assert_array_equal(got["generated"], req.output)


def test_a_decode_step_that_gains_two_tokens_by_hand():
    # an 8-token answer: the prefill's step emits the first token, then steps of 2 emit 2, 2, 2
    # and the last 1: 5 steps of 1 s where plain decoding takes 1 + 7
    req = Requests(np.zeros(1), np.array([4]), np.array([8]))
    costs = StepCosts((1, 2), (1.0, 1.0), 0.0, "every pass 1 s")
    for decode, steps in ((DecodeTokens(), 8), (DecodeTokens(2, 2), 5), (DecodeTokens(3, 1), 8)):
        got = simulate_serving(req, Replica(1, costs, decode_tokens=decode))
        assert got["steps"] == steps and got["times"].finish.tolist() == [float(steps)]


# speculating decoders: k drafts a step, each request's verify steps drawn from a law, its cache
# growing at its own rate, the draft's passes priced beside the verify's
SPECULATIONS = [Speculation("eagle3", 3, (0.73, 0.52, 0.35), "given", 6, seed=5),
                Speculation("ngram", 2, (0.5, 0.1), "given", 2, seed=9),
                Speculation("mtp", 1, (1.0,), "given", 2, seed=1)]


@pytest.mark.parametrize("spec", SPECULATIONS, ids=lambda s: s.method)
@pytest.mark.parametrize("policy", [None, "reserve", "paged"])
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_a_speculating_replica_equals_the_step_by_step_simulator(scheduler, policy, spec):
    for seed in range(40):
        req, replica = random_case(seed, scheduler, policy)
        draft = None if spec.method == "ngram" else \
            StepCosts((1, 64), (1e-4, 3e-4), 1e-6, "a draft head")
        kv = replica.kv and dataclasses.replace(  # (room beside the longest for its drafts)
            replica.kv, capacity_tokens=replica.kv.capacity_tokens + spec.lookahead
            + replica.kv.block_tokens)
        replica = dataclasses.replace(replica, speculation=spec, kv=kv,
                                      costs=SpeculativeCosts(replica.costs, draft, spec.k))
        # (a speculating decoder's cache grows by a fraction a step: its peak to 1e-9)
        assert_same_run(req, replica, (seed, replica), policy, ("preemptions", "peak_running"))
