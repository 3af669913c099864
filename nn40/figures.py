"""Figures, drawn from the results dictionary alone: the palette and what every figure shares,
A's and B's, then C's and D's, FIGURES (each figure's name, the results it needs and how it
is drawn) and draw_figures. matplotlib is imported where a figure is drawn.
"""
import math
import os

import numpy as np

from nn40.disaggregated import SEARCH_ATTAINMENT
from nn40.host import run_parallel, write_atomic
from nn40.pricing import measured
from nn40.replicas import SCHEDULERS
from nn40.tables import describe
from nn40.text_ko import TEXT


# one palette for every figure: static red and continuous blue (as in the post), chunked green;
# prefill (compute) orange and decode (memory) purple; throughput dark grey
RED, BLUE, GREY = "#d62728", "#1f77b4", "#7f7f7f"

PREFILL, DECODE, DARK = "#ff7f0e", "#9467bd", "#333333"


def figure_note(results):
    env, cfg = results["environment"], results["config"]["model"]
    if "device" not in env:
        return f"simulation, {env['date'][:10]}"
    return (f"{env['device']}, {cfg['dtype']}, {cfg['layers']} layers x {cfg['hidden']} "
            f"({cfg['params'] / 1e6:,.0f} M params), {env['date'][:10]}")


NO_ROWS = "no measured rows to draw"  # what a plot returns that has nothing to draw


def save_figure(fig, results, path):
    """Note the device, dtype and model on the figure, then write it atomically."""
    import io
    import matplotlib.pyplot as plt
    fig.text(0.99, 0.005, figure_note(results), ha="right", va="bottom", fontsize=7, color=GREY)
    buf = io.BytesIO()
    fig.savefig(buf)  # (in the dpi and format draw_one sets for this figure)
    plt.close(fig)
    write_atomic(path, buf.getvalue(), mode="wb")


def plot_slot_panels(results, path, slots, panels, xlabel, title):
    """Occupied slots over time, static (red) over continuous (blue), the post's figure (and
    below them, where given, continuous speculating: purple).

    panels: [(x, occupied, step, panel title)] for static, then continuous (then
    speculating); step is matplotlib's: "post" when each value holds from its x on, "pre"
    when it holds up to it.
    """
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.3 * len(panels)), sharex=True,
                             sharey=True)
    for ax, (x, occupied, step, panel_title), color in zip(axes, panels, (RED, BLUE, DECODE)):
        ax.fill_between(x, occupied, step=step, color=color, alpha=0.8, linewidth=0)
        ax.set_ylim(0, slots * 1.05)
        ax.set_ylabel("occupied slots")
        ax.set_title(panel_title, fontsize=9, loc="left")
    axes[-1].set_xlabel(xlabel)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    save_figure(fig, results, path)


def plot_decode_batch(results, path):
    import matplotlib.pyplot as plt
    A = results["A"]
    if not any(r["context"] == A["context"] for r in measured(A["rows"])):
        return NO_ROWS
    fig, ax = plt.subplots(figsize=(8, 4.2))
    ax2 = ax.twinx()
    for mode, style in zip(A["modes"], ("--", "-") if len(A["modes"]) == 2 else ("-",)):
        rows = [r for r in measured(A["rows"]) if r["context"] == A["context"]
                and r["mode"] == mode]
        batch = [r["batch"] for r in rows]
        ax.plot(batch, [r["step_ms"] for r in rows], "o" + style, color=DECODE,
                label=f"step time = each user's wait ({mode})")
        ax.fill_between(batch, [r["p10_ms"] for r in rows], [r["p90_ms"] for r in rows],
                        color=DECODE, alpha=0.15, linewidth=0)
        ax2.plot(batch, [r["tokens_per_s"] for r in rows], "s" + style, color=DARK,
                 label=f"tokens/s ({mode})")
    ax.set_xscale("log", base=2)
    batches = sorted({r["batch"] for r in measured(A["rows"])})
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("decode batch size")
    ax.set_ylabel("step time (ms; band: p10-p90)", color=DECODE)
    ax2.set_ylabel("throughput (tokens/s)", color=DARK)
    ax.set_ylim(bottom=0)
    ax2.set_ylim(bottom=0)
    ax.set_title(f"A: one decode step for the whole batch (context {A['context']} tokens per "
                 "row)", fontsize=10)
    fig.legend(loc="upper left", bbox_to_anchor=(0.1, 0.88), fontsize=8)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    save_figure(fig, results, path)


