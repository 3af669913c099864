"""Disaggregated serving: phase prices, pipeline stages, DistServe's runs and the placement
search (pure)

An engine profiled per phase (DistServe's fits: a prefill pass by its prompts, a decode pass
by its rows and their context: PhaseCosts), a replica of pipeline stages (PipelineCosts),
DistServe's logged runs replayed on their placements (replay_distserve, check_placement), and
the placements searched by goodput per card (search_placements). The KV a decode pool lacks
is sent over a link by the hand-off (handoff.py); the pools run in pools.py.
"""
import itertools
import json
import os
import time
from dataclasses import dataclass

import numpy as np

from nn40.config import GPUS, MODELS, card_key
from nn40.errors import UsageError
from nn40.handoff import GPUS_PER_NODE, kv_link
from nn40.host import one_line, parallel_executor, run_parallel
from nn40.kv import KVBudget
from nn40.metrics import serving_metrics
from nn40.placement import Role, check_roles
from nn40.pools import Pool, simulate_pools
from nn40.pricing import StepCosts
from nn40.replicas import Replica
from nn40.stages import pipeline_costs, pipelined
from nn40.stats import percentiles
from nn40.workload import Requests, arrival_times, read_engine_run


@dataclass(frozen=True)
class PhaseCosts:
    """Prices by phase: a prefill pass from one StepCosts and a decode pass from another (an
    engine profiled per phase). A step runs its prefill pass, then its decode pass."""
    prefill: StepCosts
    decode: StepCosts
    source: object
    in_flight = 1  # (PassPrices)

    def run_price(self, plan, decoders, cached, k, fused=False, growth=None):
        """As StepCosts.run_price (the two passes apart: `fused` cannot join two prices)."""
        pre = self.prefill.run_price(plan, 0, 0, k)
        dec = self.decode.run_price((), decoders, cached, k, growth=growth)
        return pre[0], dec[1], pre[2] + dec[2], pre[3] + dec[3], pre[4]

    def decode_steps_to(self, n, cached, t, when, k, growth=None):
        return self.decode.decode_steps_to(n, cached, t, when, k, growth)

    def pass_s(self, tokens, kv_tokens=0, pairs=0):
        """A prefill pass where it computes prompt pairs, else a decode pass of `tokens` rows."""
        return (self.prefill if pairs else self.decode).pass_s(tokens, kv_tokens, pairs)

    def as_dict(self):
        return {"prefill": self.prefill.as_dict(), "decode": self.decode.as_dict(),
                "source": self.source}


# DistServe's profiler fits of a step's milliseconds (simdistserve/estimators/profile_data):
# prefill = a + b sum(L) + c sum(L^2) over the batch's prompts; decode = a + b sum(context + 1)
# + c rows, one triple below `decoding_large_small_bs_threshold` rows and another from it
DISTSERVE_PROFILES = {"vllm": "profiler-a100-80g.vllm.json",
                      "distserve": "profiler-a100-80g.distserve.json"}
DISTSERVE_MODELS = {"opt-13b": "facebook/opt-13b", "opt-66b": "facebook/opt-66b"}
BIG_BATCH = 1 << 20  # (a last knot past any batch: the fits are linear beyond it too)
# What DistServe's simulator adds to the fits (simdistserve/base/worker.py, add_ray_overhead,
# on the first stage of every step: 2 ms and 1e-4 ms a context token, a prompt's tokens in a
# prefill; estimators/time_estimator.py, get_prefill_time: pp ms on each of pp stages of a
# prefill, its "pp_const"), in seconds
STEP_OVERHEAD_S, CONTEXT_TOKEN_S, PREFILL_STAGE_S = 2e-3, 1e-7, 1e-3


