"""Disaggregated serving: prices by phase (DistServe's profiles), pipeline stages, the KV
hand-off between pools, and DistServe's logged runs replayed."""
import heapq
import itertools
import json
import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest

import NN_40_serving as S
from nn40.config import GPUS, MODELS
from nn40.disaggregated import (
    DISTSERVE_DECODE_IN_FLIGHT, check_placement, distserve_kv_tokens, distserve_placement,
    distserve_replica, placement_goodput, placement_pools, profiled_costs,
    read_distserve_profile, replay_distserve, search_candidates, search_placements)
from nn40.stages import PipelineCosts, pipeline_costs, pipelined, steps_reaching
from nn40.errors import UsageError
from nn40.events import EventQueue, SENT
from nn40.handoff import KVLink, KVSends, kv_link
from nn40.host import run_parallel
from nn40.kv import KVBudget
from nn40.loop import simulate_serving
from nn40.metrics import serving_metrics
from nn40.pools import Pool, simulate_pools
from nn40.pricing import StepCosts, card_costs
from nn40.replicas import Replica, schedule_prefill
from nn40.workload import Requests, arrival_times, read_engine_run
from test_cli import expect_usage_error

UNIT = StepCosts((1, 2), (1.0, 1.0), 0.0, "every pass 1 s")
SLOW = StepCosts((1, 2), (1.5, 1.5), 0.0, "every pass 1.5 s")
HERE = os.path.dirname(os.path.abspath(__file__))
DISTSERVE = os.path.join(HERE, "..", "..", "shared", "traces", "real_runs", "distserve")
PROFILES = os.path.join(DISTSERVE, "profile_data")
LOGS = os.path.join(DISTSERVE, "ground_truth_opt-13b-sharegpt")
needs_logs = pytest.mark.skipif(not os.path.isdir(LOGS), reason="DistServe's logs absent")
# OPT-13B at TP 1 in DistServe's vLLM profile (profiler-a100-80g.vllm.json), in ms
FIT = {"decoding_large_small_bs_threshold": 95,
       "prefill": [22.052204789310185, 0.14050923870128956, 8.076584822611088e-06],
       "decoding_smallbs": [23.475041008414784, 0.000592934466077393, 0.060726861260369455],
       "decoding_largebs": [20.206356173691958, 0.0004907727036234946, 0.1200031385587413]}


class Chunk:  # (what run_price reads of a prefilling request)
    def __init__(self, num_cached=0):
        self.num_cached = num_cached


def ray_overhead_ms(tokens):  # simdistserve/base/worker.py, add_ray_overhead, as written
    return 2 + tokens * 0.0001


def distserve_prefill_ms(prompts, pp=1):
    # DistServe's simulator, written plainly: each of pp stages runs the profile's fit / pp
    # and pp ms (time_estimator.py, get_prefill_time), the first its overhead on the prompts
    a, b, c = FIT["prefill"]
    stage = (a + b * sum(prompts) + c * sum(p * p for p in prompts)) / pp + pp
    return pp * stage + ray_overhead_ms(sum(prompts))


def distserve_decode_ms(contexts, pp=1):
    # the first stage sets a pipeline's pace: pp of its passes (the fit / pp and its
    # overhead on the contexts) per micro-batch's token (get_decode_time, add_ray_overhead)
    a, b, c = FIT["decoding_smallbs" if len(contexts) < 95 else "decoding_largebs"]
    first = (a + b * sum(x + 1 for x in contexts) + c * len(contexts)) / pp + \
        ray_overhead_ms(sum(contexts))
    return pp * first


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("prompts", [[1], [814], [2031, 17, 300], [512] * 20])
def test_profiled_prefill_is_distserves_formula(prompts, pp):
    costs = profiled_costs(FIT, "test", pp)
    prefill_s = costs.run_price([(Chunk(), p) for p in prompts], 0, 0, 1)[0]
    assert prefill_s * 1e3 == pytest.approx(distserve_prefill_ms(prompts, pp), rel=1e-12)


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("rows", [1, 2, 94, 95, 96, 300])
def test_profiled_decode_is_distserves_formula_over_a_run(rows, pp):
    # k steps of a decode run: each row's context grows by one a step; the run's seconds are
    # the formula's steps summed
    costs, rng = profiled_costs(FIT, "test", pp), np.random.default_rng(rows)
    contexts, k = rng.integers(10, 2000, size=rows), 7
    decode_s = costs.run_price((), rows, int(contexts.sum()), k)[1]
    reference = sum(distserve_decode_ms(contexts + j, pp) for j in range(k))
    assert decode_s * 1e3 == pytest.approx(reference, rel=1e-9)


def test_a_pipeline_step_is_its_stages_plus_hops_by_hand():
    # inner: 0.5 s + 0.1 s a token or row; 2 stages, a hop 0.1 s + 0.01 s a token.
    # Decode of 5 rows: 2 micro-batches of 3 rows (rounded up): 0.5 + 0.3 + (0.1 + 0.03)
    # = 0.93 s a step, every row a token. Prefill of 10 tokens: 1.5 + 0.1 + 0.1 = 1.7 s
    inner = StepCosts((1, 2), (0.6, 0.7), 0.0, "0.5 s + 0.1 s a token")
    pp = PipelineCosts(inner, 2, 0.1, 0.01)
    assert pp.run_price((), 5, 0, 1)[1] == pytest.approx(0.93)
    assert pp.run_price([(Chunk(), 10)], 0, 0, 1)[0] == pytest.approx(1.7)
    assert pp.run_price([(Chunk(), 10)], 5, 0, 3)[:2] == pytest.approx((5.1, 2.79))
    one = PipelineCosts(inner, 2, 0.1, 0.01, micro_batches=1)  # one batch in flight
    assert one.run_price((), 5, 0, 1)[1] == pytest.approx(1.0 + 0.15)
    # four stages of 8 rows holding 800 tokens, 1 ms a cached token: 2 rows, 200 tokens
    inner = StepCosts((1, 2), (0.6, 0.7), 1e-3, "and 1 ms a cached token")
    pp4 = PipelineCosts(inner, 4, 0.0, 0.0)
    assert pp4.run_price((), 8, 800, 1)[1] == pytest.approx(0.7 + 0.2)
    # and the growth: each step every micro-batch's 2 rows add 2 cached tokens
    assert pp4.run_price((), 8, 800, 2)[1] == pytest.approx(0.9 + 0.902)
    card = GPUS["a100-80gb"]
    assert pipeline_costs(inner, 1, MODELS["opt-13b"], card) is inner
    hop = pipeline_costs(inner, 2, MODELS["opt-13b"], card).hop_token_s
    assert hop == pytest.approx(5120 * 2 / 300e9)  # a token's hidden state over NVLink 3


