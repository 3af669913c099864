"""Calibration: a profile fitted to a user's own runs (pure)

A measured run (vLLM's or SGLang's benchmark output, or an engine's own log) read row by row
(read_measured_run), replayed through C's simulation at its own arrivals (replay_run), and the
profile's constants fitted to it (calibrate), checked on the runs each fit left out
(leave_one_out). Calls the workload, the step costs, the published rows' search, and the
event loop and metrics.
"""
import dataclasses
import json
import math
import os
from typing import NamedTuple

import numpy as np

from nn40.config import GPUS, MODELS, VLLM_MAX_NUM_SEQS
from nn40.errors import UsageError
from nn40.host import one_line
from nn40.kv import KVBudget, check_kv_budget
from nn40.loop import simulate_serving
from nn40.metrics import serving_metrics
from nn40.names import named
from nn40.pricing import card_costs, card_kv_tokens
from nn40.published import coordinate_search
from nn40.replicas import Replica
from nn40.runs import every_nth
from nn40.settings import SchedulerConfig
from nn40.stats import percentiles
from nn40.workload import Requests, read_bench_result, read_engine_run, read_run_meta


# A user's own measured runs (--calibrate): a run's requests replayed through C's simulation
# at their own arrivals and lengths, under the run's engine settings, on the chunked scheduler
# with paged blocks (vLLM's and SGLang's), its p50 TPOT and E2E matched by the profile's
# constants. Fitted: the fixed costs and the card's shares every run exercises, and first,
# where a run crosses cards, the link's share its all-reduces (tp) or all-to-alls (ep) reach
# (C's collectives are its least checked price: no published calibration row crosses PCIe).
# A fit whose error on its own runs stays past CALIBRATE_MAX_ERROR has not converged: C's
# form cannot follow those runs.
CALIBRATE_FIELDS = ("step_s", "layer_s", "bandwidth_share", "matmul_share")
CALIBRATED = ("tpot_s", "e2e_s")
CALIBRATE_MAX_ERROR = 0.25
CALIBRATE_ROUNDS, CALIBRATE_TOLERANCE = 6, 1e-6  # (a round that lowers the mean squared log
                                                 # error by 1e-6 or less ends the search)
# What a run file may not say, as vLLM's server runs by default (--slots, --chunk-tokens)
RUN_DEFAULTS = {"slots": VLLM_MAX_NUM_SEQS, "chunk_tokens": 2048, "tp": 1, "ep": 1,
                "replicas": 1, "kv_tokens": None}
RUN_FORMATS = "vLLM's `bench serve --save-result --save-detailed` JSON, SGLang's " \
    "`bench_serving --output-details` JSONL, LLMServingSim's requests.jsonl or DistServe's .exp"


class MeasuredRun(NamedTuple):
    """A run of a real engine on a card, as C replays it: its requests (arrivals, lengths),
    what it measured (ttft_s, tpot_s, e2e_s: percentiles), the engine's settings."""
    path: str
    kind: str
    model: str
    gpu: str
    tp: int
    ep: int
    replicas: int
    slots: int
    chunk_tokens: int
    kv_tokens: int     # None: the profile's rule on the card (card_kv_tokens)
    requests: Requests
    measured: dict
    settings: dict


