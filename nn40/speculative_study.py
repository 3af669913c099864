"""C's speculative decoding: the run's Speculation (its law, its draft's prices) and what C prints
of it: the speculating replica beside the plain one at the run's rate, the speedup at each
concurrency for k = 1..K drafts with where speculation stops paying, and the capacity answer
with speculation (pure simulation)
"""
import dataclasses

from nn40.capacity import capacity_study
from nn40.accounting import kv_bytes_per_token
from nn40.config import GPUS, SWEEP_REQUESTS
from nn40.errors import UsageError
from nn40.host import run_parallel
from nn40.kv import KVUnfit
from nn40.loop import simulate_serving
from nn40.metrics import itl_mean_s, serving_metrics
from nn40.memory import kv_budget_bytes
from nn40.pricing import NO_DRAFT, card_costs, card_kv_terms
from nn40.profiles import run_profile
from nn40.runs import timed_task, work_of
from nn40.speculative import (
    Speculation, SpeculativeCosts, draft_config, draft_memory, lookahead_tokens)
from nn40.workload import seed_for

# the speedup table's concurrencies (requests in flight), up to the replica's seats
CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


def run_speculation(run, k=None, gpu=None, tp=None, limits=None):
    """(the run's Speculation with k drafts, default its own; the draft's StepCosts, or None;
    the KV tokens the cache keeps beside the draft, or None where a flag set them) on the
    run's card at its TP, or on `gpu` at `tp` with the batch `limits` (a pool's). Each draft
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
    return spec, costs, drafting_kv_tokens(run, draft, gpu, tp, limits)


def drafting_kv_tokens(run, draft, gpu=None, tp=None, limits=None):
    """The KV tokens left beside the draft's weights, its layers' KV in the same cache
    (run_draft_memory; card_kv_terms), on the run's card or a pool's; None where --kv-tokens
    set them. One line where the draft leaves no cache where the model alone has one."""
    hw, memory = run.hardware, run_draft_memory(run, tp)
    if run.scheduler.kv_tokens and gpu is None:
        return None
    tokens = [card_kv_terms(hw.model, GPUS[gpu], run_profile(run), tp, 1, limits, m)["tokens"]
              if gpu is not None else
              int(kv_budget_bytes(run, None, m)[0] // kv_bytes_per_token(hw.model))
              for m in (memory, NO_DRAFT)]
    if tokens[0] <= 0 < tokens[1]:
        raise UsageError(f"--speculative-config: beside {draft.name} "
                         f"({memory.weight_bytes / 2**30:.2f} GiB of weights a card) no KV "
                         f"cache fits on {GPUS[gpu or hw.gpu].name} at TP {tp or hw.tp}")
    return max(tokens[0], 0)


def run_draft_memory(run, tp=None):
    """What the run's draft keeps on each card (draft_memory) at the run's TP and EP, or a
    pool's `tp`."""
    sched, hw = run.scheduler, run.hardware
    draft = draft_config(sched.speculative_method, hw.model, sched.speculative_model)
    return draft_memory(sched.speculative_method, draft, tp or hw.tp, 1 if tp else hw.ep)


def speculating(replica, spec, draft, kv_tokens=None):
    """The replica with its decoders speculating by `spec`, the draft priced by `draft`, its KV
    cache `kv_tokens` (None: as it was)."""
    kv = replica.kv if kv_tokens is None or replica.kv is None else \
        dataclasses.replace(replica.kv, capacity_tokens=kv_tokens)
    return dataclasses.replace(replica, speculation=spec, kv=kv,
                               costs=SpeculativeCosts(replica.costs, draft, spec.k))


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
    spec, draft, kv_tokens = run_speculation(run)
    about = {"method": spec.method, "k": spec.k}
    plain, _ = capacity_or_why(run, req, replica)
    fast, fast_error = capacity_or_why(run, req, speculating(replica, spec, draft, kv_tokens))
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
