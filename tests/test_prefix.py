"""C's prefix cache: prompts known by their blocks, the cache that keeps them, and its hits."""
import collections
import dataclasses
import json
import os

import numpy as np
import pytest

import NN_40_serving as S
from nn40.accounting import kv_bytes_per_token
from nn40.cli import parse_args
from nn40.config import GPUS, MODELS
from nn40.kv import KVBudget, PrefixCache, Seq
from nn40.loop import simulate_serving
from nn40.pools import Fleet, simulate_fleet
from nn40.pricing import StepCosts, card_costs
from nn40.queues import EVICTION_ORDERS, BlockQueue
from nn40.replicas import DecodeBatch, Replica
from nn40.routers import CacheAware, PrecisePrefix
from nn40.runs import host_tier
from nn40.tables_c import format_tables
from nn40.workload import (
    HashedPrompts, PrefixWorkload, Requests, SharedPrompts, arrival_times, is_engine_run,
    is_hashed_trace, lognormal_lengths, make_requests, read_hashed_trace, shared_prompts)
from conftest import TRACES
from test_cli import expect_usage_error, run_main, said

COSTS = StepCosts(tokens=(1, 64, 1024), seconds=(0.010, 0.012, 0.100), kv_token_s=1e-7,
                    source="test")
MOONCAKE = os.path.join(TRACES, "mooncake")


class FakeLedger:
    """What a KV manager reads of the ledger at admission."""

    def __init__(self, identity, to_prefill):
        self.identity, self.to_prefill = identity, list(to_prefill)
        self.cached, self.arrival = [0] * len(self.to_prefill), [0.0] * len(self.to_prefill)


def system_prompts(n, system_tokens=8, own=2, system=0):
    """n requests opening with the same system prompt, then `own` tokens of their own."""
    identity = SharedPrompts(np.full(n, system), np.array([system_tokens]), np.full(n, -1))
    return FakeLedger(identity, [system_tokens + own] * n)


def admit(cache, ledger, r):
    cached = cache.lookup(ledger, r)
    left = ledger.to_prefill[r] - cached
    seq = Seq(r, r, left, 5, cached)
    cache.admit(seq, cache.need(ledger.to_prefill[r], cached, left, left))
    return seq


def prefill(cache, seq):
    """Its whole prompt in one step, and its first token."""
    cache.advance(0, [(seq, seq.prompt_left)], 1, 1.0, 0.0)
    seq.num_cached += seq.prompt_left + 1
    seq.prompt_left = 0


def free_blocks(cache):
    return cache.free.blocks()


def test_hashed_prompts_share_keys_while_their_ids_agree():
    ids = np.empty(3, dtype=object)
    ids[:] = [(7, 8, 9), (7, 8, 5), (1, 8, 9)]
    keys = HashedPrompts(ids, np.array([1536, 1536, 1400])).block_keys
    a, b, c = (keys(r, 1536, 256) for r in range(3))  # two engine blocks per hash id
    assert len(a) == 6 and len(set(a)) == 6
    assert a[:4] == b[:4] and a[4] != b[4]          # the third id differs
    assert not set(a) & set(c)                      # a chain: the same id after another
    assert keys(0, 1535, 256) == a[:5]              # full blocks only
    assert keys(0, 4096, 256) == a                  # the prompt's blocks only (preempted, a
    assert len(c) == 5 and keys(2, 4096, 256) == c  # request prefills its answer again too)


def test_a_hit_is_the_cached_leading_blocks_and_leaves_a_token_to_compute():
    cache = PrefixCache(KVBudget("prefix", 32, 4))   # 8 blocks of 4 tokens
    ledger = system_prompts(3)
    first = admit(cache, ledger, 0)
    assert first.num_cached == 0
    prefill(cache, first)  # 11 tokens: 3 blocks, the system prompt's 2 cached
    assert cache.total == 12 and cache.ref == {k: 1 for k in cache.of[first].keys}
    second = admit(cache, ledger, 1)
    assert second.num_cached == 8 and second.prompt_left == 2
    assert cache.total == 12 and cache.shared == 8  # the 2 shared blocks held once
    # a prompt that is all system prompt keeps its last token to compute: 1 block hit of 2
    short = system_prompts(1, system_tokens=8, own=0)
    assert cache.lookup(short, 0) == 4
    p = cache.report()["prefix_cache"]
    assert (p["queried_tokens"], p["hit_tokens"]) == (20, 8)


def test_reference_counts_and_the_free_queue_tail_first():
    cache = PrefixCache(KVBudget("prefix", 32, 4))
    ledger = system_prompts(2)
    first = admit(cache, ledger, 0)
    prefill(cache, first)
    keys = cache.of[first].keys  # (the prefix cache's own record of a running request)
    second = admit(cache, ledger, 1)
    prefill(cache, second)
    assert cache.total == 16 and free_blocks(cache) == 4
    cache.release(first, 11)  # its 2 shared blocks stay held by the second
    assert cache.total == 4 * 3 - 0 and cache.shared == 0 and first not in cache.of
    assert all(cache.ref[k] == 1 for k in keys)
    cache.release(second, 11)
    assert cache.total == 0 and free_blocks(cache) == 8
    assert all(cache.ref[k] == 0 for k in keys)  # cached, free
    head, tail = keys
    assert list(cache.free)[-2:] == [tail, head]        # freed last first
    cache.take(7)  # 6 uncached blocks, then the least recently freed: the prefix's tail
    assert tail not in cache.ref and head in cache.ref
    third = system_prompts(1)
    assert cache.lookup(third, 0) == 4


def test_preemption_and_the_watermark_keep_working_and_memory_counts_once():
    n = 400
    rng = np.random.default_rng(3)
    output = lognormal_lengths(n, 3)
    req = shared_prompts(Requests(arrival_times(n, 30.0, 1.0, rng), np.full(n, 32), output),
                           PrefixWorkload(96, 4, 0.8, 1.0, 3, 2.0), rng)
    replica = Replica(16, COSTS, scheduler="chunked", chunk_tokens=256,
                        kv=KVBudget("prefix", 3000, 16, watermark=0.01))
    sim = simulate_serving(req, replica)
    assert np.isfinite(sim["times"].finish).all()
    mem, p = sim["kv"], sim["prefix_cache"]
    assert mem["preemptions"] > 0 and p["evicted_blocks"] > 0
    assert 0 < p["hit_tokens"] < p["queried_tokens"]
    assert mem["held_s"] <= mem["alloc_s"] and mem["max_alloc"] <= 3000
    assert (np.array(sim["generated"]) == req.output).all()


def test_a_preempted_request_hits_its_own_blocks_when_it_comes_back():
    cache = PrefixCache(KVBudget("prefix", 64, 4))   # 16 blocks of 4 tokens
    ledger = system_prompts(1, system_tokens=8, own=6)  # 14 tokens: 2 shared blocks, then its own
    seq = admit(cache, ledger, 0)
    prefill(cache, seq)                              # 15 tokens held: 3 full blocks
    cache.preempt(seq, 15)
    ledger.to_prefill[0] = 15                        # it prefills its prompt and its token again
    assert cache.lookup(ledger, 0) == 12             # its 3 full blocks, its own third included
    back = admit(cache, ledger, 0)
    assert back.num_cached == 12 and cache.report()["prefix_cache"]["readmitted_hit_tokens"] \
        == 12
    cache.release(back, 15)                          # finished: its own keys are not kept
    assert cache.own == set()
    stranger = system_prompts(1, system_tokens=8, own=6)
    assert cache.lookup(stranger, 0) == 8            # another request finds the shared 2 only


