"""C's speculative decoding: the run's Speculation (its law, its draft's prices) and what C prints
of it: the speculating replica beside the plain one at the run's rate, the speedup at each
concurrency for k = 1..K drafts with where speculation stops paying, and the capacity answer
with speculation (pure simulation)
"""
import dataclasses
from typing import NamedTuple

from nn40.capacity import capacity_study
from nn40.accounting import kv_bytes_per_token
from nn40.config import GPUS, SWEEP_REQUESTS
from nn40.errors import UsageError
from nn40.host import run_parallel
from nn40.kv import KVUnfit, check_kv_budget
from nn40.loop import simulate_serving
from nn40.metrics import itl_mean_s, serving_metrics
from nn40.memory import draft_scale, kv_budget_bytes
from nn40.pricing import NO_DRAFT, card_costs, card_kv_terms
from nn40.profiles import run_profile
from nn40.runs import study_budget, timed_task, work_of
from nn40.stages import PipelineCosts
from nn40.speculative import (
    Speculation, SpeculativeCosts, draft_config, draft_memory, lookahead_tokens)
from nn40.workload import seed_for

# the speedup table's concurrencies (requests in flight), up to the replica's seats
CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


def run_speculation(run, k=None, gpu=None, tp=None, limits=None):
    """(the run's Speculation with k drafts, default its own; the draft's StepCosts, or None;
    the DraftCache beside the draft, or None) on the run's card at its TP, or on `gpu` at `tp`
    with the batch `limits` (a pool's). Each draft
    pass is priced as a pass of its own, the engine's fixed cost a pass included: vLLM's EAGLE
    proposer runs its k passes one after another, each sampling its token before the next
    (vllm/v1/spec_decode/eagle.py); priced without it, vLLM's own batch-1 runs of April 2025
    are 22-26% slower than C says (see tests/test_speculative.py)."""
    sched, hw = run.scheduler, run.hardware
    k = k or sched.num_speculative_tokens
    spec = Speculation(sched.speculative_method, k, tuple(sched.acceptance_rates[:k]),
                       sched.acceptance_law, lookahead_tokens(sched.speculative_method, k),
                       seed_for(run, "speculation"))
    draft = draft_config(spec.method, hw.model, sched.speculative_model)
    if draft is None:
        return spec, None, None
    ep = hw.ep if draft.experts and not tp else 1
    costs = card_costs(draft, GPUS[gpu or hw.gpu], run_profile(run), tp or hw.tp, ep)
    return spec, costs, drafting_cache(run, draft, gpu, tp, limits)


class DraftCache(NamedTuple):
    """The KV cache a speculating replica keeps beside its draft: its tokens (None: as set by
    --kv-tokens) and `scale`, the bytes a cached token weighs over the model's own where the
    draft's K and V sit in the same cache (a host tier then holds 1/scale as many tokens and
    loads each scale times slower: vLLM's offloading copies every layer's blocks)."""
    tokens: int = None
    scale: float = 1.0


