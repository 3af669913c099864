"""D against C: its requests, its step costs timed, its runs beside C's simulation of them
(device code)

What D serves, the prices it is predicted with, and the verdict: steps, seconds, speedup
and, with system prompts, what its prefix cache saved.
"""
import dataclasses
import math
from typing import NamedTuple

import numpy as np
import torch

from nn40.device import device_name, engine_attention
from nn40.errors import UsageError
from nn40.experiment_ab import attention_policy, decode_kernel
from nn40.experiment_d import (
    EngineBlocks, EngineDrafts, EngineRequests, engine_pool_blocks, run_engine)
from nn40.host import free_host_memory_bytes, gib
from nn40.kv import KVBudget, PREFIX_REPORT
from nn40.loop import simulate_serving
from nn40.metrics import LATENCIES, thin
from nn40.model import new_kv_cache
from nn40.pricing import fit_passes, fit_step_costs
from nn40.replicas import Replica
from nn40.runs import arrivals, order_info, run_order
from nn40.speculative_study import run_speculation, speculating
from nn40.workload import (
    PrefixWorkload, Requests, SharedPrompts, arrival_times, lognormal_lengths, random_stream,
    seed_for, shared_prompts)


def engine_requests(run):
    """D's requests: output lengths of C's law (divided by --engine-shrink, at least 1), and
    their arrivals (--rate: Poisson, on the wall clock; else all at once)."""
    n, P = run.engine.engine_requests, run.engine.engine_prompt_len
    need, free = n * (P + 32) * 8, free_host_memory_bytes()
    if need > 0.5 * free:  # its prompts, and a list of tokens for each
        raise UsageError(f"D: {n:,} requests of {P:,} prompt tokens would need about "
                         f"{gib(need)} of memory, and {gib(free)} is free")
    lengths = np.maximum(lognormal_lengths(n, run.workload.seed) // run.engine.engine_shrink, 1)
    rng = random_stream(run, "engine_arrivals")
    arrival = arrival_times(n, run.workload.rate, run.workload.burstiness, rng) \
        if isinstance(run.workload.rate, float) else None
    return lengths, arrival


def check_engine(run, lengths):
    """D's requests must fit the model's positions (with their drafts, when it speculates);
    its system prompts (which open its prompts, --prompt-len tokens of their own following)
    must be whole blocks."""
    if run.workload.prefix_len % run.scheduler.block_tokens:
        raise UsageError(f"D: --prefix-len {run.workload.prefix_len} must be whole blocks of "
                         f"--block-tokens {run.scheduler.block_tokens}, as the engine keeps them")
    block, pool = run.scheduler.block_tokens, run.scheduler.kv_tokens
    alone = -(-(run.engine.engine_prompt_len + int(lengths.max())) // block)
    if pool is not None and run.scheduler.speculative_method:
        raise UsageError("D: its speculating engine keeps no block pool: give --kv-tokens or "
                         "--speculative-config, not both")
    if pool is not None and pool // block < alone:
        raise UsageError(f"D: --kv-tokens {pool:,} holds {pool // block} blocks of {block}, and "
                         f"D's longest request alone needs {alone}: give at least "
                         f"{alone * block:,}")
    drafts = run.scheduler.num_speculative_tokens if run.scheduler.speculative_method else 0
    longest = run.engine.engine_prompt_len + int(lengths.max()) + drafts
    if longest > run.hardware.model.max_positions:
        raise UsageError(f"D: a request of {longest:,} tokens (prompt "
                         f"{run.engine.engine_prompt_len} + output {lengths.max():,}"
                         + (f" + {drafts} drafts" if drafts else "") + ") exceeds "
                         f"--max-positions {run.hardware.model.max_positions:,}")


def engine_costs(bench, prompt_len, pad):
    """D's step costs, measured here with the engine's own passes: decode steps by batch, each
    also at a longer context (the cost of a cached token), and batched prefills of whole
    prompts, half the usual time per shape. They are fitted on each shape's mean, not its
    median: the engine's wall time is a sum of steps, and a sum grows with the mean.

    A continuous batch holds rows at many positions, so it is also priced as it runs: each
    batch's rows spread evenly over the contexts from the prompt to the longer one, attended
    per span (each row its own: a call per row, an upper bound on the engine's) or, with pad,
    in one padded call (its cost per cached token then carries the padding read).
    -> (costs of one-span decodes, costs of spread decodes, the timed rows)"""
    run, budget_s = bench.run, bench.run.measurement.time_budget_s / 2
    long_context = min(prompt_len + 512, bench.cfg.max_positions - 1)
    batches = sorted({1, max(1, run.engine.engine_slots // 4), run.engine.engine_slots})

    def row(t, **shape):
        return {**shape, "step_ms": t["mean_ms"], "median_ms": t["median_ms"],
                "p10_ms": t["p10_ms"], "p90_ms": t["p90_ms"]}
    decode = [row(bench.time_decode(batch, context, budget_s=budget_s), batch=batch,
                  context=context, spread=False, padded=False)
              for batch in batches for context in (prompt_len, long_context)]
    decode += [row(bench.time_decode(b, long_context, budget_s=budget_s, low=prompt_len,
                                     pad=pad), batch=b, context=(prompt_len + long_context) / 2,
                   spread=True, padded=pad)
               for b in batches if b > 1]  # (a single row has nothing to spread)
    prefills = [row(bench.time_prefill(prompt_len, batch, budget_s=budget_s), batch=batch,
                    tokens=batch * prompt_len, spread=False, padded=False)
                for batch in sorted({1, run.engine.engine_slots})]
    source = {"kind": "pricing_engine", "device": device_name(bench.device)}
    one_span = fit_step_costs([r for r in decode if not r["spread"]], prefills, prompt_len,
                              0.0, source)
    # the spread rows, the same batches at the prompt's context, and the single row
    spread = fit_step_costs([r for r in decode if r["spread"] or r["batch"] == 1
                             or r["context"] == prompt_len], prefills, prompt_len, 0.0, source)
    return one_span, spread, decode + prefills


def latencies(times):
    """A run's makespan and its requests' TTFT and E2E, p50 and p90 (RequestTimes.summary's)."""
    summary = times.summary()
    ttft, e2e = summary["ttft_s"], summary["e2e_s"]
    return {"makespan_s": summary["makespan_s"], "ttft_p50_s": ttft["p50"],
            "ttft_p90_s": ttft["p90"], "e2e_p50_s": e2e["p50"], "e2e_p90_s": e2e["p90"]}


def steps_check(engine_times, sim_times):
    """Every request's first-token step and finish step, the engine's against the
    simulation's; the first request where they differ."""
    engine = np.array([engine_times.first_step, engine_times.finish_step])
    simulated = np.array([sim_times.first_step, sim_times.finish_step])
    differ = np.flatnonzero((engine != simulated).any(axis=0))
    check = {"requests": engine.shape[1], "agree": int(engine.shape[1] - len(differ))}
    if len(differ):
        r = int(differ[0])
        check["first_mismatch"] = {"request": r, "engine": engine[:, r].tolist(),
                                   "simulated": simulated[:, r].tolist()}
    return check


def run_serving_engine(bench, lengths, arrival, log):
    """D: serve the requests under each policy for real and set C's simulation of the same
    requests beside the run: the step at which each request emits its first token and its last
    (equal when all wait at t=0: both are deterministic), and its latencies in seconds,
    predicted twice: priced with step costs timed just before (the cost model's test: does
    timing passes predict a run?) and priced with the run's own passes (the scheduling
    model's test, free of the machine's drift between timing and running)."""
    run, cfg, device = bench.run, bench.cfg, bench.device
    n, P, slots = len(lengths), run.engine.engine_prompt_len, run.engine.engine_slots
    pad = engine_attention(run, device)
    one_span, spread, cost_rows = engine_costs(bench, P, pad)
    for name, costs in (("one span", one_span), ("spread", spread)):
        log_step_costs(log, name, costs)
    lengths, divisor, priced_s = bounded_lengths(run, lengths, arrival, one_span, spread)
    if divisor > 1:
        log(f"D: priced at {priced_s[0]:.0f} s for both runs, past D's bound of "
            f"{ENGINE_BOUND_S:.0f} s: outputs divided by {divisor} more ({priced_s[1]:.0f} s)")
    system = engine_system_prompts(run, arrival, lengths)
    prompts = engine_prompts(run, cfg.vocab, n, system).to(device)
    spec = run_speculation(run)[0] if run.scheduler.speculative_method else None
    cache = new_kv_cache(cfg, slots, P + max(int(lengths.max()), 2) + (spec.k if spec else 0),
                         device)
    warm_engine(bench.model, cache, prompts[:min(2, n, slots)], pad, spec)
    replica = Replica(slots, one_span, order=run_order(run, lengths))
    result = {"requests": n, "slots": slots, "prompt_tokens": P,
              "shrink": run.engine.engine_shrink * divisor,
              "bound": {"bound_s": ENGINE_BOUND_S, "priced_s": priced_s[0],
                        "shrunk_by": divisor, "priced_shrunk_s": priced_s[1]},
              "lengths": {"median": float(np.median(lengths)), "mean": float(lengths.mean()),
                          "max": int(lengths.max()), "total": int(lengths.sum())},
              "order": order_info(replica.order, lengths, run.workload.seed),
              "arrivals": arrivals(run) if arrival is not None else {"kind": "arrivals_zero"},
              "attention": "padded" if pad else "spans",
              **attention_policy(decode_kernel(bench, slots, P + int(lengths.max()), pad)),
              "kv_tokens": run.scheduler.kv_tokens,  # (a block pool for the continuous runs)
              "cost_model": {**one_span.as_dict(), "rows": cost_rows},
              "cost_model_spread": spread.as_dict()}
    served = EngineServed(bench, prompts, system, lengths, arrival, cache, pad, replica, spread,
                          spec)
    for name, pool, kv in engine_runs(run, prompts, system, slots, P + int(lengths.max()),
                                      spec):
        result[name], generated, elog = serve_and_simulate(served, name, pool, kv)
        log(f"D {name}: {result[name]['wall_s']:.2f} s measured, "
            f"{result[name]['predicted']['wall_s']:.2f} s predicted "
            f"({np.max(result[name]['per_request']['passes_finish_s']):.2f} s with its own "
            f"passes), {result[name]['steps']} steps")
        if pool is not None and pool.caching:
            result["prefix_check"] = prefix_check(result, elog, generated, plain, run)
        if name == "continuous":
            plain = generated
    result["speedup_measured"] = result["static"]["wall_s"] / result["continuous"]["wall_s"]
    result["speedup_predicted"] = (result["static"]["predicted"]["wall_s"]
                                   / result["continuous"]["predicted"]["wall_s"])
    if spec:
        result["speculation_check"] = speculation_check(result, spec)
    result["verdict"] = engine_verdict(result)
    return result


def warm_engine(model, cache, prompts, pad, spec):
    """The engine warmed: a prefill and a decode step of `prompts`, and with a Speculation
    a verify step too."""
    warm = len(prompts)
    run_engine(model, cache, EngineRequests(prompts, [2] * warm), "continuous", pad)
    if spec:
        run_engine(model, cache, EngineRequests(prompts, [3] * warm, drafts=EngineDrafts(
            spec.k, [[2]] * warm)), "continuous", pad)


class EngineServed(NamedTuple):
    """What each of D's runs serves (run_serving_engine): the requests, the engine's cache and
    attention, C's replica for them and its spread costs, and the Speculation (or None)."""
    bench: object
    prompts: torch.Tensor
    system: object
    lengths: np.ndarray
    arrival: object
    cache: torch.Tensor
    pad: bool
    replica: Replica
    spread: object
    spec: object


def serve_and_simulate(served, name, pool, kv):
    """One of D's runs (engine_runs) on the engine, its KV in `pool` (an EngineBlocks, or None),
    beside C's simulation of it on `kv`. -> (its result, the tokens it generated, the engine's
    log)"""
    s, n = served, len(served.lengths)
    policy = "static" if name == "static" else "continuous"
    spec = s.spec if name == "speculative" else None
    drafts = EngineDrafts(spec.k, spec.gains_for(s.lengths), spec.seed) if spec else None
    generated, elog = run_engine(s.bench.model, s.cache, EngineRequests(
        s.prompts, s.lengths.tolist(), s.arrival, pool, drafts), policy, s.pad,
        s.replica.order)
    at_zero = s.arrival is None
    req = Requests(np.zeros(n) if at_zero else s.arrival, np.full(n, s.prompts.shape[1]),
                   s.lengths)
    if pool is not None and pool.caching:  # (the run with a prefix cache)
        work = s.bench.run.workload
        req = dataclasses.replace(req, identity=SharedPrompts(
            s.system, np.full(work.num_prefixes, work.prefix_len), np.full(n, -1)))
    d = engine_against_simulation(req, elog, dataclasses.replace(
        s.replica, scheduler=policy, kv=kv), s.spread, at_zero, spec)
    return d, generated, elog


def engine_runs(run, prompts, system, slots, longest, spec=None):
    """D's runs: [(name, its block pool, C's KV budget for it)]: static, and continuous (with
    --kv-tokens on a pool of paged blocks that many tokens, caching nothing, C's paged blocks
    beside it: where the running requests outgrow it, the newest is preempted and computed
    again); where prompts share system prompts the continuous run again with a prefix cache,
    a block pool of --kv-tokens or else of its rows' memory (`longest` tokens a row), C's
    PrefixCache on as many blocks; with a Speculation `spec`, the continuous run again
    speculating."""
    block, tokens = run.scheduler.block_tokens, run.scheduler.kv_tokens
    pool = tokens // block if tokens else engine_pool_blocks(slots, longest, block)
    runs = [("static", None, None), ("continuous", None, None) if not tokens else (
        "continuous", EngineBlocks(prompts, pool, block, caching=False),
        KVBudget("paged", pool * block, block))]
    if system is not None:
        runs.append(("prefix", EngineBlocks(prompts, pool, block),
                     KVBudget("prefix", pool * block, block)))
    if spec is not None:
        runs.append(("speculative", None, None))
    return runs


def speculation_check(result, spec):
    """D speculating against its plain continuous run: tokens emitted a verify step, and the
    speedup (the plain run's wall time over the speculating one's), measured and as C's
    simulation predicted it (each run priced beforehand)."""
    plain, fast = result["continuous"], result["speculative"]
    emitted = result["lengths"]["total"] - result["requests"]  # (the first from each prefill)
    measured = plain["wall_s"] / fast["wall_s"]
    predicted = plain["predicted"]["wall_s"] / fast["predicted"]["wall_s"]
    return {"method": spec.method, "k": spec.k, "rates": list(spec.rates),
            "expected_length": spec.expected_length,
            "emitted_per_step": emitted / max(fast["verify_steps"], 1),
            "measured": measured, "predicted": predicted, "off": measured / predicted - 1,
            "tolerance": ENGINE_TOLERANCE,
            "within": abs(measured / predicted - 1) <= ENGINE_TOLERANCE}


def log_step_costs(log, name, costs):
    knots = ", ".join(f"{k}: {1e3 * v:.1f}" for k, v in zip(costs.tokens, costs.seconds))
    per_token = ", ".join(f"{b}: {1e6 * v:.2f}" for b, v in costs.kv_by_batch)
    log(f"D step costs ({name}), ms by tokens per pass: {knots}; µs per cached token by "
        f"batch: {per_token}")


def engine_prompts(run, vocab, n, system):
    """D's prompts, random tokens on the CPU; each system prompt's tokens open every prompt
    it opens (system: see engine_system_prompts)."""
    g = torch.Generator(device="cpu").manual_seed(seed_for(run, "prompts"))
    prompts = torch.randint(vocab, (n, run.engine.engine_prompt_len), generator=g)
    if system is not None:
        texts = torch.randint(vocab, (run.workload.num_prefixes, run.workload.prefix_len),
                              generator=g)
        prompts[system >= 0, :run.workload.prefix_len] = texts[system[system >= 0]]
    return prompts


def engine_system_prompts(run, arrival, lengths):
    """D's system prompts (--prefix-len): the one opening each request (-1: none), drawn as C
    draws them (shared_prompts), or None where D's prompts share nothing."""
    if not run.workload.prefix_len:
        return None
    n = len(lengths)
    work = run.workload
    prefix = PrefixWorkload(work.prefix_len, work.num_prefixes, work.prefix_share,
                            work.prefix_zipf)
    opened = shared_prompts(Requests(np.zeros(n) if arrival is None else arrival, np.zeros(n),
                                     lengths), prefix,
                            random_stream(run, "prefixes"))
    return np.asarray(opened.identity.system)


def prefix_check(result, elog, generated, plain, run):
    """D with its prefix cache against the plain continuous run of the same prompts: tokens
    identical, prompt tokens found cached (engine and C), preemptions and the tokens the
    preempted found again on their return (engine and C), and the seconds caching saved,
    measured and as C's simulation predicted them (each run priced beforehand)."""
    cached, plain_run = result["prefix"], result["continuous"]
    saved = plain_run["wall_s"] - cached["wall_s"]
    predicted = plain_run["predicted"]["wall_s"] - cached["predicted"]["wall_s"]
    return {"tokens_identical": generated == plain, "prefix_tokens": run.workload.prefix_len,
            "prompt_tokens": result["requests"] * result["prompt_tokens"],
            "hit_tokens": int(sum(elog["hit_tokens"])),
            "hit_tokens_simulated": cached.get("hit_tokens_simulated"),
            "requests": result["requests"], "hits_agree": cached.get("hits_agree"),
            **{key: cached.get(key) for key in (
                "preemptions", "preemptions_simulated", "readmitted_hit_tokens",
                "readmitted_hit_tokens_simulated")},
            "saved_s": saved, "saved_predicted_s": predicted,
            "off": saved / predicted - 1 if predicted > 0 else None, "tolerance": ENGINE_TOLERANCE,
            "within": predicted > 0 and abs(saved / predicted - 1) <= ENGINE_TOLERANCE}


# how far D's seconds (its latencies, its speedups, what its prefix cache saved) may be from
# what C predicts for them and still hold
ENGINE_TOLERANCE = 0.15

# D's two runs together, priced beforehand with the step costs just timed, may take this long:
# past it the outputs shrink (a mixture of experts run eagerly on CUDA: 0.4-0.6 s a step at
# 48 layers, over an hour for the post's requests as they are)
ENGINE_BOUND_S = 120.0


def bounded_lengths(run, lengths, arrival, one_span, spread):
    """D's output lengths within ENGINE_BOUND_S: both policies' runs priced by C's simulation
    with the costs just timed (static one-span, continuous spread), the outputs divided until
    they fit. -> (lengths, divisor, (priced s as given, priced s as run)); a one-line error
    where outputs of a token each would still take longer."""
    n, P = len(lengths), run.engine.engine_prompt_len
    arrival = np.zeros(n) if arrival is None else arrival

    def priced(out):
        req = Requests(arrival, np.full(n, P), out)
        replica = Replica(run.engine.engine_slots, one_span, order=run_order(run, out))
        return sum(float(simulate_serving(req, dataclasses.replace(
            replica, scheduler=policy, costs=costs))["times"].finish.max())
            for policy, costs in (("static", one_span), ("continuous", spread)))
    first = seconds = priced(lengths)
    divisor, shrunk = 1, lengths
    while seconds > ENGINE_BOUND_S:
        if shrunk.max() == 1:
            raise RuntimeError(f"D would take {seconds:.0f} s priced with its step costs even "
                               f"with one-token outputs, past its bound of "
                               f"{ENGINE_BOUND_S:.0f} s: give fewer --engine-requests")
        divisor = max(2 * divisor, math.ceil(divisor * seconds / ENGINE_BOUND_S))
        shrunk = np.maximum(lengths // divisor, 1)
        seconds = priced(shrunk)
    return shrunk, divisor, (first, seconds)


def engine_against_simulation(req, elog, replica, spread, at_zero, spec=None):
    """One policy's engine run (elog) beside the simulation of the same requests on a replica
    priced with the one-span costs, or with the spread ones where the run's rows sat at
    several positions, and on one priced with the run's own passes; both speculating by
    `spec` (a Speculation, its drafts at no cost) where the engine did."""
    several = elog["attention_calls"] > elog["decode_steps"] or elog["padded_decode_steps"]
    if several:
        replica = dataclasses.replace(replica, costs=spread)
    own = dataclasses.replace(replica, costs=fit_passes(elog["passes"],
                                                         {"kind": "pricing_passes"}))
    if spec is not None:
        replica, own = (speculating(r, spec, None) for r in (replica, own))
    sim = simulate_serving(req, replica)
    replay = simulate_serving(req, own)
    passes = np.array(elog["passes"], dtype=np.float64)
    is_prefill = np.zeros(len(passes), bool)
    is_prefill[elog["prefill_passes"]] = True
    decode, prefill = passes[~is_prefill], passes[is_prefill]
    steps, wall, slots = len(elog["t_s"]), elog["wall_s"], replica.slots
    measured = elog["times"]
    t, running = zip(*thin(list(zip(elog["t_s"], elog["running"])), 1000))
    return {
        "wall_s": wall, "output_tokens_per_s": float(req.output.sum()) / wall, "steps": steps,
        "occupancy": sum(elog["running"]) / (steps * slots),
        "prefill_s": elog["prefill_s"], "decode_s": elog["decode_s"],
        "other_s": wall - elog["prefill_s"] - elog["decode_s"] - elog["idle_s"],
        "idle_s": elog["idle_s"], "decode_steps": elog["decode_steps"],
        "verify_steps": elog["verify_steps"],
        "padded_decode_steps": elog["padded_decode_steps"],
        "attention_calls_per_decode": elog["attention_calls"] / max(elog["decode_steps"], 1),
        "predicted": {"wall_s": float(sim["times"].finish.max()), "steps": sim["steps"],
                      "prefill_s": sim["prefill_s"], "decode_s": sim["decode_s"],
                      "cost_model": "spread" if several else "one_span"},
        "steps_check": steps_check(measured, sim["times"]) if at_zero else None,
        "latency": {"measured": latencies(measured), "passes": latencies(replay["times"]),
                    "priced": latencies(sim["times"])},
        # the step costs timed beforehand against the run's own passes (sums by kind)
        "passes_priced": {kind: {"passes": len(p), "measured_s": float(p[:, 2].sum()),
                                 "priced_s": float(sum(replica.costs.pass_s(int(k), v)
                                                       for k, v, _ in p))}
                          for kind, p in (("decode", decode), ("prefill", prefill))},
        "per_request": {"engine_first_step": measured.first_step.tolist(),
                        "engine_finish_step": measured.finish_step.tolist(),
                        "simulated_first_step": sim["times"].first_step,
                        "simulated_finish_step": sim["times"].finish_step,
                        "measured_first_s": measured.first_token.tolist(),
                        "measured_finish_s": measured.finish.tolist(),
                        "passes_first_s": replay["times"].first_token,
                        "passes_finish_s": replay["times"].finish},
        "timeline": {"t_s": t, "running": running},
        "preemptions": elog["preemptions"],  # (on a block pool; C's on as many blocks)
        "preemptions_simulated": sim["kv"]["preemptions"] if "kv" in sim else 0,
        **({"hit_tokens_simulated": sim[PREFIX_REPORT]["hit_tokens"],
            "hits_agree": sum(sim[PREFIX_REPORT]["hits"].get(r) == hit
                              for r, hit in enumerate(elog["hit_tokens"])),
            "readmitted_hit_tokens": elog["readmitted_hit_tokens"],
            "readmitted_hit_tokens_simulated": sim[PREFIX_REPORT]["readmitted_hit_tokens"]}
           if PREFIX_REPORT in sim else {})}


def engine_verdict(D, tolerance=ENGINE_TOLERANCE):
    """What D checked, and whether it held. Steps: every request's first-token and finish
    step equal in the engine and the simulation (when all wait at t=0). Seconds: each policy's
    makespan and TTFT/E2E p50/p90 within `tolerance` of the simulation priced with the run's
    own passes, and of the one priced beforehand. The speedup against the predicted one; when
    it misses, the cost C priced worst: prefill passes, decode passes, or the host work between
    them (not priced at all)."""
    policies = [p for p in ("static", "continuous", "speculative") if p in D]
    checks = [D[p]["steps_check"] for p in policies]
    verdict = {"tolerance": tolerance, "steps_exact": None if None in checks else
               all(c["agree"] == c["requests"] for c in checks)}
    for pricing in ("passes", "priced"):
        offs = [(p, m, D[p]["latency"]["measured"][m] / max(D[p]["latency"][pricing][m], 1e-12)
                 - 1) for p in policies for m in LATENCIES]
        mode, metric, off = max(offs, key=lambda o: abs(o[2]))
        verdict[pricing] = {"checked": len(offs), "within": sum(abs(o[2]) <= tolerance
                                                                for o in offs),
                            "worst": {"mode": mode, "metric": metric, "off": off}}
    if "prefix_check" in D:  # every request's hit and steps as C's (the cache's rules)
        c, steps = D["prefix_check"], D["prefix"]["steps_check"]
        verdict["prefix_exact"] = c["hits_agree"] == c["requests"] and \
            (steps is None or steps["agree"] == steps["requests"]) and \
            c["preemptions"] == c["preemptions_simulated"] and \
            c["readmitted_hit_tokens"] == c["readmitted_hit_tokens_simulated"]
    if "speculation_check" in D:  # speculating against plain: the speedup within tolerance
        verdict["speculation_within"] = D["speculation_check"]["within"]
    measured, predicted = D["speedup_measured"], D["speedup_predicted"]
    off = measured / predicted - 1
    verdict.update(measured=measured, predicted=predicted, off=off,
                   within=abs(off) <= tolerance)
    if not verdict["within"]:
        gaps = []
        for mode in ("static", "continuous"):
            d, p = D[mode], D[mode]["predicted"]
            gaps += [(d["decode_s"], p["decode_s"], mode, "decode"),
                     (d["prefill_s"], p["prefill_s"], mode, "prefill"),
                     (d["other_s"], 0.0, mode, "host")]
        got, priced, mode, part = max(gaps, key=lambda g: abs(g[0] - g[1]))
        verdict.update(mode=mode, part=part, measured_s=got, priced_s=priced)
    return verdict
