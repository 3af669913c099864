"""C's fleets and capacity: replicas behind routers, the capacity at an SLO, and the prefix study
(pure simulation)

The routers' study (replicas_study: every router on the same requests), the SLO a request
meets (SLO, attained), the capacity searches (capacity_one: the highest rate one replica
serves within the SLO; fewest_replicas and fleet_capacity: how many a target rate needs;
capacity_choice: the answer C prints), and the prefix study (hits and TTFT against the
cache's capacity).
"""
import dataclasses
import math
from typing import NamedTuple

import numpy as np

from nn40.config import CAPACITY_REQUESTS, CAPACITY_SEEDS, REPLICAS_MAX
from nn40.errors import UsageError
from nn40.host import log, run_parallel
from nn40.kv import KV_MANAGERS, PREFIX_REPORT, check_kv_budget, plain_twin
from nn40.loop import simulate_serving
from nn40.metrics import serving_metrics
from nn40.pools import Fleet, simulate_fleet
from nn40.routers import ROUTERS
from nn40.runs import (
    arrivals, kv_metrics, memory_metrics, prefix_metrics, run_order, study_budget, timed_task,
    work_of)
from nn40.stats import percentiles
from nn40.workload import arrival_times, seed_for


def fleet_summary(req, fleet, slo_ttft_s, slo_tpot_s, kv=None):
    """A router's latencies and SLO over all requests, how evenly it spread them, and with a
    KV budget (kv) the memory its replicas used (memory_metrics)."""
    m = serving_metrics(req, fleet, slo_ttft_s, slo_tpot_s)
    per = fleet["per_replica"]
    memory = memory_metrics(req, fleet, kv, m["makespan_s"]) if "kv" in fleet else {}
    return {**{k: m[k] for k in ("throughput_rps", "output_tokens_per_s", "ttft_s", "tpot_s",
                                 "e2e_s", "goodput_rps", "slo_attained") if k in m},
            **prefix_metrics(req, fleet),
            "wait_s": percentiles(fleet["times"].start - req.arrival_s),
            "per_replica": per, "iterations": fleet["iterations"],
            "simulation_s": fleet.get("wall_s"),
            "balance": {"requests_min": min(p["requests"] for p in per),
                        "requests_max": max(p["requests"] for p in per),
                        "tokens_min": min(p["output_tokens"] for p in per),
                        "tokens_max": max(p["output_tokens"] for p in per),
                        "busiest_occupancy": max(p["occupancy"] for p in per)}, **memory}


def run_routers(run):
    if run.scheduler.router != "all":
        return (run.scheduler.router,)
    caching = any(KV_MANAGERS[policy].tracks_prefixes for policy in run.scheduler.kv_policies)
    return tuple(name for name, router in ROUTERS.items() if router.in_all or caching)


def replicas_study(run, req, replica):
    """C with --replicas: the run's requests over that many replicas behind each router,
    continuous batching. -> (result, Work)"""
    replica = dataclasses.replace(replica, scheduler="continuous")
    routers = run_routers(run)
    fleets = run_parallel([(timed_task, (
        f"C fleet {router}", simulate_fleet, req, replica,
        Fleet(run.scheduler.replicas, router, seed_for(run, "fleet")))) for router in routers],
        run.measurement.jobs)
    return {"replicas": run.scheduler.replicas, "slots": replica.slots,
            "chunk_tokens": replica.chunk_tokens,
            "requests": len(req.output),
            "scheduler": "continuous", "kv_policy": replica.kv.policy if replica.kv else None,
            "arrivals": arrivals(run),
            "routers": {router: fleet_summary(req, fleet, run.slo.slo_ttft_s, run.slo.slo_tpot_s,
                                              replica.kv)
                        for router, fleet in zip(routers, fleets)}}, work_of(fleets)


class SLO(NamedTuple):
    """What a request must meet (None: no bound), and the share of requests that must."""
    ttft_s: float = None
    tpot_s: float = None
    attainment: float = 0.9


