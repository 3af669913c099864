"""Placements of the user's model: colocated replicas, or a prefill pool handing each request's
KV over a link to a decode pool (disaggregated serving), each role on its own card at its own
TP and PP; a placement checked before anything runs (check_roles), its pools priced as the run
prices its card (role_replica), and the disaggregated run beside colocated replicas on as many
cards (disaggregation_study) (pure simulation)
"""
import functools
import math
from typing import NamedTuple

import numpy as np

from nn40.accounting import card_weight_bytes, kv_bytes_per_token
from nn40.config import GPUS
from nn40.errors import UsageError
from nn40.handoff import GPUS_PER_NODE, kv_link
from nn40.host import log, run_parallel
from nn40.kv import KV_MANAGERS, KVBudget
from nn40.metrics import serving_metrics
from nn40.pools import Pool, simulate_pools
from nn40.pricing import ENGINE_RULES, card_costs, card_kv_tokens
from nn40.profiles import run_profile
from nn40.runs import host_tier, prefix_metrics, run_order, tier_fields, timed_task, work_of
from nn40.speculative_study import run_speculation, speculating
from nn40.stages import pipeline_costs, pipelined, stage_model
from nn40.stats import percentiles
from nn40.workload import arrival_times, random_stream, seed_for

ROLES = ("colocated", "prefill", "decode")
POOL_ROUTER = "least-requests"  # (a pool's router where --router names none: DistServe's)


class Role(NamedTuple):
    """One pool of a placement: its role (ROLES), replicas, and each replica's TP, PP and
    card (a key of GPUS)."""
    role: str
    replicas: int
    tp: int
    pp: int
    gpu: str

    @property
    def gpus(self):
        return self.replicas * self.tp * self.pp

    @property
    def label(self):
        return f"{self.replicas} x {self.role} TP{self.tp} PP{self.pp} {GPUS[self.gpu].name}"


def run_roles(run):
    """The placement the flags give: a prefill pool and a decode pool (each role's TP, PP and
    card defaulting to --tp, --pp and --gpu), or --replicas colocated replicas."""
    hw, p = run.hardware, run.placement
    if not p.disaggregated:
        return [Role("colocated", run.scheduler.replicas, hw.tp, hw.pp, hw.gpu)]
    return [Role("prefill", p.prefill_replicas, p.prefill_tp or hw.tp, p.prefill_pp or hw.pp,
                 p.prefill_gpu or hw.gpu),
            Role("decode", p.decode_replicas, p.decode_tp or hw.tp, p.decode_pp or hw.pp,
                 p.decode_gpu or hw.gpu)]


def colocated_twin(run, gpus):
    """Colocated replicas at --tp and --pp on --gpu on at most `gpus` cards (as many as a
    placement takes)."""
    hw = run.hardware
    n = gpus // (hw.tp * hw.pp)
    if n < 1:
        raise UsageError(f"the placement takes {gpus} cards: too few for one colocated "
                         f"replica of TP {hw.tp} x PP {hw.pp} to run beside it")
    return [Role("colocated", n, hw.tp, hw.pp, hw.gpu)]