@pytest.mark.parametrize("scheduler", ["continuous", "chunked"])
def test_with_nothing_shared_it_is_the_paged_simulation_but_for_preempted_requests_own_hits(
        scheduler, monkeypatch):
    n = 300
    rng = np.random.default_rng(5)
    req = Requests(arrival_times(n, 40.0, 1.0, rng), np.full(n, 64), lognormal_lengths(n, 5))
    lone = SharedPrompts(np.full(n, -1), np.array([0]), np.full(n, -1))

    def run():
        return [simulate_serving(r, Replica(16, COSTS, scheduler=scheduler, chunk_tokens=256,
                                                kv=KVBudget(policy, 2000, 16, watermark=0.01)))
                for r, policy in ((req, "paged"), (Requests(
                    req.arrival_s, req.prompt, req.output, identity=lone), "prefix"))]
    sims = run()
    assert sims[0]["kv"]["preemptions"] > 0
    p = sims[1]["prefix_cache"]
    assert p["hit_tokens"] == 0 and p["readmitted_hit_tokens"] > 0  # its own blocks only
    assert sims[1]["times"].finish.max() < sims[0]["times"].finish.max()  # less recomputed
    # without its own blocks' keys, a preempted request recomputes all: paged, step for step
    monkeypatch.setattr(PrefixCache, "keys_of", lambda self, r, tokens:
                        self.identity.block_keys(r, tokens, self.block))
    sims = run()
    assert sims[1]["prefix_cache"]["readmitted_hit_tokens"] == 0
    for key in ("start", "first_token", "finish", "first_step", "finish_step"):
        assert np.array_equal(*(getattr(s["times"], key) for s in sims)), key
    # (the same integral, summed in another order: a prompt's blocks taken as scheduled)
    assert sims[0]["kv"]["alloc_s"] == pytest.approx(sims[1]["kv"]["alloc_s"], rel=1e-12)


@pytest.mark.parametrize("scheduler", ["continuous", "chunked"])
def test_requests_admitted_in_one_step_share_the_blocks_it_schedules(scheduler, monkeypatch):
    # 64 requests of one 1,024-token system prompt (then 64 tokens of their own) at t = 0:
    # vLLM caches the first one's blocks as it schedules them (kv_cache_manager.py's
    # allocate_slots), so the 63 admitted after it in the same step hit all 1,024 tokens
    n = 64
    identity = SharedPrompts(np.zeros(n, int), np.array([1024]), np.full(n, -1))
    req = Requests(np.zeros(n), np.full(n, 1088), np.full(n, 8), identity=identity)
    replica = Replica(n, COSTS, scheduler=scheduler, chunk_tokens=8192,
                        kv=KVBudget("prefix", 10**6, 16))
    sim = simulate_serving(req, replica)
    assert sim["prefix_cache"]["hit_tokens"] == 63 * 1024 == 64_512
    assert sim["prefix_cache"]["hits"][0] == 0
    ttft = np.median(sim["times"].first_token)
    # the rule it replaces, a seeded bug: blocks cached once computed, not shared in the step
    monkeypatch.setattr(PrefixCache, "caches_scheduled", False)
    late = simulate_serving(req, replica)
    assert late["prefix_cache"]["hit_tokens"] < 60_000
    assert np.median(late["times"].first_token) > 2 * ttft


def test_a_hit_is_not_prefilled():
    # two requests of one long system prompt, far apart: the second prefills 1 block's worth
    identity = SharedPrompts(np.zeros(2, int), np.array([1008]), np.full(2, -1))
    req = Requests(np.array([0.0, 100.0]), np.array([1024, 1024]), np.array([2, 2]),
                     identity=identity)
    runs = [simulate_serving(Requests(req.arrival_s, req.prompt, req.output, identity=i),
                               Replica(4, COSTS, kv=KVBudget(p, 10**5, 16)))
            for i, p in ((None, "paged"), (identity, "prefix"))]
    ttft = [r["times"].first_token - req.arrival_s for r in runs]
    assert ttft[0][1] == pytest.approx(ttft[0][0])
    assert ttft[1][1] < 0.5 * ttft[1][0]
    assert runs[1]["prefix_cache"]["hits"] == {0: 0, 1: 1008}


