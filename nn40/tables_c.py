"""Every experiment's tables: A's and B's, C's (the post's table, the schedulers, the KV cache,
who waits, fleets, capacity) and D's (the engine against the simulation), --catalog; prefix
caching (the hits per tier, TTFT by hit, hits against the cache's capacity), DistServe's runs
replayed and the placements ranked (from the results dictionary alone). TABLES registers
what a run prints, in order.
"""
import math

from nn40.capacity import capacity_choice
from nn40.config import GPUS, REPLICAS_MAX
from nn40.host import fit_lines
from nn40.kv import KV_MANAGERS, PREFIX_REPORT
from nn40.metrics import LATENCIES
from nn40.speculative import DEFAULT_ACCEPTANCE
from nn40.tables import (
    ROOFLINE_COLUMNS, ceilings_moved, cell, chain_text, context_table, describe, fetch,
    kernels_text, latency_columns, machine_warnings, render, roofline_notes, spec_table,
    speed_moved, summary_text, table)
from nn40.text_ko import TEXT


def post_table_text(T, C):
    """The post's table: static vs continuous in steps, and how much one draw says."""
    rows = [[T[p], f"{C[p]['steps']:,}", f"{100 * C[p]['occupancy']:.1f}%"]
            for p in ("static", "continuous")]
    lines = [T["C"].format(**C), "", table(T, rows, ["policy", "steps", "occupancy"]), "",
             T["lengths"].format(speedup=T["speedup"], value=C["speedup"], **C["lengths"])]
    if "seed_spread" in C:
        s = C["seed_spread"]
        lines += ["", T["spread"].format(
            seeds=s["seeds"], static=spread_text(T, s["static_occupancy"], pct=True),
            continuous=spread_text(T, s["continuous_occupancy"], pct=True),
            speedup=spread_text(T, s["speedup"]))]
    return "\n".join(lines)


def spread_text(T, s, pct=False):
    if pct:
        return f"{100 * s['p50']:.1f}% ({100 * s['p10']:.1f}-{100 * s['p90']:.1f}%)"
    return f"{s['p50']:.2f}{T['times']} ({s['p10']:.2f}-{s['p90']:.2f}{T['times']})"


def orders_steps_table(T, C):
    """The post's table in each order of the queue."""
    columns = [("order", "label", "text")] + [
        (f"{p}_{h}", f"{p}.{key}", fmt) for p in ("static", "continuous")
        for h, key, fmt in (("steps", "steps", ","), ("occ", "occupancy", "pct"),
                            ("finish", "mean_finish_step", ",.0f"))] + [
        ("continuous_p99", "continuous.p99_finish_step", ",.0f")]
    rows = [{"label": T["order_" + name], **s} for name, s in C["orders_steps"].items()]
    return "\n".join([T["orders_steps"].format(requests=C["requests"]),
                      spec_table(T, rows, columns)])


def order_text(T, info):
    """--order as a phrase: its name, how good its predictions are, its guard."""
    text = T["order_" + info["name"]]
    if "kendall_tau" in info:
        text += T["queue_predicted"].format(**info)
    if info.get("max_wait_s") is not None:
        text += T["queue_guard"].format(**info)
    return text


SERVING_COLUMNS = [("policy", "label", "text"), ("steps", "steps", ","),
                   ("seconds", "makespan_s", ",.2f"), ("req_s", "throughput_rps", ",.2f"),
                   ("tokens_per_s", "output_tokens_per_s", ",.0f"),
                   ("occupancy", "occupancy", "pct")] + latency_columns("p50", "p99")


def serving_table(T, C):
    """C in seconds: each scheduler's throughput and latency percentiles."""
    rows = [{"label": T[name], **m} for name, m in C["schedulers"].items()]
    goodput = [("goodput", "goodput_rps", ",.2f")] if "goodput_rps" in rows[-1] else []
    lines = [T["C_seconds"].format(requests=C["requests"], source=describe(T, C["source"]),
                                   slots=C["slots"], arrivals=describe(T, C["arrivals"])),
             T["step_costs"].format(pricing=describe(T, C["cost_model"]["source"])),
             T["queue"].format(order=order_text(T, C["order"]))]
    if C.get("share_of", 1) > 1:
        lines.append(T["one_share"].format(replicas=C["share_of"]))
    lines.append(spec_table(T, rows, SERVING_COLUMNS + goodput))
    work = C.get("simulation")
    if work:
        lines.append(T["simulations"].format(
            runs=work["runs"], iterations=work["iterations"], seconds=work["simulation_s"],
            rate=work["iterations"] / max(work["simulation_s"], 1e-9), wall=work["wall_s"],
            jobs=work["jobs"]))
    return "\n".join(lines)


KV_COLUMNS = [("allocation", "allocation", "text"), ("policy", "label", "text"),
              ("req_s", "throughput_rps", ",.2f"), ("concurrency", "concurrency", "text"),
              ("kv_used", "utilization", ".1%"), ("never_used", "fragmentation", ".1%"),
              ("max_allocated", "max_allocated_tokens", ","), ("preempted", "preemptions", ","),
              ("recomputed", "recomputed_tokens", ","),
              (("ttft", "p99", "ms"), "ttft_s.p99", "ms"),
              (("e2e", "p99", "ms"), "e2e_s.p99", "ms")]