def test_prompts_side_by_side_overlap_across_the_stages_by_hand():
    # inner: 0.5 s + 0.1 s a token; 2 stages, no hops. Chunks of 10, 7 and 2 tokens: the 10
    # in one micro-batch, the 7 and the 2 in the other (9 tokens), so the heaviest carries
    # 10: a step of 0.5 + 1.0 = 1.5 s prefills all 19 (one micro-batch in flight: 2.4 s)
    inner = StepCosts((1, 2), (0.6, 0.7), 0.0, "0.5 s + 0.1 s a token")
    plan = [(Chunk(), 7), (Chunk(), 10), (Chunk(), 2)]
    pp = PipelineCosts(inner, 2)
    assert pp.heaviest_prompts(plan) == [plan[1]]
    assert pp.run_price(plan, 0, 0, 1)[0] == pytest.approx(1.5)
    assert pp.run_price(plan, 0, 0, 1)[4] == 19  # (every chunk advances)
    assert PipelineCosts(inner, 2, micro_batches=1).run_price(plan, 0, 0, 1)[0] == \
        pytest.approx(2.4)
    # with 4 decoders fused into the pass: 2 rows beside the heaviest chunks, 0.5 + 1.2
    assert sum(pp.run_price(plan, 4, 0, 1, fused=True)[:2]) == pytest.approx(1.7)
    # three stages, four chunks of 5: 5, 5 and 10 tokens a micro-batch
    assert sum(c for _, c in PipelineCosts(inner, 3).heaviest_prompts(
        [(Chunk(), 5)] * 4)) == 10


def test_a_pipeline_replica_takes_a_step_budget_for_each_micro_batch():
    # vLLM v1 schedules each of the pp batches in flight with its own budget
    # and a prompt's chunk within one batch's budget: 5,000 tokens left take 2,048 a step
    # beside another's 2,048, not 4,096 alone
    pp = Replica(8, PipelineCosts(UNIT, 2), "chunked", 2048, prompt_tokens=4096)
    assert (pipelined(pp).chunk_tokens, pipelined(pp).prompt_tokens) == (4096, 8192)
    assert pipelined(pp).batch_tokens == 2048
    one = Replica(8, PipelineCosts(UNIT, 4, micro_batches=1), "chunked", 2048)
    assert (pipelined(one).chunk_tokens, pipelined(one).prompt_tokens,
            pipelined(one).batch_tokens) == (2048, None, None)
    flat = Replica(8, UNIT, "chunked", 2048)
    assert pipelined(flat) is flat
    long, other = SimpleNamespace(prompt_left=5000), SimpleNamespace(prompt_left=3000)
    assert schedule_prefill([long, other], 0, 4096, 2048) == [(long, 2048), (other, 2048)]
    assert schedule_prefill([long], 0, 4096) == [(long, 4096)]  # (no cap: one chunk of both)


def test_a_pipeline_replica_prefills_two_prompts_at_once():
    # two prompts of 10 tokens waiting on 2 stages of 0.5 s + 0.1 s a token: one micro-batch
    # each, both first tokens at 1.5 s (in one micro-batch: 2.5 s)
    inner = StepCosts((1, 2), (0.6, 0.7), 0.0, "0.5 s + 0.1 s a token")
    req = Requests(np.zeros(2), np.array([10, 10]), np.array([1, 1]))
    for micro_batches, first in ((None, 1.5), (1, 2.5)):
        sim = simulate_serving(req, Replica(4, PipelineCosts(inner, 2,
                                                             micro_batches=micro_batches)))
        assert sim["times"].first_token.tolist() == pytest.approx([first, first])


def distserve_decode_loop(arrivals, tokens, spills=(), newcomers_to_lighter=False, pp=2):
    """DistServe's decoding engine loop on pp stages, written out plainly (decoding_stage_
    scheduler.py, single_stage_engine.py): each step takes the next of pp batch queues,
    adds the waiting requests to it, and launches it through the stages (each 5 ms + 0.1 ms
    a row), or with it empty sleeps 3 ms; with pp batches in the pipeline it waits on the
    oldest, whose requests then gain a token; at the step's end the requests that have
    crossed by then wait for the next, but for those in `spills`, accepted a step later (a
    crossing in the yield between steps, or one held back by the waiting prompts' share of
    the blocks). `newcomers_to_lighter`: the rule seeded otherwise. -> the rows of every
    launch, [(queue, rows)]."""
    queues, waiting, held, pipeline, launched = [[] for _ in range(pp)], [], [], [], []
    left, free, t, cur, k = {}, [0.0] * pp, 0.0, -1, 0
    while k < len(arrivals) or waiting or held or any(queues):
        cur = (cur + 1) % pp
        for r in waiting:
            (min(queues, key=len) if newcomers_to_lighter else queues[cur]).append(r)
        waiting, batch = [], queues[cur]
        if batch:
            end = t
            for stage in range(pp):
                end = free[stage] = max(end, free[stage]) + 0.005 + 1e-4 * len(batch)
            pipeline.append((cur, end, list(batch)))
            launched.append((cur, len(batch)))
        else:
            pipeline.append(None)
            t += 0.003
        if len(pipeline) == pp and pipeline[0] is None:
            pipeline.pop(0)
        elif len(pipeline) == pp:
            queue, done, rows = pipeline.pop(0)
            t = max(t, done)
            for r in rows:
                left[r] -= 1
                if not left[r]:
                    queues[queue].remove(r)
        if not any(queues) and not pipeline and k < len(arrivals):
            t = max(t, arrivals[k])
        waiting, held = waiting + held, []
        while k < len(arrivals) and arrivals[k] <= t:
            (held if k in spills else waiting).append(k)
            left[k], k = tokens, k + 1
    return launched