def check_roles(cfg, roles, gpus=None, profile=None):
    """A placement, before anything runs: one colocated pool, or a prefill pool and a decode
    pool; each pool's TP must divide the heads (and the K/V heads, or be a multiple of them),
    its PP at most the layers, a card's share of the weights fit on it (and, given the engine
    `profile`, leave its KV cache room), the cards add up to at most `gpus`. -> cards used"""
    names = [r.role for r in roles]
    if names not in (["colocated"], ["prefill", "decode"]):
        raise UsageError(f"a placement of {names or 'no pools'}: one colocated pool, or a "
                         "prefill pool and a decode pool")
    for r in roles:
        kv_heads = cfg.n_kv_heads
        if r.replicas < 1 or r.tp < 1 or r.pp < 1 or cfg.heads % r.tp or \
                (kv_heads % r.tp and r.tp % kv_heads) or r.pp > cfg.layers:
            raise UsageError(f"{r.role} pool of {r.replicas} x TP {r.tp} x PP {r.pp}: TP must "
                             f"divide {cfg.name}'s {cfg.heads} heads and its {kv_heads} K/V "
                             f"heads (or be a multiple of them), PP at most its {cfg.layers} "
                             "layers, and a pool has a replica at least")
        card, stage = GPUS[r.gpu], stage_model(cfg, r.pp)
        weights = card_weight_bytes(stage, r.tp)
        if weights > card.memory_bytes:
            raise UsageError(f"{r.role} pool at TP {r.tp} x PP {r.pp}: {weights / 1e9:,.1f} GB "
                             f"of {cfg.name}'s weights on each {card.name} "
                             f"({card.memory_bytes / 1e9:,.1f} GB): give more TP or PP")
        if profile is not None and not card_kv_tokens(stage, card, profile, r.tp):
            raise UsageError(f"{r.role} pool at TP {r.tp} x PP {r.pp}: the weights leave "
                             f"{card.name} no room for a KV cache under the {profile.name} "
                             "profile: give more TP or PP")
    used = sum(r.gpus for r in roles)
    if gpus is not None and used > gpus:
        raise UsageError(f"the placement takes {used} cards, past the budget of {gpus}")
    return used


def check_placement(run):
    """The run's prefill and decode pools, colocated replicas on as many cards, and the link
    between the pools, each refused in one line where it cannot run. -> (roles, the colocated
    roles, the KVLink)"""
    cfg, profile = run.hardware.model, run_profile(run)
    roles = run_roles(run)
    gpus = check_roles(cfg, roles, profile=profile)
    try:
        twin = colocated_twin(run, gpus)
        check_roles(cfg, twin, profile=profile)
    except UsageError as e:
        raise UsageError(f"the colocated replicas run beside the pools (--tp, --pp, --gpu): "
                         f"{e}") from None
    if run.scheduler.speculative_method:  # (a draft leaving a speculating pool no cache)
        for role in roles + twin:
            if role.role != "prefill":
                run_speculation(run, gpu=role.gpu, tp=role.tp,
                                limits=role_limits(run, role, profile))
    return roles, twin, placement_link(run, roles)


def role_limits(run, role, profile):
    """A role's seats and step budget: --slots and --chunk-tokens where given, else the
    engine's defaults on the role's card and TP (EngineRules.defaults)."""
    hw, rules = run.hardware, ENGINE_RULES[profile.rules]
    stage, drafting = stage_model(hw.model, role.pp), run.scheduler.speculative_method
    own = rules.defaults(profile, stage, GPUS[role.gpu], role.tp, 1,
                         drafting if role.role != "prefill" else None)[:2]
    run_own = rules.defaults(profile, stage_model(hw.model, hw.pp), GPUS[hw.gpu], hw.tp,
                             hw.ep, drafting)[:2]  # (what the run's limits were resolved against)
    served = (run.scheduler.serve_slots, run.scheduler.serve_chunk_tokens)
    return tuple(s if s != d else o for s, d, o in zip(served, run_own, own))