def profiled_costs(fit, source, pp=1, in_flight=None):
    """PhaseCosts from one (model, TP) entry of a DistServe profile, as DistServe's simulator
    prices a step on pp stages: a prompt of L tokens computes L (L + 1) / 2 attention pairs,
    so c L^2 = 2 c pairs - c L, and a decode row of context x reads x cached tokens and adds
    one, so b (x + 1) + c = b x + (b + c); to each step the simulator's overhead (a fixed
    cost and a cost a context token); a prefill's pp stages pp ms each. Under PP the first
    stage, which pays the overhead, sets the pace of the `in_flight` micro-batches (default
    pp), so a decode cycle pays it once for each (one batch through the stages: once)."""
    in_flight = in_flight or pp
    a, b, c = (v / 1e3 for v in fit["prefill"])
    a, b = a + STEP_OVERHEAD_S + pp * pp * PREFILL_STAGE_S, b + CONTEXT_TOKEN_S
    prefill = StepCosts((1, BIG_BATCH), (a + (b - c), a + (b - c) * BIG_BATCH), 0.0, source,
                        pair_s=2 * c)
    edge = int(fit["decoding_large_small_bs_threshold"])
    (a1, b1, c1), (a2, b2, c2) = ([v / 1e3 for v in fit[k]]
                                  for k in ("decoding_smallbs", "decoding_largebs"))
    a1, a2 = a1 + in_flight * STEP_OVERHEAD_S, a2 + in_flight * STEP_OVERHEAD_S
    c1, c2 = c1 - in_flight * CONTEXT_TOKEN_S, c2 - in_flight * CONTEXT_TOKEN_S  # (on x, not
    b1, b2 = b1 + in_flight * CONTEXT_TOKEN_S, b2 + in_flight * CONTEXT_TOKEN_S  # x + 1)
    decode = StepCosts((1, edge - 1, edge, BIG_BATCH),
                       (a1 + b1 + c1, a1 + (b1 + c1) * (edge - 1), a2 + (b2 + c2) * edge,
                        a2 + (b2 + c2) * BIG_BATCH), b1, source,
                       kv_by_batch=((edge - 1, b1), (edge, b2)))
    return PhaseCosts(prefill, decode, source)


def read_distserve_profile(profile_dir, engine, model, tp, pp=1, in_flight=None):
    """A DistServe profile's fit of `model` at `tp` cards (a replica of pp stages of them,
    `in_flight` micro-batches: see profiled_costs) -> PhaseCosts."""
    path = os.path.join(profile_dir, DISTSERVE_PROFILES[engine])
    try:
        with open(path, encoding="utf-8") as f:
            fit = json.load(f)[DISTSERVE_MODELS[model]][str(tp)]
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}")
    except (KeyError, ValueError) as e:
        raise UsageError(f"{path}: no fit of {model} at tp {tp} ({one_line(e)})")
    return profiled_costs(fit, {"kind": "distserve_profile", "engine": engine, "model": model,
                                "tp": tp, "pp": pp, "file": os.path.basename(path)}, pp,
                          in_flight)


def distserve_kv_tokens(profile_dir, model, tp, pp):
    """The KV cache's tokens DistServe's simulator gives `model` on tp x pp cards
    (max_num_tokens.csv)."""
    path = os.path.join(profile_dir, "max_num_tokens.csv")
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split()
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}")
    for line in lines[1:]:  # (model,tp,pp,max_num_tokens)
        name, *numbers = line.split(",")
        if name == DISTSERVE_MODELS[model] and numbers[:2] == [str(tp), str(pp)]:
            return int(numbers[2])
    raise UsageError(f"{path}: no KV capacity of {model} at tp {tp}, pp {pp}")


# DistServe's logged runs (OPT-13B on A100-80GB cards, ShareGPT), named
# <backend>[-<placement>]-<N>-<rate>.exp: prefill (TP, PP) and decode (TP, PP) by placement
# (c21d11 as its align_with_real.py runs it; c21d12 by the same pattern); vllm colocated on
# one card. The plain distserve-N-R runs state no placement: DistServe's default launch,
# (2, 1, 1, 1), is assumed.
DISTSERVE_PLACEMENTS = {"c21d11": ((2, 1), (1, 1)), "c21d12": ((2, 1), (1, 2)),
                        "distserve": ((2, 1), (1, 1))}
# The engines' limits as DistServe's evaluation/2-benchmark-serving/2-start-api-server.py
# launches them: vLLM max_num_seqs 1024 and max_num_batched_tokens 16384 (whole prompts: no
# chunked prefill), block 16; DistServe a prefill batch of at most 128 requests and 8192
# prompt tokens (context-max-batch-size, context-max-tokens-per-batch), a decode batch of at
# most 1024; the KV capacity DistServe's simulator gives each (TP, PP) (max_num_tokens.csv);
# vLLM's block manager keeps 1% free
DISTSERVE_SLOTS = {"colocated": 1024, "prefill": 128, "decode": 1024}
DISTSERVE_PROMPT_TOKENS = {"colocated": 16384, "prefill": 8192, "decode": None}
VLLM_WATERMARK = 0.01
DISTSERVE_SLO = (0.2, 0.1)  # TTFT and TPOT seconds, DistServe's for this workload