def plot_moe_batching(results, path):
    """A for a mixture of experts: its decode step against batch beside its dense twin's, and
    the experts a step read beside what the routing's expectation says."""
    import matplotlib.pyplot as plt
    A = results["A"]
    if "dense_twin" not in A:
        return "needs A on a mixture of experts (--experts)"
    mode = A["modes"][-1]
    moe = [r for r in measured(A["rows"]) if r["context"] == A["context"] and r["mode"] == mode]
    twin = measured(A["dense_twin"]["rows"])
    if not moe or not twin:
        return NO_ROWS
    cfg = results["config"]["model"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4.2))
    for rows, color, label in ((moe, DECODE, f"{cfg['experts']} experts, "
                                f"{cfg['experts_per_token']} a token"),
                               (twin, DARK, f"dense twin (MLP {A['dense_twin']['ffn']:,} wide)")):
        batch = [r["batch"] for r in rows]
        ran = sorted({r.get("ran", r["mode"]) for r in rows})  # (the mode each row ran in)
        ax.plot(batch, [r["step_ms"] for r in rows], "o-", color=color,
                label=f"{label}, {'/'.join(ran)}")
        ax.fill_between(batch, [r["p10_ms"] for r in rows], [r["p90_ms"] for r in rows],
                        color=color, alpha=0.15, linewidth=0)
    batch = [r["batch"] for r in moe]
    ax2.plot(batch, [r["experts_touched"] for r in moe], "o-", color=DECODE, label="measured")
    ax2.plot(batch, [r["experts_expected"] for r in moe], "--", color=DARK,
             label="expected under the routing assumed")
    ax2.axhline(cfg["experts"], color="grey", linewidth=0.8)
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.set_xticks(batch, [str(b) for b in batch])
        a.set_xlabel("decode batch size")
        a.set_ylim(bottom=0)
        a.legend(fontsize=8)
    ax.set_ylabel("step time (ms; band: p10-p90)")
    ax2.set_ylabel("distinct experts a layer reads")
    ax.set_title("A: the same active parameters, dense and routed", fontsize=10)
    ax2.set_title(f"experts read grow with the batch, up to all {cfg['experts']}", fontsize=10)
    fig.tight_layout()
    save_figure(fig, results, path)


def plot_phases(results, path, decode_steps=24):
    """One request to scale: a prefill block, then a train of decode steps; beneath, the same
    steps shared by a batch. Widths, rates and bounds are this run's measured B rows."""
    import matplotlib.pyplot as plt
    rows = measured(results["B"]["rows"])
    prefills = [r for r in rows if r["phase"] == "prefill"]
    decodes = [r for r in rows if r["phase"] == "decode"]
    mode = decodes[-1]["mode"] if decodes else None
    alone = next((r for r in decodes if r["batch"] == 1 and r["mode"] == mode), None)
    shared = max((r for r in decodes if r["mode"] == mode), key=lambda r: r["batch"],
                 default=None)
    if not prefills or not alone:
        return NO_ROWS
    pre = prefills[-1]
    fig, ax = plt.subplots(figsize=(8, 3.4))
    lanes = [(1.0, alone, "one user")]
    if shared and shared["batch"] > 1:
        lanes.append((0.0, shared, f"batch of {shared['batch']}"))
    for y, dec, label in lanes:
        ax.broken_barh([(0, pre["step_ms"])], (y + 0.1, 0.8), color=PREFILL)
        ax.broken_barh([(pre["step_ms"] + i * dec["step_ms"], dec["step_ms"] * 0.85)
                        for i in range(decode_steps)], (y + 0.1, 0.8), color=DECODE)
        ax.text(pre["step_ms"] + decode_steps * dec["step_ms"], y + 0.5,
                f"  {label}: {dec['us_per_token']:,.0f} µs/token, {dec['tflops']:.3g} TFLOP/s, "
                f"{dec['bound']}-bound", va="center", fontsize=8)
    ax.text(pre["step_ms"] / 2, 1.5, f"prefill {pre['tokens']} tokens\n{pre['tflops']:.3g} "
            f"TFLOP/s\n{pre['bound']}-bound", ha="center", va="center", fontsize=8,
            color="white")
    ax.set_yticks([y + 0.5 for y, _, _ in lanes], [label for _, _, label in lanes])
    longest = pre["step_ms"] + decode_steps * max(d["step_ms"] for _, d, _ in lanes)
    ax.set_xlim(0, longest * 1.9)
    ax.set_xlabel(f"time (ms): prefill, then {decode_steps} decode steps of one token each")
    ax.set_title("two phases of one request, to scale (this run's B rows)", fontsize=10)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    save_figure(fig, results, path)


