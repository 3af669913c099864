"""What speculative decoding costs the simulator: one simulation of a million generated requests
on one replica (Llama-3.1-8B on an H100 under the vllm profile, its engine's seats, paged KV),
plain and with EAGLE-3 drafting 3 tokens a step (vLLM's baseline acceptance), alternated. Prints
one line a run: wall seconds, loop iterations (events), events/s and the speculating run's share
of the plain one's time. (Each speculating run draws every request's verify steps first: timed
with the run.)

    python tests/bench_speculation.py [--requests 1000000] [--repeats 2] [--rate 30]
"""
import argparse
import dataclasses
import os
import platform
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nn40.config import GPUS, MODELS  # noqa: E402
from nn40.kv import KVBudget  # noqa: E402
from nn40.loop import simulate_serving  # noqa: E402
from nn40.pricing import ENGINE_PROFILES, card_costs, card_kv_tokens  # noqa: E402
from nn40.speculative import (  # noqa: E402
    DEFAULT_ACCEPTANCE, Speculation, draft_config, lookahead_tokens)
from nn40.speculative_study import speculating  # noqa: E402
from nn40.workload import Requests, arrival_times, lognormal_lengths  # noqa: E402


def replicas():
    """(plain, speculating) replicas: Llama-3.1-8B on an H100, the vllm profile's seats and
    step budget, its paged KV cache."""
    cfg, card, profile = MODELS["llama-3.1-8b"], GPUS["h100"], ENGINE_PROFILES["vllm"]
    kv = KVBudget("paged", card_kv_tokens(cfg, card, profile), 16, watermark=0.01)
    plain = profile.replica(card_costs(cfg, card, profile), slots=1024, chunk_tokens=8192, kv=kv)
    rates = DEFAULT_ACCEPTANCE["eagle3"][0]
    spec = Speculation("eagle3", 3, rates, "eagle3", lookahead_tokens("eagle3", 3), seed=1)
    return plain, speculating(plain, spec, card_costs(draft_config("eagle3", cfg), card,
                                                      profile))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=1_000_000)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--rate", type=float, default=30.0)
    args = p.parse_args()
    n = args.requests
    req = Requests(arrival_times(n, args.rate, 1.0, np.random.default_rng(0)), np.full(n, 128),
                   lognormal_lengths(n, 3))
    print(f"{platform.processor() or platform.machine()}, python {platform.python_version()}: "
          f"{n:,} requests at {args.rate:g}/s")
    runs = dict(zip(("plain", "eagle3 k=3"), replicas()))
    walls = {name: [] for name in runs}
    for rep in range(args.repeats):
        for name, r in runs.items():
            t0 = time.perf_counter()
            sim = simulate_serving(req, r)
            wall = time.perf_counter() - t0
            walls[name].append(wall)
            print(f"  {rep}: {name:>11}: {wall:7.2f} s, {sim['iterations']:,} iterations "
                  f"({sim['iterations'] / wall:,.0f}/s), {sim['steps']:,} steps, "
                  f"{sim['times'].finish.max():,.0f} s simulated")
    med = {name: statistics.median(w) for name, w in walls.items()}
    print(f"median: plain {med['plain']:.2f} s, speculating {med['eagle3 k=3']:.2f} s: "
          f"{med['eagle3 k=3'] / med['plain']:.2f}x")


if __name__ == "__main__":
    main()