def attained(req, rate, replica, fleet, slo):
    """The share of requests meeting the SLO when they arrive at `rate`: req's arrivals are
    drawn at one request per second and scaled, so that every rate sees the same draw. fleet:
    None for one replica."""
    at_rate = req.take(arrival_s=req.arrival_s / rate)
    sim = simulate_fleet(at_rate, replica, fleet) if fleet and fleet.replicas > 1 else \
        simulate_serving(at_rate, replica)
    return serving_metrics(at_rate, sim, slo.ttft_s, slo.tpot_s)["slo_attained"]


def capacity_one(req, replica, slo, rel=0.01):
    """The highest rate (of req's unit-rate arrivals, scaled) at which one replica serves
    slo.attainment of its requests within the SLO, to `rel`: bracketed from the rate it
    sustains with every request waiting at t=0, then bisected. -> (rate, [(rate, attainment)
    tried]); rate 0 when no rate meets the SLO, inf when every rate up to a thousand times
    that does."""
    tried = []

    def ok(rate):
        tried.append((rate, attained(req, rate, replica, None, slo)))
        return tried[-1][1] >= slo.attainment
    saturated = req.take(arrival_s=np.zeros(len(req.output)))
    top = hi = serving_metrics(saturated, simulate_serving(saturated, replica))["throughput_rps"]
    if not ok(top / 1000):  # (nearly idle, and still late)
        return 0.0, tried
    lo = hi / 2
    while ok(hi):
        lo, hi = hi, 2 * hi
        if hi > 1000 * top:
            return math.inf, tried
    while not ok(lo):  # (it ends: top / 1000 was met)
        lo, hi = lo / 2, lo
    while (hi - lo) / lo > rel:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    for share in (0.5, 0.8, 1.1, 1.25, 1.5):  # (the curve around the answer, for the figure)
        ok(share * lo)
    return lo, tried


def fewest_replicas(req, replica, slo, fleet, rate, start):
    """The fewest replicas behind fleet.router that serve `rate` (of req's unit-rate arrivals,
    scaled) with slo.attainment of the requests within the SLO, searched from `start` (up by
    doubling, then bisected; down one by one). -> (replicas, {replicas: attainment});
    replicas None past REPLICAS_MAX."""
    tried = {}

    def ok(n):
        if n not in tried:
            tried[n] = attained(req, rate, replica, fleet._replace(replicas=n), slo)
        return tried[n] >= slo.attainment
    n = max(1, min(start, REPLICAS_MAX))
    if ok(n):
        while n > 1 and ok(n - 1):
            n -= 1
    else:
        lo, hi = n, n
        while not ok(hi):
            if hi >= REPLICAS_MAX:
                return None, tried
            lo, hi = hi, min(2 * hi, REPLICAS_MAX)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if ok(mid) else (mid, hi)
        n = hi
    for m in range(max(1, n - 2), n + 2):  # (a few around the answer, for the figure)
        ok(m)
    return n, tried


def unit_rate(run, req, n, seed):
    """n requests, the run's cycled, arriving at one per second (Poisson, or gamma with
    --burstiness; a search scales the draw to each rate), and the replica's order for them.
    Prompts known by their blocks are not cycled (a prompt sent again would find itself
    cached): at most the run's requests, in their order."""
    if req.identity is not None:
        n = min(n, len(req.output))
    cycled = req.take(np.arange(n) % len(req.output))
    unit = arrival_times(n, 1.0, run.workload.burstiness, np.random.default_rng(seed))
    return cycled.take(arrival_s=unit), run_order(run, cycled.output)