def drafting_cache(run, draft, gpu=None, tp=None, limits=None):
    """The DraftCache beside the draft's weights and KV as the engine's rule charges them
    (run_draft_memory; card_kv_terms), on the run's card or a pool's. One line where the
    draft leaves no cache where the model alone has one."""
    hw, profile, memory = run.hardware, run_profile(run), run_draft_memory(run, tp)
    scale = draft_scale(run, memory, gpu, tp)
    card, tp = GPUS[gpu or hw.gpu], tp or hw.tp
    if run.scheduler.kv_tokens and gpu is None:
        return DraftCache(None, scale)
    tokens = [card_kv_terms(hw.model, card, profile, tp, 1, limits, m)["tokens"]
              if gpu is not None else
              int(kv_budget_bytes(run, None, m)[0] // kv_bytes_per_token(hw.model))
              for m in (memory, NO_DRAFT)]
    if tokens[0] <= 0 < tokens[1]:
        raise UsageError(f"--speculative-config: beside {draft.name} "
                         f"({memory.weight_bytes / 2**30:.2f} GiB of weights a card) no KV "
                         f"cache fits on {card.name} at TP {tp}")
    return DraftCache(max(tokens[0], 0), scale)


def check_drafting_fits(run, req, budgets):
    """Before anything runs: every request fits alone in the cache the study's speculating
    replica keeps (study_budget's, beside the draft, with its drafts' lookahead slots), else
    one line that names the draft."""
    kv = study_budget(budgets)
    if not run.scheduler.speculative_method or kv is None:
        return
    spec, _, cache = run_speculation(run)
    tokens = kv.capacity_tokens if cache is None or cache.tokens is None else cache.tokens
    why = check_kv_budget(req, dataclasses.replace(kv, capacity_tokens=tokens), spec)
    if why and why["kind"] == "kv_too_long":
        raise UsageError(f"--speculative-config: beside its draft a replica's {kv.policy} KV "
                         f"cache holds {tokens:,} tokens (without it {kv.capacity_tokens:,}), "
                         f"and request {why['request']} alone needs {why['needs']:,} with its "
                         f"{spec.lookahead} draft slots: give a larger card, more --tp or a "
                         "smaller draft")


def run_draft_memory(run, tp=None):
    """What the run's draft keeps on each card (draft_memory) at the run's TP and EP, or a
    pool's `tp`."""
    sched, hw = run.scheduler, run.hardware
    draft = draft_config(sched.speculative_method, hw.model, sched.speculative_model)
    return draft_memory(sched.speculative_method, draft, tp or hw.tp, 1 if tp else hw.ep)


def speculating(replica, spec, draft, cache=None):
    """The replica with its decoders speculating by `spec`, the draft priced by `draft`, its KV
    cache and host tier as `cache` (a DraftCache) leaves them (None: as they were)."""
    kv = replica.kv
    if cache is not None and kv is not None:
        kv = dataclasses.replace(
            kv, capacity_tokens=kv.capacity_tokens if cache.tokens is None else cache.tokens,
            host_tokens=int(kv.host_tokens / cache.scale),
            host_token_s=kv.host_token_s * cache.scale,
            disk_tokens=int(kv.disk_tokens / cache.scale),
            disk_token_s=kv.disk_token_s * cache.scale)
    verify = replica.costs  # (on pipeline stages a decoder's k + 1 query tokens go whole
    if isinstance(verify, PipelineCosts):  # into one micro-batch)
        verify = dataclasses.replace(verify, row_tokens=spec.k + 1)
    return dataclasses.replace(replica, speculation=spec, kv=kv,
                               costs=SpeculativeCosts(verify, draft, spec.k))


def summary(req, sim):
    """What the speculation tables read of a run."""
    m = serving_metrics(req, sim)
    return {**{key: m[key] for key in ("throughput_rps", "output_tokens_per_s", "ttft_s",
                                       "tpot_s", "e2e_s", "steps", "makespan_s")},
            "itl_s": {"mean": itl_mean_s(sim)}}


def speculation_study(run, req, replica, arrived):
    """C with --speculative-config: the run's requests (`arrived`: at the run's arrivals) on
    the replica plain and speculating, then SWEEP_REQUESTS of them at each concurrency of
    CONCURRENCY up to the replica's seats or their number (that many in flight, all waiting at
    t=0, as a benchmark's clients keep them), plain and with each k of 1..K drafts; all under the
    replica's scheduler and KV cache. The speedup: the plain TPOT p50 over the speculating
    one. -> (result, Work)"""
    specs = [run_speculation(run, k) for k in range(1, run.scheduler.num_speculative_tokens + 1)]
    sweep = req.take(slice(SWEEP_REQUESTS))
    waiting = sweep.take(arrival_s=sweep.arrival_s * 0)
    most = min(replica.slots, len(waiting.output))  # (no more in flight than there are)
    levels = [c for c in CONCURRENCY if c < most] + [most]
    replicas = [(f"c {c} k {k}", dataclasses.replace(replica, slots=c) if not k else
                 speculating(dataclasses.replace(replica, slots=c), *specs[k - 1]))
                for c in levels for k in range(len(specs) + 1)]
    sims = run_parallel([(timed_task, ("C speculation plain", simulate_serving, arrived,
                                       replica)),
                         (timed_task, ("C speculation", simulate_serving, arrived,
                                       speculating(replica, *specs[-1])))] +
                        [(timed_task, (f"C speculation {label}", simulate_serving, waiting, r))
                         for label, r in replicas], run.measurement.jobs)
    rows, per = [], len(specs) + 1
    for i, c in enumerate(levels):
        runs = [summary(waiting, sim) for sim in sims[2 + i * per:2 + (i + 1) * per]]
        rows.append({"concurrency": c, "plain": runs[0],
                     "k": [{**s, "k": k, "speedup": speedup(runs[0], s)}
                           for k, s in enumerate(runs[1:], 1)]})
    spec = specs[-1][0]
    result = {"method": spec.method, "k": spec.k, "rates": list(spec.rates),
              "law": spec.law, "acceptance_length": spec.expected_length,
              "lookahead_tokens": spec.lookahead, "draft": None if specs[-1][1] is None else
              specs[-1][1].source, "kv_policy": replica.kv.policy if replica.kv else None,
              "memory": {**run_draft_memory(run)._asdict(), "kv_tokens": [
                  r.kv.capacity_tokens if r.kv else None for r in (replica, speculating(
                      replica, *specs[-1]))]},
              "plain": summary(arrived, sims[0]), "speculative": summary(arrived, sims[1]),
              "concurrency": rows, "crossover": crossovers(rows, len(specs))}
    result["speedup"] = speedup(result["plain"], result["speculative"])
    return result, work_of(sims)


def speedup(plain, spec):
    """The plain TPOT p50 over the speculating one (above 1: speculation pays)."""
    return plain["tpot_s"]["p50"] / spec["tpot_s"]["p50"] if spec["tpot_s"]["p50"] else None


def crossovers(rows, kmax):
    """For each k, the first concurrency at which the speedup falls below 1 (found: whether
    it does), and the k with the best speedup at each concurrency."""
    below_one = []
    for k in range(1, kmax + 1):
        below = [row["concurrency"] for row in rows if (row["k"][k - 1]["speedup"] or 0) < 1]
        below_one.append({"k": k, "found": bool(below), "concurrency": below[0] if below
                          else None})
    best = [max(row["k"], key=lambda s: s["speedup"] or 0) for row in rows]
    return {"below_one": below_one, "best_k": [{"concurrency": row["concurrency"],
                                                "k": b["k"], "speedup": b["speedup"]}
                                               for row, b in zip(rows, best)]}


def capacity_with_speculation(run, req, replica):
    """The capacity answer plain and speculating (capacity_study with the run's k): the plain
    one with the speculating one beside it ("speculating"), or, where no rate meets the SLO
    without speculation but one does with it (a TPOT bound plain decoding cannot reach), the
    speculating one ("plain_misses")."""
    spec, draft, cache = run_speculation(run)
    about = {"method": spec.method, "k": spec.k}
    plain, _ = capacity_or_why(run, req, replica)
    fast, fast_error = capacity_or_why(run, req, speculating(replica, spec, draft, cache))
    if plain is None and fast is None:
        raise fast_error
    if plain is None:
        return {**fast, "plain_misses": True, "speculating": about}
    plain["speculating"] = {**about, "one_replica_rps": fast and fast["one_replica"]["rate_rps"],
                            "answer": fast and fast.get("answer")}
    return plain


def capacity_or_why(run, req, replica):
    """(capacity_study's answer, None), or (None, why) where no rate meets the SLO on one
    replica (a budget some request cannot fit is raised)."""
    try:
        return capacity_study(run, req, replica), None
    except KVUnfit:
        raise
    except UsageError as e:
        return None, e