def kv_table(T, kv):
    """C's KV-cache study: memory use, concurrency and latency of each policy and scheduler."""
    rows = [{"allocation": T.get(policy, policy), "label": T[name], **m, "concurrency":
             f"{m['peak_concurrency']} / {m['mean_concurrency']:.1f}"}
            for policy in KV_MANAGERS for name, m in kv.get(policy, {}).items()]
    admission = (T["admit_watermark"].format(share=kv["watermark"]) if kv.get("watermark")
                 else T["admit_naive"])
    lines = [T["kv"].format(gb=max(kv["memory_bytes"], 0) / 1e9,
                            memory_source=describe(T, kv["memory_source"]),
                            tokens=kv["budget_tokens"], bytes=kv["bytes_per_token"],
                            max_output=kv["max_output"], block=kv["block_tokens"],
                            admission=admission)] + ([spec_table(T, rows, KV_COLUMNS)]
                                                     if rows else [])
    lines += [T["kv_unfit_row"].format(policy=T.get(policy, policy), why=describe(T, why))
              for policy, why in kv.get("unfit", {}).items()]
    if kv.get("engine_refuses"):
        lines.append(describe(T, kv["engine_refuses"]))
    lines += prefix_tables(T, [row for row in rows if PREFIX_REPORT in row], kv)
    if kv.get("device_check"):
        lines.append(device_check_text(T, kv["device_check"]))
    return "\n".join(lines)


def device_check_text(T, check):
    shape = T["check_shape"].format(rows=check["rows"], tokens=check["row_tokens"],
                                    gb=check["bytes"] / 1e9)
    if "skipped" in check:
        return T["check_skipped"].format(device=check["device"], shape=shape,
                                         reason=describe(T, check["skipped"]))
    clamped = T["check_clamped"].format(n=check["clamped_rows"]) if check["clamped_rows"] else ""
    return T["check"].format(device=check["device"], shape=shape, batch=check["batch"],
                             max_context=check["max_context"], clamped=clamped,
                             ms=check["step_ms"])


WHO_WAITS_COLUMNS = [("order", "label", "text"), ("seconds", "makespan_s", "s"),
                     ("req_s", "throughput_rps", ",.2f")] + \
    latency_columns("mean", "p99", keys=("ttft", "e2e")) + [
                     ("per_token_ms", "normalized_s_per_token", "ms"),
                     ("longest_wait", "max_wait_s", "s")]
BY_LENGTH_COLUMNS = [("order", "label", "text"), ("output_tokens", "bucket", "text"),
                     ("count", "count", ",")] + \
    latency_columns("p50", "p99", keys=("ttft", "e2e")) + [
                     ("per_token_ms", "normalized_s_per_token", "ms"),
                     ("longest_wait", "max_wait_s", "s")]


def who_waits_tables(T, C):
    """Who waits: each order's makespan and latencies, then by output length."""
    w, orders = C["who_waits"], C["orders"]
    kv = T[w["kv_policy"]] if w["kv_policy"] else T["who_waits_kv_none"]
    header = [T["who_waits"].format(requests=w["requests"], slots=w["slots"], kv=kv,
                                    arrivals=describe(T, w["arrivals"])),
              T["who_waits_setup"].format(sigma=w["sigma"], tau=w["kendall_tau"],
                                          guard=w["guard_s"], source=T[w["guard_source"]])]
    rows = [{"label": T["order_" + name], **m} for name, m in orders.items()]
    by_length = [{"label": T["order_" + name], **b, "bucket": T["bucket"].format(
                  name=T["bucket_" + b["bucket"]], **b)}
                 for name, m in orders.items() for b in m["by_length"]]
    return ["\n".join(header + [spec_table(T, rows, WHO_WAITS_COLUMNS)]),
            "\n".join([T["who_waits_by_length"], spec_table(T, by_length, BY_LENGTH_COLUMNS)])]


def fleet_table(T, fleet):
    """C with --replicas: each router's latencies, SLO and balance over the whole load."""
    rows = [{"label": router, **m, "spread": f"{m['balance']['requests_min']:,}-"
             f"{m['balance']['requests_max']:,}"} for router, m in fleet["routers"].items()]
    slo = [("slo_met", "slo_attained", ".1%"), ("goodput", "goodput_rps", ",.2f")] \
        if "slo_attained" in rows[-1] else []
    hits = [("hit_card", "prefix_cache.hit_ratio", ".1%"),
            ("wait_p99", "wait_s.p99", "s")] if PREFIX_REPORT in rows[-1] else []
    columns = [("router", "label", "text"), ("req_s", "throughput_rps", ",.2f")] + \
        latency_columns("p50", "p99") + slo + hits + [
            ("per_replica", "spread", "text"), ("busiest", "balance.busiest_occupancy", ".1%")]
    kv = T[fleet["kv_policy"]] if fleet["kv_policy"] else T["who_waits_kv_none"]
    return "\n".join([T["fleet"].format(replicas=fleet["replicas"], slots=fleet["slots"],
                                        requests=fleet["requests"], kv=kv,
                                        arrivals=describe(T, fleet["arrivals"])),
                      spec_table(T, rows, columns)])


def capacity_text(T, cap):
    """The capacity of one replica at the SLO and, for a target rate, the replicas needed."""
    def rate(value):
        if value == 0:
            return T["capacity_none"]
        return f"{value:,.3g}" if math.isfinite(value) else T["capacity_all"].format(
            rate=max(rate for rate, _ in cap["one_replica"]["tried"]))
    slo = ", ".join(T[key].format(ms=1e3 * cap[f"{key}_s"]) for key in ("slo_ttft", "slo_tpot")
                    if cap[f"{key}_s"])
    one = cap["one_replica"]
    lines = [T["capacity"].format(slo=slo, attainment=cap["attainment"], rate=rate(one["rate_rps"]),
                                  tokens=one["output_tokens_per_s"] if math.isfinite(
                                      one["rate_rps"]) else 0.0, seeds=cap["seeds"],
                                  requests=cap["requests"], low=rate(one["rates_rps"][0]),
                                  high=rate(one["rates_rps"][-1]))]
    if "routers" not in cap:
        return "\n".join(lines)
    rows = [{"label": T["router_plain"].format(router=router) if group == "without_caching"
             else router, **r, "needed": f"{r['replicas']:,}" if r["replicas"] else
             T["too_many"].format(n=REPLICAS_MAX)}
            for group in ("routers", "without_caching")
            for router, r in cap.get(group, {}).items()]
    lines += ["", T["replicas_needed"].format(rate=cap["target_rate"],
                                              requests=cap["fleet_requests"]),
              spec_table(T, rows, [("router", "label", "text"), ("replicas_col", "needed", "text"),
                                   ("attained_col", "attainment", ".1%"),
                                   ("below_col", "below", ".1%")])]
    answer = cap["answer"] if "answer" in cap else capacity_choice(cap)
    if not answer:
        lines.append(T["answer_none"].format(n=REPLICAS_MAX))
    else:
        lines.append(T["answer"].format(
            replicas=counted(T, answer["replicas"], "replica"), router=answer["router"],
            tie=T["answer_tie"] if answer["tie"] else "",
            gpus=counted(T, answer["gpus"], "gpu")))
    return "\n".join(lines + speculating_capacity_text(T, cap, rate))