def plot_prefill_decode(results, path):
    import matplotlib.pyplot as plt
    rows = measured(results["B"]["rows"])
    if not rows:
        return NO_ROWS
    labels = [f"prefill\n{r['tokens']} tokens" if r["phase"] == "prefill"
              else f"decode\nbatch {r['batch']}\n{r['mode']}" for r in rows]
    colors = [PREFILL if r["phase"] == "prefill" else DECODE for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    bars = ax.bar(labels, [r["tflops"] for r in rows], color=colors)
    ax.set_yscale("log")
    ax.set_ylabel("achieved TFLOP/s (log)")
    for bar, r in zip(bars, rows):
        ax.annotate(f"{r['tflops']:.3g} TFLOP/s\n{r['intensity']:.0f} FLOP/byte",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                    va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.set_ylim(top=ax.get_ylim()[1] * 3)
    ax.set_title("B: achieved TFLOP/s of prefill and decode on the same device", fontsize=10)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    save_figure(fig, results, path)


def plot_roofline(results, path):
    """Achieved TFLOP/s against arithmetic intensity, under the two measured ceilings."""
    import matplotlib.pyplot as plt
    ceil = results["environment"]["ceilings"]
    points = []
    if "A" in results:
        points += [(r, f"b{r['batch']}", DECODE) for r in measured(results["A"]["rows"])
                   if r["context"] == results["A"]["context"]]
    if "B" in results:
        points += [(r, f"prefill {r['tokens']}" if r["phase"] == "prefill" else
                    f"B b{r['batch']}", PREFILL if r["phase"] == "prefill" else DARK)
                   for r in measured(results["B"]["rows"])]
    if not points:
        return NO_ROWS
    fig, ax = plt.subplots(figsize=(8, 4.8))
    xs = [r["intensity"] for r, _, _ in points] + [ceil["ridge_flop_per_byte"]]
    x = np.geomspace(min(xs) / 2, max(xs) * 2, 200)
    ax.plot(x, np.minimum(ceil["matmul_tflops"], ceil["bandwidth_gbs"] * x / 1e3), color=GREY,
            label=f"roofline: {ceil['bandwidth_gbs']:,.0f} GB/s, "
                  f"{ceil['matmul_tflops']:.3g} TFLOP/s")
    for i, (r, label, color) in enumerate(points):
        marker = "o" if r["mode"] == "eager" else "^"
        ax.scatter(r["intensity"], r["tflops"], color=color, marker=marker, zorder=3,
                   facecolors="none" if color == DECODE else color)
        # alternate labels above and below so neighbouring batches do not overprint
        ax.annotate(label, (r["intensity"], r["tflops"]), fontsize=7, xytext=(
            4, 5 if i % 2 else -9), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte, log)")
    ax.set_ylabel("achieved TFLOP/s (log)")
    ax.set_title("roofline: A (open, decode sweep) and B (filled) against the measured "
                 "ceilings; o eager, ^ CUDA graph", fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    save_figure(fig, results, path)


def plot_decode_context(results, path):
    """Decode step time and tokens/s against batch at each context: where the KV cache rules."""
    import matplotlib.pyplot as plt
    A = results["A"]
    mode = A["modes"][-1]
    if not measured(A["rows"]) or results["config"]["model"].get("arch") == "post":
        return NO_ROWS  # (the post's proxy has no KV cache: its context changes nothing)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 4))
    colors = plt.get_cmap("viridis")(np.linspace(0, 0.85, len(A["contexts"])))
    for context, color in zip(A["contexts"], colors):
        rows = [r for r in measured(A["rows"]) if r["context"] == context and r["mode"] == mode]
        batch = [r["batch"] for r in rows]
        ax1.plot(batch, [r["step_ms"] for r in rows], "o-", color=color, label=f"context "
                                                                             f"{context}")
        ax2.plot(batch, [r["tokens_per_s"] for r in rows], "o-", color=color)
        cross = A["kv_crossover_batch"][str(context)]
        if cross and batch and cross <= max(batch):
            ax1.axvline(cross, color=color, linestyle=":", linewidth=1)
    batches = sorted({r["batch"] for r in measured(A["rows"])})
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("decode batch size")
    ax1.set_ylabel("step time (ms)")
    ax2.set_ylabel("tokens/s")
    ax1.legend(fontsize=8)
    ax1.set_title("step time (dotted: KV reads = weight reads)", fontsize=9)
    ax2.set_title("throughput", fontsize=9)
    fig.suptitle(f"A: decode at several contexts ({mode})", fontsize=10)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    save_figure(fig, results, path)


# figures of C and D: and the drawing of every figure (from the results dictionary alone)


def plot_occupancy(results, path):
    C = results["C"]
    if "static" not in C:  # a trace run has no step-count table
        return NO_ROWS
    panels = [(np.arange(len(C[p]["occupied"])) * C[p].get("occupied_bin_steps", 1),
               C[p]["occupied"], "post", f"{p} batching: {C[p]['steps']:,} steps, "
               f"{100 * C[p]['occupancy']:.1f}% occupancy") for p in ("static", "continuous")]
    plot_slot_panels(results, path, C["slots"], panels, "decode step",
                     f"{C['requests']} requests, {C['slots']} slots: continuous batching is "
                     f"{C['speedup']:.2f}x faster")


SCHEDULER_COLORS = {"static": RED, "continuous": BLUE, "chunked": "#2ca02c"}


def plot_latency_cdf(results, path):
    import matplotlib.pyplot as plt
    C = results["C"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8), sharey=True)
    for ax, key, label in zip(axes, ("ttft_s", "e2e_s"), ("time to first token", "end-to-end "
                                                                                  "latency")):
        for name, dist in C["distributions"].items():
            values = np.asarray(dist[key])
            ax.plot(values, np.linspace(0, 1, len(values)), color=SCHEDULER_COLORS[name],
                    label=name, linestyle="--" if name == "chunked" else "-")
        ax.set_xlabel(f"{label} (s)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests")
    axes[0].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"C: latency CDFs, {C['requests']:,} requests, {C['slots']} slots, arrivals "
                 f"{describe(TEXT['en'], C['arrivals'])}", fontsize=10)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    save_figure(fig, results, path)


def plot_rate_sweep(results, path):
    import matplotlib.pyplot as plt
    sweep = results["C"].get("rate_sweep") or []
    if not sweep:
        return NO_ROWS
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for name in SCHEDULERS:
        ax.plot([p[name]["throughput_rps"] for p in sweep], [p[name]["e2e_p99_s"] for p in sweep],
                "o--" if name == "chunked" else "o-", color=SCHEDULER_COLORS[name], label=name,
                linewidth=3 if name == "continuous" else 1.5)  # visible under chunked
    ax.set_yscale("log")
    ax.set_xlabel("achieved throughput (requests/s)")
    ax.set_ylabel("p99 end-to-end latency (s, log)")
    ax.set_title("C: the serving curve: offered rate rising from "
                 f"{sweep[0]['rate_rps']:.3g} to {sweep[-1]['rate_rps']:.3g} requests/s",
                 fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    save_figure(fig, results, path)


ORDER_STYLES = {"fcfs": (BLUE, "-"), "sjf": ("#2ca02c", "-"), "predicted": (PREFILL, "-"),
                "longest": (DECODE, "-"), "sjf_guarded": ("#2ca02c", "--"),
                "predicted_guarded": (PREFILL, "--")}


def plot_who_waits(results, path):
    """Latency against output length under each order of the queue: who waits for whom."""
    import matplotlib.pyplot as plt
    C = results["C"]
    if "orders" not in C:
        return NO_ROWS
    w = C["who_waits"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    for ax, key, label in zip(axes, ("ttft_mean_s", "per_token_mean_s"), (
            "time to first token (s, mean)", "end-to-end latency per output token (s, mean)")):
        for name, m in C["orders"].items():
            color, style = ORDER_STYLES[name]
            ax.plot(m["curve"]["length"], m["curve"][key], style, color=color, marker=".",
                    label=name.replace("_guarded", " + guard"))
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("output tokens (log)")
        ax.set_ylabel(label, fontsize=9)
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"C: who waits: {w['requests']:,} requests, continuous batching, {w['slots']} "
                 f"slots, arrivals {describe(TEXT['en'], w['arrivals'])}; guard "
                 f"{w['guard_s']:.3g} s", fontsize=9)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    save_figure(fig, results, path)


ROUTER_STYLES = {"round-robin": (GREY, "o"), "least-requests": (BLUE, "s"),
                 "power-of-two": ("#2ca02c", "^"), "least-kv": (PREFILL, "D"),
                 "cache-aware": ("#9467bd", "v"), "precise-prefix": ("#8c564b", "P")}


def plot_capacity(results, path):
    """The SLO met against the offered rate on one replica, and against the replicas behind
    each router at the target rate."""
    import matplotlib.pyplot as plt
    cap = results["C"].get("capacity")
    if not cap:
        return "needs an SLO (--slo-ttft-ms or --slo-tpot-ms)"
    fleet = "routers" in cap
    fig, axes = plt.subplots(1, 2 if fleet else 1, figsize=(9 if fleet else 6, 3.8),
                             squeeze=False)
    ax = axes[0][0]
    rate, met = zip(*sorted(cap["one_replica"]["tried"]))
    ax.plot(rate, met, "o-", color=BLUE, label="one replica (one arrival draw)")
    one = cap["one_replica"]["rate_rps"]
    if 0 < one < math.inf:
        ax.axvline(one, color=DARK, linestyle=":", linewidth=1)
        ax.annotate(f" capacity {one:.3g}/s", (one, 0.05), fontsize=8)
    ax.set_xlabel("offered rate (requests/s)")
    ax.set_ylabel("share of requests within the SLO")
    ax.set_title("one replica", fontsize=9)
    if fleet:
        ax2 = axes[0][1]
        for group, line in (("routers", "-"), ("without_caching", "--")):
            for router, r in cap.get(group, {}).items():
                color, marker = ROUTER_STYLES[router]
                n, met2 = zip(*r["tried"])
                ax2.plot(n, met2, marker + line, color=color, alpha=0.8, label=router if
                         group == "routers" else f"{router}, no prefix caching")
        ax2.set_xlabel("replicas")
        ax2.xaxis.get_major_locator().set_params(integer=True)
        ax2.set_title(f"at {cap['target_rate']:g} requests/s", fontsize=9)
        ax2.legend(fontsize=7)
    for a in axes[0]:
        a.axhline(cap["attainment"], color=RED, linewidth=1, linestyle="--")
        a.set_ylim(-0.02, 1.02)
        a.grid(alpha=0.3)
    slo = ", ".join(f"{name} <= {1e3 * cap[key]:g} ms" for name, key in (
        ("TTFT", "slo_ttft_s"), ("TPOT", "slo_tpot_s")) if cap[key])
    fig.suptitle(f"C: capacity at the SLO ({slo}; dashed: {cap['attainment']:.0%} of "
                 "requests)", fontsize=10)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    save_figure(fig, results, path)


KV_STYLES = {"reserve": ("#8c564b", 3), "paged": ("#17becf", 1.5)}  # (color, held line's
# width: reserve's stays visible under paged's; a policy not named here takes the cycle's color)


def plot_kv_memory(results, path):
    """KV tokens held against tokens reserved or allocated, and requests running, over time
    (the continuous scheduler under each allocation policy)."""
    import matplotlib.pyplot as plt
    kv = results["C"].get("kv")
    if not kv or not kv["series"]:
        return NO_ROWS
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 5.4), sharex=True)
    for i, (policy, series) in enumerate(kv["series"].items()):
        (color, width), m = KV_STYLES.get(policy, (f"C{i}", 1.5)), kv[policy]["continuous"]
        ax1.plot(series["t_s"], series["allocated_tokens"], color=color, linestyle="--",
                 label=f"{policy}: allocated")
        ax1.plot(series["t_s"], series["held_tokens"], color=color,
                 linewidth=width,
                 label=f"{policy}: held ({m['utilization']:.0%} of allocated)")
        ax2.plot(series["t_s"], series["running"], color=color, drawstyle="steps-post",
                 label=f"{policy}: peak {m['peak_concurrency']}, mean "
                       f"{m['mean_concurrency']:.1f}, {m['preemptions']:,} preemptions")
    ax1.axhline(kv["budget_tokens"], color=GREY, linewidth=1)
    ax1.annotate(f"budget {kv['budget_tokens']:,} tokens", (0, kv["budget_tokens"]),
                 xytext=(2, -10), textcoords="offset points", fontsize=8, color=GREY)
    ax1.set_ylabel("KV tokens")
    ax1.set_ylim(0, kv["budget_tokens"] * 1.08)
    ax1.legend(fontsize=7, loc="center right")
    ax2.set_ylabel("requests running")
    ax2.set_xlabel("time (s)")
    ax2.set_ylim(bottom=0)
    ax2.legend(fontsize=7, loc="lower center")
    fig.suptitle(f"C: KV memory under continuous batching: {results['C']['slots']} slots, "
                 f"{kv['memory_bytes'] / 1e9:.2f} GB of KV cache", fontsize=10)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    save_figure(fig, results, path)