def run_kind(path):
    """A run file's format by its content -> (kind, the parsed file) or one line naming the
    formats C reads."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}")
    except UnicodeDecodeError:
        text = ""
    if path.endswith(".exp"):
        return "distserve", None
    lines = [line for line in text.splitlines() if line.strip()]
    data = None  # (one JSON object; else JSON lines: SGLang's last run, a log's request)
    for attempt in [text] + lines[-1:]:
        try:
            data = json.loads(attempt)
            break
        except ValueError:
            pass
    if isinstance(data, dict) and "input_lens" in data:
        return ("sglang-bench" if "dataset_name" in data or "server_info" in data
                else "vllm-bench"), data
    if isinstance(data, dict) and "input_toks" in data and "queued_ts" in data:
        return "llmservingsim", None
    if isinstance(data, dict) and "completed" in data and "duration" in data:
        raise UsageError(f"{path}: a benchmark's summary without its requests: save it with "
                         "--save-detailed (vLLM) or --output-details (SGLang)")
    raise UsageError(f"{path}: not a run C reads ({RUN_FORMATS})")


def read_measured_run(path, given):
    """A run file -> MeasuredRun: its requests and measurements, its model and card in C's
    names, and its settings (the file's, else `given`: the flags', else RUN_DEFAULTS)."""
    kind, data = run_kind(path)
    if kind.endswith("bench"):
        try:
            logged = read_bench_result(path, data, "vLLM" if kind == "vllm-bench" else "SGLang")
        except (KeyError, TypeError, IndexError, ValueError) as e:
            raise UsageError(f"{path}: a benchmark result without its per-request detail "
                             f"({one_line(e)})")
        stated = {k: v for k, v in logged["settings"].items() if k in ("model", "tp")}
        if logged["settings"].get("dp"):
            stated["replicas"] = logged["settings"]["dp"]
    else:
        logged = read_engine_run(path)
        meta = read_run_meta(path) if kind == "llmservingsim" else {}
        logged["settings"] = {**logged["settings"], **meta}
        stated = {k: meta.get(k) for k in ("model", "gpu", "tp", "slots", "chunk_tokens",
                                           "kv_tokens")}
        if meta.get("dp", 1) > 1:
            stated.update(replicas=meta["dp"], ep=meta["dp"] if meta["expert_parallel"] else 1)
    if not len(logged["output"]):
        raise UsageError(f"{path}: no completed requests in the run")
    fields = {**RUN_DEFAULTS, **{k: v for k, v in given.items() if v is not None},
              **{k: v for k, v in stated.items() if v}}
    for kind_name, key, flag in (("model", "model", "--model"), ("card", "gpu", "--gpu")):
        if not fields.get(key):
            raise UsageError(f"{path}: the run does not name its {kind_name}: give {flag}")
        try:
            fields[key] = named(fields[key], kind_name)
        except UsageError as e:
            raise UsageError(f"{path}: {e}")
    measured = {k: percentiles(logged[k]) for k in ("ttft_s", "tpot_s", "e2e_s")}
    req = Requests(logged["arrival_s"], logged["prompt"], logged["output"])
    return MeasuredRun(path, kind, requests=req, measured=measured,
                       settings=logged["settings"], **{f: fields[f] for f in (
                           "model", "gpu", "tp", "ep", "replicas", "slots", "chunk_tokens",
                           "kv_tokens")})


def replay_run(run, profile):
    """C's p50 TTFT, TPOT and E2E of a measured run under an engine profile: its requests at
    their arrivals (one replica's share where the run had several, as round-robin gives),
    the run's seats and step budget, paged blocks of the run's KV tokens (else the profile's
    on the card). None where the KV budget cannot hold a request."""
    cfg, card = MODELS[run.model], GPUS[run.gpu]
    req = every_nth(run.requests, run.replicas) if run.replicas > 1 else run.requests
    kv = KVBudget("paged", run.kv_tokens or card_kv_tokens(cfg, card, profile, run.tp, run.ep),
                  SchedulerConfig.block_tokens, int(req.output.max()), SchedulerConfig.watermark)
    if check_kv_budget(req, kv):
        return None
    replica = Replica(run.slots, card_costs(cfg, card, profile, run.tp, run.ep),
                      scheduler="chunked", chunk_tokens=run.chunk_tokens, kv=kv,
                      fused=profile.fused)
    metrics = serving_metrics(req, simulate_serving(req, replica))
    return {k: metrics[k]["p50"] for k in ("ttft_s", "tpot_s", "e2e_s")}


def calibration_errors(runs, profile):
    """[(C's p50s, {metric: signed error against the run's p50})] a run (None: unfit)."""
    out = []
    for run in runs:
        got = replay_run(run, profile)
        out.append((got, got and {k: got[k] / run.measured[k]["p50"] - 1 for k in got}))
    return out


def calibration_loss(runs, profile):
    """Mean squared log error of the CALIBRATED p50s (a run C cannot fit counts 100% off)."""
    errors = [math.log(1 + err[k]) if err else math.log(2.0)
              for _, err in calibration_errors(runs, profile) for k in CALIBRATED]
    return float(np.mean(np.square(errors)))


def calibrate(runs, start):
    """The start profile's constants fitted to the runs (see CALIBRATE_FIELDS) -> (profile,
    its rms log error on them); one line where the fit does not converge."""
    fields = tuple(f for f, crossed in (("link_share", any(r.tp > 1 for r in runs)),
                                        ("all_to_all_share", any(r.ep > 1 for r in runs)))
                   if crossed) + CALIBRATE_FIELDS
    profile, loss, _ = coordinate_search(start, lambda p: calibration_loss(runs, p), fields,
                                         CALIBRATE_ROUNDS, CALIBRATE_TOLERANCE)
    if math.sqrt(loss) > CALIBRATE_MAX_ERROR:
        raise UsageError(f"the fit did not converge: its error on the runs it saw stays near "
                         f"{math.expm1(math.sqrt(loss)):.0%} (C's form cannot follow them; "
                         "are the card, the model and the engine's settings the run's?)")
    cards = sorted({r.gpu for r in runs})
    names = ", ".join(run_label(r) for r in runs)
    return dataclasses.replace(profile, name=f"{start.name} on {', '.join(cards)} (calibrated)",
                               fitted_on=f"{len(runs)} measured run(s): {names}"), \
        math.sqrt(loss)


def run_label(run):
    """A run by name: LLMServingSim's by its folder (each run a folder), others by file."""
    folder = os.path.basename(os.path.dirname(os.path.abspath(run.path)))
    return folder if run.kind == "llmservingsim" else os.path.basename(run.path)


def leave_one_out(runs, start):
    """Each run's errors under a profile calibrated on the others (none for a single run)."""
    if len(runs) < 2:
        return []
    return [calibration_errors([run], calibrate(runs[:i] + runs[i + 1:], start)[0])[0]
            for i, run in enumerate(runs)]