def test_distserves_decoding_loop_fills_one_batch_queue_till_a_spill():
    # 200 requests crossing at 20 a second, 50 tokens each: every launch is of the same queue,
    # the other empty throughout, so the pool runs one micro-batch in flight
    # (DISTSERVE_DECODE_IN_FLIGHT); one crossing accepted a step late (the 11th) lands in the
    # other queue, and from then on newcomers join both: two in flight; the rule seeded
    # otherwise (newcomers to the lighter queue) launches both from the start
    arrivals = list(np.arange(200) / 20)
    assert len({queue for queue, _ in distserve_decode_loop(arrivals, 50)}) == 1
    spilled = [queue for queue, _ in distserve_decode_loop(arrivals, 50, spills={10})]
    assert min(spilled.count(0), spilled.count(1)) > 0.4 * len(spilled)
    assert len({queue for queue, _ in distserve_decode_loop(arrivals, 50, (), True)}) == 2
    ds = distserve_replica(PROFILES, "distserve", (1, 2), "decode", GPUS["a100-80gb"]) \
        if os.path.isdir(PROFILES) else None
    if ds is not None:
        assert ds.costs.in_flight == DISTSERVE_DECODE_IN_FLIGHT == 1
        assert distserve_replica(PROFILES, "distserve", (1, 2), "decode", GPUS["a100-80gb"],
                                 2).costs.in_flight == 2  # (--pp-micro-batches 2)
        assert distserve_replica(PROFILES, "distserve", (1, 2), "prefill",
                                 GPUS["a100-80gb"]).costs.in_flight == 2


def test_a_pipeline_replica_decodes_by_hand():
    # one request (prompt 4, 3 tokens) on 2 stages of the 1 s model, hops 0.25 s: its prefill
    # 1 + 0.25, then two decode steps of 1 + 0.25 each
    pp = PipelineCosts(UNIT, 2, 0.25, 0.0)
    req = Requests(np.array([0.0]), np.array([4]), np.array([3]))
    sim = simulate_serving(req, Replica(4, pp))
    assert sim["times"].first_token.tolist() == [1.25] and sim["times"].finish.tolist() == [3.75]


@pytest.mark.parametrize("first, gap, k", list(itertools.product(
    [0.5, 1.0], [0.0, 0.3, 1.0, 2.5, 7.1, 100.0], [1, 3, 50])))
def test_steps_reaching_is_the_first_run_long_enough(first, gap, k):
    for growth in (0.0, 0.01, 0.7):
        ends = [first * j + growth * j * (j - 1) / 2 for j in range(1, k + 1)]
        want = next((j for j, end in enumerate(ends, 1) if end >= gap), k)
        assert steps_reaching(first, growth, gap, k) == want


def test_prefill_first_emits_the_first_token_before_the_decode_pass():
    # A (prompt 4, 3 tokens) at 0: prefilled 0-1, its first token at 1. B (2 tokens) at 0.5
    # is admitted at 1: the step 1-3 prefills B (1 s), then decodes A (1 s). Prefill first,
    # B's first token is at 2, else at the step's end, 3; A's tokens are at 3 and 5 either way
    req = Requests(np.array([0.0, 0.5]), np.array([4, 4]), np.array([3, 2]))
    late = simulate_serving(req, Replica(2, UNIT))
    first = simulate_serving(req, Replica(2, UNIT, prefill_first=True))
    assert late["times"].first_token.tolist() == [1.0, 3.0]
    assert first["times"].first_token.tolist() == [1.0, 2.0]
    assert first["times"].finish.tolist() == late["times"].finish.tolist() == [4.0, 4.0]


def land_times(link, starts):
    """KVSends on one link alone: [(tokens, start s)] -> (when each lands, the totals)."""
    queue, landed = EventQueue([]), {}
    sends = KVSends(link, 1, queue, landed.__setitem__)
    pending = sorted((t, r, tokens) for r, (tokens, t) in enumerate(starts))
    while pending or queue.events:
        if pending and (not queue.events or pending[0][0] < queue.events[0][0]):
            t, r, tokens = pending.pop(0)
            sends.send(0, tokens, t, r)
        else:
            t, kind, _, target, value = heapq.heappop(queue.events)
            assert kind == SENT
            target.sent(t, value)
    return [landed[r] for r in range(len(starts))], sends.totals


def test_kv_bytes_of_a_hand_off_by_hand():
    # OPT-13B: 40 layers x K and V x 5,120 x 2 bytes = 819,200 bytes a token; a 1,000-token
    # prompt is 819.2 MB, over the A100's NVLink 3 (300 GB/s) 2.7307 ms
    link = kv_link(MODELS["opt-13b"], GPUS["a100-80gb"])
    assert link.kv_bytes_per_token == 819_200 and link.bytes_per_s == 300e9
    landed, totals = land_times(link, [(1000, 0.0)])
    assert landed == [pytest.approx(819.2e6 / 300e9)] and totals["bytes"] == 819.2e6
    net = kv_link(MODELS["opt-13b"], GPUS["a100-80gb"], gbs=25.0, latency_us=10.0)
    assert land_times(net, [(1000, 1.0)])[0] == [pytest.approx(1.0 + 819.2e6 / 25e9 + 1e-5)]