def speculating_capacity_text(T, cap, rate):
    """With --speculative-config: the same answer with the replicas speculating."""
    spec = cap.get("speculating")
    if not spec:
        return []
    if cap.get("plain_misses"):
        return [T["capacity_spec_only"].format(method=spec["method"], k=spec["k"])]
    if not spec["one_replica_rps"]:
        return [T["capacity_spec_misses"].format(method=spec["method"], k=spec["k"])]
    answer = spec["answer"]
    fleet = "" if "routers" not in cap else T["capacity_spec_none"].format(n=REPLICAS_MAX) \
        if not answer else T["capacity_spec_fleet"].format(
            replicas=counted(T, answer["replicas"], "replica"), router=answer["router"],
            gpus=counted(T, answer["gpus"], "gpu"))
    return [T["capacity_spec"].format(method=spec["method"], k=spec["k"],
                                      rate=rate(spec["one_replica_rps"]), fleet=fleet)]


def serving_text(T, serving):
    """The seats and step budget an answer used, and where they came from."""
    source = serving["source"].split("+")
    return T["serving_limits"].format(slots=serving["slots"], chunk=serving["chunk_tokens"],
                                      source=T["limits_" + source[0]] + "".join(
                                          T[f"limits_{part}_too"] for part in source[1:]))


def counted(T, n, noun):
    """"1 replica", "2 replicas": a count and its noun in T's language."""
    one, many = T["noun_" + noun].split("|")
    return (one if n == 1 else many).format(n=n)


def capacity_answer(T, results):
    """The capacity question answered first, in words, with the workload and limits the
    answer assumes (what a reader changes to ask it of their own deployment)."""
    C, cfg = results["C"], results["config"]
    cap, price = C["capacity"], C["cost_model"]["source"]
    slo = ", ".join(T[key].format(ms=1e3 * cap[f"{key}_s"]) for key in ("slo_ttft", "slo_tpot")
                    if cap[f"{key}_s"])
    one = cap["one_replica"]["rate_rps"]
    name = cfg["model"]["name"]
    fields = {"slo": slo, "attainment": cap["attainment"],
              "model": T["answer_post"] if name == "post" else name,
              "one": f"{one:,.3g}" if math.isfinite(one) else T["capacity_all"].format(
                  rate=max(rate for rate, _ in cap["one_replica"]["tried"]))}
    fields["card"] = price["card"] if price["kind"] == "pricing_card" else describe(T, price)
    answer = (cap["answer"] if "answer" in cap else capacity_choice(cap)) \
        if "routers" in cap else None
    if "routers" not in cap:
        lines = [T["answer_one"].format(**fields)]
    elif not answer:
        lines = [T["answer_fleet_none"].format(rate=cap["target_rate"], n=REPLICAS_MAX, **fields)]
    else:
        lines = [T["answer_fleet"].format(
            rate=cap["target_rate"], router=answer["router"], **fields,
            replicas=counted(T, answer["replicas"], "replica"),
            gpus=counted(T, answer["gpus"], "gpu"))]
    if cap.get("plain_misses"):
        lines.append(T["capacity_spec_only"].format(**cap["speculating"]))
    arrivals = {"kind": "arrivals_poisson" if cfg["burstiness"] == 1 else "arrivals_gamma",
                "rate": 1.0, "burstiness": cfg["burstiness"]}
    lines.append(T["answer_assumes"].format(
        arrivals=T["answer_arrivals_" + arrivals["kind"][9:]].format(**arrivals),
        prompt=C["prompt_tokens"]["p50"], output=C["output_tokens"]["p50"],
        longest=cap.get("longest_output") or C["lengths"]["max"],
        source=describe(T, C["source"]), kv=T[cap["kv_policy"]] if cap["kv_policy"] else "-",
        limits=serving_text(T, cap.get("serving") or {
            "slots": C["slots"], "chunk_tokens": cfg["chunk_tokens"], "source": "post"})))
    return "\n".join(lines)


ENGINE_COLUMNS = [("policy", "label", "text"), ("wall_s", "wall_s", ",.2f"),
                  ("predicted_s", "predicted.wall_s", ",.2f"),
                  ("tokens_per_s", "output_tokens_per_s", ",.0f"), ("steps", "steps", ","),
                  ("occupancy", "occupancy", "pct"), ("prefill_s", "prefill", "text"),
                  ("decode_s", "decode", "text"), ("between_s", "other_s", ",.2f")]


ENGINE_LABELS = {"static": "static", "continuous": "continuous", "speculative": "D_spec_label"}


