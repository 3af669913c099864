"""One run of experiment C: what it is given and what it measures

Its step costs (run_step_costs: measured, fitted or priced from --gpu's spec sheet under the
engine's profile), its KV budgets checked against every request (kv_setup, with the host tier
where given), its arrivals and the order it serves in, the work it did (Work: runs,
iterations, seconds), and what it measured of memory, the KV cache and the prefix cache's
hits (memory_metrics, kv_metrics, prefix_metrics).
"""
import dataclasses
import functools
import os
import time
from typing import NamedTuple

import numpy as np

from nn40.accounting import card_kv_bytes_per_token, kv_bytes_per_token
from nn40.config import (
    DISK_READ_GBS, GPUS, HOST_LINK_SHARE, HOST_LINKS, LENGTH_MAX, LENGTH_MU, LENGTH_SIGMA,
    REFERENCE_BANDWIDTH_GBS, REFERENCE_TFLOPS, _PCIE4)
from nn40.host import log_labelled
from nn40.kv import KVBudget, KV_MANAGERS, PREFIX_REPORT, check_kv_budget, kv_manager
from nn40.memory import kv_budget_bytes
from nn40.metrics import serving_metrics
from nn40.pricing import analytic_costs, card_costs, card_kv_tokens, measured_costs
from nn40.profiles import engine_profile, run_profile
from nn40.queues import kendall_tau, queue_order
from nn40.stages import pipeline_costs, stage_model
from nn40.stats import percentiles
from nn40.workload import seed_for


def run_step_costs(hw, results):
    """C's prices on hardware hw (a HardwareConfig): measured (A's rows; the default when A ran
    and no --gpu is named), or the named card's analytic roofline, or one of --peak-*, this
    run's ceilings or the post's."""
    if hw.cost == "measured" or (hw.cost is None and "A" in results and not hw.gpu):
        return measured_costs(hw.model, results)  # (run_config refuses it without A)
    if hw.gpu and not (hw.peak_bandwidth_gbs or hw.peak_tflops):
        card = GPUS[hw.gpu]
        return pipeline_costs(card_costs(hw.model, card, engine_profile(hw.engine_profile),
                                         hw.tp, hw.ep), hw.pp, hw.model, card, hw.tp)
    ceil = results["environment"].get("ceilings", {})
    return analytic_costs(hw.model, hw.peak_bandwidth_gbs or ceil.get("bandwidth_gbs")
                          or REFERENCE_BANDWIDTH_GBS,
                          hw.peak_tflops or ceil.get("matmul_tflops") or REFERENCE_TFLOPS)


def arrivals(run):
    """How C's requests arrive, as a description for the tables."""
    if run.workload.rate is None:
        return {"kind": "arrivals_zero"}
    if run.workload.rate == "trace":
        return {"kind": "arrivals_trace"}
    if run.workload.burstiness == 1:
        return {"kind": "arrivals_poisson", "rate": run.workload.rate}
    return {"kind": "arrivals_gamma", "rate": run.workload.rate,
            "burstiness": run.workload.burstiness}


def workload(run):
    """Where C's request lengths come from, as a description for the tables."""
    if run.workload.trace:
        return {"kind": "source_trace", "name": os.path.basename(run.workload.trace)}
    if run.workload.lengths_file:
        return {"kind": "source_file", "path": run.workload.lengths_file}
    return {"kind": "source_law", "mu": LENGTH_MU, "sigma": LENGTH_SIGMA, "max": LENGTH_MAX,
            "seed": run.workload.seed}


def run_order(run, output, name=None):
    """The queue's Order for C's requests: --order with --max-wait-s, or the order `name` with
    no guard; the predicted lengths are the same draw (--predict-sigma) in every study."""
    return queue_order(name or run.scheduler.order, output, run.scheduler.predict_sigma,
                       seed_for(run, "predicted"),
                       None if name else run.scheduler.max_wait_s)


def order_info(order, output, seed=0):
    """An Order as a description for the tables (with how well its predictions rank)."""
    info = {"name": order.name, "max_wait_s": order.max_wait_s}
    if order.name == "predicted":
        info.update(sigma=order.sigma, kendall_tau=kendall_tau(output, order.keys, seed=seed))
    return info


def timed_task(label, simulate, *args):
    """One timed simulation (simulate_serving's or simulate_fleet's), with progress lines on a
    long one: what C's worker processes run."""
    t0 = time.perf_counter()
    result = simulate(*args, progress=functools.partial(log_labelled, label))
    result["wall_s"] = time.perf_counter() - t0
    return result


class Work(NamedTuple):
    """What a study's simulations cost: how many ran, their loops' iterations, their seconds."""
    runs: int = 0
    iterations: int = 0
    seconds: float = 0.0


def work_of(sims):
    return Work(len(sims), sum(s["iterations"] for s in sims), sum(s["wall_s"] for s in sims))