def test_sends_on_one_link_share_it_fairly_by_hand():
    # 10 bytes/s, a byte a token. A (10) from 0 alone: 5 sent by 0.5. B (10) and C (2) join
    # at 0.5: three at 10/3 bytes/s each; C's 2 bytes end at 1.1 (A has 3 left, B 8); two at
    # 5 bytes/s: A ends at 1.7 (B 5 left), B alone at 2.2: all 22 bytes at the full rate, as
    # first come first sent would end them (1.0, 2.0, 2.2), but each shares the wait
    link = KVLink(10.0, 0.0, 1.0)
    landed, totals = land_times(link, [(10, 0.0), (10, 0.5), (2, 0.5)])
    assert landed == pytest.approx([1.7, 2.2, 1.1])
    assert totals["link_s"] == pytest.approx(2.2)
    assert totals["queued_s"] == pytest.approx((1.7 - 1.0) + (1.7 - 1.0) + (0.6 - 0.2))
    # a send that joins an idle link starts its clock again: alone, at the full rate
    assert land_times(link, [(10, 0.0), (10, 5.0)])[0] == pytest.approx([1.0, 6.0])


def test_a_hand_off_waits_for_its_kv_exactly():
    # The tiny case of test_fleet's hand-off, with a link of 16 bytes/s, 0.25 s a send and a
    # byte a token: a 4-token prompt takes 0.25 s to send and lands 0.25 s later. A's first
    # token at 1.5, in the decode pool at 2.0: 2.0-3.0-4.0. B's first token at 3.0 (it waited
    # for the prefill slot), sent 3.0-3.25, in at 3.5 during A's step 3-4: joins at 4, ends 5
    req = Requests(np.array([0.0, 0.5]), np.array([4, 4]), np.array([3, 2]))
    pools = [Pool("prefill", Replica(1, SLOW)), Pool("decode", Replica(2, UNIT))]
    link = KVLink(16.0, 0.25, 1.0)
    sim = simulate_pools(req, pools, ["prefill", "decode"], link=link)
    times = sim["times"]
    assert times.first_token.tolist() == [1.5, 3.0] and times.finish.tolist() == [4.0, 5.0]
    assert sim["kv_transfer"] == {"sends": 2, "bytes": 8.0, "link_s": 0.5, "queued_s": 0.0}
    # two prompts prefilled in one step share their replica's link: each at 8 bytes/s, both
    # sent 1.5-2.0, in at 2.25, decoding together 2.25-3.25-4.25
    req = Requests(np.array([0.0, 0.0]), np.array([4, 4]), np.array([3, 3]))
    pools = [Pool("prefill", Replica(2, SLOW)), Pool("decode", Replica(2, UNIT))]
    sim = simulate_pools(req, pools, ["prefill", "decode"], link=link)
    assert sim["times"].first_token.tolist() == [1.5, 1.5] and sim["times"].finish.tolist() == [4.25, 4.25]
    assert sim["kv_transfer"]["queued_s"] == 0.5
    # without a link the hand-off is at the first token, as before
    sim = simulate_pools(req, pools, ["prefill", "decode"])
    assert sim["times"].finish.tolist() == [3.5, 3.5] and "kv_transfer" not in sim


def test_a_one_token_request_sends_nothing():
    req = Requests(np.array([0.0, 0.5]), np.array([4, 4]), np.array([1, 3]))
    pools = [Pool("prefill", Replica(1, SLOW)), Pool("decode", Replica(2, UNIT))]
    sim = simulate_pools(req, pools, ["prefill", "decode"], link=KVLink(16.0, 0.25, 1.0))
    assert sim["kv_transfer"]["sends"] == 1 and sim["times"].finish.tolist() == [1.5, 5.5]


@pytest.mark.parametrize("name, engine, placement", [
    ("vllm-100-1.exp", "vllm", None), ("distserve-c21d11-300-3.exp", "distserve",
                                       ((2, 1), (1, 1))),
    ("distserve-c21d12-400-4.exp", "distserve", ((2, 1), (1, 2))),
    ("distserve-800-8.exp", "distserve", ((2, 1), (1, 1)))])
def test_a_logs_name_gives_its_placement(name, engine, placement):
    assert distserve_placement(name) == (engine, placement)


def test_a_name_that_is_no_distserve_run_is_a_usage_error():
    with pytest.raises(UsageError, match="not a DistServe run"):
        distserve_placement("sglang-100-1.exp")


@pytest.mark.skipif(not os.path.isdir(PROFILES), reason="DistServe's profiles absent")
def test_the_profiles_read_from_their_files():
    costs = read_distserve_profile(PROFILES, "vllm", "opt-13b", 1)
    with open(os.path.join(PROFILES, "profiler-a100-80g.vllm.json")) as f:
        assert json.load(f)["facebook/opt-13b"]["1"] == FIT
    assert costs.run_price([(Chunk(), 814)], 0, 0, 1)[0] * 1e3 == \
        pytest.approx(distserve_prefill_ms([814]))
    assert distserve_kv_tokens(PROFILES, "opt-13b", 1, 1) == 66_144
    assert distserve_kv_tokens(PROFILES, "opt-13b", 1, 2) == 163_008
    with pytest.raises(UsageError, match="no fit of opt-13b at tp 3"):
        read_distserve_profile(PROFILES, "vllm", "opt-13b", 3)


@needs_logs
def test_a_colocated_vllm_run_replayed_on_the_profile():
    # priced as DistServe's simulator prices vLLM: C's TPOT p50 on the 1 request/s run is
    # within 15% of the measured 31.2 ms (34.3 ms: the simulator's 2 ms a step on top of the
    # profile), every request is served, and the measured row is the log's own
    row = replay_distserve(os.path.join(LOGS, "vllm-100-1.exp"), PROFILES)
    assert row["requests"] == 100 and row["pools"] == ["vllm"] and row["placement"] == "TP1"
    assert row["measured"]["tpot_s"]["p50"] == pytest.approx(0.0312, abs=5e-4)
    assert row["simulated"]["tpot_s"]["p50"] == pytest.approx(0.0312, rel=0.15)
    assert row["kv_transfer"] is None


