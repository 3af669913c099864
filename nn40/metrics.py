"""A run's latencies as engines report them: TTFT, TPOT, end-to-end and queueing percentiles,
throughput, goodput and SLO attainment (serving_metrics), a CDF's points (quantile_curve),
and the ones D's verdict compares (LATENCIES)
"""
import numpy as np


def serving_metrics(req, sim, slo_ttft_s=None, slo_tpot_s=None):
    """A simulation's summary: its record's (RequestTimes.summary) beside its steps and
    throughput, and with an SLO the goodput and the share of requests meeting it."""
    times = sim["times"]
    summary = times.summary()
    span, n = summary["makespan_s"], len(times.arrival)
    metrics = {"steps": sim["steps"], "iterations": sim["iterations"],
               "simulation_s": sim.get("wall_s"), "makespan_s": span,
               "throughput_rps": n / span, "output_tokens_per_s": req.output.sum() / span,
               "occupancy": sim["occupancy"], "longest_step_s": sim["longest_step_s"],
               "ttft_s": summary["ttft_s"], "tpot_s": summary["tpot_s"],
               "e2e_s": summary["e2e_s"]}
    if slo_ttft_s or slo_tpot_s:
        ttft_ok, tpot_ok = slo_met(times, slo_ttft_s, slo_tpot_s)
        ok = ttft_ok & tpot_ok
        metrics["goodput_rps"] = float(ok.sum() / span)
        metrics["slo_attained"] = float(ok.mean())
    return metrics


def itl_mean_s(sim):
    """The mean inter-token latency over every gap between the chunks a stream delivers, as
    `vllm bench serve` averages it: the decode time of all requests over their chunks after
    the first (a speculating replica's: its verify steps, each delivering what it accepted at
    once, and the token of each prefill that brings a preempted request back), else one a
    token."""
    times = sim["times"]
    chunks = sim.get("chunks")
    if chunks is None:
        chunks = np.maximum(times.output - 1, 0)
    total = int(np.sum(chunks))
    return float(np.sum(times.finish - times.first_token) / total) if total else None


def slo_met(times, slo_ttft_s=None, slo_tpot_s=None):
    """(which requests meet the TTFT bound, which the TPOT bound): boolean arrays, all true
    where there is no bound; a request of one token has no TPOT and meets it."""
    n = len(times.arrival)
    ttft_ok = times.ttft() <= slo_ttft_s if slo_ttft_s else np.ones(n, bool)
    if not slo_tpot_s:
        return ttft_ok, np.ones(n, bool)
    per_token = np.zeros(n)
    per_token[times.output > 1] = times.tpot()
    return ttft_ok, per_token <= slo_tpot_s


def quantile_curve(sorted_values, points=200):
    """A compact CDF for the JSON and the figure: values at evenly spaced quantiles."""
    q = np.linspace(0, 1, points)
    return np.quantile(sorted_values, q).tolist() if len(sorted_values) else []


def thin(rows, points=400):
    """At most `points` evenly spaced rows of a time series, the last one included."""
    keep = np.unique(np.linspace(0, len(rows) - 1, min(points, len(rows))).astype(int))
    return [rows[i] for i in keep]


LATENCIES = ("makespan_s", "ttft_p50_s", "ttft_p90_s", "e2e_p50_s", "e2e_p90_s")