def engine_table(T, D):
    """D: the engine's measured wall time and its parts beside what C's simulation priced."""
    rows = [{"label": T[label], **d, **{part: f"{d[part + '_s']:,.2f} / "
                                            f"{d['predicted'][part + '_s']:,.2f}"
                                        for part in ("prefill", "decode")}}
            for run, label in (("static", "static"), ("continuous", "continuous"),
                               ("prefix", "D_prefix_label"), ("speculative", "D_spec_label"))
            if run in D
            for d in (D[run],)]
    shrink = D.get("shrink", 1)
    source = T["D_source_shrunk"].format(shrink=shrink) if shrink > 1 else T["D_source"]
    return "\n".join([
        T["D"].format(requests=D["requests"], prompt=D["prompt_tokens"], slots=D["slots"],
                      source=source, order=order_text(T, D["order"]),
                      arrivals=describe(T, D["arrivals"]), **D["lengths"])]
        + ([T["D_cpu"]] if shrink > D.get("bound", {}).get("shrunk_by", 1) else [])
        + ([T["D_bound"].format(**D["bound"])] if D.get("bound", {}).get("shrunk_by", 1) > 1
           else []) + [
        T["D_predicted"].format(pricing=describe(T, D["cost_model"]["source"])),
        spec_table(T, rows, ENGINE_COLUMNS),
        T["attention_calls"].format(static=D["static"]["attention_calls_per_decode"],
                                    continuous=D["continuous"]["attention_calls_per_decode"])
        + (T["attention_padded"].format(padded=D["continuous"]["padded_decode_steps"],
                                        steps=D["continuous"]["decode_steps"])
           if D["continuous"]["padded_decode_steps"] else T["attention_spans"]),
        *kernels_text(T, D),
        *pool_text(T, D),
        "", request_table(T, D), verdict_text(T, D["verdict"])] + prefix_check_text(T, D)
        + speculation_check_text(T, D) + engine_machine_text(T, D))


def pool_text(T, D):
    """D's continuous run on a block pool of --kv-tokens: its preemptions and C's."""
    if not D.get("kv_tokens"):
        return []
    return [T["D_pool"].format(tokens=D["kv_tokens"], **D["continuous"])]


def prefix_check_text(T, D):
    """D's prefix cache against the plain continuous run and against C's PrefixCache."""
    if "prefix_check" not in D:
        return []
    c, steps = D["prefix_check"], D["prefix"]["steps_check"]
    text = T["D_prefix"].format(
        **c, identical=T["yes" if c["tokens_identical"] else "no"],
        steps=T["D_steps_count"].format(**steps) if steps else T["not_checked"],
        hit_simulated=c["hit_tokens_simulated"] or 0)
    if c["off"] is not None:
        text += T["D_prefix_within" if c["within"] else "D_prefix_outside"].format(**c)
    if c.get("preemptions") or c.get("preemptions_simulated"):
        text += T["D_prefix_preempted"].format(**c)
    return [text]


def speculation_check_text(T, D):
    """D speculating against the plain continuous run and against C's simulation of it."""
    if "speculation_check" not in D:
        return []
    c, steps = D["speculation_check"], D["speculative"]["steps_check"]
    return [T["D_spec"].format(**{**c, "rates": ", ".join(f"{a:.2f}" for a in c["rates"])},
                               steps=T["D_steps_count"].format(**steps) if steps
                               else T["not_checked"])
            + T["D_prefix_within" if c["within"] else "D_prefix_outside"].format(**c)]


def engine_machine_text(T, D):
    """Whether the machine's speed held between D's pricing and its run (its ceilings
    measured on either side of D)."""
    if "machine" not in D:
        return []
    change = ceilings_moved(D["machine"]["before"], D["machine"]["after"])
    held = not speed_moved(D["machine"]["before"], D["machine"]["after"])
    return [T["verdict_machine_held" if held else "verdict_machine_moved"].format(**change)]


REQUEST_COLUMNS = [("policy", "label", "text"), ("latency", "latency", "text"),
                   ("measured_col", "measured", "text"), ("passes_col", "passes.s", "text"),
                   ("off_col", "passes.off", "+.0%"), ("priced_col", "priced.s", "text"),
                   ("off_col", "priced.off", "+.0%")]


def request_table(T, D):
    """D request by request: steps, then latencies measured against the two predictions."""
    rows, lines = [], [T["D_requests"]]
    policies = [p for p in ENGINE_LABELS if p in D]
    for policy in policies:
        lat = D[policy]["latency"]
        for metric in LATENCIES:
            m, unit = lat["measured"][metric], "s" if metric == "makespan_s" else "ms"
            rows.append({"label": T[ENGINE_LABELS[policy]],
                         "latency": f"{T['lat_' + metric]} {T['unit_' + unit]}",
                         "measured": render(m, unit), **{
                pricing: {"s": render(lat[pricing][metric], unit),
                          "off": m / max(lat[pricing][metric], 1e-12) - 1}
                for pricing in ("passes", "priced")}})
    lines.append(spec_table(T, rows, REQUEST_COLUMNS))
    checks = {p: D[p]["steps_check"] for p in ("static", "continuous")}
    if None in checks.values():
        lines.append(T["D_steps_arrivals"])
    else:
        text = T["D_steps"].format(**{p: T["D_steps_count"].format(**c)
                                      for p, c in checks.items()})
        wrong = [(p, c["first_mismatch"]) for p, c in checks.items() if "first_mismatch" in c]
        if "speculative" in D and D["speculative"]["steps_check"]:
            text += T["D_steps_spec"].format(
                speculative=T["D_steps_count"].format(**D["speculative"]["steps_check"]))
            if "first_mismatch" in D["speculative"]["steps_check"]:
                wrong.append(("speculative", D["speculative"]["steps_check"]["first_mismatch"]))
        if wrong:
            policy, first = wrong[0]
            text += T["D_steps_mismatch"].format(policy=T[ENGINE_LABELS[policy]], **first)
        lines.append(text)
    for policy in policies:
        p = D[policy]["passes_priced"]
        lines.append(T["D_passes"].format(
            policy=T[ENGINE_LABELS[policy]], n_decode=p["decode"]["passes"],
            n_prefill=p["prefill"]["passes"],
            **{kind: p[kind]["priced_s"] / max(p[kind]["measured_s"], 1e-12) - 1
               for kind in ("decode", "prefill")}))
    return "\n".join(lines)