@needs_logs
def test_a_disaggregated_run_replayed_moves_every_prompts_kv():
    path = os.path.join(LOGS, "distserve-c21d11-300-3.exp")
    row, log = replay_distserve(path, PROFILES), read_engine_run(path)
    sends = row["kv_transfer"]
    assert row["pools"] == ["prefill", "decode"]
    assert sends["sends"] == int((log["output"] > 1).sum())
    assert sends["bytes"] == 819_200 * int(log["prompt"][log["output"] > 1].sum())


def within_bounds(row):
    """A replayed DistServe run within bounds: SLO met within 10 points of the measured (a
    share of whole requests: 68 of 100 against 58 is within), TTFT and TPOT p50 within 20%."""
    m, s = row["measured"], row["simulated"]
    return abs(m["slo_attained"] - s["slo_attained"]) <= 0.10 + 1e-9 and all(
        abs(s[key]["p50"] / m[key]["p50"] - 1) <= 0.20 for key in ("ttft_s", "tpot_s"))


@needs_logs
def test_replay_distserve_end_to_end(tmp_path, capsys):
    from test_cli import run_main
    out = tmp_path / "out"
    results, printed = run_main(["--replay-distserve", DISTSERVE, "--out", str(out),
                                 "--jobs", "2"], capsys)
    rows = results["distserve_replay"]["rows"]
    assert len(rows) == len([n for n in os.listdir(LOGS) if n.endswith(".exp")]) == 37
    assert rows[0]["file"].startswith("vllm") and "TP2 PP1 + TP1 PP2" in printed.out
    saved = json.loads((out / "distserve_replay.json").read_text())
    assert [r["file"] for r in saved["distserve_replay"]["rows"]] == [r["file"] for r in rows]
    # 30 of the 37 within bounds (tests/README.md: the table); DistServe's decode pool
    # replayed with its two batch queues both filled (the engine's rule seeded otherwise)
    # brings its runs' count down from 4 of 7 to 2
    assert sum(map(within_bounds, rows)) == 30
    pp2 = [r for r in rows if "c21d12" in r["file"]]
    seeded = [replay_distserve(os.path.join(LOGS, r["file"]), PROFILES, None, 2) for r in pp2]
    assert (sum(map(within_bounds, pp2)), sum(map(within_bounds, seeded))) == (4, 2)
    # a slower link between the pools only delays the decode side: TTFT is unchanged
    path = os.path.join(LOGS, "distserve-c21d11-300-3.exp")
    slow = replay_distserve(path, PROFILES, kv_link(MODELS["opt-13b"],
                                                         GPUS["a100-80gb"], None, 1.0, 100.0))
    fast = next(r for r in rows if r["file"] == "distserve-c21d11-300-3.exp")
    assert slow["simulated"]["ttft_s"] == fast["simulated"]["ttft_s"]
    assert slow["kv_transfer"]["link_s"] == pytest.approx(fast["kv_transfer"]["link_s"] * 300)


@pytest.mark.parametrize("args, fragment", [
    (["--replay-distserve", os.path.join(HERE, "data")], "no DistServe logs"),
    (["--replay-distserve", DISTSERVE, "--kv-link-gbs", "0"], "expected a number"),
    (["--replay-distserve", DISTSERVE, "--pp-micro-batches", "0"], "positive integer")])
def test_bad_replay_flags(args, fragment, capsys):
    from test_cli import expect_usage_error
    expect_usage_error(args, capsys, fragment)


OPT = MODELS["opt-13b"]
A100 = GPUS["a100-80gb"]


@pytest.mark.parametrize("pools, gpus, fragment", [
    ([("prefill", 1, 2, 1)], None, "a prefill pool and a decode pool"),
    ([], None, "no pools"),
    ([("colocated", 1, 1, 1), ("decode", 1, 1, 1)], None, "one colocated pool"),
    ([("prefill", 1, 3, 1), ("decode", 1, 1, 1)], None, "TP must divide"),
    ([("colocated", 1, 1, 41)], None, "PP at most its 40 layers"),
    ([("colocated", 0, 1, 1)], None, "a replica at least"),
    ([("prefill", 4, 2, 1), ("decode", 4, 1, 2)], 8, "16 cards, past the budget of 8")])
def test_a_placement_that_does_not_fit_is_one_line(pools, gpus, fragment):
    with pytest.raises(UsageError, match=fragment) as e:
        check_placement(OPT, A100, pools, gpus)
    assert "\n" not in str(e.value)


def test_weights_that_do_not_fit_a_card_and_a_zero_link():
    big = MODELS["llama-3.1-70b"] if "llama-3.1-70b" in MODELS else None
    if big is not None:
        with pytest.raises(UsageError, match="GB of llama-3.1-70b's weights on each"):
            check_placement(big, A100, [("colocated", 1, 1, 1)])
        assert check_placement(big, A100, [("colocated", 1, 2, 2)]) == 4
    assert check_placement(OPT, A100, [("prefill", 1, 2, 1), ("decode", 1, 1, 2)], 4) == 4
    with pytest.raises(UsageError, match="a bandwidth above zero"):
        kv_link(OPT, A100, gbs=0.0)


def test_the_placements_within_a_budget_by_hand():
    # two cards: a colocated replica at TP1, TP2 or PP2, and one prefill TP1 + one decode TP1
    assert search_candidates(2) == [
        [("colocated", 1, 1, 1)], [("colocated", 1, 1, 2)], [("colocated", 1, 2, 1)],
        [("prefill", 1, 1, 1), ("decode", 1, 1, 1)]]
    every = search_candidates(4)
    assert len(every) == 23 and all(check_placement(OPT, A100, p, 4) <= 4 for p in every)
    assert [("prefill", 1, 2, 1), ("decode", 1, 1, 2)] in every  # (c21d12)


