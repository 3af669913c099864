"""Published measurements: C's prices against real engines on real GPUs (pure)

Each row of a published table (an engine, a model, a card, a precision, TP, a workload and
what was measured) is predicted from C's prices: a batch-1 decode rate, a first token, a
static batch's throughput, or an in-flight batch's steady state under all-queued load. The
profiles' constants are fitted on the calibration file's rows alone (tests/fit_profiles.py);
every other row is validation. Calls the accounting and the step costs.
"""
import dataclasses
import os
from typing import NamedTuple

import numpy as np

from nn40.accounting import card_weight_bytes
from nn40.config import GPUS, MODELS, WEIGHT_FORMATS
from nn40.names import find_name
from nn40.pricing import ENGINE_PROFILES, card_costs, card_kv_tokens


# (cards and models by name_key and NAME_ALIASES; an engine by its source's prefix or its
# engine_version's first word, letters alone)
PUBLISHED_ENGINES = {"trtllm": "tensorrt-llm", "tensorrtllm": "tensorrt-llm",
                     "gptfast": "gpt-fast", "vllm": "vllm"}
# a metric per card, as the whole TP group's times its cards
PUBLISHED_PER_GPU = {"output_tokens_per_s_per_gpu": "output_tokens_per_s"}
GPT_FAST_OUTPUT = 200  # gpt-fast's generate.py default max_new_tokens (its README: none)
PUBLISHED_METRICS = ("tokens_per_s_per_user", "ttft_ms", "output_tokens_per_s")


class Published(NamedTuple):
    """One published measurement, in C's names; `role`: calibration or validation."""
    source: str
    engine: str
    model: str
    gpu: str
    tp: int
    weights: str
    kv_dtype: str
    batch: object      # an int (a static batch), or "max-load" (in-flight, all queued)
    isl: int
    osl: int
    metric: str
    value: float
    role: str


# the columns a file of published rows must have (a|b: either)
PUBLISHED_COLUMNS = ("source_id", "model", "gpu", "tp", "weights|weight_dtype",
                     "batch|batch_or_concurrency", "isl", "osl", "metric", "value")


class RowUnusable(ValueError):
    """A row C cannot read (a blank field it needs, a value it cannot parse): its reason."""


def published_weights(text):
    """A table's precision in C's names: "int4 weight-only g32" -> int4."""
    name = text.split()[0].lower() if text else ""
    if name not in WEIGHT_FORMATS:
        raise RowUnusable(f"precision {text!r}" if name else "blank precision")
    return name


def row_number(r, name, parse=int):
    """A row's number in column `name`, or RowUnusable: blank, or not a number."""
    text = (r.get(name) or "").strip()
    if not text:
        raise RowUnusable(f"blank {name}")
    try:
        return parse(text)
    except ValueError:
        raise RowUnusable(f"{name} {text!r}") from None


def published_row(r, role):
    """A CSV row (calibration.csv's columns or tests/data/published.csv's) -> Published, or
    the reason C cannot express it (a model or card it cannot name)."""
    model, gpu = find_name(r["model"], "model"), find_name(r["gpu"], "card")
    engine = published_engine(r)
    if model is None or gpu is None or engine is None:
        what, name = ("model", r["model"]) if model is None else ("card", r["gpu"]) \
            if gpu is None else ("engine", r["source_id"])
        return f"{what} {name}"
    batch = (r.get("batch") or r.get("batch_or_concurrency") or "").strip()
    metric, value, tp = r["metric"], row_number(r, "value", float), row_number(r, "tp")
    if metric in PUBLISHED_PER_GPU:  # (n_gpus where the file says, else the TP group's)
        gpus = row_number(r, "n_gpus") if (r.get("n_gpus") or "").strip() else tp
        metric, value = PUBLISHED_PER_GPU[metric], value * gpus
    if metric not in PUBLISHED_METRICS or not (batch == "max-load" or batch.isdigit()):
        return f"metric {metric}" if metric not in PUBLISHED_METRICS else \
            f"batch {batch}" if batch else "blank batch"
    weights = published_weights(r.get("weights") or r.get("weight_dtype"))
    kv = (r.get("kv_dtype") or "").lower()
    # (the L40S's KV type is not stated: TensorRT-LLM's FP8 builds take an FP8 cache)
    kv = "fp8" if kv == "fp8" or (not kv and weights == "fp8") else "auto"
    osl = row_number(r, "osl") if (r["osl"] or "").strip() else GPT_FAST_OUTPUT  # (gpt-fast's)
    return Published(r["source_id"], engine, model, gpu, tp, weights, kv,
                     batch if batch == "max-load" else int(batch), row_number(r, "isl"), osl,
                     metric, value, role)