def trace_bound(path, block):
    """The token hit ratio a trace's hash ids allow, from the file alone: each prompt's longest
    leading run of tokens some earlier prompt computed (whole engine blocks, short of its last
    token), over all prompt tokens."""
    computed, queried, hit = {}, 0, 0  # prefix of ids -> its last 512-block's tokens computed
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            ids, n = row["hash_ids"], row["input_length"]
            tokens = 0
            for d in range(1, len(ids) + 1):
                got = computed.get(tuple(ids[:d]), 0)
                tokens = (d - 1) * 512 + got
                if got < 512:
                    break
            hit += min(tokens // block, (n - 1) // block) * block
            queried += n
            for d in range(1, len(ids) + 1):
                whole = min(512, n // block * block - (d - 1) * 512)
                computed[tuple(ids[:d])] = max(computed.get(tuple(ids[:d]), 0), whole)
    return hit / queried


@pytest.mark.parametrize("name", ["conversation", "synthetic"])
def test_an_unlimited_cache_hits_what_the_trace_allows(name):
    path = os.path.join(MOONCAKE, f"{name}_trace.jsonl")
    if not os.path.exists(path):
        pytest.skip("the Mooncake traces are not beside the project")
    req = read_hashed_trace(path, block=16)
    # one at a time (each done before the next comes), so every earlier block is computed
    apart = Requests(np.arange(len(req.output)) * 1e4, req.prompt, req.output,
                       identity=req.identity)
    sim = simulate_serving(apart, Replica(64, card_costs(MODELS["llama-3-8b"],
                                                              GPUS["h100"]),
                                              kv=KVBudget("prefix", float("inf"), 16)))
    p = sim["prefix_cache"]
    assert p["hit_tokens"] / p["queried_tokens"] == trace_bound(path, 16)
    assert p["queried_tokens"] == int(req.prompt.sum())


def lru_bound(path, capacity_blocks, block=16):
    """The token hit ratio of requests one at a time through an LRU cache of capacity_blocks
    engine blocks, from the trace file alone (a plain reference): a request hits its leading
    blocks cached (short of its last prompt token), takes them out of the free queue, takes
    the blocks its prompt and output need from the queue's head (evicting what they held; the
    KV of all its tokens but the last), and when it ends gives back its uncached blocks, then
    its prompt's blocks tail first."""
    free = collections.OrderedDict(((None, i), None) for i in range(capacity_blocks))
    chains, fresh, queried, hit_tokens, per = {}, capacity_blocks, 0, 0, 512 // block
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            ids, n = row["hash_ids"], row["input_length"]
            chain, keys = 0, []
            for d in range(min(-(-(n // block) // per), len(ids))):
                chain = chains.setdefault((chain, ids[d]), len(chains) + 1)
                keys += [(chain, place) for place in range(per)]
            keys = keys[:n // block]
            hit, most = 0, min(len(keys), (n - 1) // block)
            while hit < most and keys[hit] in free:
                del free[keys[hit]]
                hit += 1
            held = -(-(n + row["output_length"] - 1) // block)
            for _ in range(held - hit):
                free.popitem(last=False)
            for _ in range(held - len(keys)):
                free[(None, fresh)], fresh = None, fresh + 1
            free.update((key, None) for key in reversed(keys))
            queried, hit_tokens = queried + n, hit_tokens + hit * block
    return hit_tokens / queried


def test_the_decoders_next_blocks_are_taken_once_however_often_a_step_is_planned():
    """Decoders holding 5, 9 and 6 tokens in 4-token blocks have written 4, 8 and 5: the next
    step writes the first two into new blocks, which are taken from the free queue as the
    step is scheduled, once if it is planned twice; a decoder preempted before it is planned
    again gives its block back; the step's run takes no more. Throughout, the blocks out of
    the free queue are the blocks allocated."""
    cache, batch, s0 = PrefixCache(KVBudget("prefix", 64 * 4, 4)).for_decode_steps(1), \
        DecodeBatch(), 7
    seqs = [Seq(i, i, 0, 1, num_cached=ctx) for i, ctx in enumerate([5, 9, 6])]
    for seq in seqs:
        cache.admit(seq, cache.need(seq.num_cached, seq.num_cached, 0, 0))
        batch.join([seq], s0)
        cache.join(seq)

    def out():
        assert cache.free.blocks() + cache.total // 4 == 64
        return 64 - cache.free.blocks()
    assert out() == 1 + 2 + 2
    cache.schedule_decoders(s0)
    cache.schedule_decoders(s0)
    assert 64 - cache.free.blocks() == 5 + 2
    cache.preempt(seqs[0], 5)
    cache.schedule_decoders(s0)
    assert 64 - cache.free.blocks() == 2 + 2 + 1
    cache.advance(s0, [], 1, 1.0, 0.0)
    assert out() == 3 + 2 and cache.ahead == 0


@pytest.mark.parametrize("blocks", [20_000, 10_000, 5_000])
def test_a_bounded_cache_hits_what_lru_allows(blocks):
    """Mooncake's conversation trace through 20k, 10k and 5k of its 512-token blocks: the
    ratio a plain LRU reference gets (up to a request that recomputes a block cached beyond
    a gap in its hit: vLLM then keeps both copies, C the older, a few in a million tokens)."""
    path = os.path.join(MOONCAKE, "conversation_trace.jsonl")
    if not os.path.exists(path):
        pytest.skip("the Mooncake traces are not beside the project")
    req = read_hashed_trace(path, block=16)
    apart = Requests(np.arange(len(req.output)) * 1e4, req.prompt, req.output,
                       identity=req.identity)
    sim = simulate_serving(apart, Replica(64, card_costs(MODELS["llama-3-8b"], GPUS["h100"]),
                                              kv=KVBudget("prefix", blocks * 512, 16)))
    p = sim["prefix_cache"]
    assert p["evicted_blocks"] > 0
    assert p["hit_tokens"] / p["queried_tokens"] == pytest.approx(
        lru_bound(path, blocks * 32), abs=1e-5)


def test_shared_prompts_by_hand():
    req = Requests(np.array([0.0, 1.0, 2.0]), np.array([10, 20, 30]), np.array([5, 6, 7]))
    convs = shared_prompts(req, PrefixWorkload(100, 1, 1.0, 1.0, 2, 0.0),
                             np.random.default_rng(0))
    # conversations (0: turns 0 and 1) and (1: turn 0); no think time: turn 1 at turn 0's time
    assert convs.arrival_s.tolist() == [0.0, 0.0, 1.0]
    assert convs.prompt.tolist() == [110, 110 + 5 + 20, 130]
    keys = convs.identity.block_keys
    first, second = keys(0, 110 + 5, 16), keys(1, 135, 16)
    assert second[:len(first)] == first       # the next turn repeats the first and its answer
    assert keys(2, 130, 16)[:6] == first[:6]  # the system prompt's 6 whole blocks
    assert keys(2, 130, 16)[6] != first[6]


def conversations(n=800, replicas=4, rate=8.0, seed=2):
    rng = np.random.default_rng(seed)
    base = Requests(arrival_times(n, rate, 1.0, rng), np.full(n, 64), lognormal_lengths(
        n, seed))
    return shared_prompts(base, PrefixWorkload(256, 4, 0.9, 1.0, 4, 5.0), rng)


def test_cache_aware_routing_hits_more_than_round_robin_on_four_replicas():
    req = conversations()
    replica = Replica(16, COSTS, kv=KVBudget("prefix", 20_000, 16, watermark=0.01))
    ratio = {}
    for router in ("round-robin", "cache-aware", "precise-prefix"):
        sim = simulate_fleet(req, replica, Fleet(4, router))
        p = sim["prefix_cache"]
        ratio[router] = p["hit_tokens"] / p["queried_tokens"]
        assert sum(row["prefix_cache"]["queried_tokens"] for row in sim["per_replica"]) == \
            p["queried_tokens"] == req.prompt.sum()
    assert min(ratio["cache-aware"], ratio["precise-prefix"]) > ratio["round-robin"] + 0.1, \
        ratio


def test_cache_aware_by_hand_follows_the_cache_unless_out_of_balance():
    # requests 0 and 1 open conversation 0 and its next turn; 2 is a stranger
    identity = SharedPrompts(np.full(3, -1), np.array([0]), np.array([0, 0, 1]))
    req = Requests(np.array([0.0, 10.0, 10.0]), np.array([64, 64 + 4 + 64, 64]),
                     np.array([4, 4, 4]), identity=identity)
    replica = Replica(4, COSTS, kv=KVBudget("prefix", 10_000, 16))
    sim = simulate_fleet(req, replica, Fleet(3, "cache-aware"))
    assert sim["replica"].tolist() == [0, 0, 1]  # the next turn where its first turn is cached
    assert sim["prefix_cache"]["hits"] == {0: 0, 1: 64, 2: 0}


class RoutedTo:
    """A replica as a router reads it: its load, its queue, its KV cache (what it holds of a
    request, `held` tokens; a cache-aware router must not read it)."""

    def __init__(self, ledger, load=0, held=None, waiting=0, used=0.0):
        self.ledger, self.kv, self.n, self.held, self.waiting = ledger, self, load, held, waiting
        self.block, self.capacity, self.total = 16, 1000.0, used * 1000

    def load(self):
        return self.n

    def waiting_requests(self):
        return self.waiting

    def lookup(self, ledger, r):
        assert self.held is not None, "the router read a replica's cache"
        return self.held


def prompts_of(n, system_tokens=320, own=80):
    """n requests of one system prompt (20 blocks of 16), then `own` tokens of their own."""
    ledger = system_prompts(n, system_tokens, own)
    ledger.prompt = ledger.to_prefill
    return ledger


def test_sglangs_cache_aware_rules_where_they_differ_from_best_match_against_least_loaded():
    ledger = prompts_of(4)
    router = CacheAware()
    servers = [RoutedTo(ledger, load) for load in (5, 3, 0)]
    assert router.pick(servers, 0, None) == 0   # empty trees: the smallest, the first
    # request 1 matches replica 0's tree (320 of 400 tokens, over 0.3), which is 5 requests
    # from the least loaded: balanced, by the most against the least, so the tree wins
    assert router.pick(servers, 1, None) == 0
    # out of balance (the most, 100, against the least, 0), though the best match (5) is
    # near the least: the least loaded (best against least would have taken replica 0)
    servers[1].n = 100
    assert router.pick(servers, 2, None) == 2
    # replicas 0 and 2 now match as long (the router's record of what it sent, never the
    # caches: RoutedTo refuses a lookup): the tie goes to the less loaded
    servers[1].n = 3
    assert router.pick(servers, 3, None) == 2
    # under the threshold: the smallest tree, though it is not the least loaded
    stranger = prompts_of(1, system_tokens=0, own=400)
    fresh = CacheAware()
    fresh.trees = [collections.OrderedDict.fromkeys(range(n), True) for n in (30, 2, 10)]
    assert fresh.pick([RoutedTo(stranger, load) for load in (0, 9, 1)], 0, None) == 1


def test_sglangs_tree_forgets_its_least_recently_sent_blocks_tails_first(monkeypatch):
    monkeypatch.setattr(CacheAware, "max_tree_tokens", 16 * 24)  # 24 blocks
    ledger = prompts_of(2, system_tokens=320, own=80)  # 25 blocks each, 20 shared
    router = CacheAware()
    router.pick([RoutedTo(ledger)], 0, None)
    tree = router.trees[0]
    keys = list(tree)
    assert len(tree) == 24 and ledger.identity.block_keys(0, 400, 16)[0] == keys[-1]
    router.pick([RoutedTo(ledger)], 1, None)  # the shared head touched again, its own tail in
    assert ledger.identity.block_keys(0, 400, 16)[0] in tree and len(tree) == 24


def test_llm_ds_precise_prefix_scores_by_hand():
    ledger = prompts_of(1)
    router = PrecisePrefix()
    # held 64, 0, 32 tokens: prefix scores 1, 0, 0 (min-max over those holding any); queues
    # 4, 0, 0: 0, 1, 1; all caches empty: 1 each. 3 + 2 + 0 = 5 beats 0 + 2 + 2 = 4
    servers = [RoutedTo(ledger, held=h, waiting=w) for h, w in ((64, 4), (0, 0), (32, 0))]
    assert router.pick(servers, 0, (1, 0)) == 0
    # its cache half full: 3 + 1 + 0 = 4, a tie with the others: the draw decides
    servers[0].total = 500
    assert router.pick(servers, 0, (1, 0)) == 1 and router.pick(servers, 0, (0, 1)) == 0
    # nobody holds any of it: queue and free cache alone
    servers = [RoutedTo(ledger, held=0, waiting=w, used=u) for w, u in ((1, 0.1), (1, 0.0),
                                                                          (3, 0.0))]
    assert router.pick(servers, 0, (2, 0)) == 1


GOOD = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}'


@pytest.mark.parametrize("line, fragment", [
    ('{"timestamp": 5, "input_length": 600, "hash_ids": [1, 2]}', "missing output_length"),
    ('{"timestamp": 5, "input_length": -600, "output_length": 5, "hash_ids": [1, 2]}',
     "must be finite numbers >= 0"),
    ('{"timestamp": 5, "input_length": Infinity, "output_length": 5, "hash_ids": [1, 2]}',
     "must be finite numbers >= 0"),
    ('{"timestamp": 5, "input_length": 600, "output_length": 1e400, "hash_ids": [1, 2]}',
     "must be finite numbers >= 0"),
    ('{"timestamp": Infinity, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}',
     "must be finite numbers >= 0"),
    ('{"timestamp": 5, "input_length": 600, "output_length": 5, "hash_ids": [1]}',
     "1 hash_ids for input_length 600 at 512 tokens a block (expected 2)"),
    ('{"timestamp": 5, "input_length": 600, "output_length": 5, "hash_ids": [1, "x"]}',
     "hash_ids must be a list of integers"),
    ('{"timestamp": 5, "input_length": 600, "output_length": 5', "Expecting"),
])
def test_a_bad_trace_line_is_named_and_nothing_is_written(line, fragment, tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    path.write_text(GOOD + "\n" + line + "\n")
    out = tmp_path / "out"
    err = expect_usage_error(["--experiments", "C", "--trace", str(path), "--out", str(out),
                              "--enable-prefix-caching"], capsys, f"{path}:2:", fragment)
    assert "Traceback" not in err
    assert not (out / "results.json").exists()


@pytest.mark.parametrize("text", [
    '{"timestamp": 0, "input_length": 600, "output_length": 5}\n' + GOOD + "\n",
    '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_id": [1, 2]}\n',
])
def test_a_first_line_without_hash_ids_is_a_trace_of_lengths_not_an_engine_log(
        text, tmp_path, capsys):
    # (Mooncake's fields without hash ids: read as lengths and times, no prefix shared)
    path = tmp_path / "trace.jsonl"
    path.write_text(text)
    assert not is_hashed_trace(str(path)) and not is_engine_run(str(path))
    results = S.main(["--experiments", "C", "--trace", str(path), "--out",
                      str(tmp_path / "out"), "--no-figures", "--rates", "5"])
    assert results["C"]["requests"] == text.count("\n")
    assert "no hash ids, so no prompts share a prefix" in capsys.readouterr().err


def test_a_trace_opening_with_a_blank_line_is_read(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n" + GOOD + "\n")
    assert is_hashed_trace(str(path)) and not is_engine_run(str(path))
    req = read_hashed_trace(str(path))
    assert req.prompt.tolist() == [600] and req.identity.hash_ids[0] == (1, 2)


def test_a_block_that_does_not_divide_the_hash_block_is_refused(tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    path.write_text(GOOD + "\n")
    expect_usage_error(["--experiments", "C", "--trace", str(path), "--block-tokens", "48",
                        "--out", str(tmp_path / "out")], capsys, str(path),
                       "a block of 48 tokens does not divide the trace's 512-token hash blocks")


def test_the_rate_counts_requests_whatever_the_turns():
    for turns in (1, 3):  # (conversations open at rate / turns: `turns` requests each)
        req = make_requests(parse_args(["--experiments", "C", "--requests", "3000", "--rate",
                                            "10", "--turns", str(turns)]))
        assert len(req.output) / (req.arrival_s.max() - req.arrival_s.min()) == \
            pytest.approx(10, rel=0.1)


def test_flags_that_would_do_nothing_are_refused(tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    path.write_text(GOOD + "\n")
    for extra in (["--prefix-len", "64"], ["--turns", "3"]):  # (the trace's ids say it)
        expect_usage_error(["--experiments", "C", "--trace", str(path), *extra, "--out",
                            str(tmp_path / "out")], capsys, "shape generated requests only")
    expect_usage_error(["--experiments", "C", "--enable-prefix-caching", "--kv-policy",
                        "reserve"], capsys, "give --kv-policy paged")


def test_a_hashed_trace_end_to_end(tmp_path, capsys):
    # three prompts of one 1,024-token prefix, then one of its own, apart in time
    rows = [{"timestamp": 1000 * i, "input_length": 1100, "output_length": 4,
             "hash_ids": [7, 8, 10 + i] if i < 3 else [1, 2, 3]} for i in range(4)]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    results, out = run_main(["--experiments", "C", "--trace", str(path), "--rate", "trace",
                             "--gpu", "h100", "--model", "llama-3-8b", "--enable-prefix-caching",
                             "--host-kv-gb", "10", "--no-figures", "--out", str(tmp_path)], capsys)
    kv = json.loads((tmp_path / "results.json").read_text())["C"]["kv"]
    p = kv["prefix"]["continuous"]["prefix_cache"]
    assert (p["queried_tokens"], p["hit_tokens"], p["host_hit_tokens"]) == (4400, 2048, 0)
    assert p["prefill_tokens_saved"] == 2048 and p["prefill_tokens_computed"] == 4400 - 2048
    assert [b["requests"] for b in p["ttft_by_hit"]] == [2, 0, 2]
    assert said("Prefix cache (paged blocks that keep what they computed; a write-through host "
                "tier of 10.0 GB",
                out.out)


def test_a_disk_tier_end_to_end(tmp_path, capsys):
    # 16 system prompts of 512 tokens in 3-turn conversations on a 12,000-token card and a
    # 0.2 GB host tier: a 5 GB disk tier below finds much of what the two above gave up
    args = ["--experiments", "C", "--model", "llama-3-8b", "--gpu", "h100", "--requests", "300",
            "--rate", "20", "--prefix-len", "512", "--num-prefixes", "16", "--turns", "3",
            "--think-time-s", "5", "--enable-prefix-caching", "--kv-tokens", "12000",
            "--host-kv-gb", "0.2", "--slots", "16", "--jobs", "1", "--no-figures"]
    got = {}
    for name, extra in (("host", []), ("disk", ["--disk-kv-gb", "5"]),
                        ("prefetch", ["--disk-kv-gb", "5", "--disk-prefetch"])):
        _, out = run_main(args + extra + ["--out", str(tmp_path / name)], capsys)
        kv = json.loads((tmp_path / name / "results.json").read_text())["C"]["kv"]
        got[name] = kv["prefix"]["continuous"]["prefix_cache"], kv, out.out
    disk, kv, text = got["disk"]
    assert disk["disk_hit_ratio"] > 0.1 and got["host"][0]["disk_hit_ratio"] == 0
    assert disk["hit_ratio"] > got["host"][0]["hit_ratio"] + 0.1
    assert disk["prefill_tokens_saved"] == disk["hit_tokens"] + disk["host_hit_tokens"] + \
        disk["disk_hit_tokens"]
    per_token = kv["bytes_per_token"]
    assert kv["disk_tokens"] == int(5e9 // per_token)
    assert kv["disk_token_s"] == pytest.approx(per_token / 6.9e9)  # (an NVMe drive's read)
    assert said("below it a write-through disk tier of 5.0 GB", text) and "hit on disk" in text
    assert "s waited for loads" in text  # (the seconds requests waited for their loads)
    assert "hit on disk" not in got["host"][2]
    # reads begun as requests arrive: less of each wait is the disk's
    prefetch = got["prefetch"][0]
    assert prefetch["host_load_s"] < disk["host_load_s"] and \
        said("read at 6.9 GB/s, each read starting as its request arrives", got["prefetch"][2])


def test_the_prefix_study_end_to_end(tmp_path, capsys):
    results, out = run_main(["--experiments", "C", "--model", "llama-3-8b", "--gpu", "h100",
                             "--requests", "300", "--rate", "20", "--prefix-len", "512",
                             "--num-prefixes", "4", "--turns", "3", "--think-time-s", "5",
                             "--enable-prefix-caching", "--prefix-study", "--kv-tokens",
                             "20000", "--slots", "16", "--jobs", "1", "--out", str(tmp_path)],
                            capsys)
    study = json.loads((tmp_path / "results.json").read_text())["C"]["prefix_study"]
    card = [row["hit_ratio"] for row in study["card"]]
    host = [row["hit_ratio"] for row in study["card_host"]]
    unlimited = study["unlimited"][0]["hit_ratio"]
    # (1/64 and 1/16 of the card cannot hold the longest request: left out)
    assert [row["capacity_tokens"] for row in study["card"]] == [5000, 10000, 20000, 40000,
                                                                   80000]
    assert card == sorted(card) and card[0] < card[-1]  # more cache, more hits
    assert host[0] > card[0] + 0.2                      # a host tier keeps what the card drops
    assert max(card) <= unlimited <= study["optimum"][0]["hit_ratio"]
    # (not so with the host tier: a turn that queues long enough behind a small card finds its
    # previous turn's answer computed, which an unlimited cache serving it at once may not)
    assert (tmp_path / "prefix_cache.png").exists()
    assert said("Prefix cache against its capacity", out.out)
    with pytest.raises(SystemExit):
        S.main(["--experiments", "C", "--prefix-study", "--kv-policy", "paged", "--requests",
                "20", "--no-figures", "--out", str(tmp_path / "plain")])
    assert "--prefix-study needs --enable-prefix-caching" in capsys.readouterr().err


def test_write_back_stores_a_block_as_the_card_evicts_it_and_a_hit_loads_it_back():
    cache = PrefixCache(KVBudget("prefix", 32, 4, host_tokens=8, host_token_s=0.5,
                                 host_write="write-back"))
    ledger = system_prompts(2)
    first = admit(cache, ledger, 0)
    prefill(cache, first)
    keys = cache.of[first].keys
    assert len(cache.host) == 0  # (computed: not stored yet)
    cache.release(first, 11)
    cache.take(8)  # every free block: the system prompt's two go to the host (2 blocks fit)
    assert cache.ref == {} and list(cache.host) == keys[::-1]
    assert cache.lookup(ledger, 1) == 8  # both found in the host tier
    second = admit(cache, ledger, 1)
    assert cache.of[second].loading == 8 and cache.load_s(second, 0.0) == 4.0  # 8 x 0.5 s
    assert cache.ref == {}  # (loading: not found on the card by others until it lands)
    cache.landed(second)
    assert cache.ref == {k: 1 for k in keys}  # back on the card, and still in the host
    assert sorted(cache.host) == sorted(keys) and cache.of[second].loading == 0
    p = cache.report()["prefix_cache"]
    assert (p["hit_tokens"], p["host_hit_tokens"], p["evicted_blocks"]) == (0, 8, 2)
    assert p["host_load_s"] == 4.0


def test_write_through_stores_a_block_as_it_is_computed_and_keeps_only_the_newest():
    cache = PrefixCache(KVBudget("prefix", 32, 4, host_tokens=8, host_token_s=0.5))
    ledger = system_prompts(1)
    first = admit(cache, ledger, 0)
    keys = cache.of[first].keys
    prefill(cache, first)
    assert list(cache.host) == keys  # computed: stored at once
    cache.release(first, 11)
    cache.take(8)  # the card gives them up: the host has them already
    assert cache.ref == {} and list(cache.host) == keys
    # another system prompt's 2 blocks computed: the host keeps its newest 2
    other = FakeLedger(SharedPrompts(np.ones(1, int), np.array([8, 8]), np.full(1, -1)), [10])
    stranger = admit(cache, other, 0)
    prefill(cache, stranger)
    assert list(cache.host) == cache.of[stranger].keys and cache.lookup(ledger, 0) == 0


def test_the_block_queue_takes_blocks_as_an_ordered_dict_of_keys_and_runs_would():
    """BlockQueue against a plain reference: an OrderedDict of keys (None) and runs (a count),
    popped from the head one entry at a time, on random pushes, removals and pops."""
    rng = np.random.default_rng(5)
    queue, ref, runs = BlockQueue(), __import__("collections").OrderedDict(), 0
    for _ in range(3000):
        op = rng.integers(4)
        if op == 0:  # push keys not in the queue, some pushed and taken before
            keys = [int(k) for k in rng.choice(60, size=rng.integers(0, 6), replace=False)
                    if int(k) not in ref]
            queue.push(keys)
            ref.update(dict.fromkeys(keys))
        elif op == 1:
            count = int(rng.integers(1, 4))
            queue.push_run(count)
            ref[("run", runs)], runs = count, runs + 1
        elif op == 2 and ref:  # take some keys out from anywhere
            keys = [k for k in ref if not isinstance(k, tuple) and rng.random() < 0.2]
            queue.remove(keys)
            for key in keys:
                del ref[key]
        else:
            blocks, want = int(rng.integers(1, 8)), []
            left = blocks
            while left > 0 and ref:
                key, count = ref.popitem(last=False)
                if count and count > left:
                    ref[key] = count - left
                    ref.move_to_end(key, last=False)
                left -= count or 1
                if count is None:
                    want.append(key)
            assert queue.pop(blocks) == want
        assert list(queue) == [k for k in ref if not isinstance(k, tuple)]
        assert queue.blocks() == sum(count or 1 for count in ref.values())


def test_the_fewest_replicas_with_and_without_caching_under_each_router(tmp_path, capsys):
    path = os.path.join(MOONCAKE, "conversation_trace.jsonl")
    if not os.path.exists(path):
        pytest.skip("the Mooncake traces are not beside the project")
    with open(path) as f:  # a slice of the conversation trace: its first 80 requests
        (tmp_path / "slice.jsonl").write_text("".join(next(f) for _ in range(80)))
    results, out = run_main(["--experiments", "C", "--trace", str(tmp_path / "slice.jsonl"),
                             "--rate", "trace", "--model", "llama-3-8b", "--gpu", "h100",
                             "--enable-prefix-caching", "--router", "all", "--slo-ttft-ms",
                             "2000", "--target-rate", "2", "--no-figures", "--out",
                             str(tmp_path / "out")], capsys)
    cap = json.loads((tmp_path / "out" / "results.json").read_text())["C"]["capacity"]
    assert cap["kv_policy"] == "prefix" and cap["fleet_requests"] == 80  # (not cycled)
    assert cap["requests"] == 80 and cap["longest_output"] > 0
    with_caching, without = cap["routers"], cap["without_caching"]
    assert {"round-robin", "cache-aware"} <= set(with_caching)
    assert set(without) == set(with_caching) - {"cache-aware", "precise-prefix"}  # (by the cache)
    # (llm-d's weights send every request matching a block to the replica holding it while
    # queues are short: on this slice a hot spot that no count relieves)
    for name, r in [*with_caching.items(), *without.items()]:
        if name == "precise-prefix":
            assert r["replicas"] is None and max(a for _, a in r["tried"]) < 0.9
            continue
        assert r["replicas"] >= 1 and r["attainment"] >= 0.9
        assert r["below"] is None or r["below"] < 0.9
        assert dict(r["tried"])[r["replicas"]] == r["attainment"]
    assert said("round-robin, no prefix caching", out.out)
    assert said("cache-aware", out.out.split("replicas needed for 2 requests/s")[1])
    ko = format_tables(results, "ko")
    assert "round-robin, 접두사 캐시 없이" in ko


def test_a_host_tier_loads_over_each_tensor_parallel_cards_link_at_once():
    """Each of the tp cards loads the share of a token's KV it keeps over its own host link,
    all at once: its K/V heads' share (llama-3-8b's 8 heads over 2 cards: half each; over 16,
    one head each, replicated), or a latent attention's whole latent (every card keeps it)."""
    def host(model, tp):
        run = parse_args(["--experiments", "C", "--model", model, "--gpu", "h200", "--tp",
                            str(tp), "--enable-prefix-caching", "--host-kv-gb", "10"])
        per_token = kv_bytes_per_token(run.hardware.model)
        return per_token, host_tier(run, per_token)
    per_token, one = host("llama-3-8b", 1)
    # (at a DMA copy's share of the link: about 50 of PCIe 5.0's 64 GB/s, vLLM's measurement)
    assert one["host_link_gbs"] == 64.0 and one["host_load_share"] == 50 / 64
    assert one["host_token_s"] == pytest.approx(per_token / 50e9)
    assert host("llama-3-8b", 2)[1]["host_token_s"] == pytest.approx(one["host_token_s"] / 2)
    assert host("llama-3-8b", 16)[1]["host_token_s"] == pytest.approx(one["host_token_s"] / 8)
    assert host("llama-3-8b", 2)[1]["host_tokens"] == one["host_tokens"] == \
        int(10e9 // per_token)
    latent_per_token, latent = host("deepseek-v3", 8)
    assert latent["host_token_s"] == pytest.approx(latent_per_token / 50e9)


@pytest.mark.parametrize("flags, fragment", [
    (["--host-kv-gb", "10"], "--host-kv-gb works with a prefix cache"),
    (["--router", "cache-aware", "--replicas", "2"], "--router cache-aware works with a prefix"),
    (["--host-kv-gb", "10", "--kv-policy", "paged"], "add --enable-prefix-caching"),
    (["--host-write-policy", "write-back", "--enable-prefix-caching"], "add --host-kv-gb"),
    (["--disk-kv-gb", "100", "--enable-prefix-caching"], "the disk tier is below host memory"),
    (["--disk-kv-gbs", "3", "--enable-prefix-caching", "--host-kv-gb", "10"],
     "add --disk-kv-gb"),
    (["--disk-kv-gb", "100", "--host-kv-gb", "10"], "--host-kv-gb works with a prefix cache"),
    (["--disk-prefetch", "--enable-prefix-caching", "--host-kv-gb", "10"], "add --disk-kv-gb"),
    (["--router", "precise-prefix", "--replicas", "2"], "--router precise-prefix works with"),
])
def test_the_cache_flags_without_a_cache_are_refused(flags, fragment, tmp_path, capsys):
    expect_usage_error(["--experiments", "C", "--out", str(tmp_path)] + flags, capsys, fragment)
    assert not (tmp_path / "results.json").exists()


@pytest.mark.parametrize("second, fragment", [
    ('{"timestamp": 1' + "0" * 400 + ', "input_length": 600, "output_length": 5, '
     '"hash_ids": [1, 2]}', "trace.jsonl:2: "),
    ('{"timestamp": 1e300, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}',
     "past the 1e+09 s C's clock keeps"),
])
def test_timestamps_too_large_for_the_clock_are_refused(second, fragment, tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    path.write_text(GOOD + "\n" + second + "\n")
    out = tmp_path / "out"
    expect_usage_error(["--experiments", "C", "--trace", str(path), "--rate", "trace",
                        "--enable-prefix-caching", "--out", str(out)], capsys, fragment)
    assert not (out / "results.json").exists()


def test_a_host_tier_load_parks_only_the_request_it_loads_for():
    """vLLM's offloading connector and LMCache load a hit from host memory asynchronously: the
    request waits for its KV (parked), the batch decodes on. Request 0 computes a 256-token
    system prompt; 1, a long stranger, evicts part of it from a 64-block card to the host tier
    (write-through: stored as computed); 2 decodes 400 tokens while 3, opening with that system
    prompt, loads the evicted part at 0.01 s a token."""
    identity = SharedPrompts(np.array([0, -1, -1, 0]), np.array([256]), np.full(4, -1))
    arrival, output = np.array([0.0, 10.0, 20.0, 21.0]), np.array([2, 2, 400, 2])
    req = Requests(arrival, np.array([272, 900, 64, 272]), output, identity=identity)
    kv = KVBudget("prefix", 1024, 16, host_tokens=4096, host_token_s=0.01)
    sim = simulate_serving(req, Replica(4, COSTS, kv=kv))
    p, times = sim["prefix_cache"], sim["times"]
    loaded = p["host_hit_tokens"]
    assert p["hits"][3] == 256 and loaded > 0 and p["host_load_s"] == loaded * 0.01
    assert times.first_token[3] - arrival[3] >= loaded * 0.01  # it waited for its KV
    # the decoder beside it did not: its last token as early as without request 3 but for
    # request 3's own prefill step (a load that stalled the step would add loaded x 0.01 s)
    alone = simulate_serving(Requests(arrival[:3], req.prompt[:3], output[:3],
                                      identity=identity.take(np.arange(3))),
                             Replica(4, COSTS, kv=kv))
    assert times.finish[2] - alone["times"].finish[2] < 0.1 < loaded * 0.01


@pytest.mark.parametrize("write", ["write-through", "write-back"])
def test_the_disk_tier_keeps_what_host_memory_gave_up(write):
    """A disk tier below a host tier of 4 blocks: request 1 (900 tokens) pushes request 0's
    256-token system prompt out of the 64-block card and (most of it) out of host memory, and
    request 3, opening with it, reads it from disk (0.05 s a token, slower than the host link's 0.01 s:
    its load takes the disk's time); without the disk tier it recomputes what the card lost.
    Write-through, the disk stored the prompt as it was computed; write-back, as host memory
    gave it up."""
    identity = SharedPrompts(np.array([0, -1, -1, 0]), np.array([256]), np.full(4, -1))
    arrival, output = np.array([0.0, 10.0, 20.0, 21.0]), np.array([2, 2, 40, 2])
    req = Requests(arrival, np.array([272, 900, 64, 272]), output, identity=identity)
    kv = KVBudget("prefix", 1024, 16, host_tokens=64, host_token_s=0.01, host_write=write,
                  disk_tokens=16_384, disk_token_s=0.05)
    sim = simulate_serving(req, Replica(4, COSTS, kv=kv))
    p = sim["prefix_cache"]
    read = p["disk_hit_tokens"]
    assert p["hits"][3] == 256 and read > 0 and p["hit_tokens"] == 0
    # (write-back, host memory keeps the prompt's head: the card gave its blocks up tail first)
    assert p["host_hit_tokens"] == (0 if write == "write-through" else 64)
    assert p["host_load_s"] == pytest.approx(read * 0.05)  # (the disk read, not the link)
    assert sim["times"].first_token[3] - arrival[3] >= read * 0.05
    without = simulate_serving(req, Replica(4, COSTS, kv=dataclasses.replace(kv, disk_tokens=0)))
    assert without["prefix_cache"]["hits"][3] == 256 - read


def test_a_disk_read_prefetched_as_its_request_arrives():
    # 8 tokens to load, 4 of them read from disk first at 1 s a token, the link's copy 0.25 s a
    # token: admitted at 10 s, arrived at 3 s. Prefetched (SGLang's L3 prefetch), the read ran
    # from 3 to 7 s and only the copy waits, 10 to 12 s; read at admission (LMCache's
    # retrieve), 10 to 14 s decides. A second load admitted at 10.5 s queues behind both: its
    # copy on the link from 12 to 13 s, its read after the first's
    from nn40.tiers import TierLoads
    for prefetch, waits in ((True, (2.0, 2.5)), (False, (4.0, 7.5))):
        loads = TierLoads(0.25, 1.0, prefetch)
        assert loads.load("a", 8, 4, 10.0, 3.0) == waits[0]
        assert loads.load("b", 4, 4, 10.5, 3.5) == waits[1]
        assert loads.wait_s == sum(waits)


def test_a_read_left_unfinished_gives_the_disk_back_and_stores_nothing():
    # a 32-token system prompt on the disk alone (1 s a token; the link 0.01 s): request 0
    # admitted at 0 waits 32 s for it; preempted at 1 s, it has stored nothing in host memory,
    # and the disk is free from 1 s: back at 1.5 s it reads all of it again, to 33.5 s
    from nn40.tiers import TierLoads
    ledger = system_prompts(2, system_tokens=32, own=2)
    cache = PrefixCache(KVBudget("prefix", 256, 4, host_tokens=64, host_token_s=0.01,
                                 disk_tokens=1024, disk_token_s=1.0))
    keys = ledger.identity.block_keys(0, 34, 4)
    cache.disk.store(keys[:8])
    seq = admit(cache, ledger, 0)
    assert cache.load_s(seq, 0.0) == 32.0
    cache.cancel_load(seq, 1.0)
    cache.preempt(seq, seq.num_cached)
    assert not any(key in cache.host.where for key in keys[:8])
    assert cache.link.disk_free_s == 1.0 and free_blocks(cache) == 64
    again = admit(cache, ledger, 0)
    assert cache.of[again].from_disk == 32 and cache.load_s(again, 1.5) == 32.0
    assert cache.report()["prefix_cache"]["host_load_s"] == 1.0 + 32.0
    cache.landed(again)  # (landed: now host memory keeps it too)
    assert all(key in cache.host.where for key in keys[:8])
    # the link is busy with a load's copy alone: a load from host memory behind a long read
    # waits for the copy before it, not for the read
    loads = TierLoads(0.1, 1.0)
    assert loads.load("a", 10, 10, 0.0, 0.0) == 10.0 and loads.link_free_s == 1.0
    assert loads.load("b", 10, 0, 0.5, 0.5) == pytest.approx(1.5)


def test_the_tiers_pass_blocks_down_by_their_write_policy():
    # write-through: computed blocks go to every tier; write-back: to a tier as the one above
    # gives them up; a block read from the disk is stored in host memory, the disk keeping it
    from nn40.tiers import HOST_TIERS
    for write, host_after, disk_after in (("write-through", ["b", "c"], ["a", "b", "c"]),
                                          ("write-back", [], [])):
        disk = HOST_TIERS[write](10)
        host = HOST_TIERS[write](2, below=disk)
        host.computed(["a", "b", "c"])
        assert list(host) == host_after and list(disk) == disk_after, write
    host.evicted(["a", "b", "c"])  # (write-back: the card gave them up)
    assert list(host) == ["b", "c"] and list(disk) == ["a"]
    host.promoted(["a"])  # read from disk: host stores it, pushing b down
    assert list(host) == ["c", "a"] and sorted(disk) == ["a", "b"]


def test_blocks_still_loading_are_not_hit_and_a_pool_wakes_as_they_land():
    """A request opening with the same system prompt during another's load does not find
    the loading blocks on the card (vLLM caches them once received): it loads them too. And
    one replica in a pool, idle but for the load, still takes an arrival before it lands:
    the pool equals the replica alone."""
    identity = SharedPrompts(np.array([0, -1, -1, 0, 0]), np.array([256]), np.full(5, -1))
    arrival, output = np.array([0.0, 10.0, 20.0, 21.0, 21.5]), np.array([2, 2, 40, 2, 2])
    req = Requests(arrival, np.array([272, 900, 64, 272, 272]), output, identity=identity)
    replica = Replica(4, COSTS, kv=KVBudget("prefix", 1024, 16, host_tokens=4096,
                                            host_token_s=0.01))
    sim = simulate_serving(req, replica)
    times, p = sim["times"], sim["prefix_cache"]
    load = p["host_hit_tokens"] / 2 * 0.01  # (both loaded the same blocks, one after the
    assert load > 1.0                        # other over the one host link)
    assert p["host_load_s"] == pytest.approx(load + (arrival[3] + 2 * load - arrival[4]))
    assert times.first_token[4] >= arrival[3] + 2 * load  # it waited for both loads
    fleet = simulate_fleet(req, replica, Fleet(1, "round-robin"))
    for key in ("start", "first_token", "finish"):
        assert np.array_equal(getattr(fleet["times"], key), getattr(times, key)), key


@pytest.mark.parametrize("name", ["fifo", "lfu"])
def test_the_ranked_eviction_orders_against_a_plain_reference(name):
    """FIFO (by first caching: the cache says so before it frees a key; a key pushed uncached
    by that push) and LFU (fewest hits, held or free, then least recently pushed) against a
    plain reference: a dict of each queued key's rank, the lowest popped first; runs of
    keyless blocks before any key; random cachings, hits, pushes, removals and pops."""
    rng = np.random.default_rng(7)
    queue, ranks, runs, born, hits, tick = EVICTION_ORDERS[name](), {}, 0, {}, {}, 0
    for _ in range(4000):
        op = rng.integers(6)
        keys = [int(k) for k in rng.choice(50, size=rng.integers(0, 5), replace=False)]
        if op == 0:  # push keys not in the queue
            keys = [k for k in keys if k not in ranks]
            queue.push(keys)
            for key in keys:
                born.setdefault(key, tick)
                ranks[key] = (born[key],) if name == "fifo" else (hits.get(key, 0), tick)
                tick += 1
        elif op == 1:
            count = int(rng.integers(1, 4))
            queue.push_run(count)
            runs += count
        elif op == 2 and ranks:  # taken out (a hit on a free block)
            keys = [k for k in ranks if rng.random() < 0.2]
            queue.remove(iter(keys))  # (an iterator, as the cache passes one)
            for key in keys:
                del ranks[key]
        elif op == 3:  # cached (computed) keys, in the queue or not
            queue.cached(keys)
            if name == "fifo":
                for key in keys:
                    born.setdefault(key, tick)
                    tick += 1
        elif op == 4:  # hits, held or free (a free one's rank is fixed until pushed again)
            queue.hit(keys)
            if name == "lfu":
                for key in keys:
                    hits[key] = hits.get(key, 0) + 1
        else:
            blocks = int(rng.integers(1, 8))
            keyless = min(blocks, runs)
            runs -= keyless
            want = sorted(ranks, key=ranks.get)[:blocks - keyless]
            for key in want:  # (evicted: its first caching and hits forgotten)
                del ranks[key]
                born.pop(key, None)
                hits.pop(key, None)
            assert queue.pop(blocks) == want
        assert list(queue) == sorted(ranks, key=ranks.get)
        assert queue.blocks() == len(ranks) + runs


def test_each_eviction_order_runs_and_the_orders_differ(tmp_path, capsys):
    req = conversations(n=600)
    ratio = {}
    for order in ("lru", "fifo", "lfu"):
        sim = simulate_serving(req, Replica(16, COSTS, kv=KVBudget(
            "prefix", 6_000, 16, watermark=0.01, eviction=order)))
        assert np.isfinite(sim["times"].finish).all() and sim["prefix_cache"]["evicted_blocks"]
        ratio[order] = sim["prefix_cache"]["hit_tokens"] / sim["prefix_cache"]["queried_tokens"]
    # (FIFO gives up a system prompt however often it is hit)
    assert len(set(ratio.values())) == 3 and ratio["fifo"] == min(ratio.values()), ratio
    with pytest.raises(SystemExit):
        run_main(["--experiments", "C", "--eviction-policy", "lfu", "--out", str(tmp_path)],
                 capsys)
    assert said("--eviction-policy lfu works with a prefix cache", capsys.readouterr().err)


def test_sglangs_radix_cache_matches_tokens_and_shares_only_what_is_computed():
    # a 1,000-token system prompt (not whole 16-token blocks) opening 64 requests at t = 0,
    # then one more at t = 100: the radix cache at SGLang's page size 1 finds all 1,000 tokens
    # where 16-token blocks find 992; and the 63 newcomers of the first step, prefilled with
    # the one computing it, share nothing (SGLang inserts a request's tokens once computed)
    n = 65
    identity = SharedPrompts(np.zeros(n, int), np.array([1000]), np.full(n, -1))
    arrival = np.r_[np.zeros(n - 1), 100.0]
    req = Requests(arrival, np.full(n, 1064), np.full(n, 8), identity=identity)
    hits = {}
    for policy, block in (("prefix", 16), ("radix", 1), ("radix", 16)):
        sim = simulate_serving(req, Replica(n, COSTS, scheduler="continuous",
                                            kv=KVBudget(policy, 10**6, block)))
        hits[policy, block] = sim["prefix_cache"]["hits"]
    assert hits["prefix", 16][n - 1] == 992 and hits["radix", 1][n - 1] == 1000
    assert hits["radix", 16][n - 1] == 992
    assert sum(hits["prefix", 16].values()) == 64 * 992          # 63 shared in the step
    assert sum(hits["radix", 1].values()) == 1000                # only the late one


def test_the_radix_policy_in_the_main_run(tmp_path, capsys):
    results, out = run_main(["--experiments", "C", "--model", "llama-3-8b", "--gpu", "h100",
                             "--requests", "200", "--rate", "10", "--prefix-len", "500",
                             "--num-prefixes", "2", "--kv-policy", "radix", "--block-tokens",
                             "1", "--no-figures", "--out", str(tmp_path)], capsys)
    kv = json.loads((tmp_path / "results.json").read_text())["C"]["kv"]
    p = kv["radix"]["continuous"]["prefix_cache"]
    assert p["hit_tokens"] > 0 and p["hit_tokens"] % 500 == 0  # (token-exact: whole prompts)
    assert said("radix cache", out.out)


# Published runs, as checks (nothing is fitted on them): vLLM's KV offloading connector to CPU
# memory, blog.vllm.ai "Inside vLLM's New Offloading Connector" (2025-12-29; vLLM at commit
# 2a1776b, one H100 80GB, Llama-3.1-8B-Instruct, GPU prefix caching off, blocks of 16 tokens).
# Its text: loading a 512-token prompt's KV from the CPU instead of computing it cuts a single
# request's TTFT by 2x ("TTFT for this prompt size only decreased by X2"), and 10,000 prefill
# requests of 512 tokens, all their KV in the CPU cache, run at up to 9x the throughput of
# none ("throughput increases by up to X9"). C: 1.81x and 10.4x; with every load on the link at
# once (no queue), C said 29.9x.
def offloading_replica():
    """Llama-3.1-8B on an H100 under the vllm profile, its prefix cache and a host tier that
    holds every prompt, written through, loading at C's host-link share."""
    from nn40.config import HOST_LINK_SHARE, HOST_LINKS
    from nn40.pricing import ENGINE_PROFILES, card_kv_tokens
    cfg, card, profile = MODELS["llama-3.1-8b"], GPUS["h100"], ENGINE_PROFILES["vllm"]
    token_s = kv_bytes_per_token(cfg) / (HOST_LINK_SHARE * HOST_LINKS["h100"][1] * 1e9)
    kv = KVBudget("prefix", card_kv_tokens(cfg, card, profile), 16, 0, 0.01, 6_000_000,
                  token_s)
    return profile.replica(card_costs(cfg, card, profile), slots=1024, chunk_tokens=8192,
                           kv=kv)


def prompts_of_512(ids, arrival):
    """Requests of 512 prompt tokens, each a system prompt of its own id, one output token."""
    n = len(ids)
    return Requests(np.asarray(arrival, float), np.full(n, 512), np.ones(n, dtype=np.int64),
                    identity=SharedPrompts(np.asarray(ids), np.full(max(ids) + 1, 512),
                                           np.full(n, -1)))


def test_vllms_offloading_blog_single_request_ttft():
    # prompt 0 computed, pushed off the card by 1,000 others (512,000 tokens past its
    # 448,224), then asked again alone: its 496 cached tokens (31 blocks) load from the host
    m = 1000
    req = prompts_of_512(np.r_[0, np.arange(1, m + 1), 0], np.r_[0.0, np.full(m, 10.0), 1e3])
    sim = simulate_serving(req, offloading_replica())
    assert sim["prefix_cache"]["hits"][m + 1] == 496 and sim["prefix_cache"]["hit_tokens"] == 0
    ttft = sim["times"].first_token - req.arrival_s
    assert ttft[0] / ttft[-1] == pytest.approx(2.0, rel=0.15)


def test_vllms_offloading_blog_throughput_at_every_hit_in_host():
    # 10,000 distinct prompts, all waiting, then the same 10,000 again once the first have
    # gone: every one found in the host tier (the card kept none of the first by then)
    n, later = 10_000, 1e5
    req = prompts_of_512(np.tile(np.arange(n), 2), np.r_[np.zeros(n), np.full(n, later)])
    sim = simulate_serving(req, offloading_replica())
    p, finish = sim["prefix_cache"], sim["times"].finish
    assert p["host_hit_tokens"] == n * 496 and p["hit_tokens"] == 0
    none, every = n * 512 / finish[:n].max(), n * 512 / (finish[n:].max() - later)
    assert every / none == pytest.approx(9.0, rel=0.2)  # (C: 10.4x; "up to X9")


# SGLang's cache-aware router, lm-sys.github.io blog/2024-12-04-sglang-v0-4.md: 8 A100 80GB,
# Llama-3.1-8B-Instruct at --dp-size 8, bench_serving.py --dataset-name generated-shared-prefix
# with its defaults (64 groups of 16 prompts, a 2,048-token system prompt, a 128-token question,
# 256 output tokens, shuffled, all sent at once: sample_generated_shared_prefix_requests, the
# 1,024 requests of sgl-project/sglang#1990). It measured 158,596 tokens/s and a 75% cache hit
# rate behind the router against 82,665 and 20% behind v0.3's round-robin data parallelism
# (1.9x). C finds 50% and 85% and 1.57x: its round-robin replicas each see about two prompts of a
# group, the second hitting the first's blocks, where SGLang measured 20%. The post's reproduce
# block gives the bench no flags but the dataset (its defaults, as here, sent at once); the
# numbers are sgl-project/sglang#2170's table ("Original RR DP": v0.3's own data-parallel
# controller, not the router's round-robin; "Cache Aware v1": #2114's router, always
# cache-aware, cache_threshold 0.5, the smallest tree below it, no balance thresholds), and
# neither says how the hit rate was counted (likely the scheduler's cumulative "cache hit rate"
# log line, hit tokens over all prefill tokens). What keeps SGLang's round-robin at 20% is not
# pinned (the bench shuffles its requests; v0.3 shared no prefix within a prefill batch, as C's
# radix cache does not); the check is expected to fail until that is known.
@pytest.mark.xfail(strict=True, reason="C finds 50% cached behind round-robin where SGLang v0.3 "
                   "measured 20% (85% against 75% behind the router)")
def test_sglangs_v04_router_blog_hit_rates_and_speedup():
    from nn40.pricing import ENGINE_PROFILES, card_kv_tokens
    groups, per, n = 64, 16, 64 * 16
    order = np.random.default_rng(0).permutation(n) // per  # (the bench's shuffle)
    req = Requests(np.zeros(n), np.full(n, 2048 + 128), np.full(n, 256),
                   identity=SharedPrompts(order, np.full(groups, 2048), np.full(n, -1)))
    cfg, card, profile = MODELS["llama-3.1-8b"], GPUS["a100-80gb"], ENGINE_PROFILES["sglang"]
    replica = profile.replica(card_costs(cfg, card, profile), kv=KVBudget(
        "radix", card_kv_tokens(cfg, card, profile), 1))
    hit, makespan = {}, {}
    for router in ("round-robin", "cache-aware"):
        sim = simulate_fleet(req, replica, Fleet(8, router))
        p = sim["prefix_cache"]
        hit[router] = p["hit_tokens"] / p["queried_tokens"]
        makespan[router] = float(np.nanmax(sim["times"].finish))
    assert hit["cache-aware"] == pytest.approx(0.75, abs=0.05)  # (C: 0.853)
    assert hit["round-robin"] == pytest.approx(0.20, abs=0.05)  # (C: 0.501)
    assert makespan["round-robin"] / makespan["cache-aware"] == pytest.approx(
        158_596 / 82_665, rel=0.15)  # (C: 1.57x)


def test_loads_queue_on_the_host_link_and_a_cancelled_one_gives_its_time_back():
    # 8 tokens at 0.5 s each: a's load takes the link from 0 to 4 s, b's (asked at 1 s) from 4
    # to 8; b preempted at 2 s gives the link back from 4 (it was the last queued) and has
    # waited 1 s, so c, asked at 3 s, loads from 4 to 8; a cancelled at 1 s while c waits
    # behind it leaves c's slot alone and has waited 1 s
    from nn40.kv import CachedBlocks
    cache = PrefixCache(KVBudget("prefix", 64, 4, host_tokens=8, host_token_s=0.5))
    a, b, c = (Seq(r, r, 4, 1) for r in range(3))
    for seq in (a, b, c):
        cache.of[seq] = CachedBlocks([], [], 0, 8)
    assert cache.load_s(a, 0.0) == 4.0 and cache.load_s(b, 1.0) == 7.0
    cache.cancel_load(b, 2.0)
    assert cache.link.link_free_s == 4.0 and cache.link.wait_s == 4.0 + (2.0 - 1.0)
    assert cache.load_s(c, 3.0) == 5.0
    cache.cancel_load(a, 1.0)  # (c is queued behind it: the link stays booked to 8 s)
    assert cache.link.link_free_s == 8.0 and cache.link.wait_s == (1.0 - 0.0) + 1.0 + 5.0