def distserve_placement(path):
    """A DistServe log's file name -> (engine, placement: None colocated, else the prefill and
    decode pools' (tp, pp))."""
    name = os.path.basename(path)
    backend, _, rest = name.partition("-")
    kind = rest.split("-")[0] if backend == "distserve" and rest[:1] == "c" else backend
    if backend not in DISTSERVE_PROFILES or kind not in DISTSERVE_PLACEMENTS and \
            kind != "vllm":
        raise UsageError(f"{name}: not a DistServe run (vllm-N-R.exp or "
                         "distserve[-c21d11|-c21d12]-N-R.exp)")
    return backend, DISTSERVE_PLACEMENTS.get(kind)


# DistServe's decoding engine on pp stages keeps pp batch queues, but a request that has
# crossed joins only the queue the next step launches (decoding_stage_scheduler.py,
# get_next_batch: the waiting requests go to batch_queues[cur_index]), and crossings are
# accepted at the end of a step (single_stage_engine.py, _step, then post_process). With
# one queue holding every request, the step of the empty one sleeps 3 ms and then waits on
# the oldest batch, and the next step, launching the full queue, finds the empty one's slot
# oldest and waits on nothing: the crossings accepted after the wait all join the full
# queue and the other stays empty. It stays so until a crossing lands in the other queue
# (one accepted in the event loop's yield between two steps, one the scheduler held back
# while the waiting prompts took 5% of the blocks, a swapped request coming back); from
# then on newcomers join both and two micro-batches are in flight. Which happens when is
# a race C does not follow: its decode pool runs the one micro-batch the engine starts
# with (test_disagg.py runs the loop written out plainly, both ways); its context stage,
# which takes a fresh batch from its queue every step, one a stage.
DISTSERVE_DECODE_IN_FLIGHT = 1


def distserve_replica(profile_dir, engine, shape, role, card, micro_batches=None):
    """A Replica of `engine` in `role` (a key of DISTSERVE_SLOTS) priced by its DistServe
    profile of OPT-13B on tp x pp cards (shape: (tp, pp)), with the engine's limits, its
    micro-batches in flight `micro_batches` (None: as the engine runs them) each with the
    engine's step budget."""
    cfg, (tp, pp) = MODELS["opt-13b"], shape
    if pp == 1:  # (one stage: nothing in flight beside the step)
        micro_batches = None
    elif micro_batches is None and engine == "distserve" and role == "decode":
        micro_batches = DISTSERVE_DECODE_IN_FLIGHT
    costs = pipeline_costs(read_distserve_profile(profile_dir, engine, cfg.name, tp, pp,
                                                  micro_batches), pp, cfg, card, tp,
                           micro_batches)
    kv = KVBudget("paged", distserve_kv_tokens(profile_dir, cfg.name, tp, pp), 16,
                  watermark=VLLM_WATERMARK if engine == "vllm" else 0.0)
    return pipelined(Replica(DISTSERVE_SLOTS[role], costs, "continuous", kv=kv,
                             prefill_first=True, prompt_tokens=DISTSERVE_PROMPT_TOKENS[role]))


def distserve_pools(profile_dir, path, link=None, micro_batches=None):
    """The pools a DistServe log ran on, each priced by its engine's profile -> (pools, path
    of pool names, the KVLink between them or None)."""
    card = GPUS["a100-80gb"]
    engine, placement = distserve_placement(path)
    check_placement(MODELS["opt-13b"], card, [("colocated", 1, 1, 1)] if placement is None
                    else [("prefill", 1, *placement[0]), ("decode", 1, *placement[1])])
    if placement is None:
        return [Pool("vllm", distserve_replica(profile_dir, engine, (1, 1), "colocated",
                                                card))], None, None
    pools = [Pool("prefill", distserve_replica(profile_dir, engine, placement[0], "prefill",
                                               card)),
             Pool("decode", distserve_replica(profile_dir, engine, placement[1], "decode",
                                              card, micro_batches))]
    return pools, ["prefill", "decode"], link or kv_link(MODELS["opt-13b"], card)


