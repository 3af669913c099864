"""Tables: the renderer and its pieces, the banner's lines and the summary's claims (from the
results dictionary alone)

Every line printed comes from TEXT (text.py and text_ko.py), one table of strings per
language; a description stored in results.json as a dict with a "kind" names its template
there. Each experiment's tables are in tables_c.py.
"""
from nn40.host import OUTPUT_WIDTH, busy, columns, fit_lines
from nn40.pricing import measured


# A step that reaches under this share of both ceilings is bound by neither. On a GPU that is
# kernel launches and host work (eager decode on a fast card): "launch". On a CPU, "overhead":
# a matmul library far from its best at the shape (small batches on some chips), and host work.
LAUNCH_BOUND_SHARE = 0.25


def describe(T, what):
    """A description from results.json (a dict naming its template in "kind") in T's
    language; a plain string as it is."""
    if not isinstance(what, dict):
        return str(what)
    return T[what["kind"]].format(**{k: T[v] if k == "mode" else describe(T, v) if isinstance(
        v, dict) and "kind" in v else v for k, v in what.items()})


def cell(T, row, key, fmt):
    if key == "step_ms" and "skipped" in row:
        return describe(T, row["skipped"])
    if key == "mode" and "graph_failed" in row:
        return T["graph_failed"]
    if key in ("mode", "bound") and key in row:
        return T[row[key]]
    if key in row.get("above_ceiling", ()):
        return T["above_ceiling"]
    text = format(row[key], fmt) if key in row else ""
    return text + "*" if key == "step_ms" and row.get("few_reps") else text


def roofline_notes(T, results, rows):
    """The lines under A's or B's table that say what its marks and labels mean."""
    lines = []
    if any(r.get("few_reps") for r in rows):
        lines.append(T["few_reps"].format(budget=results["config"]["time_budget_s"]))
    if any("above_ceiling" in r for r in rows):
        lines.append(T["above_ceiling_note"])
    for bound in ("launch", "overhead"):
        if any(r.get("bound") == bound for r in rows):
            lines.append(T[bound + "_note"].format(share=LAUNCH_BOUND_SHARE))
    return lines


ROOFLINE_COLUMNS = [("gbs", ",.1f"), ("mbu", ".0%"), ("mfu", ".1%"), ("bound", "s")]


def table(T, rows, headers, **fields):
    """Rows under the headers named (TEXT keys, formatted with `fields`, or a metric's
    (metric, statistic, unit)), right-aligned; wider than OUTPUT_WIDTH, split into tables of
    the columns that fit, each led by the row's labels (its leading columns of words)."""
    from tabulate import tabulate
    heads = [header_text(T, h).format(**fields) for h in headers]
    rows = [list(map(str, r)) for r in rows]
    labels = next((i for i in range(len(heads)) if not all(any(c.isalpha() for c in r[i])
                                                           for r in rows)), len(heads))
    labels = min(max(labels, 1), len(heads) - 1)

    def render(start, end):
        cols = list(range(labels)) + list(range(start, end))
        return tabulate([[r[i] for i in cols] for r in rows], [heads[i] for i in cols],
                        stralign="right", disable_numparse=True)

    def fits(start, end):  # (as rendered: tabulate pads each header by two)
        return max(map(columns, render(start, end).split("\n"))) <= OUTPUT_WIDTH
    parts, start = [], labels
    while start < len(heads) or not parts:
        end = start + 1
        while end < len(heads) and fits(start, end + 1):
            end += 1
        parts.append(render(start, end))
        start = end
    return "\n\n".join(parts)


def header_text(T, header):
    if isinstance(header, tuple):  # a metric at a statistic, in a unit: "TTFT p99 ms"
        return " ".join(T[f"{kind}_{name}"] for kind, name in zip(("metric", "stat", "unit"),
                                                                  header))
    return T[header]