def role_replica(run, role, output):
    """A Replica of the role's pool: the run's model on the role's card at its TP and PP,
    priced as the run prices a card (card_costs under the engine profile; PP: pipeline
    stages), its KV cache what the engine leaves each card of a stage (paged blocks, the
    prefix cache and its host tier where the run keeps one)."""
    cfg, card, profile = run.hardware.model, GPUS[role.gpu], run_profile(run)
    slots, chunk = role_limits(run, role, profile)
    tokens = card_kv_tokens(stage_model(cfg, role.pp), card, profile, role.tp, 1, (slots, chunk))
    sched = run.scheduler  # (the policy engines serve with: paged, or its prefix cache)
    policy = next((p for p in sched.kv_policies if KV_MANAGERS[p].served), "paged")
    tiers = tier_fields(host_tier(run, kv_bytes_per_token(cfg), role.gpu, role.tp)) if \
        KV_MANAGERS[policy].tracks_prefixes else {}
    kv = KVBudget(policy, tokens, sched.block_tokens, 0, sched.watermark,
                  eviction=sched.eviction_policy, **tiers)
    costs = pipeline_costs(card_costs(cfg, card, profile, role.tp), role.pp, cfg, card, role.tp)
    replica = pipelined(profile.replica(costs, slots=slots, chunk_tokens=chunk,
                                        scheduler="continuous", order=run_order(run, output),
                                        kv=kv, prompt_tokens=chunk, fused=profile.fused))
    if sched.speculative_method and role.role != "prefill":  # (a decode pool speculates, and
        # the colocated replicas beside it; a prefill pool emits one token a request)
        replica = speculating(replica, *run_speculation(run, gpu=role.gpu, tp=role.tp,
                                                         limits=(slots, chunk)))
    return replica


def placement_link(run, roles):
    """The KV link between a prefill pool and a decode pool: --kv-link (or its GB/s and
    latency), else the card's own where the placement fits in a node of one kind of card,
    else the prefill card's network."""
    p = run.placement
    one_node = sum(r.gpus for r in roles) <= GPUS_PER_NODE and roles[0].gpu == roles[1].gpu
    name = p.kv_link or (None if one_node else "network")
    ends = [kv_link(run.hardware.model, GPUS[r.gpu], name, p.kv_link_gbs,
                    p.kv_link_latency_us, p.kv_layerwise) for r in roles]
    return min(ends, key=lambda link: link.bytes_per_s)  # (each end checked; the slower)


def placement_pools(run, roles, output):
    """(the Pools of a placement, the requests' path through them)."""
    router = run.scheduler.router if run.scheduler.router != "all" else POOL_ROUTER
    pools = [Pool(r.role, role_replica(run, r, output), r.replicas, router,
                  seed_for(run, "fleet")) for r in roles]
    return pools, [r.role for r in roles]


def placement_summary(req, sim, roles, slo):
    """What a reader compares placements by: latencies at p50, p90 and p99, the SLO met and
    the goodput per card, and each pool's replicas busy (the share of the run their steps
    took), slots filled and queue (a prefill's wait for its first step; a decode's for room
    at its replica: back-pressure); the KV that crossed the link."""
    m = serving_metrics(req, sim, *slo)
    gpus = sum(r.gpus for r in roles)
    span = m["makespan_s"]
    out = {"placement": " + ".join(r.label for r in roles), "gpus": gpus,
           **{k: m[k] for k in ("throughput_rps", "output_tokens_per_s", "ttft_s", "tpot_s",
                                "e2e_s", "makespan_s") if k in m},
           "slo_attained": m.get("slo_attained"), "goodput_rps": m.get("goodput_rps"),
           "goodput_per_gpu": m["goodput_rps"] / gpus if "goodput_rps" in m else None,
           "output_tokens_per_s_per_gpu": m["output_tokens_per_s"] / gpus,
           "wait_s": percentiles(sim["times"].start - req.arrival_s), "pools": {},
           **prefix_metrics(req, sim)}
    per_pool = sim.get("pools") or {roles[0].role: {"per_replica": sim["per_replica"]}}
    for r in roles:
        per = per_pool[r.role]["per_replica"]
        out["pools"][r.role] = {
            "replicas": r.replicas, "tp": r.tp, "pp": r.pp, "gpu": r.gpu,
            "busy": float(np.mean([p["busy_s"] for p in per])) / span if span else 0.0,
            "occupancy": float(np.mean([p["occupancy"] for p in per])),
            "requests": sum(p["requests"] for p in per)}
    if "hand_off" in sim:
        handed = sim["hand_off"]
        out["back_pressure"] = {"waited": handed["waited"], "wait_s": handed["wait_s"],
                                "mean_wait_s": handed["wait_s"] / max(handed["waited"], 1)}
    if "kv_transfer" in sim:
        sent = sim["kv_transfer"]
        out["kv_transfer"] = {**sent, "mean_s": (sent["link_s"] + sent["queued_s"]) /
                              max(sent["sends"], 1)}
    return out


