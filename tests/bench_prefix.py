"""What prefix caching costs the simulator: one simulation of generated requests with shared
system prompts, paged blocks without and with the prefix cache, alternated, and the
Mooncake conversation trace's replay. Prints one line a run: wall seconds, loop iterations
(events) and events/s, token hit ratio.

Three runs are alternated: paged blocks without caching; the prefix cache; and paged blocks
given each request's hits (the cache's, from its first run) as cached on arrival. While memory
has room, the third runs the prefix cache's very events with no cache at all (it says when it
does not: paged blocks hold each given hit apart, so under memory pressure they preempt more):
caching shortens the prefills, so fewer newcomers share a step and the loop has more events to
run; prefix / hits given is what the cache's own bookkeeping costs, prefix / paged that and the
workload's change together.

    python tests/bench_prefix.py [--requests 1000000] [--repeats 2] [--rate 40]
    python tests/bench_prefix.py --traces   (both Mooncake traces on 4 replicas: each cache
                                             tier, then each router on the conversation trace)
    python tests/bench_prefix.py --capacity [--target-rate 4]   (the fewest replicas for the
        conversation trace at TTFT <= 2 s for 90%, with and without caching, round-robin and
        cache-aware: fewest_replicas, as the capacity study runs it)
"""
import argparse
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dataclasses  # noqa: E402
from nn40.accounting import kv_bytes_per_token  # noqa: E402
from nn40.capacity import SLO, fewest_replicas  # noqa: E402
from nn40.config import DISK_READ_GBS, GPUS, HOST_LINK_SHARE, HOST_LINKS, MODELS  # noqa: E402
from nn40.host import run_parallel  # noqa: E402
from nn40.kv import KVBudget, PREFIX_REPORT  # noqa: E402
from nn40.loop import simulate_serving  # noqa: E402
from nn40.metrics import serving_metrics  # noqa: E402
from nn40.pools import Fleet, simulate_fleet  # noqa: E402
from nn40.pricing import DEFAULT_PROFILE, ENGINE_PROFILES, card_costs, card_kv_tokens  # noqa: E402
from nn40.replicas import Replica  # noqa: E402
from nn40.runs import prefix_metrics  # noqa: E402
from nn40.workload import (
    PrefixWorkload, Requests, arrival_times, lognormal_lengths, read_hashed_trace,
    shared_prompts)

CONVERSATION = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared",
                            "traces", "mooncake", "conversation_trace.jsonl")


def shared_requests(n, rate, seed=0, output_scale=1):
    """n requests: the post's output law (times output_scale), 128-token messages, 8 system
    prompts of 512 tokens opening 80% of them (Zipf 1), Poisson arrivals at `rate`."""
    rng = np.random.default_rng(seed)
    base = Requests(arrival_times(n, rate, 1.0, rng), np.full(n, 128),
                      lognormal_lengths(n, seed) * output_scale)
    return shared_prompts(base, PrefixWorkload(512, 8, 0.8, 1.0, 1, 0.0), rng)


def replica(policy, slots=256):
    cfg, card = MODELS["llama-3-8b"], GPUS["h100"]
    profile = ENGINE_PROFILES[DEFAULT_PROFILE]
    kv = KVBudget(policy, card_kv_tokens(cfg, card, profile), 16, watermark=0.01)
    return Replica(slots, card_costs(cfg, card, profile), scheduler="chunked",
                     chunk_tokens=2048, kv=kv, fused=True)


def timed(label, req, rep):
    """-> (wall seconds, the run's result)."""
    t0 = time.perf_counter()
    sim = simulate_serving(req, rep)
    wall = time.perf_counter() - t0
    p = sim.get(PREFIX_REPORT)
    hit = f"{p['hit_tokens'] / p['queried_tokens']:.4f}" if p else "-"
    ttft = sim["times"].first_token - req.arrival_s
    print(f"{label:34s} {wall:8.2f} s  {sim['iterations']:>10,} iterations "
          f"({sim['iterations'] / wall:,.0f}/s)  hit {hit}  TTFT p50 {np.percentile(ttft, 50):.3f}"
          f" s p99 {np.percentile(ttft, 99):.3f} s", flush=True)
    return wall, sim