@needs_logs
def test_placement_search_end_to_end(tmp_path, capsys):
    from test_cli import run_main
    results, printed = run_main(["--placement-search", DISTSERVE, "--gpu-budget", "2",
                                 "--jobs", "2", "--out", str(tmp_path)], capsys)
    R = results["placement_search"]
    per_gpu = [r["goodput_per_gpu"] for r in R["rows"]]
    assert len(per_gpu) == 4 and per_gpu == sorted(per_gpu, reverse=True)
    assert set(R["best"]) == {"colocated", "disaggregated"}
    assert R["simulations"] == sum(r["simulations"] for r in R["rows"])
    assert R["rows"][0]["goodput_rps"] > 0 and "the best of each kind" in printed.out
    assert json.loads((tmp_path / "placement_search.json").read_text())["placement_search"]["budget"] == 2


@needs_logs
def test_the_goodput_is_where_the_slo_stops_being_met():
    log = read_engine_run(os.path.join(LOGS, "vllm-100-1.exp"))
    rng = np.random.default_rng(0)
    unit = Requests(arrival_times(100, 1.0, 1.0, rng), log["prompt"], log["output"])
    placement = [("prefill", 1, 2, 1), ("decode", 1, 1, 1)]
    row = placement_goodput(PROFILES, placement, unit)
    pools = placement_pools(PROFILES, placement)
    link = kv_link(OPT, A100)

    def met(rate):
        req = unit.take(arrival_s=unit.arrival_s / rate)
        sim = simulate_pools(req, pools, ["prefill", "decode"], link=link)
        return serving_metrics(req, sim, 0.2, 0.1)["slo_attained"]
    assert met(row["goodput_rps"]) >= 0.9 > met(row["goodput_rps"] * 1.05)
    assert row["gpus"] == 3 and row["goodput_per_gpu"] == row["goodput_rps"] / 3


def test_pipeline_stages_on_the_per_operator_model():
    # C's own prices of OPT-13B on an A100 (card_costs): two stages of 8 decoders are a
    # pass of 4 rows and the hops of 4 tokens' hidden states; a prefill is the whole pass
    costs = card_costs(OPT, A100)
    pp = pipeline_costs(costs, 2, OPT, A100)
    hop = 4 * 5120 * 2 / 300e9
    assert pp.run_price((), 8, 8000, 1)[1] == pytest.approx(costs.pass_s(4, 4000) + hop)
    prefill = costs.run_price([(Chunk(), 512)], 0, 0, 1)[0]
    assert pp.run_price([(Chunk(), 512)], 0, 0, 1)[0] == pytest.approx(
        prefill + 512 * 5120 * 2 / 300e9)


def test_the_link_flags_are_refused_where_nothing_reads_them(capsys):
    expect_usage_error(["--placement-search", "somewhere", "--kv-link-latency-us", "5"], capsys,
                       "apply to --replay-distserve")


def small_search(**where):
    rng = np.random.default_rng(3)  # (lengths of ShareGPT's scale, drawn)
    lengths = (rng.integers(20, 900, size=200), rng.integers(2, 300, size=200))
    return search_placements(PROFILES, lengths, 2, requests=60, **where)


@pytest.mark.skipif(not os.path.isdir(PROFILES), reason="DistServe's profiles absent")
def test_the_search_on_a_dask_cluster_ranks_as_worker_processes_do():
    distributed = pytest.importorskip("distributed")
    alone = small_search(workers=2)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                                  dashboard_address=None) as cluster:
        dask = small_search(workers=2, cluster=cluster.scheduler_address)
    ranked = [[(r["placement"], r["goodput_rps"], r["simulations"]) for r in R["rows"]]
              for R in (alone, dask)]
    assert ranked[0] == ranked[1] and len(ranked[0]) == 4
    assert dask["cluster"] == cluster.scheduler_address and alone["cluster"] is None
    for R in (alone, dask):
        assert R["simulations"] == sum(r["simulations"] for r in R["rows"]) > 4 * 3
        s = R["simulation_s"]
        assert 0 < s["p10"] <= s["p50"] <= s["p90"] and 0 < R["busy"] <= 2.5


def test_the_inline_executor_and_worker_processes_agree():
    calls = [(pow, (n, 3)) for n in range(6)]
    assert run_parallel(calls, 1) == run_parallel(calls, 2) == [n ** 3 for n in range(6)]


def test_a_cluster_without_dask_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "distributed", None)  # (import distributed fails)
    expect_usage_error(["--placement-search", "somewhere", "--cluster", "local"], capsys,
                       "pip install distributed")
    expect_usage_error(["--replay-distserve", "somewhere", "--cluster", "local"], capsys,
                       "pip install distributed")


def test_a_cluster_is_refused_where_nothing_reads_it(capsys):
    expect_usage_error(["--experiments", "C", "--cluster", "local"], capsys,
                       "--cluster runs --placement-search, --replay-distserve and the cheapest")