def plot_engine(results, path):
    """D's measured occupancy over wall time, in the form of occupancy.png."""
    D = results["D"]
    panels = []
    for policy in ("static", "continuous", "speculative"):
        if policy not in D:
            continue
        d = D[policy]
        t, running = d["timeline"]["t_s"], d["timeline"]["running"]
        # each step's slots fill the interval that ends with it, the first from t = 0
        name = "continuous + speculating" if policy == "speculative" else policy
        panels.append(([0.0, *t], [running[0], *running], "pre",
                       f"{name}: {d['wall_s']:,.1f} s measured ({d['predicted']['wall_s']:,.1f} "
                       f"s predicted), {d['steps']:,} steps, {100 * d['occupancy']:.1f}% "
                       "occupancy"))
    spec = D.get("speculation_check")
    plot_slot_panels(results, path, D["slots"], panels, "wall time (s)",
                     f"D: a real engine, {D['requests']} requests, {D['slots']} slots: continuous "
                     f"is {D['speedup_measured']:.2f}x faster (C predicts "
                     f"{D['speedup_predicted']:.2f}x)" + (
                         f";\nspeculating ({spec['k']} drafts) {spec['measured']:.2f}x faster "
                         f"again (C predicts {spec['predicted']:.2f}x)" if spec else ""))