def capacity_study(run, req, replica):
    """C with an SLO: the capacity of one replica (CAPACITY_SEEDS draws of Poisson arrivals,
    bisected to 1%), and with --target-rate, the fewest replicas under each router; continuous
    batching under the replica's KV budget."""
    replica = dataclasses.replace(replica, scheduler="continuous")
    slo = SLO(run.slo.slo_ttft_s, run.slo.slo_tpot_s, run.slo.slo_attainment)
    m = max(CAPACITY_REQUESTS, len(req.output))
    draws = [unit_rate(run, req, m, seed_for(run, "capacity", s))
             for s in range(CAPACITY_SEEDS)]
    log(f"C capacity: bisecting one replica's rate at the SLO, {CAPACITY_SEEDS} draws of "
        f"{len(draws[0][0].output):,} arrivals on {min(run.measurement.jobs, CAPACITY_SEEDS)} "
        "worker processes")
    searches = run_parallel([(capacity_one, (r, dataclasses.replace(replica, order=o), slo))
                             for r, o in draws], run.measurement.jobs)
    rates = sorted(rate for rate, _ in searches)
    one = rates[len(rates) // 2]
    log(f"C capacity: one replica serves {one:,.3g} requests/s (draws {rates[0]:,.3g}-"
        f"{rates[-1]:,.3g})")
    result = {"slo_ttft_s": run.slo.slo_ttft_s, "slo_tpot_s": run.slo.slo_tpot_s,
              "attainment": slo.attainment, "requests": len(draws[0][0].output),
              "seeds": CAPACITY_SEEDS, "longest_output": int(req.output.max()),
              "gpus_per_replica": run.hardware.tp * run.hardware.pp, "scheduler": "continuous",
              "kv_policy": replica.kv.policy if replica.kv else None,
              "serving": {"slots": replica.slots, "chunk_tokens": replica.chunk_tokens,
                          "source": run.scheduler.serve_source},
              "one_replica": {"rate_rps": one, "rates_rps": rates,
                              "output_tokens_per_s": one * float(req.output.mean()),
                              "tried": searches[0][1]}}
    if run.slo.target_rate is not None:
        result.update(fleet_capacity(run, req, replica, slo, one, m))
        result["answer"] = capacity_choice(result)
    return result


def capacity_choice(cap):
    """The capacity answer, one for every place that prints it: the router that needs the
    fewest replicas, ties broken by the share of requests meeting the SLO at that count (then
    by the routers' order). -> {"router", "replicas", "gpus", "tie"} or None (no count up to
    REPLICAS_MAX serves the load)"""
    found = {k: r for k, r in cap["routers"].items() if r["replicas"]}
    if not found:
        return None
    router = min(found, key=lambda k: (found[k]["replicas"], -found[k]["attainment"]))
    fewest = found[router]["replicas"]
    return {"router": router, "replicas": fewest,
            "gpus": fewest * cap.get("gpus_per_replica", 1),
            "tie": sum(r["replicas"] == fewest for r in found.values()) > 1}


def fleet_capacity(run, req, replica, slo, one, m):
    """--target-rate: the fewest replicas under each router, searched from what one replica's
    capacity (`one` requests/s, found on `m` requests) says."""
    if one == 0.0:
        raise UsageError("no arrival rate meets the SLO on one replica (even a nearly idle one "
                         "misses it): loosen --slo-ttft-ms / --slo-tpot-ms")
    start = max(1, math.floor(0.7 * run.slo.target_rate / one)) if math.isfinite(one) else 1
    if start > REPLICAS_MAX:
        raise UsageError(f"--target-rate {run.slo.target_rate:g}: one replica serves {one:.3g} "
                         f"requests/s at the SLO, so even {REPLICAS_MAX:,} replicas cannot")
    # as many requests per replica (at the count the search starts from) as one replica's
    # search had: a finite run past capacity fails a loose SLO late, so the horizon matters
    # (prompts known by their blocks are not cycled: a fleet takes the trace once, fewer each)
    seed = seed_for(run, "replicas")
    base, order = unit_rate(run, req, min(m * start, 200_000), seed)
    replica = dataclasses.replace(replica, order=order)
    searches = [("routers", router, replica) for router in run_routers(run)]
    twin = plain_twin(replica.kv.policy) if replica.kv else None
    if twin and KV_MANAGERS[replica.kv.policy].tracks_prefixes:  # and the same without
        plain = dataclasses.replace(replica, kv=dataclasses.replace(replica.kv, policy=twin))
        searches += [("without_caching", router, plain) for _, router, _ in searches
                     if ROUTERS[router].in_all]  # (cache-aware: least-requests, without)
    log(f"C capacity: the fewest replicas for {run.slo.target_rate:g} requests/s, "
        f"{len(searches)} searches (routers, with and without caching), from {start:,} up")
    found = run_parallel([(fewest_replicas, (base, spec, slo, Fleet(start, router, seed),
                                             run.slo.target_rate, start))
                          for _, router, spec in searches], run.measurement.jobs)
    result = {"target_rate": run.slo.target_rate, "fleet_requests": len(base.output)}
    for (group, router, _), (replicas, tried) in zip(searches, found):
        result.setdefault(group, {})[router] = {
            "replicas": replicas, "attainment": tried.get(replicas),
            "below": tried.get(replicas - 1) if replicas else None,
            "tried": sorted(tried.items())}
    return result


# C's prefix caching: what the prefix caches hit, and their hits against the cache's capacity


PREFIX_STUDY_SHARES = (1 / 64, 1 / 16, 0.25, 0.5, 1.0, 2.0, 4.0)  # of the card's KV budget:
# from a few blocks to a card four times the size (those some request cannot fit left out)


def prefix_study(run, req, replica, info, budgets):
    """--prefix-study: the prefix cache's hits and TTFT against its capacity (shares of the
    card's KV budget), on the card alone, with the host tier (--host-kv-gb, else four times
    the card's budget; and the disk tier below it, where given) and unlimited; continuous
    batching; with an SLO, the capacity of one replica without caching beside the capacity
    study's (with it). -> (result, Work)"""
    kv = study_budget(budgets)
    if kv is None or not KV_MANAGERS[kv.policy].tracks_prefixes:
        raise UsageError("--prefix-study needs --enable-prefix-caching (or --kv-policy prefix)")
    base = dataclasses.replace(replica, scheduler="continuous")
    host = info["host_tokens"] or 4 * info["budget_tokens"]
    runs = [(tier, share, dataclasses.replace(kv, capacity_tokens=int(share * kv.capacity_tokens),
                                              host_tokens=host if tier == "card_host" else 0))
            for tier in ("card", "card_host") for share in PREFIX_STUDY_SHARES]
    unlimited = dataclasses.replace(kv, capacity_tokens=math.inf, host_tokens=0)
    runs = [r for r in runs if not check_kv_budget(req, r[2])] + [
        ("unlimited", None, unlimited), ("optimum", None, unlimited)]
    apart = req.take(arrival_s=np.arange(len(req.output)) * 1e6)  # (one at a time: each
    # request finds every earlier one's blocks computed, the trace's own optimum)
    sims = run_parallel([(timed_task, (f"C prefix {tier} {share}", simulate_serving,
                                       apart if tier == "optimum" else req,
                                       dataclasses.replace(base, kv=budget)))
                         for tier, share, budget in runs], run.measurement.jobs)
    result = {"budget_tokens": info["budget_tokens"], "host_tokens": host,
              "host_link": info["host_link"], "host_link_gbs": info["host_link_gbs"],
              "disk_tokens": int(kv.disk_tokens),  # (a disk tier given: below the host's)
              **{tier: [] for tier in ("card", "card_host", "unlimited", "optimum")}}
    for (tier, share, budget), sim in zip(runs, sims):
        m = kv_metrics(apart if tier == "optimum" else req, sim, budget)
        result[tier].append({"share": share, "capacity_tokens": budget.capacity_tokens,
                             "ttft_s": m["ttft_s"], **m[PREFIX_REPORT]})
    if (run.slo.slo_ttft_s or run.slo.slo_tpot_s) and plain_twin(kv.policy):
        paged = dataclasses.replace(kv, policy=plain_twin(kv.policy))
        without = capacity_study(run.replace(target_rate=None), req,
                                 dataclasses.replace(base, kv=paged))
        result["capacity_without_caching_rps"] = without["one_replica"]["rate_rps"]
    return result, work_of(sims)
