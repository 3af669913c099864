"""What disaggregated serving costs the simulator: the same Poisson requests through 8
colocated replicas and through 4 prefill and 4 decode replicas joined by NVLink (each send
sharing its link, reserving blocks on its decode replica and holding its prompt's on the
prefill replica until it lands), alternated. Prints one line a run: wall seconds and loop
iterations; then the ratio of the medians.

Lengths are drawn from DistServe's vllm-400-4 log (ShareGPT) where ../shared has it, else the
post's law with 256-token prompts; prices are DistServe's profile of OPT-13B on one A100
(TP1 replicas), least-requests routing, paged KV.

    python tests/bench_pools.py [--requests 1000000] [--rate 20] [--repeats 2]
"""
import argparse
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nn40.config import GPUS, MODELS  # noqa: E402
from nn40.disaggregated import distserve_replica  # noqa: E402
from nn40.handoff import kv_link  # noqa: E402
from nn40.pools import Pool, simulate_pools  # noqa: E402
from nn40.workload import Requests, arrival_times, lognormal_lengths, read_engine_run  # noqa: E402

DISTSERVE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared",
                         "traces", "real_runs", "distserve")
PROFILES = os.path.join(DISTSERVE, "profile_data")
LOG = os.path.join(DISTSERVE, "ground_truth_opt-13b-sharegpt", "vllm-400-4.exp")


def requests(n, rate, seed=0):
    rng = np.random.default_rng(seed)
    if os.path.exists(LOG):
        log = read_engine_run(LOG)
        pick = rng.integers(len(log["prompt"]), size=n)
        prompt, output = log["prompt"][pick], log["output"][pick]
    else:
        prompt, output = np.full(n, 256), lognormal_lengths(n, seed)
    return Requests(arrival_times(n, rate, 1.0, rng), prompt, output)


def placements():
    card = GPUS["a100-80gb"]

    def replica(role):
        return distserve_replica(PROFILES, "distserve", (1, 1), role, card)
    return {"8 colocated": ([Pool("colocated", replica("colocated"), 8, "least-requests")],
                            None, None),
            "4 prefill + 4 decode": ([Pool("prefill", replica("prefill"), 4, "least-requests"),
                                      Pool("decode", replica("decode"), 4, "least-requests")],
                                     ["prefill", "decode"], kv_link(MODELS["opt-13b"], card))}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=1_000_000)
    p.add_argument("--rate", type=float, default=20.0)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    if not os.path.isdir(PROFILES):
        sys.exit(f"{PROFILES}: DistServe's profiles are needed (../shared)")
    req = requests(args.requests, args.rate)
    print(f"{args.requests:,} requests at {args.rate:g}/s on {platform.processor() or 'cpu'}")
    walls = {name: [] for name in placements()}
    for _ in range(args.repeats):
        for name, (pools, path, link) in placements().items():
            clock = time.perf_counter()
            sim = simulate_pools(req, pools, path, link=link)
            walls[name].append(time.perf_counter() - clock)
            print(f"  {name}: {walls[name][-1]:.1f} s, {sim['iterations']:,} iterations")
    joint, split = (float(np.median(walls[name])) for name in placements())
    print(f"medians: {joint:.1f} s colocated, {split:.1f} s disaggregated ({split / joint:.2f}x)")


if __name__ == "__main__":
    main()