def hits_given(req, sim):
    """The requests with the prefix cache's hits (its run's report) as cached on arrival, and
    no identity: plain paged blocks then run the cache's events without a cache."""
    hits = sim[PREFIX_REPORT]["hits"]
    cached = np.fromiter((hits.get(r, 0) for r in range(len(req.output))), np.int64,
                         len(req.output))
    return dataclasses.replace(req, cached=cached, identity=None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rate", type=float, default=40.0)
    ap.add_argument("--output-scale", type=int, default=1,
                    help="outputs this many times longer: more decode steps, as many requests")
    ap.add_argument("--traces", action="store_true")
    ap.add_argument("--capacity", action="store_true")
    ap.add_argument("--target-rate", type=float, default=4.0)
    args = ap.parse_args()
    if args.traces:
        return traces()
    if args.capacity:
        return capacity(args.target_rate)
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}; llama-3-8b on h100, 256 slots, chunked 2048, paged KV "
          f"blocks of 16 on the card; outputs x{args.output_scale}", flush=True)
    req = shared_requests(args.requests, args.rate, output_scale=args.output_scale)
    walls, events, given = {"paged": [], "prefix": [], "hits given": []}, {}, None
    for i in range(args.repeats):
        for policy in walls:
            run = (given, "paged") if policy == "hits given" else (req, policy)
            wall, sim = timed(f"{args.requests:,} shared, {policy} #{i + 1}", run[0],
                              replica(run[1]))
            walls[policy].append(wall)
            events[policy] = sim["iterations"]
            if given is None and policy == "prefix":
                given = hits_given(req, sim)
    if events["hits given"] != events["prefix"]:
        print("hits given ran other events than the prefix cache (memory pressure): prefix / "
              "hits given is not the cache's cost alone", flush=True)
    med = {policy: np.median(w) for policy, w in walls.items()}
    print(f"prefix / paged: {med['prefix'] / med['paged']:.2f}x, prefix / hits given: "
          f"{med['prefix'] / med['hits given']:.2f}x, hits given / paged: "
          f"{med['hits given'] / med['paged']:.2f}x (medians); load average now "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    if os.path.exists(CONVERSATION):
        trace = read_hashed_trace(CONVERSATION, block=16)
        for policy in ("paged", "prefix"):
            timed(f"conversation trace, {policy}", trace, replica(policy))


def budget(policy, capacity, host_gb=0, write="write-through", disk_gb=0):
    cfg, card = MODELS["llama-3-8b"], GPUS["h100"]
    per_token = kv_bytes_per_token(cfg)
    return KVBudget(policy, capacity, 16, 0, 0.01, int(host_gb * 1e9 // per_token),
                      per_token / (HOST_LINK_SHARE * HOST_LINKS["h100"][1] * 1e9), write,
                      disk_tokens=int(disk_gb * 1e9 // per_token),
                      disk_token_s=per_token / (DISK_READ_GBS * 1e9))


def fleet(label, req, kv, router, replicas=4):
    rep = dataclasses.replace(replica("paged"), kv=kv)
    t0 = time.perf_counter()
    sim = simulate_fleet(req, rep, Fleet(replicas, router, 0))
    m, p = serving_metrics(req, sim), prefix_metrics(req, sim).get(PREFIX_REPORT)
    line = (f"{label:38s} {router:15s} {time.perf_counter() - t0:6.1f} s  TTFT p50 "
            f"{m['ttft_s']['p50']:.3f} p99 {m['ttft_s']['p99']:.3f} s  queued p99 "
            f"{np.percentile(sim['times'].start - req.arrival_s, 99):.3f} s")
    if p:
        line += (f"  hit card {p['card_hit_ratio']:.3f} host {p['host_hit_ratio']:.3f} disk "
                 f"{p['disk_hit_ratio']:.3f}  saved "
                 f"{p['prefill_tokens_saved']:,} of {p['queried_tokens']:,}")
    print(line, flush=True)


def traces(host_gb=200, disk_gb=2000):
    """Both traces at their timestamps on 4 replicas: no caching, the card's cache, with a
    host tier (write-through, write-back), with a disk tier below it, unlimited
    (least-requests); then the conversation trace under each router."""
    card = replica("paged").kv.capacity_tokens
    tiers = [("no caching", budget("paged", card)), ("card", budget("prefix", card)),
             (f"card + {host_gb} GB host", budget("prefix", card, host_gb)),
             (f"card + {host_gb} GB write-back", budget("prefix", card, host_gb, "write-back")),
             (f"card + {host_gb} GB + {disk_gb} GB disk", budget("prefix", card, host_gb,
                                                               disk_gb=disk_gb)),
             ("unlimited", budget("prefix", float("inf")))]
    for name in ("conversation", "synthetic"):
        req = read_hashed_trace(CONVERSATION.replace("conversation", name), block=16)
        for label, kv in tiers:
            fleet(f"{name}: {label}", req, kv, "least-requests")
    req = read_hashed_trace(CONVERSATION, block=16)
    for label, kv in tiers[1:3]:
        for router in ("round-robin", "least-requests", "cache-aware", "precise-prefix"):
            fleet(f"conversation: {label}", req, kv, router)


def search(args):
    """One fewest_replicas search (a worker process's)."""
    label, req, rep, router, rate, start = args
    t0 = time.perf_counter()
    n, tried = fewest_replicas(req, rep, SLO(2.0, None, 0.9), Fleet(start, router, 0),
                                 rate, start)
    return (f"{label:22s} {router:12s} {n} replicas (SLO met {tried[n]:.1%}, with one fewer "
            f"{tried.get(n - 1, float('nan')):.1%})  {time.perf_counter() - t0:6.1f} s")


def capacity(rate, seed=13):
    """The conversation trace's 12,031 requests re-timed as Poisson arrivals at `rate` (in the
    trace's order), continuous batching, llama-3-8b on H100 replicas (the card's KV budget)."""
    req = read_hashed_trace(CONVERSATION, block=16)
    req = req.take(arrival_s=arrival_times(len(req.output), 1.0, 1.0,
                                              np.random.default_rng(seed)))
    card = replica("paged").kv.capacity_tokens
    start = max(1, int(0.7 * rate / 0.43))  # (one replica: about 0.43 requests/s at the SLO)
    calls = [(label, req, dataclasses.replace(replica("paged"), scheduler="continuous", kv=kv),
              router, rate, start)
             for label, kv in (("card prefix cache", budget("prefix", card)),
                               ("no caching", budget("paged", card)))
             for router in ("round-robin", "cache-aware", "precise-prefix")]
    print(f"conversation trace at {rate:g} requests/s, TTFT <= 2 s for 90%; load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    for line in run_parallel([(search, (c,)) for c in calls], 2):
        print(line, flush=True)
    print(f"load average now {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
