"""Fixed inputs for the serving simulation and a summary of what it computes on them.

`python tests/sim_reference.py` records the summaries into tests/data/sim_reference.json;
test_sim_reference.py checks that the simulation still computes them: counts exactly, seconds
and memory integrals to 1e-9 relative. The event loop records them, so before a recording is
committed it is held to the plain reference, tests/step_reference.py, on every case that
finishes within its 100,000 steps (37 of the 51: steps, first tokens, finishes, preemptions,
peaks and memory integrals equal); that reference is the live one (test_step_reference.py).
"""
import json
import math
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from nn40.accounting import kv_bytes_per_token  # noqa: E402
from nn40.config import ModelConfig  # noqa: E402
from nn40.kv import KVBudget  # noqa: E402
from nn40.loop import simulate_serving  # noqa: E402
from nn40.metrics import serving_metrics  # noqa: E402
from nn40.pricing import StepCosts, analytic_costs  # noqa: E402
from nn40.replicas import Replica, SCHEDULERS  # noqa: E402
from nn40.workload import Requests, arrival_times, read_trace  # noqa: E402

REFERENCE = os.path.join(HERE, "data", "sim_reference.json")
TRACES = os.path.join(os.path.dirname(HERE), "..", "shared", "traces")
AZURE = os.path.join(TRACES, "AzureLLMInferenceTrace_conv.csv")
SHAREGPT = os.path.join(TRACES, "sharegpt_8k_filtered_stats_llama2_tokenizer.csv")

POST_COSTS = analytic_costs(ModelConfig(), 960.0, 105.5)
CPU_COSTS = StepCosts(tokens=(1, 8, 32, 128, 256, 2048),
                        seconds=(0.0105, 0.0167, 0.0369, 0.116, 0.258, 0.93), kv_token_s=5e-6,
                        source="a CPU-like measured model",
                        kv_by_batch=((1, 8e-6), (8, 5e-6), (32, 3.7e-6)))


def lognormal(n, seed, median, sigma, max_len):
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(rng.lognormal(math.log(median), sigma, n)), 1, max_len).astype(np.int64)


def requests(name):
    """-> (Requests, slots, costs, chunk_tokens, {label: KVBudget or None}); None if absent."""
    rng = np.random.default_rng(7)
    unlimited = {"plain": None}
    if name == "default":  # the post's setting, all waiting at t=0, the RTX 5080 budget
        out = lognormal(600, 0, 70, 1.0, 2048)
        req = Requests(np.zeros(600), np.full(600, 128), out)
        return req, 32, POST_COSTS, 512, {**unlimited,
                                          "reserve": KVBudget("reserve", 131_000, 16, 2048),
                                          "paged": KVBudget("paged", 131_000, 16, 2048)}
    if name == "poisson":  # near capacity on CPU-like prices
        out = lognormal(3000, 1, 70, 1.0, 2048)
        req = Requests(arrival_times(3000, 2.4, 1.0, rng), np.full(3000, 256), out)
        return req, 64, CPU_COSTS, 512, {**unlimited,
                                         "paged": KVBudget("paged", 40_000, 16)}
    if name == "tight":  # long prompts in a small paged cache: many preemptions
        n = 800
        prompt, out = lognormal(n, 2, 900, 0.8, 6000), lognormal(n, 3, 250, 0.9, 2000)
        req = Requests(arrival_times(n, 40.0, 1.0, rng), prompt, out)
        return req, 32, POST_COSTS, 512, {
            "paged": KVBudget("paged", 24_000, 16),
            "paged_b1": KVBudget("paged", 24_000, 1),
            "reserve": KVBudget("reserve", 24_000, 16, 2000)}
    if name == "bursty":  # gamma gaps (burstiness 0.2), long prompts, small chunks
        n = 1500
        prompt, out = lognormal(n, 4, 1500, 1.0, 8000), lognormal(n, 5, 120, 1.0, 2048)
        req = Requests(arrival_times(n, 6.0, 0.2, rng), prompt, out)
        return req, 48, POST_COSTS, 256, {**unlimited,
                                          "paged": KVBudget("paged", 60_000, 32)}
    if name == "smallchunk":  # more decoding rows than the chunk budget: prefills wait
        n = 400
        prompt, out = lognormal(n, 6, 200, 0.5, 1000), lognormal(n, 8, 60, 1.0, 1000)
        req = Requests(arrival_times(n, 30.0, 1.0, rng), prompt, out)
        return req, 64, CPU_COSTS, 40, {**unlimited, "paged": KVBudget("paged", 12_000, 16)}
    if name == "azure":  # a real trace at its own timestamps
        if not os.path.exists(AZURE):
            return None
        prompt, out, times = read_trace(AZURE, 3000)
        req = Requests(times, prompt, out)
        return req, 32, POST_COSTS, 512, {**unlimited,
                                          "paged": KVBudget("paged", 60_000, 16),
                                          "reserve": KVBudget("reserve", 60_000, 16, 2048)}
    if name == "sharegpt":  # the tight case: ShareGPT, 32 slots, 3 GB of the post's KV
        if not os.path.exists(SHAREGPT):
            return None
        prompt, out, _ = read_trace(SHAREGPT, 2000)
        req = Requests(np.zeros(len(out)), prompt, out)
        budget = int(3e9 // kv_bytes_per_token(ModelConfig()))
        return req, 32, POST_COSTS, 512, {"paged": KVBudget("paged", budget, 16),
                                          "reserve": KVBudget("reserve", budget, 16, 4096)}
    raise KeyError(name)


NAMES = ("default", "poisson", "tight", "bursty", "smallchunk", "azure", "sharegpt")


def summarize(req, sim):
    """The numbers a table or figure is made of, as plain JSON values."""
    m = serving_metrics(req, sim)
    out = {"steps": int(sim["steps"]), "occupancy": sim["occupancy"],
           "makespan_s": m["makespan_s"], "longest_step_s": sim["longest_step_s"],
           "prefill_s": sim["prefill_s"], "decode_s": sim["decode_s"],
           **{f"sum_{k}": float(np.sum(getattr(sim["times"], k)))
              for k in ("start", "first_token", "finish")},
           **{f"{k}_{p}": m[k][p] for k in ("ttft_s", "tpot_s", "e2e_s")
              for p in ("mean", "p50", "p90", "p99")}}
    if "kv" in sim:
        mem = sim["kv"]
        out.update({k: mem[k] for k in ("held_s", "alloc_s", "running_s")})
        out.update({k: int(mem[k]) for k in ("peak_running", "max_alloc", "preemptions",
                                             "recomputed_tokens", "peak_held")})
        out["peak_contexts"] = sorted(int(c) for c in mem["peak_contexts"])
        out["generated"] = int(np.sum(sim["generated"]))
    return out


def run(name):
    """{label/scheduler: summary} for one input, or None when its trace is absent."""
    spec = requests(name)
    if spec is None:
        return None
    req, slots, costs, chunk, budgets = spec
    return {f"{label}/{scheduler}": summarize(req, simulate_serving(
                req, Replica(slots, costs, scheduler, chunk, kv=kv)))
            for label, kv in budgets.items() for scheduler in SCHEDULERS}


if __name__ == "__main__":
    recorded = {name: run(name) for name in NAMES}
    os.makedirs(os.path.dirname(REFERENCE), exist_ok=True)
    with open(REFERENCE, "w") as f:
        json.dump(recorded, f, indent=1)
    print(f"wrote {REFERENCE}: " + ", ".join(f"{k}: {len(v) if v else 'absent'}"
                                             for k, v in recorded.items()))