def verdict_text(T, v):
    """The verdict: steps exact, seconds within the tolerance, the speedup."""
    answer = {True: "yes", False: "no", None: "not_checked"}[v["steps_exact"]]
    worst = v["priced"]["worst"]
    text = T["verdict_steps"].format(answer=T[answer])
    if "prefix_exact" in v:
        text += T["verdict_prefix"].format(answer=T["yes" if v["prefix_exact"] else "no"])
    if "speculation_within" in v:
        text += T["verdict_spec"].format(tolerance=v["tolerance"],
                                         answer=T["yes" if v["speculation_within"] else "no"])
    text += T["verdict_seconds"].format(
        tolerance=v["tolerance"], checked=v["passes"]["checked"], passes=v["passes"]["within"],
        priced=v["priced"]["within"], mode=T[ENGINE_LABELS[worst["mode"]]],
        metric=T["lat_" + worst["metric"]],
        off=worst["off"])
    speedup = T["verdict"].format(speedup=T["speedup"], **v)
    if v["within"]:
        return text + "\n" + speedup + T["verdict_within"].format(**v)
    return text + "\n" + speedup + T["verdict_outside"].format(
        tolerance=v["tolerance"], mode=T[v["mode"]], part=T["part_" + v["part"]],
        measured_s=v["measured_s"], priced_s=v["priced_s"])


def catalog_table(T, cat):
    """--catalog: every named model on every named card."""
    b = cat["batch"]
    rows = [{**r, "card": GPUS[r["gpu"]].name, **{key: T["no_fit"] if r[key] is None else
                                                  f"{r[key]:,.2f}"
                                                  for key in ("decode_b1_ms", f"decode_b{b}_ms")}}
            for r in cat["rows"]]
    p = cat["profile"]
    rule = p["rules"] + ("_given" if p["rules"] == "sglang" and p["kv_fraction"] else "")
    kv = T["catalog_kv_" + rule].format(**{**cat, **p})
    header = T["catalog"].format(**cat, **p, kv=kv, step_us=p["step_s"] * 1e6,
                                 layer_us=p["layer_s"] * 1e6)
    return "\n".join([header, spec_table(T, rows, [
        ("model_col", "model", "text"), ("card_col", "card", "text"),
        ("weights_gb", "weights_gb", ",.2f"), ("kv_per_token", "kv_bytes_per_token", ","),
        ("kv_fit", "kv_tokens", ","), ("crossover_col", "crossover_batch", ","),
        ("decode_b1", "decode_b1_ms", "text"), ("decode_bn", f"decode_b{b}_ms", "text")],
        batch=b)])


def engine_run_table(T, E):
    """C beside a real engine's measured run: latencies at p50/p90/p99, and C's errors,
    under each scheduler."""
    columns = latency_columns("p50", "p90", "p99")
    rows = [[T["engine_measured"]] + [render(fetch(E["measured"], path), fmt)
                                       for _, path, fmt in columns]]
    for label, sim in E["simulated"].items():
        rows.append([T["engine_simulated"].format(label=label)] + [
            render(fetch(sim, path), fmt) for _, path, fmt in columns])
        rows.append([T["engine_error"]] + [render(fetch(sim["error"], path), "spct")
                                           for _, path, _ in columns])
    settings = ", ".join(f"{k} {v:,}" if isinstance(v, int) else f"{k} {v}"
                         for k, v in E["settings"].items()) or "-"
    cached = E["settings"].get("prefix_caching") == "on"
    return "\n".join([T["engine_run"].format(settings=settings, **{
        k: "-" if v is None else f"{v:,}" if isinstance(v, int) else v
        for k, v in E["run"].items()}),
        table(T, rows, ["run_col"] + [h for h, _, _ in columns])] +
        ([T["replay_cached"].format(runs=T["engine_measured"])] if cached else []))


VALIDATION_COLUMNS = [("role_col", "role", "text"), ("source_col", "source", "text"),
                      ("rows_col", "rows", ","), ("median_abs_col", "median_abs", "pct"),
                      ("median_col", "median", "spct"), ("max_abs_col", "max_abs", "pct"),
                      ("within_col", "within_15", "pct")]
WORST_COLUMNS = [("role_col", "role", "text"), ("model_col", "model", "text"),
                 ("card_col", "gpu", "text"), ("tp_col", "tp", ","),
                 ("weights_col", "weights", "text"), ("lengths_col", "lengths", "text"),
                 ("metric_col", "metric", "text"), ("published_col", "value", ",.1f"),
                 ("predicted_col", "predicted", ",.1f"), ("error_col", "error", "spct")]


def validation_tables(T, V, worst=12):
    """--validate: errors by source (calibration and validation apart), the worst rows, and
    what C could not express."""
    rows = [{**r, "lengths": f"{r['batch']} x {r['isl']}/{r['osl']}"} for r in V["rows"]
            if r["error"] is not None]
    rows.sort(key=lambda r: -abs(r["error"]))
    profiles = "; ".join(f"{k}: {p['fitted_on']}" for k, p in V["profiles"].items())
    left = ", ".join(f"{n} ({why})" for why, n in V["left_out"].items()) or "-"
    return "\n".join([T["validation"].format(profiles=profiles, **V["files"]),
                      spec_table(T, V["summary"], VALIDATION_COLUMNS),
                      T["validation_worst"].format(n=worst),
                      spec_table(T, rows[:worst], WORST_COLUMNS),
                      T["validation_left"].format(left=left)])