def test_back_pressure_by_hand():
    # A and B (prompt 4, 3 tokens) have their first tokens at 1.5 on one prefill replica;
    # the decode replica's cache is 8 tokens in blocks of 4: a hand-off reserves
    # blocks(4 + 1) = 8 there (its prompt's KV and its first token's, which its first decode
    # step writes), so one request at a time. A: reserved and sent at 1.5 (0.25 s on the link,
    # 0.25 s latency), in at 2.0, decodes 2-3-4. B waits, its KV held on the prefill replica,
    # until A finishes at 4.0: sent 4.0-4.25, in at 4.5, decodes 4.5-5.5-6.5. Held on the
    # prefill side until its last byte left (its prompt's 4 tokens of KV): A 4 x 0.25 s, B 4 x
    # 2.75 s = 12.0 token-s
    req = Requests(np.array([0.0, 0.0]), np.array([4, 4]), np.array([3, 3]))
    link = KVLink(16.0, 0.25, 1.0)
    prefill = Pool("prefill", Replica(2, SLOW, kv=KVBudget("paged", 16, 4)))

    def run(decode_tokens):
        decode = Pool("decode", Replica(2, UNIT, kv=KVBudget("paged", decode_tokens, 4)))
        return simulate_pools(req, [prefill, decode], ["prefill", "decode"], link=link)
    sim = run(8)
    assert sim["times"].first_token.tolist() == [1.5, 1.5] and sim["times"].finish.tolist() == [4.0, 6.5]
    assert sim["hand_off"] == {"waited": 1, "wait_s": 2.5, "held_token_s": 12.0}
    # with room for both, A and B share the link (1.5-2.0), in at 2.25, and are held 0.5 s
    # each: 2 + 2 token-s; the prefill replica's memory counts the difference
    roomy = run(64)
    assert roomy["times"].finish.tolist() == [4.25, 4.25]
    assert roomy["hand_off"] == {"waited": 0, "wait_s": 0.0, "held_token_s": 4.0}
    assert sim["kv"]["held_s"] - roomy["kv"]["held_s"] == pytest.approx(12.0 - 4.0)
    # (allocated there in whole blocks: one 4-token block for each 4 held)
    assert sim["kv"]["alloc_s"] - roomy["kv"]["alloc_s"] == pytest.approx(12.0 - 4.0)
    assert np.isfinite(sim["times"].finish).all()  # (nothing dropped)


def test_the_network_between_nodes_from_the_catalogue():
    # an A100 node's HDR InfiniBand, 200 Gb/s a GPU: 25 GB/s and 2 us; an H100's NDR twice
    # that; a card with no HGX board a 100 GbE NIC; --kv-link-gbs overrides the rate alone
    net = kv_link(OPT, A100, name="network")
    assert (net.bytes_per_s, net.latency_s, net.name) == (25e9, 2e-6, "HDR InfiniBand")
    assert kv_link(OPT, GPUS["h100"], name="network").bytes_per_s == 50e9
    assert kv_link(OPT, GPUS["l40s"], name="network").bytes_per_s == 12.5e9
    assert kv_link(OPT, A100, gbs=40.0, name="network").bytes_per_s == 40e9
    assert kv_link(OPT, A100, name="network").latency_s == 2e-6
    assert kv_link(OPT, A100).latency_s == 0.0  # (inside a node: NVLink, no latency)
    # 1,000 tokens of OPT-13B's KV over the network: 819.2 MB / 25 GB/s + 2 us
    assert land_times(net, [(1000, 0.0)])[0] == [pytest.approx(819.2e6 / 25e9 + 2e-6)]


@needs_logs
def test_the_placement_search_draws_its_figure_and_replot_redraws_it(tmp_path, capsys):
    from test_cli import run_main
    results, printed = run_main(["--placement-search", DISTSERVE, "--gpu-budget", "2",
                                 "--jobs", "1", "--out", str(tmp_path)], capsys)
    figure = tmp_path / "placements.png"
    assert figure.stat().st_size > 10_000 and "placements.png" in printed.out
    rows = results["placement_search"]["rows"]
    assert all(r["simulations"] == len(r["tried"]) for r in rows)  # (the figure's points)
    again = S.main(["--replot", str(tmp_path / "placement_search.json"), "--out",
                    str(tmp_path / "r")])
    assert again["written"] == ["placements.png"]
    assert not (tmp_path / "results.json").exists()  # (a main run's name: never a mode's)


def test_layerwise_overlap_sends_the_kv_during_the_prefill_by_hand():
    # 4 layers, 16 bytes/s, 0.25 s a send, a byte a token. A (prompt 4) prefilled 0-1.5: by
    # its end the first 3 layers' KV could have gone (16 bytes/s x 1.5 s x 3/4 >= 3 bytes),
    # so 1 byte (its last layer's) is left: sent 1.5-1.5625, in at 1.8125, decoding
    # 1.8125-2.8125-3.8125. Off (layers 0) it is the whole 4 bytes: in at 2.0, as above
    req = Requests(np.array([0.0]), np.array([4]), np.array([3]))
    pools = [Pool("prefill", Replica(1, SLOW)), Pool("decode", Replica(2, UNIT))]
    for layers, finish in ((4, 3.8125), (0, 4.0)):
        link = KVLink(16.0, 0.25, 1.0, layers=layers)
        sim = simulate_pools(req, pools, ["prefill", "decode"], link=link)
        assert sim["times"].finish.tolist() == [finish] and sim["kv_transfer"]["bytes"] == 4.0
    # a slow link: of 100 bytes at 10 bytes/s in a 2 s prefill, 4 layers: 100 - 10 x 2 x 3/4
    # = 85 left; a prefill long enough leaves the last layer's 25
    assert KVLink(10.0, 0.0, 1.0, layers=4).bytes_left(100.0, 2.0) == 85.0
    assert KVLink(10.0, 0.0, 1.0, layers=4).bytes_left(100.0, 60.0) == 25.0
    assert kv_link(OPT, A100, layerwise=True).layers == 40 and kv_link(OPT, A100).layers == 0


@needs_logs
def test_kv_layerwise_leaves_less_to_send_after_each_prefill(tmp_path):
    logs = tmp_path / "logs"  # (one run beside the profiles)
    logs.mkdir()
    (logs / "profile_data").symlink_to(os.path.abspath(PROFILES))
    (logs / "distserve-c21d11-300-3.exp").symlink_to(os.path.join(LOGS,
                                                                "distserve-c21d11-300-3.exp"))

    def replay(*flags):
        return S.main(["--replay-distserve", str(logs), "--out", str(tmp_path / "out"),
                       "--jobs", "1", *flags])["distserve_replay"]["rows"][0]
    whole, layered = replay(), replay("--kv-layerwise")
    assert whole["kv_transfer"]["sends"] == layered["kv_transfer"]["sends"] == 300
    assert layered["kv_transfer"]["link_s"] < whole["kv_transfer"]["link_s"]
    assert layered["simulated"]["ttft_s"] == whole["simulated"]["ttft_s"]


