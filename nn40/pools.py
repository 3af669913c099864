"""Fleets: one or more named pools of replicas (Pool: a Replica spec, how many, a router), run in
time together by one event queue, a request's path through the pools being data
(simulate_pools: a prefill pool hands requests to a decode pool; simulate_fleet: one pool)
"""
import copy
import dataclasses
import math
from typing import NamedTuple

import numpy as np

from nn40.events import EventQueue
from nn40.handoff import HandOff
from nn40.kv import KVUnfit, check_kv_budget, merged_reports
from nn40.loop import FleetReplica
from nn40.queues import Ledger
from nn40.replicas import Replica
from nn40.routers import make_router


class Fleet(NamedTuple):
    """Identical replicas behind a router (see route); seed: power-of-two's draws."""
    replicas: int
    router: str = "round-robin"
    seed: int = 0


class Pool(NamedTuple):
    """A named pool of `replicas` identical replicas (each a Replica) behind a router (see
    route); seed: power-of-two's draws."""
    name: str
    replica: Replica
    replicas: int = 1
    router: str = "round-robin"
    seed: int = 0


class PoolStage:
    """One pool on the requests' path: its replicas, the router's draws, where each request
    went, and how many have still to arrive. A pool before the last serves a request to its
    first token (a prefill pool): its finish hook hands the request on, its prompt and first
    token cached, to the next stage (entered with all of its prefill done)."""

    def __init__(self, pool, ledger, arrivals, last=True):
        self.pool, self.ledger, self.left, self.last = pool, ledger, arrivals, last
        self.servers = [FleetReplica(None, pool.replica, ledger) for _ in range(pool.replicas)]
        n, m = len(ledger.output), pool.replicas
        rng, rng_second = (np.random.default_rng(pool.seed + i) for i in (0, 1))
        first = rng.integers(m, size=n)  # (power-of-two's draws)
        second = (first + 1 + rng_second.integers(max(m - 1, 1), size=n)) % m
        self.pairs, self.where = list(zip(first.tolist(), second.tolist())), [-1] * n
        self.router = make_router(pool.router)
        self.on_arrive = None  # hook (request, t): a request placed before it arrives is in

    def place(self, r):
        """Choose request r's replica now (by the router, reading each replica as it is) ->
        its index."""
        self.where[r] = i = self.router.pick(self.servers, r, self.pairs[r])
        return i

    def route(self, r, t):
        """Request r arrives at t: at the replica it was placed at, else one placed now -> that
        replica."""
        i = self.where[r]
        if i < 0:
            i = self.place(r)
        elif self.on_arrive:
            self.on_arrive(r, t)
        self.left -= 1
        return self.servers[i]


def simulate_pools(req, pools, path=None, progress=None, link=None):
    """The requests through pools of replicas (Pool: a spec, a count and a router each),
    every request along `path` (the pools' names in order; default: the first pool alone):
    a path of two is a prefill pool, whose replicas serve each request to its first token,
    then a decode pool it enters at that moment, its prompt and first token cached (KV sent
    at no cost, or, given a KVLink, once its prompt's KV has crossed it: see KVSends). One
    event queue orders every replica's runs, every arrival and every
    hand-off in time, so a replica is read by its router as it is at the arrival, and a
    hand-off between pools at any time is exact. -> as simulate_fleet, with "pools": each
    pool's "replica" (where each request went there, -1: never) and "per_replica" (and,
    given a link, "kv_transfer": what crossed it)."""
    names = [pool.name for pool in pools]
    path = names[:1] if path is None else list(path)
    if len(path) > 2 or not set(path) <= set(names) or len(set(names)) < len(names):
        raise ValueError(f"a path of pools {path} among {names}: one pool, or prefill then "
                         "decode")
    ledger = Ledger(req)
    stages = [pool_stage(req, pools[names.index(name)], ledger, last=i == len(path) - 1,
                         first=i == 0) for i, name in enumerate(path)]
    queue = EventQueue(ledger.arrival)
    hand_off = HandOff(ledger, stages[0], stages[1], queue, link) if len(stages) > 1 else None
    sends = hand_off and hand_off.sends
    queue.run(stages[0], progress)
    result = pools_result(req, stages)
    if sends:
        result["kv_transfer"] = sends.totals
    if hand_off:
        result["hand_off"] = hand_off.totals
    return result