def vllm_refuses(run, tokens):
    """Where vllm serve would not start with a cache of `tokens`: one request of max_model_len
    (a logged run's, else the model's context) must fit it (vLLM's
    check_enough_kv_cache_memory, vllm/v1/core/kv_cache_utils.py). -> its description, or
    None (another engine's rules, no named card, or a cache of none: said elsewhere)."""
    if not run.hardware.gpu or run_profile(run).rules != "vllm":
        return None
    context = run.scheduler.serve_max_model_len or run.hardware.model.max_positions
    if not 0 < tokens < context:
        return None
    kind = "vllm_short_context" if run.scheduler.serve_max_model_len is None else \
        "vllm_short_max_model_len"
    return {"kind": kind, "context": context, "tokens": tokens}


def kv_setup(run, req, device):
    """C's KV budgets, one per policy, checked against every request before anything runs.
    -> (the budget's description, the budgets every request fits); a policy a request does not
    fit is left out, and info["unfit"] says why, so its rows print as not fitting."""
    memory_bytes, source = kv_budget_bytes(run, device)
    per_token = kv_bytes_per_token(run.hardware.model)
    generated = not (run.workload.trace or run.workload.lengths_file)
    max_output = run.scheduler.max_output or (LENGTH_MAX if generated else int(req.output.max()))
    info = {"memory_bytes": memory_bytes, "memory_source": source, "bytes_per_token": per_token,
            "budget_tokens": max(int(memory_bytes // per_token), 0),
            "block_tokens": run.scheduler.block_tokens, "max_output": max_output,
            "watermark": run.scheduler.watermark, "unfit": {}, **host_tier(run, per_token)}
    refuses = vllm_refuses(run, info["budget_tokens"])
    if refuses:
        info["engine_refuses"] = refuses
    budgets = []
    for policy in run.scheduler.kv_policies:
        kv = KVBudget(policy, info["budget_tokens"], run.scheduler.block_tokens, max_output,
                      run.scheduler.watermark, eviction=run.scheduler.eviction_policy,
                      **tier_fields(info))
        why = check_kv_budget(req, kv) if info["budget_tokens"] else no_memory(run, source)
        if why:
            info["unfit"][policy] = why
        else:
            budgets.append(kv)
    return info, budgets


def no_memory(run, source):
    """Why a KV cache got nothing: on a named card, by how much each card falls short and
    which single change would leave it room (fp8 KV, fp8 weights, twice the cards)."""
    if "short_gib" not in source:  # (not a named card's)
        return {"kind": "kv_no_memory"}
    cfg, card, profile = run.hardware.model, GPUS[run.hardware.gpu], run_profile(run)
    tp, ep = run.hardware.tp, run.hardware.ep
    cfg = stage_model(cfg, run.hardware.pp)  # (a card of a stage: its share of the layers)
    tries = [("--kv-dtype fp8", dataclasses.replace(cfg, kv_dtype="fp8"), tp),
             ("--weights fp8", dataclasses.replace(cfg, weights="fp8"), tp),
             (f"--tp {2 * tp}", cfg, 2 * tp if cfg.heads % (2 * tp) == 0 else tp)]
    would = [flag for flag, c, t in tries if (c, t) != (cfg, tp)
             and card_kv_tokens(c, card, profile, t, ep)]
    return {"kind": "kv_short", "short_gib": source["short_gib"],
            "would": ", ".join(would) or "a larger card"}


def memory_metrics(req, sim, kv, makespan_s):
    """Memory use of a simulated run (a fleet's: its replicas' summed, peaks the largest one's):
    time averages over the makespan."""
    mem = sim["kv"]
    utilization = mem["held_s"] / mem["alloc_s"] if mem["alloc_s"] else 0.0
    return {"utilization": utilization,
            "fragmentation": kv_manager(kv).fragmentation(req, sim, utilization),
            "peak_concurrency": mem["peak_running"],
            "mean_concurrency": mem["running_s"] / makespan_s,
            "preemptions": mem["preemptions"], "recomputed_tokens": mem["recomputed_tokens"],
            "max_allocated_tokens": mem["max_alloc"]}


def kv_metrics(req, sim, kv):
    """Memory use of one simulated run (memory_metrics), and its latencies."""
    m = serving_metrics(req, sim)
    return {**memory_metrics(req, sim, kv, m["makespan_s"]),
            **{k: m[k] for k in ("throughput_rps", "output_tokens_per_s", "makespan_s", "steps",
                                 "iterations", "simulation_s", "ttft_s", "tpot_s", "e2e_s")},
            **prefix_metrics(req, sim)}


def study_budget(budgets):
    """The KV budget a study runs under: the policy serving engines run (paged) where every
    request fits it, else another, else none (memory unlimited)."""
    return next((b for b in budgets if KV_MANAGERS[b.policy].served),
                budgets[0] if budgets else None)


def every_nth(req, n, offset=0):
    """The requests one replica of n sees under round-robin (every n-th, arrivals kept)."""
    return req.take(slice(offset, None, n))


HIT_BUCKETS = (("hit_none", 0.0, 0.0), ("hit_some", 0.0, 0.5), ("hit_most", 0.5, 1.0))


def prefix_metrics(req, sim):
    """What a run's prefix caches did (empty without one): prompt tokens queried and hit per
    tier (vLLM's prefix_cache_queries and _hits, here at each request's first admission; a
    preempted request's hits when readmitted are counted apart), the prefill tokens computed
    and saved, and TTFT by the share of its prompt a request found cached at its first
    admission (none, up to half, over half)."""
    p = sim.get(PREFIX_REPORT)
    if not p:
        return {}
    hit = np.zeros(len(req.output))
    if p["hits"]:
        hit[list(p["hits"])] = list(p["hits"].values())
    share, ttft = hit / req.prompt, sim["times"].ttft()
    queried, card, host, disk = p["queried_tokens"], p["hit_tokens"], p["host_hit_tokens"], \
        p["disk_hit_tokens"]
    buckets = []
    for name, low, high in HIT_BUCKETS:
        mask = (share > low) & (share <= high) if high else share == 0
        buckets.append({"bucket": name, "requests": int(mask.sum()),
                        "ttft_s": percentiles(ttft[mask])})
    return {PREFIX_REPORT: {
        "queried_tokens": queried, "hit_tokens": card, "host_hit_tokens": host,
        "disk_hit_tokens": disk, "hit_ratio": (card + host + disk) / queried if queried else 0.0,
        "card_hit_ratio": card / queried if queried else 0.0,
        "host_hit_ratio": host / queried if queried else 0.0,
        "disk_hit_ratio": disk / queried if queried else 0.0,
        "prefill_tokens_computed": queried - card - host - disk,
        "prefill_tokens_saved": card + host + disk,
        "evicted_blocks": p["evicted_blocks"], "ttft_by_hit": buckets,
        "readmitted_hit_tokens": p["readmitted_hit_tokens"],
        "host_load_s": p["host_load_s"],
        "per_replica": [sum(row[PREFIX_REPORT][tier + "hit_tokens"] for tier in TIERS)
                        / max(row[PREFIX_REPORT]["queried_tokens"], 1)
                        for row in sim.get("per_replica", ()) if PREFIX_REPORT in row]}}


TIERS = ("", "host_", "disk_")  # a prefix cache's hits: the card's, the host's, the disk's


def tier_fields(info):
    """The KVBudget fields of the tiers below the card, from host_tier's description."""
    return {field: info[field] for field in ("host_tokens", "host_token_s", "host_write",
                                             "disk_tokens", "disk_token_s", "disk_prefetch")}


def host_tier(run, per_token, gpu=None, tp=None):
    """A prefix cache's host tier (--host-kv-gb): its tokens, its write policy, the card's
    link to it, and the seconds a token's KV takes to load: each of a replica's tp cards loads
    the share it keeps (card_kv_share) over its own link, all at once, at the share of the
    link a DMA copy gets (HOST_LINK_SHARE); and the disk tier below it (--disk-kv-gb), read
    whole at its bandwidth (the node's drive feeds every card). gpu, tp: a pool's card and TP
    (default: the run's)."""
    gpu, tp = gpu or run.hardware.gpu, tp or run.hardware.tp
    link, gbs = HOST_LINKS.get(gpu) or ((GPUS[gpu].link, GPUS[gpu].link_gbs) if gpu
                                        else _PCIE4)
    host_bytes = (run.scheduler.host_kv_gb or 0) * 1e9
    host_tokens = int(host_bytes // per_token)
    return {"host_bytes": host_bytes, "host_tokens": host_tokens,
            "host_link": link, "host_link_gbs": gbs, "host_load_share": HOST_LINK_SHARE,
            "host_write": run.scheduler.host_write_policy or KVBudget.host_write,
            "host_token_s": card_kv_bytes_per_token(run.hardware.model, tp)
            / (HOST_LINK_SHARE * gbs * 1e9),
            **disk_tier(run, per_token, host_tokens)}


def disk_tier(run, per_token, host_tokens):
    """The disk tier's tokens and the seconds it takes to read one token's KV (none where it,
    or the host tier above it, holds no whole block)."""
    block = run.scheduler.block_tokens
    disk_bytes = (run.scheduler.disk_kv_gb or 0) * 1e9
    if host_tokens < block or disk_bytes // per_token < block:
        disk_bytes = 0
    gbs = run.scheduler.disk_kv_gbs or DISK_READ_GBS
    return {"disk_bytes": disk_bytes, "disk_tokens": int(disk_bytes // per_token),
            "disk_gbs": gbs, "disk_token_s": per_token / (gbs * 1e9),
            "disk_prefetch": run.scheduler.disk_prefetch}