@pytest.mark.parametrize("seed", range(12))
def test_back_pressure_never_stalls_and_finishes_every_request(seed):
    # decode replicas short of room, preempting, while hand-offs hold reservations there:
    # a replica whose room is lent to KV in flight waits for it to land, never stalls
    rng = np.random.default_rng(seed)
    n = 60
    req = Requests(np.sort(rng.uniform(0, 20, n)), rng.integers(1, 30, n),
                     rng.integers(1, 20, n))
    link = KVLink(float(rng.uniform(5, 50)), 0.1, 1.0, layers=int(rng.choice([0, 4])))
    prefill = Pool("prefill", Replica(4, SLOW, kv=KVBudget("paged", 64, 4)), 2,
                     "least-requests")
    decode = Pool("decode", Replica(8, UNIT, kv=KVBudget(
        "paged", int(rng.choice([52, 64, 128])), 4)), 2, "round-robin")
    sim = simulate_pools(req, [prefill, decode], ["prefill", "decode"], link=link)
    assert np.isfinite(sim["times"].finish).all()
    assert (sim["times"].finish >= sim["times"].first_token).all()


@needs_logs  # (the logs are read before Dask is reached)
def test_a_cluster_that_is_no_address_is_one_line(capsys):
    pytest.importorskip("distributed")
    expect_usage_error(["--placement-search", DISTSERVE, "--cluster", "notanaddress"], capsys,
                       "--cluster notanaddress")


@pytest.mark.parametrize("mode", ["--placement-search", "--replay-distserve"])
def test_the_distserve_modes_refuse_the_flags_they_would_not_read(mode, capsys):
    # (they price OPT-13B on A100s at DistServe's SLO: a user's model, card or SLO would be
    # silently ignored, and the run would still exit 0)
    expect_usage_error([mode, "somewhere", "--model", "llama-3.1-70b", "--gpu", "h100",
                        "--slo-ttft-ms", "500"], capsys,
                       "prices OPT-13B on A100-80GB", "--model, --gpu, --slo-ttft-ms would not "
                       "be read")
    expect_usage_error([mode, "somewhere", "--tensor-parallel-size=2"], capsys,
                       "--tensor-parallel-size would not be read")


@needs_logs
def test_the_measured_side_is_distserves_own_numbers():
    # each log's requests (ttft_ms, tpot_ms over the tokens after the first) averaged are the
    # summary block DistServe wrote at the end of the same file, on every one of the 37
    import re
    names = sorted(n for n in os.listdir(LOGS) if n.endswith(".exp"))
    assert len(names) == 37
    for name in names:
        path = os.path.join(LOGS, name)
        with open(path) as f:
            summary = dict(re.findall(r"(\w+): ([\d.]+)", f.read().split("\n", 1)[1]))
        log = read_engine_run(path)
        assert len(log["ttft_s"]) == int(summary["num_requests"]), name
        assert 1e3 * log["ttft_s"].mean() == pytest.approx(float(summary["avg_ttft_ms"])), name
        tpot = np.zeros(len(log["output"]))
        tpot[log["output"] > 1] = log["tpot_s"]
        assert 1e3 * tpot.mean() == pytest.approx(float(summary["avg_tpot_ms"])), name


def test_a_step_takes_whole_prompts_up_to_its_budget_by_hand():
    # DistServe's context stage and vLLM without chunked prefill: whole prompts in order, up
    # to the step's token budget, the first whatever its length. 5,000 + 5,000 > 8,192: one
    # a step; 9,000 alone, past the budget, still runs. Unbudgeted, all three in one pass.
    req = Requests(np.zeros(3), np.array([5000, 5000, 9000]), np.ones(3, int))
    budgeted = simulate_serving(req, Replica(8, UNIT, "continuous", prompt_tokens=8192))
    assert list(budgeted["times"].first_token) == [1.0, 2.0, 3.0]
    whole = simulate_serving(req, Replica(8, UNIT, "continuous"))
    assert list(whole["times"].first_token) == [1.0, 1.0, 1.0]
    # (the budget is continuous batching's: chunked prefill keeps its own)
    assert simulate_serving(req, Replica(8, UNIT, "chunked", 8192, prompt_tokens=8192))[
        "times"].first_token[0] == 1.0


def test_a_prefill_replica_keeps_the_kv_the_decode_pool_has_no_room_for_by_hand():
    # prompts of 8 tokens hold blocks(8) = 8 of the prefill replica's 16; the decode replica
    # (20 tokens) takes one request at a time (blocks(8 + 1) = 12: the prompt's KV and its
    # first token's, which its first decode step writes). At t = 1 A and B have
    # their first tokens: A goes on, B waits, its 8 tokens kept on the prefill replica, so C
    # alone is admitted (first token at 2) and waits too; D cannot be admitted until B's KV
    # leaves, when A finishes (t = 10): D's first token at 11, where a prefill replica that
    # dropped the KV at the first token would prefill D by t = 2
    req = Requests(np.zeros(4), np.full(4, 8), np.full(4, 10))
    pre = Pool("prefill", Replica(4, UNIT, kv=KVBudget("paged", 16, 4)), 1)
    dec = Pool("decode", Replica(4, UNIT, kv=KVBudget("paged", 20, 4)), 1)
    sim = simulate_pools(req, [pre, dec], ["prefill", "decode"])
    assert list(sim["times"].first_token) == [1.0, 1.0, 2.0, 11.0]
    assert list(sim["times"].finish) == [10.0, 19.0, 28.0, 37.0]
    assert sim["hand_off"]["waited"] == 3
