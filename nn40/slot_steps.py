"""The post's slot-steps: static and continuous batching counted in decode steps (pure NumPy)

A request of length L holds its slot for exactly L decode steps. Static batching takes the
requests in order in groups of `slots` and runs each group until its longest request ends.
Continuous batching gives a slot freed after step t to the next waiting request at step t+1.
"""
import heapq

import numpy as np


def occupied_per_step(starts, lengths, steps, max_points=None):
    """Occupied slots at each step 0..steps-1, from each request's first step and length.
    -> (values, steps per value): per step, or past max_points steps the mean over bins of
    whole steps, computed at the bins' edges alone (no array as long as the run)."""
    if max_points is None or steps <= max_points:
        delta = np.bincount(starts, minlength=steps + 1) - np.bincount(starts + lengths,
                                                                       minlength=steps + 1)
        return np.cumsum(delta)[:steps], 1
    per = -(-steps // max_points)
    edges = np.append(np.arange(0, steps, per), steps)

    def below(a):  # sum over i of min(edge, a_i), at every edge
        a = np.sort(a)
        k = np.searchsorted(a, edges)
        return np.concatenate([[0], np.cumsum(a)])[k] + edges * (len(a) - k)
    occupied = below(starts + lengths) - below(starts)  # slot-steps before each edge
    return np.diff(occupied) / np.diff(edges), per


def static_starts(lengths, slots):
    """First step of every request under static batching, and the makespan."""
    firsts = np.arange(0, len(lengths), slots)  # the first request of each batch
    group_steps = np.maximum.reduceat(lengths, firsts)
    group_start = np.concatenate([[0], np.cumsum(group_steps)[:-1]])
    return np.repeat(group_start, np.diff(np.append(firsts, len(lengths)))), \
        int(group_steps.sum())


def continuous_starts(lengths, slots):
    """First step of every request under continuous batching, and the makespan."""
    free_at = [0] * min(slots, len(lengths))  # step at which each slot next becomes free
    starts = np.empty(len(lengths), dtype=np.int64)
    for i, length in enumerate(lengths.tolist()):
        start = heapq.heappop(free_at)
        starts[i] = start
        heapq.heappush(free_at, start + length)
    return starts, max(free_at)


def simulate_slots(lengths, slots, policy, max_points=None):
    """Steps, occupancy and occupied slots per step of one policy ('static' or 'continuous');
    see occupied_per_step for max_points."""
    starts, steps = {"static": static_starts, "continuous": continuous_starts}[policy](lengths,
                                                                                     slots)
    occupied, per = occupied_per_step(starts, lengths, steps, max_points)
    return {"steps": steps, "occupancy": float(lengths.sum() / (steps * slots)),
            "occupied": occupied, "occupied_bin_steps": per}