# A table column: (its header's TEXT key, a dotted path into the row, a format). A format is
# a format() spec or a unit below, the one place where units are converted for the tables.
UNITS = {
    "ms": lambda v: f"{1e3 * v:,.1f}",           # seconds shown in milliseconds
    "pct": lambda v: f"{100 * v:.1f}%",          # a share in per cent
    "spct": lambda v: f"{100 * v:+.1f}%",        # a signed error in per cent
    "s": lambda v: f"{v:,.2f}" if v >= 1 else f"{v:.3f}",  # seconds, to 3 figures below 1
    "text": str,                                 # a cell already written
}


def fetch(row, path):
    for key in path.split("."):
        row = row[key]
    return row


def render(value, fmt):
    """One cell: "-" where there is no value."""
    if value is None:
        return "-"
    return UNITS[fmt](value) if fmt in UNITS else format(value, fmt)


def spec_table(T, rows, specs, **fields):
    """Rows (dicts) under column specs [(header key, path, format)]."""
    return table(T, [[render(fetch(r, path), fmt) for _, path, fmt in specs] for r in rows],
                 [header for header, _, _ in specs], **fields)


def latency_columns(*stats, keys=("ttft", "tpot", "e2e"), unit="ms"):
    """TTFT, TPOT and E2E at each statistic, in ms (or seconds: unit "s")."""
    return [((k, p, unit), f"{k}_s.{p}", unit) for k in keys for p in stats]


def kernels_text(T, experiment):
    """The attention backends allowed and the kernels that ran (none for the post's proxy)."""
    if not experiment.get("kernels"):
        return []
    return [T["kernels"].format(backends=", ".join(experiment["sdpa_backends"]),
                                kernels=", ".join(experiment["kernels"]))]


def context_table(T, A):
    """Decode step ms by batch (rows) and context (columns), in the fastest mode measured."""
    from tabulate import tabulate
    mode = A["modes"][-1]
    by_key = {(r["batch"], r["context"]): r for r in A["rows"] if r["mode"] == mode}
    batches = sorted({r["batch"] for r in A["rows"]})
    rows = [[b] + [cell(T, by_key[b, c], "step_ms", ".3f") for c in A["contexts"]]
            for b in batches]
    crossover = ", ".join(T["crossover_at"].format(batch=b, context=c)
                          for c, b in A["kv_crossover_batch"].items())
    return (tabulate(rows, [T["batch"]] + [T["ctx_ms"].format(context=c) for c in A["contexts"]],
                     stralign="right")
            + "\n" + T["crossover"].format(batches=crossover))


def chain_text(T, B):
    """How close decode at batch 1 comes to a bare chain of its own matmuls."""
    lines = []
    for chain in B["linear_chain"]:
        decode = next((r for r in measured(B["rows"]) if r["phase"] == "decode"
                       and r["batch"] == 1 and r["mode"] == chain["mode"]), None)
        text = T["chain"].format(mb=chain["bytes"] / 1e6, mode=T[chain["mode"]],
                                 ms=chain["step_ms"], gbs=chain["gbs"])
        if decode:
            text += T["chain_decode"].format(gbs=decode["gbs"], share=decode["gbs"] / chain["gbs"])
        lines.append(text)
    return "\n".join(lines)


# Ceilings measured again that moved: a busy machine slows copies and matmuls alike, so both
# moving the same way by more than CEILINGS_MOVED (a CPU load that halves the machine's speed
# moves them 70-80%), or one alone by more than CEILING_MOVED_ALONE. One alone within that is
# the measurement's own spread: on a quiet 2-core VM one ceiling moved 31% while the other
# moved 12% between a run's start and its end.
CEILINGS_MOVED = 0.25
CEILING_MOVED_ALONE = 0.5

RIDGE_MIN = 1.0  # FLOP/byte: a matmul slower than a copy of its bytes, which no quiet chip is


def moved(before, after):
    """How far each ceiling moved between two measurements, as a signed share."""
    return {k: after[k] / before[k] - 1 for k in ("bandwidth_gbs", "matmul_tflops")
            if before[k] > 0}