def published_engine(r):
    """A published row's engine in C's names: its source's prefix ("trtllm_perf_v0.14.0"), or
    its engine_version's first word ("TensorRT-LLM v0.14.0") (None: neither names one)."""
    for text in (r["source_id"].split("_")[0], (r.get("engine_version") or "").split(" ")[0]):
        engine = PUBLISHED_ENGINES.get("".join(c for c in text.lower() if c.isalpha()))
        if engine:
            return engine
    return None


def read_published(path, role):
    """-> (the rows C can express, {reason: rows it cannot}), read row by row: a row C cannot
    read (a blank field it needs, a value it cannot parse) is left out with its reason and
    its lines named; a column missing from the file refuses the file (KeyError)."""
    import csv
    rows, left, unread = [], {}, {}
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        have = set(reader.fieldnames or ())
        missing = [c for c in PUBLISHED_COLUMNS if not set(c.split("|")) & have]
        if missing:
            raise KeyError(f"no column {' or '.join(missing[0].split('|'))}")
        for r in reader:
            try:
                row = published_row(r, role)
            except RowUnusable as e:
                unread.setdefault(str(e), []).append(reader.line_num)
                continue
            if isinstance(row, str):
                left[row] = left.get(row, 0) + 1
            else:
                rows.append(row)
    for why, lines in unread.items():
        left[f"{why}: line{'s' * (len(lines) > 1)} {', '.join(map(str, lines))}"] = len(lines)
    return rows, left


def row_model(row):
    return dataclasses.replace(MODELS[row.model], weights=row.weights, kv_dtype=row.kv_dtype,
                               dtype="float16" if row.weights == "fp16" else "bfloat16")


