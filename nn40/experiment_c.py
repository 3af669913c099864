"""Experiment C: static against continuous batching, in steps and in seconds (pure simulation)

The post's table, the three schedulers, the KV cache, who waits, the rate sweep; every
simulation a worker's task. Imports the simulator's modules alone.
"""
import dataclasses
import time

import numpy as np

from nn40.accounting import kv_bytes_per_token, kv_crossover_batch, weight_bytes
from nn40.capacity import capacity_study, prefix_study, replicas_study
from nn40.cheapest import cheapest_placements
from nn40.config import GPUS, MODELS, SWEEP_REQUESTS, WHO_WAITS_REQUESTS
from nn40.errors import UsageError
from nn40.host import run_parallel, write_atomic
from nn40.loop import simulate_serving
from nn40.metrics import quantile_curve, serving_metrics, thin
from nn40.placement import disaggregation_study
from nn40.pricing import DEFAULT_PROFILE, card_costs, card_kv_tokens
from nn40.profiles import engine_profile, profile_at
from nn40.queues import ORDERS
from nn40.replicas import SCHEDULERS
from nn40.runs import (
    Work, arrivals, every_nth, kv_metrics, order_info, run_order, study_budget, timed_task,
    work_of, workload)
from nn40.speculative_study import (
    capacity_with_speculation, run_speculation, speculating, speculation_study)
from nn40.slot_steps import continuous_starts, simulate_slots, static_starts
from nn40.stages import pipelined
from nn40.stats import percentiles
from nn40.workload import (
    arrival_times, is_engine_run, lognormal_lengths, random_stream, read_engine_run)


def catalog(context=1024, batch=64, profile_name=DEFAULT_PROFILE, kv_fraction=None):
    """Every named model on every named card, from the accounting alone: the weights, the KV
    bytes per token, the KV tokens that fit on one card (see card_kv_tokens), the batch from
    which a decode step reads more KV than weights, and C's price of a decode step at batch 1
    and `batch` under an engine profile (its memory fraction `kv_fraction` where given),
    every row holding `context` tokens."""
    profile = profile_at(profile_name, kv_fraction)
    rows = []
    for name, cfg in MODELS.items():
        weights, per_token = weight_bytes(cfg), kv_bytes_per_token(cfg)
        for key, card in GPUS.items():
            costs = card_costs(cfg, card, profile)
            fit = card_kv_tokens(cfg, card, profile)
            rows.append({"model": name, "gpu": key, "weights_gb": weights / 1e9,
                         "kv_bytes_per_token": per_token, "kv_tokens": fit,
                         "crossover_batch": kv_crossover_batch(cfg, context), **{
                             f"decode_b{b}_ms": 1e3 * costs.pass_s(b, b * context)
                             if b * (context + 1) <= fit else None for b in (1, batch)}})
    return {"context": context, "batch": batch, "fraction": profile.kv_fraction,
            "profile": profile.fields(), "rows": rows}