def a_tables(T, results):
    """A's table at its context (with MoE's columns where the model has experts), its notes
    and kernels, and the context table where A ran several."""
    A = results["A"]
    cols = [("mode", "s"), ("batch", "d"), ("step_ms", ".3f"), ("tokens_per_s", ",.0f"),
            ("throughput_vs_1", ".1f"), ("wait_vs_1", ".2f")] + ROOFLINE_COLUMNS
    if results["config"]["model"].get("experts"):  # (measured, and the routing's law)
        cols += [("experts_touched", ".1f"), ("experts_expected", ".1f"),
                 ("bytes_vs_1", ".2f"), ("dense_twin_ms", ".3f")]
    shown = [r for r in A["rows"] if r["context"] == A["context"]]
    rows = [[cell(T, r, k, f) for k, f in cols] for r in shown]
    post = results["config"]["model"].get("arch") == "post"
    out = [T["A_post" if post else "A"].format(**A), "\n".join(
        [table(T, rows, [k for k, _ in cols])] + roofline_notes(T, results, shown)
        + kernels_text(T, A))]
    if len(A["contexts"]) > 1:  # (its starred cells' note under it)
        few = [T["few_reps"].format(budget=results["config"]["time_budget_s"])] \
            if any(r.get("few_reps") for r in A["rows"]) else []
        out += [T["A_contexts"].format(mode=T[A["modes"][-1]]),
                "\n".join([context_table(T, A)] + few)]
    return out


def b_tables(T, results):
    """B's table of prefill against decode, its notes and kernels, and the chain's text."""
    cols = [("mode", "s"), ("step_ms", ".3f"), ("us_per_token", ".1f"), ("tflops", ".2f"),
            ("intensity", ".1f")] + ROOFLINE_COLUMNS
    rows = [[T[r["phase"]].format(**r)] + [cell(T, r, k, f) for k, f in cols]
            for r in results["B"]["rows"]]
    return [T["B"], "\n".join([table(T, rows, ["row"] + [k for k, _ in cols])]
                              + roofline_notes(T, results, results["B"]["rows"])
                              + kernels_text(T, results["B"])), chain_text(T, results["B"])]


def post_tables(T, results):
    """The post's table, and the queue orders' steps where C ran them."""
    C = results["C"]
    return [post_table_text(T, C)] + ([orders_steps_table(T, C)] if "orders_steps" in C else [])


# the tables printed, in order: (the path of results.json keys each needs, what renders it:
# (T, results) -> its texts); the capacity answer (the question asked) first
TABLES = [(("C", "capacity"), lambda T, R: [capacity_answer(T, R)]),
          (("A",), a_tables),
          (("B",), b_tables),
          (("C", "static"), post_tables),
          (("C",), lambda T, R: [serving_table(T, R["C"])]),
          (("C", "kv"), lambda T, R: [kv_table(T, R["C"]["kv"])]),
          (("C", "engine_run"), lambda T, R: [engine_run_table(T, R["C"]["engine_run"])]),
          (("C", "orders"), lambda T, R: who_waits_tables(T, R["C"])),
          (("C", "replicas"), lambda T, R: [fleet_table(T, R["C"]["replicas"])]),
          (("C", "placement"), lambda T, R: [pools_text(T, R["C"]["placement"])]),
          (("C", "placements"), lambda T, R: [placements_text(T, R["C"]["placements"])]),
          (("C", "speculation"), lambda T, R: [speculation_text(T, R["C"]["speculation"])]),
          (("C", "capacity"), lambda T, R: [capacity_text(T, R["C"]["capacity"])]),
          (("C", "prefix_study"), lambda T, R: [prefix_study_text(
              T, R["C"]["prefix_study"], R["C"].get("capacity"))]),
          (("D",), lambda T, R: [engine_table(T, R["D"])])]


def has(results, path):
    """Whether results holds the nested keys of path."""
    for key in path:
        if not isinstance(results, dict) or key not in results:
            return False
        results = results[key]
    return True


def format_tables(results, lang="en"):
    """The tables of every finished experiment (TABLES, in order), the summary and the
    machine's warnings, as one string."""
    T = TEXT[lang]
    out = [text for path, tables in TABLES if has(results, path) for text in tables(T, results)]
    out += [text for text in (summary_text(T, results),) if text]
    warnings = machine_warnings(results)
    if warnings:
        out.append("\n".join(describe(T, w) for w in warnings))
    return fit_lines("\n\n".join(out))


# tables of prefix caching and disaggregated serving: the hits per tier, TTFT by hit, hits
# against the cache's capacity; DistServe's runs replayed, and the placements ranked


PREFIX_COLUMNS = [("policy", "label", "text"), ("queried", "prefix_cache.queried_tokens", ","),
                  ("hit_card", "prefix_cache.card_hit_ratio", ".1%"),
                  ("hit_host", "prefix_cache.host_hit_ratio", ".1%"),
                  ("prefill_computed", "prefix_cache.prefill_tokens_computed", ","),
                  ("prefill_saved", "prefix_cache.prefill_tokens_saved", ","),
                  ("evicted", "prefix_cache.evicted_blocks", ",")]
DISK_COLUMN = ("hit_disk", "prefix_cache.disk_hit_ratio", ".1%")  # (with a disk tier)
LOAD_COLUMN = ("load_wait", "prefix_cache.host_load_s", ",.1f")  # (with a host tier: the
# seconds requests waited, parked, for their loads)
HIT_COLUMNS = [("policy", "label", "text"), ("found_cached", "bucket", "text"),
               ("count", "requests", ",")] + latency_columns("p50", "p99", keys=("ttft",))


def prefix_tables(T, rows, kv):
    """The prefix cache's hits per tier and the prefill they saved, then TTFT by how much of
    its prompt a request found cached (none, up to half, over half)."""
    if not rows:
        return []
    host = T["prefix_host"].format(gb=kv["host_bytes"] / 1e9, tokens=kv["host_tokens"],
                                   gbs=kv["host_link_gbs"], link=kv["host_link"],
                                   write=kv["host_write"], share=kv["host_load_share"]) \
        if kv.get("host_tokens") else T["prefix_no_host"]
    columns = PREFIX_COLUMNS + ([LOAD_COLUMN] if kv.get("host_tokens") else [])
    if kv.get("host_tokens") and kv.get("disk_tokens"):
        host += T["prefix_disk"].format(gb=kv["disk_bytes"] / 1e9, tokens=kv["disk_tokens"],
                                        gbs=kv["disk_gbs"], write=kv["host_write"]) + \
            (T["prefix_prefetch"] if kv.get("disk_prefetch") else "")
        columns = columns[:4] + [DISK_COLUMN] + columns[4:]
    by_hit = [{"label": row["label"], **b, "bucket": T[b["bucket"]]}
              for row in rows for b in row[PREFIX_REPORT]["ttft_by_hit"] if b["requests"]]
    return ["", T["prefix_cache"].format(host=host), spec_table(T, rows, columns),
            T["prefix_by_hit"], spec_table(T, by_hit, HIT_COLUMNS)]


