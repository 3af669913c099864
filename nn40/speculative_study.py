"""C's speculative decoding: the run's Speculation (its law, its draft's prices) and what C prints
of it: the speculating replica beside the plain one at the run's rate, the speedup at each
concurrency for k = 1..K drafts with where speculation stops paying, and the capacity answer
with speculation (pure simulation)
"""
import dataclasses

from nn40.capacity import capacity_study
from nn40.config import GPUS, MODELS, SWEEP_REQUESTS
from nn40.errors import UsageError
from nn40.host import run_parallel
from nn40.kv import KVUnfit
from nn40.loop import simulate_serving
from nn40.metrics import serving_metrics
from nn40.pricing import card_costs
from nn40.profiles import run_profile
from nn40.runs import timed_task, work_of
from nn40.speculative import Speculation, SpeculativeCosts, lookahead_tokens
from nn40.workload import seed_for

# the speedup table's concurrencies (requests in flight), up to the replica's seats
CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


def draft_config(method, cfg, model=None):
    """The model a method's drafts run: EAGLE's and EAGLE-3's head, one dense decoder layer of
    the target's width with its LM head (EAGLE-3 feeds it the target's fused hidden states);
    an MTP module, one layer of the target's own kind sharing its embedding and head
    (DeepSeek-V3's); a draft model, its own preset; an n-gram lookup, none."""
    if method in ("eagle", "eagle3"):
        return dataclasses.replace(cfg, layers=1, experts=0, experts_per_token=0,
                                   shared_experts=0, dense_layers=0,
                                   ffn_hidden=cfg.ffn_hidden or cfg.expert_ffn,
                                   name=f"{cfg.name} {method} head")
    if method == "mtp":
        return dataclasses.replace(cfg, layers=1, dense_layers=0, name=f"{cfg.name} mtp module")
    if method == "draft_model":
        return dataclasses.replace(MODELS[model], weights=cfg.weights, kv_dtype=cfg.kv_dtype)
    return None


def run_speculation(run, k=None, gpu=None, tp=None):
    """(the run's Speculation with k drafts, default its own; the draft's StepCosts on the
    run's card at its TP, or on `gpu` at `tp` (a pool's), or None) for --speculative-config.
    Each draft pass is priced as a pass of its own, the engine's fixed cost a pass included: vLLM's EAGLE proposer runs its k passes
    one after another, each sampling its token before the next (vllm/v1/spec_decode/eagle.py);
    priced without it, vLLM's own batch-1 runs are 22-26% slower than C says (see
    tests/test_speculative.py)."""
    sched, hw = run.scheduler, run.hardware
    k = k or sched.num_speculative_tokens
    spec = Speculation(sched.speculative_method, k, tuple(sched.acceptance_rates[:k]),
                       sched.acceptance_law, lookahead_tokens(sched.speculative_method, k),
                       seed_for(run, "speculation"))
    draft = draft_config(spec.method, hw.model, sched.speculative_model)
    if draft is None:
        return spec, None
    return spec, card_costs(draft, GPUS[gpu or hw.gpu], run_profile(run), tp or hw.tp,
                            hw.ep if draft.experts and not tp else 1)


def speculating(replica, spec, draft):
    """The replica with its decoders speculating by `spec`, the draft priced by `draft`."""
    return dataclasses.replace(replica, speculation=spec,
                               costs=SpeculativeCosts(replica.costs, draft, spec.k))


def summary(req, sim):
    """What the speculation tables read of a run."""
    m = serving_metrics(req, sim)
    return {key: m[key] for key in ("throughput_rps", "output_tokens_per_s", "ttft_s", "tpot_s",
                                    "e2e_s", "steps", "makespan_s")}


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
    spec, draft = run_speculation(run)
    about = {"method": spec.method, "k": spec.k}
    plain, _ = capacity_or_why(run, req, replica)
    fast, fast_error = capacity_or_why(run, req, speculating(replica, spec, draft))
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