def speed_moved(before, after):
    """Whether the machine's speed moved between two measurements of its ceilings."""
    change = list(moved(before, after).values())
    together = len(change) == 2 and (change[0] > 0) == (change[1] > 0) and \
        min(map(abs, change)) > CEILINGS_MOVED
    return together or any(abs(v) > CEILING_MOVED_ALONE for v in change)


def machine_warnings(results):
    """When the machine lied: the ceilings moved over the run (or around D) by more than
    CEILINGS_MOVED, a ridge under RIDGE_MIN, MBU or MFU over 100% in A's or B's rows.
    -> [a description dict each (see describe)], what to re-run named in its template"""
    env, out = results.get("environment", {}), []
    start, end = env.get("ceilings"), env.get("ceilings_end")
    if start and end and speed_moved(start, end):
        out.append({"kind": "warn_moved", **ceilings_moved(start, end)})
    if start and start["ridge_flop_per_byte"] < RIDGE_MIN:
        out.append({"kind": "warn_ridge", "ridge": start["ridge_flop_per_byte"],
                    "least": RIDGE_MIN})
    above = sorted({k.upper() for e in "AB" for r in results.get(e, {}).get("rows", [])
                    for k in r.get("above_ceiling", ())})
    if above:
        rows = sum("above_ceiling" in r for e in "AB" for r in results.get(e, {}).get("rows", []))
        out.append({"kind": "warn_above", "shares": " and ".join(above), "rows": rows})
    out += load_warnings(env.get("load", {}))
    machine = results.get("D", {}).get("machine")
    if machine and speed_moved(machine["before"], machine["after"]):
        out.append({"kind": "warn_engine", **ceilings_moved(machine["before"], machine["after"])})
    return out


def load_warnings(loads):
    """The stages other processes slowed (see busy), or where the load was not measured."""
    disturbed = {k: v for k, v in loads.items() if busy(v)}
    unknown = [k for k, v in loads.items() if v.get("others_share") is None]
    out = []
    if disturbed:
        worst = max(disturbed.values(), key=lambda v: v["others_share"] + v["steal_share"])
        out.append({"kind": "warn_busy", "stages": ", ".join(disturbed), "cpus": worst["cpus"],
                    "others": worst["others_share"], "steal": {
                        "kind": "busy_steal", "steal": worst["steal_share"]}
                    if worst["steal_share"] >= 0.01 else ""})
    if unknown:
        out.append({"kind": "note_load", "stages": ", ".join(unknown)})
    return out


def ceilings_moved(before, after):
    change = moved(before, after)
    return {"bandwidth": before["bandwidth_gbs"], "bandwidth_end": after["bandwidth_gbs"],
            "tflops": before["matmul_tflops"], "tflops_end": after["matmul_tflops"],
            "bandwidth_moved": change.get("bandwidth_gbs", 0.0),
            "tflops_moved": change.get("matmul_tflops", 0.0), "share": CEILINGS_MOVED,
            "alone": CEILING_MOVED_ALONE}


def summary_text(T, results):
    """The post's three claims as this run measured them, one line each (those it ran), each
    in the words its numbers allow: where they contradict the post, the line says so."""
    lines = [line for line in (decode_claim(T, results), prefill_claim(T, results),
                               batching_claim(T, results)) if line]
    return "\n".join([T["summary"]] + lines) if lines else ""


