"""The cheapest placement of each kind for a target rate at an SLO: colocated replicas at each
TP and PP, and a prefill pool with a decode pool at each pair of shapes, their counts searched
by simulation from what TensorRT-LLM's rate-matching rule says (rate_matching) (pure
simulation)
"""
import dataclasses
import math
import time

import numpy as np

from nn40.capacity import SLO, fewest_replicas, unit_rate
from nn40.config import CAPACITY_REQUESTS, REPLICAS_MAX
from nn40.errors import UsageError
from nn40.host import dask_distributed, log, run_parallel
from nn40.kv import check_kv_budget
from nn40.metrics import slo_met
from nn40.placement import Role, check_roles, placement_link, placement_pools, role_replica
from nn40.pools import Fleet, simulate_pools
from nn40.profiles import run_profile
from nn40.speculative import PP_METHODS
from nn40.workload import seed_for

SHAPES_TP, SHAPES_PP = (1, 2, 4, 8), (1, 2)
SHAPES_EACH = 3  # the smallest shapes that run, per role (a TP x PP of fewer cards first)


def role_shapes(run, req, role, gpu):
    """The (TP, PP) a role's replica can run at on `gpu` (TP divides the heads, the weights
    fit, and its KV cache holds each of the requests alone: a prefill replica their prompts
    and first tokens; a speculating one with its draft beside it, at PP 1 but for the
    methods vLLM runs on stages), fewest cards first: the SHAPES_EACH smallest."""
    cfg, profile = run.hardware.model, run_profile(run)
    held = dataclasses.replace(req, output=np.ones_like(req.output)) if role == "prefill" \
        else req
    method = run.scheduler.speculative_method
    one_stage = method and method not in PP_METHODS and role != "prefill"
    fits = []
    for tp in SHAPES_TP:
        for pp in SHAPES_PP[:1] if one_stage else SHAPES_PP:
            shape = Role(role, 1, tp, pp, gpu)
            try:
                check_roles(cfg, [shape] if role == "colocated" else [
                    shape._replace(role="prefill"), shape._replace(role="decode")],
                    profile=profile)
                replica = role_replica(run, shape, req.output)  # (a draft may leave no cache)
            except UsageError:
                continue
            if not check_kv_budget(held, replica.kv, replica.speculation,
                                   handed=role == "decode"):
                fits.append((tp * pp, pp, tp))
    return [(tp, pp) for _, pp, tp in sorted(fits)[:SHAPES_EACH]]