def seed_spread(n, slots):
    """Occupancy and speedup of the post's table over many draws of the default law: how much
    one draw says. 100 seeds, fewer past 20,000 requests (a large draw varies little)."""
    n_seeds = max(5, min(100, 2_000_000 // n))
    stats = []
    for seed in range(n_seeds):
        lengths = lognormal_lengths(n, seed)
        static = static_starts(lengths, slots)[1]
        continuous = continuous_starts(lengths, slots)[1]
        total = lengths.sum() / slots
        stats.append((total / static, total / continuous, static / continuous))
    p10, p50, p90 = np.percentile(np.array(stats), [10, 50, 90], axis=0)
    keys = ("static_occupancy", "continuous_occupancy", "speedup")
    return {"seeds": n_seeds, **{k: {"p10": float(a), "p50": float(b), "p90": float(c)}
                                 for k, a, b, c in zip(keys, p10, p50, p90)}}


def post_table(run, lengths):
    """The post's table: static vs continuous in decode steps, all requests at t=0."""
    result = {"requests": len(lengths), "slots": run.scheduler.slots, "lengths": {
        "median": float(np.median(lengths)), "mean": float(lengths.mean()),
        "max": int(lengths.max()), "total": int(lengths.sum())}}
    for policy in ("static", "continuous"):
        sim = simulate_slots(lengths, run.scheduler.slots, policy, max_points=20_000)
        result[policy] = {"steps": sim["steps"], "occupancy": sim["occupancy"],
                          "occupied": sim["occupied"].tolist(),
                          "occupied_bin_steps": sim["occupied_bin_steps"]}
    result["speedup"] = result["static"]["steps"] / result["continuous"]["steps"]
    return result


def orders_steps(lengths, slots, orders):
    """The post's table under each order: every request waiting at t=0, so an order is a
    stable sort of the queue; the steps, occupancy and the step at which requests finish."""
    result = {}
    for order in orders:
        ordered = lengths if order.keys is None else lengths[order.ranked]
        result[order.name] = {}
        for policy, starts_of in (("static", static_starts), ("continuous", continuous_starts)):
            starts, steps = starts_of(ordered, slots)
            finish = starts + ordered
            result[order.name][policy] = {
                "steps": steps, "occupancy": float(lengths.sum() / (steps * slots)),
                "mean_finish_step": float(finish.mean()),
                "p99_finish_step": float(np.percentile(finish, 99))}
    return result


def c_replicas(run, req, costs):
    """(serve, replica): the Replica on `costs` with the engine's seats and step budget
    (serving_limits), where C answers for an engine (its capacity, fleets and rate sweep, and
    a trace's replay); and the one the single-replica studies run, the post's own seats and
    budget but for a trace's replay. Under PP, a step's budget for each micro-batch in
    flight (stages.pipelined)."""
    profile = engine_profile(run.hardware.engine_profile)
    post = profile.replica(costs, slots=run.scheduler.slots, scheduler="continuous",
                           chunk_tokens=run.scheduler.chunk_tokens,
                           order=run_order(run, req.output),
                           fused=bool(run.hardware.gpu) and profile.fused)
    serve = pipelined(dataclasses.replace(post, slots=run.scheduler.serve_slots,
                                          chunk_tokens=run.scheduler.serve_chunk_tokens))
    return serve, serve if run.workload.trace or run.workload.lengths_file else pipelined(post)


def run_batching_sim(run, req, log, costs, kv_budgets=None):
    """C: static vs continuous batching in steps (the post's table, then in every order of the
    queue), then in seconds priced by `costs` (StepCosts: run_step_costs's) for all three
    schedulers, (kv_budgets: kv_setup's) the KV-cache study, who waits under each order, a
    sweep of arrival rates, and with --replicas or an SLO the routers and the capacity search;
    the independent simulations run in --jobs worker processes."""
    t0 = time.perf_counter()
    budgets = kv_budgets[1] if kv_budgets else ()
    serve, replica = c_replicas(run, req, costs)
    fleet_replica = dataclasses.replace(serve, kv=study_budget(budgets))  # (and capacity's)
    capacity = None  # (first: an impossible --target-rate fails before the long part)
    if run.slo.slo_ttft_s or run.slo.slo_tpot_s:
        capacity = (capacity_with_speculation if run.scheduler.speculative_method else
                    capacity_study)(run, req, fleet_replica)
    share = req
    # the single-replica studies: one replica's share under round-robin
    if run.scheduler.replicas > 1:
        share = every_nth(req, run.scheduler.replicas)
        replica = dataclasses.replace(replica, order=run_order(run, share.output))
    result, work = schedulers_study(run, share, replica, kv_budgets, log)
    result["who_waits"], result["orders"], waited = who_waits(run, share, replica, budgets)
    result["rate_sweep"], swept = rate_sweep(run, share, dataclasses.replace(
        serve, order=replica.order), result["schedulers"]["continuous"] if replica == serve
        else None)
    works = [work, waited, swept]
    if run.scheduler.speculative_method:
        result["speculation"], sped = speculation_study(
            run, share, dataclasses.replace(fleet_replica, order=replica.order), share)
        works.append(sped)
    if run.scheduler.replicas > 1:
        result["replicas"], fleets = replicas_study(run, req, fleet_replica if not
                                                    run.scheduler.speculative_method else
                                                    speculating(fleet_replica,
                                                                *run_speculation(run)))
        works.append(fleets)
    if run.placement.disaggregated:
        result["placement"], placed = disaggregation_study(
            run, req, capacity and capacity["one_replica"]["rate_rps"])
        works.append(placed)
    if (run.placement.disaggregated or run.placement.search_placements) and \
            run.slo.target_rate is not None:
        result["placements"] = cheapest_placements(run, req)
    if capacity:
        result["capacity"] = capacity
    if run.scheduler.prefix_study and kv_budgets:
        result["prefix_study"], studied = prefix_study(run, share, replica, *kv_budgets)
        works.append(studied)
    total = Work(*map(sum, zip(*works)))
    result["simulation"] = {"runs": total.runs, "jobs": run.measurement.jobs,
                            "iterations": total.iterations, "simulation_s": total.seconds,
                            "wall_s": time.perf_counter() - t0}
    return result


def schedulers_study(run, req, replica, kv_budgets, log):
    """C's main tables: the post's in steps (in every order of the queue too), then the three
    schedulers in seconds, and with kv_budgets (kv_setup's) the same under each budget, and
    the KV study. -> (result, Work)"""
    result = {} if run.workload.trace else post_table(run, req.output)
    if "static" in result:
        log(f"C: static {result['static']['steps']:,} steps, continuous "
            f"{result['continuous']['steps']:,} steps")
        result["orders_steps"] = orders_steps(req.output, run.scheduler.slots, [
            run_order(run, req.output, name) for name in ORDERS])
    result.update(source=workload(run), requests=len(req.output), slots=replica.slots,
                  chunk_tokens=replica.chunk_tokens,
                  share_of=run.scheduler.replicas, cost_model=replica.costs.as_dict(),
                  order=order_info(replica.order, req.output, run.workload.seed),
                  arrivals=arrivals(run),
                  prompt_tokens=percentiles(req.prompt), output_tokens=percentiles(req.output),
                  schedulers={}, distributions={})
    runs = [(f"C {name}", dataclasses.replace(replica, scheduler=name)) for name in SCHEDULERS]
    if kv_budgets:  # (first: the slowest go first, so no worker is left with one at the end)
        runs = [(f"C kv {budget.policy} {name}", dataclasses.replace(
            replica, scheduler=name, kv=budget)) for budget in kv_budgets[1][::-1]
            for name in SCHEDULERS] + runs
    calls = [(timed_task, (label, simulate_serving, req, r)) for label, r in runs]
    if "static" in result and not run.workload.lengths_file:
        calls.append((seed_spread, (len(req.output), run.scheduler.slots)))
    done = run_parallel(calls, run.measurement.jobs)
    if len(done) > len(runs):
        result["seed_spread"] = done.pop()
    sims = dict(zip((label for label, _ in runs), done))
    for label, sim in sims.items():
        log(f"{label}: {sim['steps']:,} steps, {sim['times'].finish.max():,.2f} s simulated, "
            f"{sim['iterations']:,} iterations in {sim['wall_s']:.2f} s")
    for name in SCHEDULERS:
        sim = sims[f"C {name}"]
        result["schedulers"][name] = serving_metrics(req, sim, run.slo.slo_ttft_s,
                                                     run.slo.slo_tpot_s)
        result["distributions"][name] = {
            "ttft_s": quantile_curve(np.sort(sim["times"].ttft())),
            "e2e_s": quantile_curve(np.sort(sim["times"].e2e()))}
    if run.output.save_requests:
        save_requests_csv(run.output.save_requests, req, {name: sims[f"C {name}"]
                                                   for name in SCHEDULERS})
    if kv_budgets:
        result["kv"] = kv_study(req, sims, *kv_budgets)
    if run.workload.trace and is_engine_run(run.workload.trace):
        result["engine_run"] = engine_run_study(run, req, sims,
                                                result.get("kv", {}).get("budget_tokens"))
    return result, work_of(list(sims.values()))


def engine_run_study(run, req, sims, kv_tokens=None):
    """C's simulation of a real engine's logged requests (their arrivals, this run's slots,
    chunk and KV budget, `kv_tokens`: the engine's own settings where given) beside what the
    engine measured: TTFT, TPOT and E2E at p50, p90 and p99, and C's error on each, under each
    scheduler (with the paged KV budget where C has one)."""
    logged = read_engine_run(run.workload.trace, run.workload.trace_limit)
    keys, stats = ("ttft_s", "tpot_s", "e2e_s"), ("p50", "p90", "p99")
    measured = {k: percentiles(logged[k]) for k in keys}
    simulated = {}
    for name in SCHEDULERS:
        label = next(k for k in (f"C kv paged {name}", f"C {name}") if k in sims)
        metrics = serving_metrics(req, sims[label])
        simulated[label[2:]] = {**{k: metrics[k] for k in keys}, "error": {
            k: {p: metrics[k][p] / measured[k][p] - 1 for p in stats} for k in keys}}
    return {"settings": logged["settings"], "measured": measured, "simulated": simulated,
            "run": {"slots": run.scheduler.serve_slots,
                    "chunk_tokens": run.scheduler.serve_chunk_tokens,
                    "kv_tokens": kv_tokens, "rate": run.workload.rate}}


def kv_study(req, sims, info, budgets):
    """C's KV cache: every allocation policy with every scheduler, against the memory budget
    (sims: the finished simulations, by label)."""
    result = {**info, "series": {}}
    for kv in budgets:
        result[kv.policy] = {}
        for name in SCHEDULERS:
            sim = sims[f"C kv {kv.policy} {name}"]
            result[kv.policy][name] = kv_metrics(req, sim, kv)
            if name == "continuous":
                t, held, alloc, running = zip(*thin(sim["kv"]["series"]))
                result["series"][kv.policy] = {"t_s": t, "held_tokens": held,
                                               "allocated_tokens": alloc, "running": running}
                result["peak"] = {"policy": kv.policy, "scheduler": name,
                                  "contexts": sim["kv"]["peak_contexts"]}
    return result


def who_waits(run, req, replica, budgets):
    """C: who waits under each order of the queue. Continuous batching serves the run's
    requests (the first WHO_WAITS_REQUESTS) as they arrive, within the KV budget (paged where
    every request fits it, else the other policy, else none); the two shortest-first orders
    run again with the starvation guard (--max-wait-s, or else FCFS's 99th-percentile wait).
    -> (what ran, {order: latencies overall and by output length}, Work)"""
    n = min(len(req.output), WHO_WAITS_REQUESTS)
    req = req.take(slice(n))
    base = dataclasses.replace(replica, scheduler="continuous", kv=study_budget(budgets))
    budget = base.kv

    def simulate(orders):
        return dict(zip(orders, run_parallel([(timed_task, (
            f"C who waits {name}", simulate_serving, req, dataclasses.replace(base, order=order)))
            for name, order in orders.items()], run.measurement.jobs)))
    orders = {name: run_order(run, req.output, name) for name in ORDERS}
    sims = simulate(orders)
    guard, source = run.scheduler.max_wait_s, "guard_flag"
    if guard is None:
        guard = float(np.percentile(sims["fcfs"]["times"].start - req.arrival_s, 99))
        source = "guard_fcfs"
    sims.update(simulate({f"{name}_guarded": dataclasses.replace(orders[name], max_wait_s=guard)
                          for name in ("sjf", "predicted")}))
    edges = [int(e) for e in np.quantile(req.output, [1 / 3, 2 / 3])]
    predicted = order_info(orders["predicted"], req.output, run.workload.seed)
    info = {"requests": n, "slots": base.slots, "scheduler": "continuous",
            "kv_policy": budget.policy if budget else None, "arrivals": arrivals(run),
            "guard_s": guard, "guard_source": source, "length_edges": edges,
            "sigma": predicted["sigma"], "kendall_tau": predicted["kendall_tau"]}
    return info, {name: order_latencies(req, sim, edges) for name, sim in sims.items()}, \
        work_of(list(sims.values()))


def order_latencies(req, sim, edges):
    """One order's latencies: overall, by output-length bucket (short up to edges[0] tokens,
    medium up to edges[1], long), and a curve by output length for the figure. Normalized
    latency is E2E / output tokens (Orca's and vLLM's measure); the wait is admission -
    arrival."""
    m = serving_metrics(req, sim)
    out = req.output
    ttft, e2e = sim["times"].ttft(), sim["times"].e2e()
    wait, per_token = sim["times"].start - req.arrival_s, e2e / out
    buckets = []
    for name, mask in (("short", out <= edges[0]), ("medium", (out > edges[0])
                                                    & (out <= edges[1])),
                       ("long", out > edges[1])):
        if mask.any():
            buckets.append({"bucket": name, "low": int(out[mask].min()),
                            "high": int(out[mask].max()), "count": int(mask.sum()),
                            "ttft_s": percentiles(ttft[mask]), "e2e_s": percentiles(e2e[mask]),
                            "normalized_s_per_token": float(per_token[mask].mean()),
                            "max_wait_s": float(wait[mask].max())})
    bins = np.unique(np.geomspace(out.min(), out.max() + 1, 17).astype(int))
    which = np.searchsorted(bins, out, side="right") - 1
    curve = {"length": [], "ttft_mean_s": [], "e2e_mean_s": [], "per_token_mean_s": []}
    for b in np.unique(which):  # (means: a bin's few long waits are what an order moves)
        mask = which == b
        curve["length"].append(float(np.median(out[mask])))
        for key, values in (("ttft_mean_s", ttft), ("e2e_mean_s", e2e),
                            ("per_token_mean_s", per_token)):
            curve[key].append(float(values[mask].mean()))
    return {**{k: m[k] for k in ("makespan_s", "throughput_rps", "output_tokens_per_s",
                                 "ttft_s", "tpot_s", "e2e_s", "iterations", "simulation_s")},
            "normalized_s_per_token": float(per_token.mean()), "max_wait_s": float(wait.max()),
            "by_length": buckets, "curve": curve}


def rate_sweep(run, req, replica, continuous):
    """Throughput and p99 latency of each scheduler as the arrival rate grows.

    Rates: --rates, or fractions of the continuous scheduler's capacity (its throughput with
    every request waiting at t=0: `continuous`, as measured above, or None: measured here).
    Each point replays the first SWEEP_REQUESTS requests with fresh Poisson (or gamma)
    arrivals, memory unlimited.
    -> (points, Work)
    """
    req = req.take(slice(SWEEP_REQUESTS))
    if continuous is None:  # (the tables ran other seats: this replica's throughput, all at 0)
        continuous = serving_metrics(req, simulate_serving(req, dataclasses.replace(
            replica, scheduler="continuous", kv=None)))
    capacity = continuous["throughput_rps"]
    rates = run.workload.rates or tuple(round(f * capacity, 6)
                                        for f in (0.2, 0.4, 0.6, 0.8, 0.9, 1.0, 1.2))
    rng = random_stream(run, "sweep")
    swept = [req.take(arrival_s=arrival_times(len(req.output), rate, run.workload.burstiness, rng))
             for rate in rates]
    sims = run_parallel([(timed_task, (f"C sweep {rate:g}/s {name}", simulate_serving, r,
                                       dataclasses.replace(replica, scheduler=name, kv=None)))
                         for rate, r in zip(rates, swept) for name in SCHEDULERS],
                        run.measurement.jobs)
    points = []
    for i, (rate, r) in enumerate(zip(rates, swept)):
        row = {"rate_rps": rate}
        for name, sim in zip(SCHEDULERS, sims[3 * i:3 * i + 3]):
            m = serving_metrics(r, sim)
            row[name] = {"throughput_rps": m["throughput_rps"], "e2e_p99_s": m["e2e_s"]["p99"],
                         "ttft_p99_s": m["ttft_s"]["p99"]}
        points.append(row)
    return points, work_of(sims)


def save_requests_csv(path, req, sims):
    lines = ["scheduler,id,arrival,prompt,output,start,first_token,finish"]
    for name, sim in sims.items():
        times = sim["times"]
        for i in range(len(req.output)):
            lines.append(f"{name},{i},{req.arrival_s[i]:.6f},{req.prompt[i]},{req.output[i]},"
                         f"{times.start[i]:.6f},{times.first_token[i]:.6f},"
                         f"{times.finish[i]:.6f}")
    try:
        write_atomic(path, "\n".join(lines) + "\n")
    except OSError as e:
        raise UsageError(f"cannot write {path}: {e.strerror}")