PREFIX_STUDY_COLUMNS = [("tier", "label", "text"), ("capacity_col", "capacity", "text"),
                        ("hit_card", "card_hit_ratio", ".1%"),
                        ("hit_host", "host_hit_ratio", ".1%")] + \
    latency_columns("p50", "p99", keys=("ttft",))
STUDY_DISK_COLUMN = ("hit_disk", "disk_hit_ratio", ".1%")  # (with a disk tier)


def prefix_study_text(T, study, capacity):
    """--prefix-study: hits and TTFT against the cache's capacity, per tier; with an SLO, one
    replica's capacity with and without caching."""
    disk = study.get("disk_tokens")
    rows = [{"label": T["tier_card_host_disk" if disk and tier == "card_host" else
                        "tier_" + tier], **row, "capacity": T["unlimited"] if row["share"] is None
             else f"{row['capacity_tokens']:,}"}
            for tier in ("card", "card_host", "unlimited", "optimum") for row in study.get(tier, ())]
    columns = PREFIX_STUDY_COLUMNS[:4] + [STUDY_DISK_COLUMN] + PREFIX_STUDY_COLUMNS[4:] \
        if disk else PREFIX_STUDY_COLUMNS
    lines = [T["prefix_study"].format(tokens=study["budget_tokens"], host=study["host_tokens"],
                                      link=study["host_link"], gbs=study["host_link_gbs"]) +
             (T["prefix_study_disk"].format(tokens=disk) if disk else ""),
             spec_table(T, rows, columns)]
    if capacity and "capacity_without_caching_rps" in study:
        lines.append(T["prefix_capacity"].format(
            cached=capacity["one_replica"]["rate_rps"],
            plain=study["capacity_without_caching_rps"]))
    return "\n".join(lines)


DISTSERVE_COLUMNS = [("file_col", "file", "text"), ("placement_col", "placement", "text"),
                     ("who_col", "who", "text"), ("slo_col", "slo_attained", "pct")] + \
    latency_columns("p50", "p90", keys=("ttft", "tpot"))


def distserve_table(T, R):
    """--replay-distserve: each log's measured row, then C's."""
    rows = [{**r[side], "file": r["file"], "placement": r["placement"], "who": T[side]}
            for r in R["rows"] for side in ("measured", "simulated")]
    return "\n".join([T["distserve_replay"].format(profiles=R["profiles"]),
                      spec_table(T, rows, DISTSERVE_COLUMNS)])


POOLS_COLUMNS = [("kind_col", "kind", "text"), ("req_s", "throughput_rps", ",.2f")] + \
    latency_columns("p50", "p99", keys=("ttft", "tpot")) + \
    latency_columns("p50", "p99", keys=("e2e",), unit="s")
POOL_COLUMNS = [("kind_col", "kind", "text"), ("pool_col", "role", "text"),
                ("replicas_col", "replicas", ","), ("busy_col", "busy", "pct"),
                ("wait_col", "wait", "s")]


def pools_text(T, P):
    """C with a prefill and a decode pool: both placements' latencies (and SLO, goodput per
    card), each pool's replicas busy and its queue, and what crossed the KV link."""
    rows = [{**P[kind], "kind": T["kind_" + kind]} for kind in ("disaggregated", "colocated")]
    columns = POOLS_COLUMNS + ([("slo_met", "slo_attained", "pct"),
                                ("per_gpu_col", "goodput_per_gpu", ",.3f")]
                               if rows[0]["slo_attained"] is not None else []) + (
        [("hit_card", "prefix_cache.hit_ratio", ".1%")] if PREFIX_REPORT in rows[0] else [])
    pools = [{"kind": T["kind_" + kind], "role": role, **pool,
              "wait": P[kind]["wait_s"]["p90"] if i == 0 else
              P[kind].get("back_pressure", {}).get("mean_wait_s")}
             for kind in ("disaggregated", "colocated")
             for i, (role, pool) in enumerate(P[kind]["pools"].items())]
    link, sent = P["link"], P["disaggregated"]["kv_transfer"]
    return "\n".join([
        T["pools"].format(requests=P["requests"], gpus=P["gpus"],
                          colocated_gpus=P["colocated"]["gpus"],
                          disaggregated=P["disaggregated"]["placement"],
                          colocated=P["colocated"]["placement"]),
        spec_table(T, rows, columns), "", spec_table(T, pools, POOL_COLUMNS),
        T["pools_kv"].format(gb=sent["bytes"] / 1e9, sends=sent["sends"],
                             ms=1e3 * sent["mean_s"], link=link["name"], gbs=link["gbs"],
                             us=link["latency_us"],
                             waited=P["disaggregated"]["back_pressure"]["waited"],
                             wait_s=P["disaggregated"]["back_pressure"]["wait_s"])])


CHEAPEST_COLUMNS = [("kind_col", "kind", "text"), ("placement_col", "placement", "text"),
                    ("gpus_col", "gpus", "d"), ("slo_met", "attainment", "pct"),
                    ("simulations_col", "simulations", "d"), ("search_col", "search_s", ".2f"),
                    ("rule_col", "rule", "text")]