def pool_stage(req, pool, ledger, last, first):
    """A PoolStage for `pool` on the path; every request must fit its KV cache alone."""
    kv = pool.replica.kv  # (identical replicas: all or none fit)
    output = req.output if last else np.ones_like(req.output)  # (a prefill pool: one token)
    unfit = kv is not None and check_kv_budget(dataclasses.replace(req, output=output), kv,
                                               pool.replica.speculation, handed=not first)
    if unfit:
        raise KVUnfit(kv.policy, unfit)
    if not first:  # (its own arrivals: the hand-offs' times; its own queues' marks)
        ledger = copy.copy(ledger)
        ledger.arrival, ledger.taken = [math.inf] * len(output), bytearray(len(output))
    return PoolStage(pool, ledger, len(output) if first else int((req.output > 1).sum()), last)


def pools_result(req, stages):
    """simulate_pools's result: the ledger's times, where each request went (the first
    pool's, and every pool's), and the replicas' steps and memory summed."""
    ledger = stages[0].ledger
    results, pools, first = [], {}, None
    for stage in stages:
        res = [server.own_result() for server in stage.servers]  # (the times: once, below)
        where = np.array(stage.where)
        output = req.output if stage.last else np.ones_like(req.output)
        output = output - (stage is not stages[0])  # (the decode pool: all but the first)
        pools[stage.pool.name] = {"replica": where, "per_replica": [
            {"requests": int((where == i).sum()), "output_tokens": int(output[where == i].sum()),
             "steps": r["steps"], "occupancy": r["occupancy"],
             "busy_s": r["prefill_s"] + r["decode_s"]} for i, r in enumerate(res)]}
        results += res
        first = first or (res, pools[stage.pool.name]["per_replica"])
    fleet = {"times": ledger.times()}
    per_replica = [p for pool in pools.values() for p in pool["per_replica"]]
    steps = sum(res["steps"] for res in results)
    fleet.update(replica=pools[stages[0].pool.name]["replica"],
                 per_replica=pools[stages[0].pool.name]["per_replica"], steps=steps,
                 occupancy=sum(p["occupancy"] * p["steps"] for p in per_replica) / max(steps, 1),
                 iterations=sum(res["iterations"] for res in results),
                 longest_step_s=max(res["longest_step_s"] for res in results),
                 prefill_s=sum(res["prefill_s"] for res in results),
                 decode_s=sum(res["decode_s"] for res in results))
    # (a prefix cache's hits where prompts are computed: the first pool's; a decode pool is
    # handed each prompt's KV whole)
    fleet.update(merged_reports(*first))
    if len(stages) > 1:
        fleet["pools"] = pools
    if all("kv" in res for res in results):
        fleet["kv"], fleet["generated"] = pooled_memory(results), np.array(ledger.generated)
    return fleet


def pooled_memory(results):
    """The replicas' memory records as one: integrals and counts summed, peaks the largest
    any replica reached (its contexts then), the series of the first replica."""
    mems = [res["kv"] for res in results]
    out = {key: sum(m[key] for m in mems) for key in (
        "held_s", "alloc_s", "running_s", "preemptions", "recomputed_tokens")}
    top = max(mems, key=lambda m: m["peak_held"])
    out.update(peak_running=max(m["peak_running"] for m in mems),
               max_alloc=max(m["max_alloc"] for m in mems), peak_held=top["peak_held"],
               peak_contexts=top["peak_contexts"], series=mems[0]["series"])
    return out


def simulate_fleet(req, replica, fleet, progress=None):
    """The requests through a Fleet of identical replicas (each simulate_serving's, with its own
    slots, KV budget and queue) behind a router that places each request at its arrival,
    reading every replica as it is then: one pool of simulate_pools. -> as simulate_serving
    (steps, iterations and memory summed over replicas; peaks the largest of any replica)
    with "replica": where each request went, and "per_replica": what each served."""
    return simulate_pools(req, [Pool("fleet", replica, fleet.replicas, fleet.router,
                                     fleet.seed)], progress=progress)