def simulate_placement(run, req, roles, label):
    """One placement's run of the requests: (label, simulate_pools, its arguments), a task
    for run_parallel."""
    pools, path = placement_pools(run, roles, req.output)
    link = placement_link(run, roles) if len(roles) > 1 else None
    return timed_task, (label, functools.partial(simulate_pools, link=link), req, pools, path)


def disaggregation_study(run, req, one_replica_rps=None):
    """C with a prefill and a decode pool: the run's requests through them, and through
    colocated replicas (--tp, --pp, --gpu) on as many cards, both continuous batching under
    the engine's limits and KV cache on each role's card; given one colocated replica's
    capacity at the SLO (requests/s), the SLO met against the rate for both (attainment_curve).
    -> (result, Work)"""
    cfg = run.hardware.model
    roles, twin, link = check_placement(run)
    gpus = sum(r.gpus for r in roles)
    log(f"C placement: {' + '.join(r.label for r in roles)} beside {twin[0].label}, the KV "
        f"over {link.name}")
    sims = run_parallel([simulate_placement(run, req, roles, "C disaggregated"),
                         simulate_placement(run, req, twin, "C colocated")],
                        run.measurement.jobs)
    slo = (run.slo.slo_ttft_s, run.slo.slo_tpot_s)
    curve, swept = attainment_curve(run, req, (roles, twin), one_replica_rps) if \
        one_replica_rps and math.isfinite(one_replica_rps) else (None, [])
    result = {"requests": len(req.output), "gpus": gpus, "slo_ttft_s": slo[0],
              "slo_tpot_s": slo[1], "link": {"name": link.name, "gbs": link.bytes_per_s / 1e9,
                                             "latency_us": link.latency_s * 1e6,
                                             "layerwise": bool(link.layers)},
              "kv_bytes_per_token": kv_bytes_per_token(cfg),
              "disaggregated": placement_summary(req, sims[0], roles, slo),
              "colocated": placement_summary(req, sims[1], twin, slo), "curve": curve}
    return result, work_of(sims + swept)


CURVE_SHARES = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0)  # of the colocated replicas' capacity


def attainment_curve(run, req, placements, one_replica_rps):
    """The SLO met against the arrival rate for both placements (DistServe's figure): the
    run's requests at shares of what the colocated replicas serve at the SLO (the capacity
    study's one replica, `one_replica_rps`, times their count), fresh Poisson (or gamma)
    arrivals a rate. -> ({"rates_rps", "disaggregated", "colocated": the shares meeting the
    SLO}, the simulations)"""
    rates = [one_replica_rps * placements[1][0].replicas * share for share in CURVE_SHARES]
    rng = random_stream(run, "sweep")
    swept = [req.take(arrival_s=arrival_times(len(req.output), rate, run.workload.burstiness,
                                              rng)) for rate in rates]
    sims = run_parallel([simulate_placement(run, r, roles, f"C {roles[0].role} {rate:g}/s")
                         for rate, r in zip(rates, swept) for roles in placements],
                        run.measurement.jobs)
    slo = (run.slo.slo_ttft_s, run.slo.slo_tpot_s)
    met = [serving_metrics(r, sim, *slo)["slo_attained"]
           for r, pair in zip(swept, zip(sims[::2], sims[1::2])) for sim in pair]
    return {"rates_rps": rates, "disaggregated": met[::2], "colocated": met[1::2]}, sims