def plot_prefix_cache(results, path):
    """--prefix-study: the share of prompt tokens found cached against the cache's capacity
    (the card alone, with a host tier, unlimited, and the workload's optimum), and TTFT."""
    import matplotlib.pyplot as plt
    study = results["C"].get("prefix_study")
    if not study:
        return "needs --prefix-study"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for tier, color, marker in (("card", BLUE, "o"), ("card_host", RED, "s")):
        rows = study[tier]
        if not rows:
            continue
        x = [r["capacity_tokens"] for r in rows]
        label = "card" if tier == "card" else f"card + host ({study['host_tokens']:,} tokens)" + (
            f" + disk ({study['disk_tokens']:,})" if study.get("disk_tokens") else "")
        ax1.plot(x, [r["hit_ratio"] for r in rows], marker + "-", color=color, label=label)
        if tier == "card_host":
            ax1.plot(x, [r["card_hit_ratio"] for r in rows], marker + ":", color=color,
                     label="of which on the card", alpha=0.6)
        for stat, style in (("p50", "-"), ("p99", "--")):
            ax2.plot(x, [r["ttft_s"][stat] for r in rows], marker + style, color=color,
                     label=f"{label}: TTFT {stat}")
    unlimited = study["unlimited"][0]
    ax1.axhline(unlimited["hit_ratio"], color=DARK, linestyle=":", linewidth=1,
                label=f"unlimited: {unlimited['hit_ratio']:.1%}")
    if study.get("optimum"):  # (the workload's own: unlimited, one request at a time)
        best = study["optimum"][0]["hit_ratio"]
        ax1.axhline(best, color=DARK, linestyle="-.", linewidth=1,
                    label=f"one at a time (the workload's optimum): {best:.1%}")
    for stat, style in (("p50", "-"), ("p99", "--")):
        ax2.axhline(unlimited["ttft_s"][stat], color=DARK, linestyle=style, linewidth=0.8,
                    alpha=0.6, label=f"unlimited: TTFT {stat}")
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.set_xlabel("KV cache on the card (tokens)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax1.set_ylabel("prompt tokens found cached")
    ax1.set_ylim(0, 1)
    ax2.set_ylabel("TTFT (s)")
    ax2.set_yscale("log")
    fig.suptitle("C: prefix caching against the cache's capacity (continuous batching)",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    save_figure(fig, results, path)


def plot_placements(results, path, shown=4):
    """--placement-search: SLO attainment against the rate a card (DistServe's figure) at the
    rates the search tried, for the `shown` best placements of each kind; and every
    placement's goodput a card."""
    import matplotlib.pyplot as plt
    R = results["placement_search"]
    rows = R["rows"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 0.9 + 0.22 * len(rows) + 1.8),
                                   gridspec_kw={"width_ratios": (1, 1.2)})
    colors = {"colocated": BLUE, "disaggregated": PREFILL}
    for kind, color in colors.items():
        best = [r for r in rows if (r["kind"] == "disaggregated") == (kind != "colocated")]
        for rank, r in enumerate(best[:shown]):
            tried = sorted(r["tried"])
            ax1.plot([rate / r["gpus"] for rate, _, _ in tried], [met for _, met, _ in tried],
                     "o-" if kind == "colocated" else "s--", color=color, markersize=3,
                     alpha=1.0 - 0.2 * rank, label=r["placement"])
    ax1.axhline(SEARCH_ATTAINMENT, color=DARK, linewidth=0.8, linestyle=":")
    ax1.set_xlabel("requests/s a card")
    ax1.set_ylabel("requests within TTFT 0.2 s and TPOT 0.1 s")
    ax1.set_ylim(0, 1.02)
    ax1.legend(fontsize=6)
    ax1.grid(alpha=0.3)
    y = range(len(rows))[::-1]
    ax2.barh(y, [r["goodput_per_gpu"] for r in rows],
             color=[colors["disaggregated" if r["kind"] == "disaggregated" else "colocated"]
                    for r in rows])
    ax2.set_yticks(list(y), [f"{r['placement']} ({r['gpus']})" for r in rows], fontsize=6)
    ax2.set_xlabel(f"goodput a card (requests/s at {SEARCH_ATTAINMENT:.0%} within the SLO)")
    ax2.grid(alpha=0.3, axis="x")
    fig.suptitle(f"C: OPT-13B's placements on up to {R['budget']} A100-80GB, DistServe's "
                 "profile: colocated (blue) and disaggregated (orange)", fontsize=10)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    save_figure(fig, results, path)


def plot_disaggregation(results, path):
    """C with a prefill and a decode pool and an SLO: the share of requests meeting it
    against the rate a card, disaggregated and colocated on as many cards (DistServe's
    figure)."""
    import matplotlib.pyplot as plt
    P = results["C"].get("placement")
    if not P or not P.get("curve"):
        return "needs --prefill-replicas, --decode-replicas and an SLO"
    curve = P["curve"]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for kind, color, style in (("disaggregated", PREFILL, "s--"), ("colocated", BLUE, "o-")):
        gpus = P[kind]["gpus"]  # (each on its own cards)
        ax.plot([r / gpus for r in curve["rates_rps"]], curve[kind], style, color=color,
                label=f"{kind}: {P[kind]['placement']} ({gpus} cards)")
    slo = " and ".join(f"{name} {1e3 * P[key]:g} ms" for name, key in (
        ("TTFT", "slo_ttft_s"), ("TPOT", "slo_tpot_s")) if P[key])
    ax.set_xlabel("requests/s a card")
    ax.set_ylabel(f"requests within {slo}")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    ax.set_title("C: SLO met against the rate, disaggregated and colocated on as many cards",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    save_figure(fig, results, path)


def plot_speculation(results, path):
    """C with --speculative-config: the speedup (plain TPOT p50 over speculating) against the
    concurrency for each k of 1..K drafts a step, the line where speculation stops paying."""
    S = results["C"].get("speculation")
    if not S:
        return "needs --speculative-config"
    if S["speedup"] is None:
        return "no request decodes past its first token"
    rows = S["concurrency"]
    fig = speedup_figure([row["concurrency"] for row in rows], {
        f"k = {spec['k']}": [row["k"][i]["speedup"] for row in rows]
        for i, spec in enumerate(rows[0]["k"])},
        f"C: speculative decoding ({S['method']}, {S['acceptance_length']:.2f} tokens a verify "
        f"step at k = {S['k']}) against the concurrency")
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    save_figure(fig, results, path)


def speedup_figure(concurrency, lines, title):
    """Speculative decoding's speedup (plain TPOT p50 over speculating) against the
    concurrency, one line a label of `lines` ({label: speedups}), the line where it stops
    paying. -> the figure"""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for label, speedups in lines.items():
        ax.plot(concurrency, speedups, "o-", label=label)
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xticks(concurrency)
    ax.set_xticklabels([f"{c:,}" for c in concurrency], fontsize=8)
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("speedup (TPOT p50, plain / speculating)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


FIGURES = {"phases.png": ("B", plot_phases),
           "occupancy.png": ("C", plot_occupancy),
           "latency_cdf.png": ("C", plot_latency_cdf),
           "rate_sweep.png": ("C", plot_rate_sweep),
           "kv_memory.png": ("C", plot_kv_memory),
           "who_waits.png": ("C", plot_who_waits),
           "capacity.png": ("C", plot_capacity),
           "prefix_cache.png": ("C", plot_prefix_cache),
           "speculation.png": ("C", plot_speculation),
           "engine.png": ("D", plot_engine),
           "decode_batch.png": ("A", plot_decode_batch),
           "moe_batching.png": ("A", plot_moe_batching),
           "prefill_decode.png": ("B", plot_prefill_decode),
           "roofline.png": ("AB", plot_roofline),
           "decode_context.png": ("A", plot_decode_context),
           "disaggregation.png": ("C", plot_disaggregation),
           "placements.png": (("placement_search",), plot_placements)}


FORMATS = ("png", "svg")


def draw_figures(results, out_dir, dpi=100, fmt="png", jobs=1):
    """Every figure the results support -> (written, missing: {name: why not}), drawn in up to
    `jobs` worker processes. A plot returns None, or why it could not draw."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401  (once, before the workers are forked)
    written, missing, calls = [], {}, []
    for name, (experiment, plot) in FIGURES.items():
        name = name.replace(".png", "." + fmt)
        if not any(e in results for e in experiment):
            missing[name] = f"needs experiment {' or '.join(experiment)}"
        else:
            calls.append((draw_one, (plot, results, os.path.join(out_dir, name), dpi, fmt)))
    calls.sort(key=lambda c: os.path.basename(c[1][2]).split(".")[0] not in SLOWEST_FIGURES)
    for (_, (_, _, path, _, _)), why in zip(calls, run_parallel(calls, jobs)):
        name = os.path.basename(path)
        if why is None:
            written.append(name)
        else:
            missing[name] = why
    names = [n.replace(".png", "." + fmt) for n in FIGURES]  # (written in FIGURES' order)
    return sorted(written, key=names.index), missing


# the figures slowest to draw (0.5-1 s each on a 2-core CPU), sent to the workers first
SLOWEST_FIGURES = ("who_waits", "rate_sweep", "roofline", "kv_memory")


def draw_one(plot, results, path, dpi, fmt):
    """One figure in its dpi and format: matplotlib's savefig settings, for this call alone."""
    import matplotlib
    with matplotlib.rc_context({"savefig.dpi": dpi, "savefig.format": fmt}):
        return plot(results, path)