def decode_claim(T, results):
    """Claim 1: batching is nearly free (batch 8, or the least batch past 1, gains at least
    2x batch 1's tokens/s; the line says what bound batch 1)."""
    if "A" not in results:
        return None
    A = results["A"]
    rows = [r for r in measured(A["rows"]) if r["context"] == A["context"]
            and r["mode"] == A["modes"][-1]]
    by_bytes = [r for r in rows if r["batch"] > 1 and r.get("bound") == "memory"] or \
        [r for r in rows if r["batch"] > 1]
    first = next((r for r in rows if r["batch"] == 1), None)
    if not (by_bytes and first):
        return None
    small = next((r for r in rows if r["batch"] == 8), min(by_bytes, key=lambda r: r["batch"]))
    holds = small["throughput_vs_1"] >= 2
    r = by_bytes[-1] if holds else small
    turn = next((s["batch"] for s in rows if s.get("bound") == "compute"), None)
    return T["summary_decode" if holds else "summary_decode_not"].format(
        batch=r["batch"], throughput=r["throughput_vs_1"], wait=r["wait_vs_1"],
        bound=T[first.get("bound", "memory")], turn=T["summary_turn"].format(
            batch=turn) if turn and turn > 1 else "")


def prefill_claim(T, results):
    """Claim 2: prefill is bound by arithmetic (the longest prompt past the ridge)."""
    if "B" not in results:
        return None
    rows = measured(results["B"]["rows"])
    prefill = [r for r in rows if r["phase"] == "prefill"]
    decode = next((r for r in rows if r["phase"] == "decode" and r["batch"] == 1), None)
    if not (prefill and decode):
        return None
    p = max(prefill, key=lambda r: r["tokens"])
    bound = p.get("bound", "compute")
    ridge = results["environment"].get("ceilings", {}).get("ridge_flop_per_byte", 0.0)
    return T["summary_prefill" if bound == "compute" else "summary_prefill_not"].format(
        tokens=p["tokens"], intensity=p["intensity"], bound=T[bound], ridge=ridge_text(ridge),
        ratio=p["tflops"] / max(decode["tflops"], 1e-30), decode=decode["intensity"])


def batching_claim(T, results):
    """Claim 3: continuous batching takes fewer steps than static (and in D, less time)."""
    C = results.get("C", {})
    if "static" not in C:
        return None
    D = results.get("D", {}).get("verdict")
    holds = C["speedup"] > 1 and (not D or D["measured"] > 1)
    return T["summary_batching" if holds else "summary_batching_not"].format(
        static=C["static"]["occupancy"], continuous=C["continuous"]["occupancy"],
        speedup=C["speedup"], engine=T["summary_engine"].format(**D) if D else "")


def dtype_probe_line(T, probe):
    """The dtype probe's choice, each type's weighted time over float32's (median, p10-p90 of
    the rounds) and the margin, as the banner prints it."""
    rows = "/".join(str(s["rows"]) for s in probe["shapes"])
    ratios = ", ".join(
        T["probe_ratio"].format(dtype=d, **q) if q else T["probe_dropped"].format(dtype=d)
        for d, q in probe["vs_float32"].items() if d != "float32")
    margin = ", ".join(
        ([T["probe_tied"].format(types=", ".join(probe["tied_with"]), noise=probe["noise"])]
         if probe.get("tied_with") else []) +
        [T["probe_margin"].format(margin=probe["margin"]) if probe["margin"] else
         T["probe_alone"]])
    return T["dtype_probe"].format(chosen=probe["chosen"], rows=rows, ratios=ratios,
                                   rounds=probe["rounds"], margin=margin,
                                   preference=probe["preference"])


def ceilings_line(T, ceilings, device_type):
    return fit_lines(T["ceilings"].format(
        bandwidth=ceilings["bandwidth_gbs"], tflops=ceilings["matmul_tflops"],
        bandwidth_source=describe(T, ceilings["bandwidth_source"]),
        matmul_source=describe(T, ceilings["matmul_source"]),
        ridge=ridge_text(ceilings["ridge_flop_per_byte"])) +
        ("" if device_type == "cuda" else T["cpu_graphs"]))


def ridge_text(ridge):
    """A ridge as the ceilings line prints it: whole from 1 up, two figures below (a ridge
    under 1, a busy machine's, must not read as 0)."""
    return f"{ridge:.0f}" if ridge >= 1 else f"{ridge:.2g}"
