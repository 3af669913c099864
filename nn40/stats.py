"""Summaries of samples: the mean and the percentiles a run's latencies are reported by."""
import numpy as np


def percentiles(values):
    """{mean, p50, p90, p99} of values (None each where there are none)."""
    if len(values) == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"mean": float(np.mean(values)), "p50": float(p50), "p90": float(p90),
            "p99": float(p99)}