def rate_matching(run, req, prefill, decode):
    """TensorRT-LLM's rate-matching rule for a prefill replica and a decode replica (Roles):
    a prefill replica's context rate (requests/s it prefills, its chunk of prompts a pass), a
    decode replica's generation rate (requests/s it completes at the largest batch whose step
    meets the TPOT bound, within its slots and KV cache), and the counts that serve the target
    rate: P = rate / context rate, D = rate / generation rate, rounded up; throughput per
    card = output tokens/s / (P cards x generation rate / context rate + D cards), as the
    rule writes it (TensorRT-LLM's disaggregated serving blog)."""
    prompt, output = float(req.prompt.mean()), float(req.output.mean())
    pre = role_replica(run, prefill, req.output)
    n = max(1, int(pre.chunk_tokens // max(prompt, 1)))
    per = in_flight_share(pre, n)  # (pipeline stages: the heaviest micro-batch's prompts)
    ctx_rate = n / pre.costs.pass_s(per * prompt, 0, per * prompt * (prompt + 1) / 2)
    dec = role_replica(run, decode, req.output)
    context = prompt + output / 2
    room = max(1, int(min(dec.slots, dec.kv.capacity_tokens // max(context, 1))))
    tpot = run.slo.slo_tpot_s or math.inf
    step = [dec.costs.pass_s(rows, rows * context) for rows in
            (in_flight_share(dec, b) for b in range(1, room + 1))]
    batch = max([b for b, s in enumerate(step, 1) if s <= tpot] or [1])
    gen_rate = batch / (max(output - 1, 1) * step[batch - 1])
    rate = run.slo.target_rate
    counts = (math.ceil(rate / ctx_rate), math.ceil(rate / gen_rate))
    per_gpu = gen_rate * output / (prefill.tp * prefill.pp * gen_rate / ctx_rate +
                                   decode.tp * decode.pp)
    return {"context_rps": ctx_rate, "generation_rps": gen_rate, "batch": batch,
            "step_s": step[batch - 1], "prefill_replicas": counts[0],
            "decode_replicas": counts[1], "output_tokens_per_s_per_gpu": per_gpu,
            "feasible": meets_alone(run, req, prefill) and
            meets_alone(run, req, decode),
            "gpus": counts[0] * prefill.tp * prefill.pp + counts[1] * decode.tp * decode.pp}


def in_flight_share(replica, n):
    """The most of n requests one of the replica's batches in flight carries (pipeline
    stages: a micro-batch's share, rounded up; else all n)."""
    return -(-n // replica.costs.in_flight)


def meets_alone(run, req, role):
    """Whether a replica of the role, idle, meets the bounds for a request of mean length:
    a prefill (or colocated) replica its prompt's TTFT, a decode (or colocated) replica a
    decode step's TPOT at a batch of one. A shape that does not can meet no SLO at any
    count."""
    costs = role_replica(run, role, req.output).costs
    prompt, context = float(req.prompt.mean()), float(req.prompt.mean() + req.output.mean())
    ttft = costs.pass_s(prompt, 0, prompt * (prompt + 1) / 2)
    tpot = costs.pass_s(1, context)
    return (role.role == "decode" or ttft <= (run.slo.slo_ttft_s or math.inf)) and \
        (role.role == "prefill" or tpot <= (run.slo.slo_tpot_s or math.inf))


def attainments(run, base, roles, slo):
    """(SLO met overall, TTFT met, TPOT met) of a placement serving `base` at the target
    rate."""
    req = base.take(arrival_s=base.arrival_s / run.slo.target_rate)
    pools, path = placement_pools(run, roles, req.output)
    sim = simulate_pools(req, pools, path, link=placement_link(run, roles) if len(roles) > 1
                         else None)
    ttft_ok, tpot_ok = slo_met(sim["times"], slo.ttft_s, slo.tpot_s)
    return float((ttft_ok & tpot_ok).mean()), float(ttft_ok.mean()), float(tpot_ok.mean())


def fewest_pools(run, base, roles, slo, start, most_gpus):
    """The fewest cards of a prefill and a decode pool (Roles at their shapes) serving the
    target rate at the SLO, from `start` (P, D): up by the role whose bound fewer requests
    meet while the SLO is missed (to `most_gpus` cards), then down by each role while it is
    still met. -> (roles at the counts found or None, {(P, D): SLO met})"""
    tried, per = {}, [r.tp * r.pp for r in roles]

    def met(counts):
        if counts not in tried:
            at = [r._replace(replicas=n) for r, n in zip(roles, counts)]
            tried[counts] = attainments(run, base, at, slo)
        return tried[counts]
    counts = tuple(start)
    while met(counts)[0] < slo.attainment:
        _, ttft, tpot = met(counts)
        grow = 0 if ttft < tpot else 1
        counts = tuple(n + (i == grow) for i, n in enumerate(counts))
        if counts[0] * per[0] + counts[1] * per[1] > most_gpus or max(counts) > REPLICAS_MAX:
            return None, {k: v[0] for k, v in tried.items()}
    for i in (0, 1):  # (down while it holds)
        while counts[i] > 1:
            less = tuple(n - (j == i) for j, n in enumerate(counts))
            if met(less)[0] < slo.attainment:
                break
            counts = less
    return [r._replace(replicas=n) for r, n in zip(roles, counts)], \
        {k: v[0] for k, v in tried.items()}


def timed(function, args):
    """(function(*args), its seconds): a search and what it took, on whichever worker."""
    clock = time.perf_counter()
    return function(*args), time.perf_counter() - clock


def skipped():
    """A pair of shapes that cannot meet the SLO (a decode step at a batch of one past the
    TPOT bound, or a prompt alone past the TTFT bound) or needs more cards than the budget
    by the rule itself: not simulated."""
    return None, {}


def colocated_fewest(run, base, shape, slo):
    """The fewest colocated replicas at `shape` (TP, PP) on --gpu for the target rate. ->
    (roles or None, {replicas: SLO met})"""
    role = Role("colocated", 1, *shape, run.hardware.gpu)
    replica = role_replica(run, role, base.output)
    router = run.scheduler.router if run.scheduler.router != "all" else "least-requests"
    n, tried = fewest_replicas(base, replica, slo, Fleet(1, router, seed_for(run, "fleet")),
                               run.slo.target_rate, 1)
    return ([role._replace(replicas=n)] if n else None), tried


def search_tasks(run, base, slo):
    """The searches to run: the fewest colocated replicas at each shape on --gpu, and the
    fewest prefill and decode replicas at each pair of shapes on their cards, from the
    rate-matching rule's counts. -> ([(function, arguments)], [its row's fields])"""
    p, gpu = run.placement, run.hardware.gpu
    cards = (p.prefill_gpu or gpu, p.decode_gpu or gpu)
    tasks, rows = [], []
    for shape in role_shapes(run, base, "colocated", gpu):
        alone = meets_alone(run, base, Role("colocated", 1, *shape, gpu))
        tasks.append((colocated_fewest, (run, base, shape, slo)) if alone else (skipped, ()))
        rows.append({"kind": "colocated", "shapes": [shape], "label": "TP{} PP{}".format(
            *shape), "skipped": not alone})
    for a in role_shapes(run, base, "prefill", cards[0]):
        for b in role_shapes(run, base, "decode", cards[1]):
            roles = [Role("prefill", 1, *a, cards[0]), Role("decode", 1, *b, cards[1])]
            rule = rate_matching(run, base, *roles)
            most = p.gpu_budget or max(16, 4 * rule["gpus"])  # (past it: not found)
            runs = rule["feasible"] and rule["gpus"] <= most
            rows.append({"kind": "disaggregated", "shapes": [a, b], "rate_matching": rule,
                         "label": "TP{} PP{} + TP{} PP{}".format(*a, *b), "skipped": not runs})
            tasks.append((fewest_pools, (run, base, roles, slo, (
                rule["prefill_replicas"], rule["decode_replicas"]), most)) if runs else
                (skipped, ()))
    return tasks, rows


def cheapest_placements(run, req):
    """With --placement-search (or pools) and a target rate: the cheapest placement of each
    kind (fewest cards, then the larger share meeting the SLO) serving it at the SLO, each
    shape's search, and the rate-matching rule's counts beside the simulated ones. ->
    result"""
    slo = SLO(run.slo.slo_ttft_s, run.slo.slo_tpot_s, run.slo.slo_attainment)
    base = unit_rate(run, req, CAPACITY_REQUESTS, seed_for(run, "placements"))[0]
    tasks, rows = search_tasks(run, base, slo)
    p = run.placement
    log(f"C placements: {len(tasks)} searches for {run.slo.target_rate:g} requests/s "
        f"({sum(r['kind'] == 'colocated' for r in rows)} colocated shapes, "
        f"{sum(r['kind'] != 'colocated' for r in rows)} pairs of pools)")
    cluster = run.measurement.cluster
    if cluster:
        dask_distributed()  # (one line where Dask is not installed)
    clock = time.perf_counter()
    done = run_parallel([(timed, task) for task in tasks], run.measurement.jobs, cluster)
    wall_s = time.perf_counter() - clock
    for row, ((roles, tried), search_s) in zip(rows, done):
        row.update(found=roles is not None, placement=None, gpus=None, attainment=None,
                   simulations=len(tried), search_s=search_s, tried=sorted(
            (list(k) if isinstance(k, tuple) else [k], v) for k, v in tried.items()))
        if roles and p.gpu_budget and sum(r.gpus for r in roles) > p.gpu_budget:
            row["found"], roles = False, None  # (past the budget)
        if roles:
            key = tuple(r.replicas for r in roles)
            row.update(placement=" + ".join(r.label for r in roles),
                       gpus=sum(r.gpus for r in roles), attainment=tried[
                           key if len(key) > 1 else key[0]],
                       roles=[r._asdict() for r in roles])
    best = {}
    for row in sorted((r for r in rows if r["found"]), key=lambda r: (r["gpus"],
                                                                       -r["attainment"])):
        best.setdefault(row["kind"], row)
    return {"target_rate": run.slo.target_rate, "requests": len(base.output),
            "wall_s": wall_s, "workers": run.measurement.jobs, "cluster": cluster,
            "simulations": sum(r["simulations"] for r in rows),
            "simulation_s": sum(r["search_s"] for r in rows),
            "slo_ttft_s": slo.ttft_s, "slo_tpot_s": slo.tpot_s, "attainment": slo.attainment,
            "rows": rows, "best": best, "answer": min(best.values(), key=lambda r: (
                r["gpus"], -r["attainment"]))["kind"] if best else None}