def placements_text(T, R):
    """The cheapest placement of each kind for the target rate: every shape's search, the
    answer and the other kind's best beside it, and the rate-matching rule's counts."""
    slo = ", ".join(T[key].format(ms=1e3 * R[f"{key}_s"]) for key in ("slo_ttft", "slo_tpot")
                    if R[f"{key}_s"])
    rows = [{**r, "kind": T["kind_" + r["kind"]], "placement": r["placement"] or
             T["placement_skipped" if r["skipped"] else "placement_none"].format(
                 shapes=r["label"]), "rule": "{prefill_replicas} + {decode_replicas}".format(
                 **r["rate_matching"]) if "rate_matching" in r else ""} for r in R["rows"]]
    lines = [T["placements"].format(rate=R["target_rate"], slo=slo, attainment=R["attainment"],
                                    requests=R["requests"]),
             spec_table(T, rows, CHEAPEST_COLUMNS),
             T["placements_timing"].format(
                 **R, where=T["on_dask" if R["cluster"] else "on_workers"].format(**R),
                 each_ms=1e3 * R["simulation_s"] / max(R["simulations"], 1))]
    best = R["best"]
    if not best:
        return "\n".join(lines + [T["placements_none"]])
    win = best[R["answer"]]
    other = next((r for kind, r in best.items() if kind != R["answer"]), None)
    lines.append(T["placements_answer"].format(**{**win, "kind": T["kind_" + win["kind"]],
                                                  "cards": counted(T, win["gpus"], "gpu")}))
    lines.append(T["placements_other"].format(**{**other, "kind": T["kind_" + other["kind"]],
                                                 "more": other["gpus"] - win["gpus"],
                                                 "cards": counted(T, other["gpus"], "gpu")})
                 if other else T["placements_other_none"])
    pair = best.get("disaggregated")
    if pair:
        rule = pair["rate_matching"]
        lines.append(T["rate_matching"].format(**rule, ms=1e3 * rule["step_s"]))
    return "\n".join(lines)


PLACEMENT_COLUMNS = [("placement_col", "placement", "text"), ("gpus_col", "gpus", "d"),
                     ("goodput_col", "goodput_rps", ",.2f"),
                     ("per_gpu_col", "goodput_per_gpu", ",.3f"),
                     ("simulations_col", "simulations", "d"), ("search_col", "search_s", ".2f")]


def placement_table(T, R):
    """--placement-search: every placement, best first, and the best of each kind."""
    best = ", ".join(f"{kind}: {r['placement']}" for kind, r in R["best"].items())
    where = T["on_dask" if R["cluster"] else "on_workers"].format(**R)
    timing = T["placement_timing"].format(where=where, **R, **{
        f"{k}_ms": v * 1e3 for k, v in R["simulation_s"].items()})
    return "\n".join([T["placement_search"].format(**R), timing,
                      spec_table(T, R["rows"], PLACEMENT_COLUMNS),
                      T["placement_best"].format(best=best)])


# speculative decoding: the speculating replica beside the plain one, and the speedup by load

SPECULATION_COLUMNS = [("policy", "label", "text"), ("steps", "steps", ","),
                       ("tokens_per_s", "output_tokens_per_s", ",.0f")] + \
    latency_columns("p50", "p99") + latency_columns("mean", keys=("itl",))


def speculation_law_text(T, S):
    """Where the acceptance comes from: given (per position, one rate, a mean length), or the
    method's published default."""
    if S["law"] in DEFAULT_ACCEPTANCE:
        return T["spec_law_default"].format(source=DEFAULT_ACCEPTANCE[S["law"]][1])
    return T["spec_law_" + S["law"]]


def speculation_text(T, S):
    """--speculative-config: the speculating replica beside the plain one at the run's
    arrivals, then the speedup (plain TPOT p50 over speculating) at each concurrency for
    k = 1..K, the concurrency from which each k stops paying, and the best k."""
    from tabulate import tabulate
    draft = T["spec_draft"].format(model=S["draft"]["model"], k=S["k"]) if S["draft"] else \
        T["spec_no_draft"]
    head = T["spec_head"].format(method=S["method"], k=S["k"], length=S["acceptance_length"],
                                 rates=", ".join(f"{a:.3f}" for a in S["rates"]),
                                 law=speculation_law_text(T, S), draft=draft,
                                 lookahead=S["lookahead_tokens"],
                                 kv=T[S["kv_policy"]] if S["kv_policy"] else T["unlimited"])
    if S["speedup"] is None:  # (every answer one token: the prefill emits it, no decode)
        return "\n".join([head, T["spec_nothing"]])
    lines = [head, spec_table(T, [{"label": T["spec_plain"], **S["plain"]},
                                  {"label": T["spec_run"], **S["speculative"]}],
                              SPECULATION_COLUMNS),
             T["spec_speedup"].format(x=S["speedup"]), "", T["spec_by_concurrency"]]
    memory = S.get("memory")
    if S["draft"] and memory:
        lines.insert(1, T["spec_memory"].format(
            weights=memory["weight_bytes"] / 2**30, kv=memory["kv_bytes_per_token"],
            **{key: f"{n:,.0f}" if n is not None else T["unlimited"]
               for key, n in zip(("plain", "spec"), memory["kv_tokens"])}))
    rows = [[f"{row['concurrency']:,}", f"{1e3 * row['plain']['tpot_s']['p50']:,.1f}"] +
            [f"{s['speedup']:.2f}x" for s in row["k"]] + [best["k"]]
            for row, best in zip(S["concurrency"], S["crossover"]["best_k"])]
    lines.append(tabulate(rows, [T["spec_concurrency"], T["spec_plain_tpot"]] +
                          [T["spec_k"].format(k=s["k"]) for s in S["concurrency"][0]["k"]] +
                          [T["spec_best"]], stralign="right", disable_numparse=True))
    lines.append(T["spec_crossover"].format(each="; ".join(
        T["spec_k"].format(k=c["k"]) + ": " + (T["spec_below_at"].format(
            load=f"{c['concurrency']:,}") if c["found"] else T["spec_pays"])
        for c in S["crossover"]["below_one"])))
    return "\n".join(lines)