def replay_distserve(path, profile_dir, link=None, micro_batches=None):
    """One DistServe log replayed on its own placement and arrivals, priced by the profiles
    alone (a decode pool of pipeline stages with `micro_batches` in flight: None, as the
    engine runs them) -> its row: what it measured and what C finds (SLO attainment, TTFT
    and TPOT p50 and p90, seconds)."""
    log = read_engine_run(path)
    req = Requests(log["arrival_s"], log["prompt"], log["output"])
    pools, names, link = distserve_pools(profile_dir, path, link, micro_batches)
    placement = distserve_placement(path)[1]
    sim = simulate_pools(req, pools, names, link=link)
    metrics = serving_metrics(req, sim, *DISTSERVE_SLO)
    multi = req.output > 1
    tpot = np.zeros(len(req.output))
    tpot[multi] = log["tpot_s"]
    ttft_slo, tpot_slo = DISTSERVE_SLO
    measured = {"slo_attained": float(((log["ttft_s"] <= ttft_slo) & (tpot <= tpot_slo)).mean()),
                "ttft_s": percentiles(log["ttft_s"]), "tpot_s": percentiles(log["tpot_s"])}
    return {"file": os.path.basename(path), "requests": len(req.output),
            "pools": [p.name for p in pools], "measured": measured,
            "placement": "TP1" if placement is None else "TP{} PP{} + TP{} PP{}".format(
                *placement[0], *placement[1]),
            "simulated": {k: metrics[k] for k in ("slo_attained", "ttft_s", "tpot_s")},
            "kv_transfer": sim.get("kv_transfer")}


def check_placement(cfg, card, pools, gpus=None):
    """A DistServe placement, before anything runs: pools [(role, replicas, tp, pp)] on `card`
    (check_roles: one line where it cannot run). -> the cards it takes"""
    return check_roles(cfg, [Role(role, n, tp, pp, card_key(card)) for role, n, tp, pp in pools],
                       gpus)


def distserve_runs(directory):
    """DistServe's logs and profiles under `directory` (its ground_truth_opt-13b-sharegpt and
    profile_data folders, or the logs themselves beside profile_data) -> (logs, profiles)."""
    logs = os.path.join(directory, "ground_truth_opt-13b-sharegpt")
    logs = logs if os.path.isdir(logs) else directory
    profiles = os.path.join(directory, "profile_data")
    names = sorted(n for n in os.listdir(logs) if n.endswith(".exp")) if \
        os.path.isdir(logs) else []
    if not names or not os.path.isdir(profiles):
        raise UsageError(f"{directory}: no DistServe logs (*.exp) with a profile_data folder")
    return [os.path.join(logs, n) for n in names], profiles


def replay_distserve_runs(directory, link=None, micro_batches=None, workers=1, cluster=None):
    """Every DistServe log under `directory` replayed (replay_distserve), colocated runs
    first, on worker processes -> {"rows", "profiles", "micro_batches"}."""
    paths, profiles = distserve_runs(directory)
    paths.sort(key=lambda p: (not os.path.basename(p).startswith("vllm"), p))
    rows = run_parallel([(replay_distserve, (p, profiles, link, micro_batches))
                         for p in paths], workers, cluster)
    return {"rows": rows, "profiles": profiles, "micro_batches": micro_batches}


# The placement search: OPT-13B on A100s under DistServe's profile of its own engine (the
# same prices for every placement, so the placement alone differs), its TPs and PPs, and
# DistServe's SLO met by 90% of requests
SEARCH_TP, SEARCH_PP, SEARCH_ATTAINMENT = (1, 2, 4), (1, 2), 0.9


def search_candidates(budget):
    """The placements within `budget` cards: a colocated replica at each (tp, pp), and a
    prefill pool and a decode pool of 1-3 replicas each at each (tp, pp) -> [[(role,
    replicas, tp, pp)]]."""
    shapes = [(tp, pp) for tp in SEARCH_TP for pp in SEARCH_PP if tp * pp <= budget]
    out = [[("colocated", 1, tp, pp)] for tp, pp in shapes]
    for (ptp, ppp), (dtp, dpp) in itertools.product(shapes, shapes):
        for n_pre, n_dec in itertools.product((1, 2, 3), repeat=2):
            if n_pre * ptp * ppp + n_dec * dtp * dpp <= budget:
                out.append([("prefill", n_pre, ptp, ppp), ("decode", n_dec, dtp, dpp)])
    return out