def max_load_tokens_per_s(costs, kv_tokens, profile, isl, osl):
    """Output tokens/s of an in-flight batch under all-queued load, in its steady state: as
    many rows as the KV cache holds with each request's whole length reserved at admission
    (TensorRT-LLM's guaranteed-no-evict) and the engine's batch allows; every step each row
    decodes a token and batch/osl prompts start, their tokens in the same pass (up to the
    engine's tokens per pass); the rows' caches hold isl + osl/2 tokens on average. The
    engine's limits are its Replica's (EngineProfile.replica), as C's simulation reads them."""
    per_step = 1 + isl / osl  # tokens per row per step
    replica = profile.replica(costs)
    batch = min(replica.slots, kv_tokens // (isl + osl), replica.chunk_tokens / per_step)
    if batch < 1:
        return None
    tokens = max(round(batch * per_step), 1)
    pairs = batch / osl * prompt_pairs(isl)  # (a prompt's, whether or not it is chunked)
    step_s = costs.pass_s(tokens, batch * (isl + osl / 2), pairs)
    return batch / step_s


def prompt_pairs(isl):
    """The (query, key) pairs a prompt's attention computes: each token sees itself and
    every token before it."""
    return isl * (isl + 1) // 2


def predict_published(row, profile):
    """C's value of a published row's metric under an engine profile (None: it does not fit)."""
    cfg, card = row_model(row), GPUS[row.gpu]
    if card_weight_bytes(cfg, row.tp) > card.memory_bytes:
        return None
    costs = card_costs(cfg, card, profile, row.tp)
    if row.metric == "ttft_ms":
        return 1e3 * costs.pass_s(row.batch * row.isl, 0, row.batch * prompt_pairs(row.isl))
    if row.batch == "max-load":
        return max_load_tokens_per_s(costs, card_kv_tokens(cfg, card, profile, row.tp),
                                     profile, row.isl, row.osl)
    b, isl, osl = row.batch, row.isl, row.osl
    seconds = costs.pass_s(b * isl, 0, b * prompt_pairs(isl)) + costs.run_s(b, b * isl, osl - 1)
    return (b * osl if row.metric == "output_tokens_per_s" else osl) / seconds


def published_errors(rows, profiles):
    """[(row, predicted, signed error predicted / published - 1)], each by its engine's
    profile (None where it does not fit)."""
    out = []
    for row in rows:
        got = predict_published(row, profiles[row.engine])
        out.append((row, got, None if got is None else got / row.value - 1))
    return out


def error_summary(errors):
    """Rows, median absolute and signed error, and the worst row of a list of errors."""
    e = np.array([x for x in errors if x is not None])
    if not len(e):
        return {"rows": 0}
    return {"rows": len(e), "median_abs": float(np.median(np.abs(e))),
            "median": float(np.median(e)), "max_abs": float(np.abs(e).max()),
            "within_15": float(np.mean(np.abs(e) <= 0.15)), "unfit": len(errors) - len(e)}


# The grid every profile fit searches (tests/fit_profiles.py on published rows, --calibrate on
# a user's runs): each field's values, in its units
PROFILE_GRID = {"bandwidth_share": np.linspace(0.5, 1.0, 51),
                "matmul_share": np.linspace(0.3, 1.0, 36),
                "half_tokens": np.array([0, 16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536,
                                         2048]),
                "step_s": np.linspace(0, 5e-3, 101), "layer_s": np.linspace(0, 150e-6, 61),
                "allreduce_s": np.linspace(0, 300e-6, 61), "link_share": np.linspace(0.1, 1, 91),
                "all_to_all_share": np.linspace(0.1, 1, 91),
                "reserved_gb": np.linspace(0, 12, 25), "dequant_flops": np.linspace(0, 300, 61),
                "activation_passes": np.linspace(0, 20, 41)}


def coordinate_search(profile, loss, fields, rounds=12, tolerance=1e-12):
    """A profile's `fields` fitted by coordinate search over PROFILE_GRID: each field in turn
    takes the grid value of least loss(profile), until a round lowers the loss by no more
    than `tolerance`. -> (the profile, its loss, whether it settled before `rounds` ran out)."""
    best = loss(profile)
    for _ in range(rounds):
        start = best
        for field in fields:
            for value in PROFILE_GRID[field]:
                trial = dataclasses.replace(profile, **{field: float(value)})
                trial_loss = loss(trial)
                if trial_loss < best - 1e-12:
                    best, profile = trial_loss, trial
        if best >= start - tolerance:
            return profile, best, True
    return profile, best, False


def validate(path, calibration_path=None, profiles=None):
    """--validate: every row of the published file (validation) and of the calibration file
    (where it exists) predicted by its engine's profile. -> the rows with their errors, a
    summary by source and role, and what C could not express."""
    profiles = profiles or ENGINE_PROFILES
    rows, left = read_published(path, "validation")
    if calibration_path and os.path.exists(calibration_path):
        cal, cal_left = read_published(calibration_path, "calibration")
        rows += cal
        left.update({f"{k} (calibration)": v for k, v in cal_left.items()})
    # (mixtures of experts apart: the profiles were fitted on dense rows alone)
    rows = [r._replace(role=f"{r.role}, MoE") if MODELS[r.model].experts else r for r in rows]
    errors = published_errors(rows, profiles)
    by = {}
    for row, _, err in errors:
        by.setdefault((row.role, row.source), []).append(err)
        by.setdefault((row.role, "all"), []).append(err)
    return {"rows": [{**row._asdict(), "predicted": got, "error": err,
                      "profile": profiles[row.engine].name} for row, got, err in errors],
            "summary": [{"role": role, "source": source, **error_summary(errs)}
                        for (role, source), errs in sorted(by.items())],
            "left_out": left, "profiles": {k: p.fields() for k, p in profiles.items()},
            "files": {"validation": path, "calibration": calibration_path}}