def placement_pools(profile_dir, placement):
    """A placement's Pools, each replica priced by DistServe's profile of its engine."""
    card = GPUS["a100-80gb"]
    return [Pool(role, distserve_replica(profile_dir, "distserve", (tp, pp), role, card),
                 replicas, "least-requests") for role, replicas, tp, pp in placement]


def placement_goodput(profile_dir, placement, unit, rel=0.02):
    """The highest rate (of `unit`'s unit-rate arrivals, scaled) at which the placement
    serves SEARCH_ATTAINMENT of its requests within DistServe's SLO, to `rel` -> a row
    (goodput in requests/s, and a card's share, seconds of search, simulations)."""
    clock, pools, tried = time.perf_counter(), placement_pools(profile_dir, placement), []
    path = [p.name for p in pools] if len(pools) > 1 else None
    gpus = sum(n * tp * pp for _, n, tp, pp in placement)  # (past a node's: the network)
    link = kv_link(MODELS["opt-13b"], GPUS["a100-80gb"],
                   "network" if gpus > GPUS_PER_NODE else None) \
        if path else None

    def ok(rate):
        start, req = time.perf_counter(), unit.take(arrival_s=unit.arrival_s / rate)
        met = serving_metrics(req, simulate_pools(req, pools, path, link=link),
                              *DISTSERVE_SLO)["slo_attained"]
        tried.append((rate, met, time.perf_counter() - start))
        return met >= SEARCH_ATTAINMENT
    lo, hi = 0.0, 1.0
    while ok(hi) and hi < 1e4:
        lo, hi = hi, 2 * hi
    while hi - lo > rel * max(lo, 1e-3) and hi > 1e-3:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return {"placement": placement_name(placement), "kind": placement[0][0] if
            len(placement) == 1 else "disaggregated", "gpus": gpus, "goodput_rps": lo,
            "goodput_per_gpu": lo / gpus, "simulations": len(tried),
            "search_s": time.perf_counter() - clock, "tried": tried}


def placement_name(placement):
    return " + ".join(f"{n} x {role} TP{tp} PP{pp}" for role, n, tp, pp in placement)


def search_placements(profile_dir, lengths, budget, requests=400, seed=0, workers=1,
                      cluster=None):
    """Every placement within `budget` A100s ranked by goodput per card, on `requests`
    ShareGPT lengths drawn from `lengths` (prompt, output) at Poisson arrivals, on worker
    processes or a Dask `cluster` (run_parallel) -> {"rows" (best first, each with the
    (rate, SLO attained, seconds) it tried), "best": the best of each kind, "simulations",
    "simulation_s": their seconds' p10, p50 and p90, "wall_s" (the workers' "start_s" apart),
    and "busy": their seconds summed over the wall time, the workers kept busy}."""
    cfg, card = MODELS["opt-13b"], GPUS["a100-80gb"]
    candidates = search_candidates(budget)
    for placement in candidates:
        check_placement(cfg, card, placement, budget)
    rng = np.random.default_rng(seed)
    pick = rng.integers(len(lengths[0]), size=requests)
    unit = Requests(arrival_times(requests, 1.0, 1.0, rng), lengths[0][pick], lengths[1][pick])
    clock = time.perf_counter()
    with parallel_executor(min(workers, len(candidates)), cluster) as pool:
        start_s, clock = time.perf_counter() - clock, time.perf_counter()
        rows = [f.result() for f in [pool.submit(placement_goodput, profile_dir, p, unit)
                                     for p in candidates]]
        wall_s = time.perf_counter() - clock
    rows.sort(key=lambda r: -r["goodput_per_gpu"])
    best = {}
    for r in rows:
        best.setdefault(r["kind"] if r["kind"] == "disaggregated" else "colocated", r)
    each_s = np.array([s for r in rows for _, _, s in r["tried"]])
    p10, p50, p90 = np.percentile(each_s, [10, 50, 90])
    return {"rows": rows, "best": best, "budget": budget, "requests": requests,
            "workers": workers, "cluster": cluster, "simulations": len(each_s),
            "simulation_s": {"p10": p10, "p50": p50, "p90": p90}, "wall_s": wall_s,
            "start_s": start_s,
            "busy": each_s.sum() / wall_s}
