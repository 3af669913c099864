"""Request traces in the forms people have, read row by row into token counts and arrival
seconds: CSV and JSONL files with named columns (Azure's, BurstGPT's, Mooncake's without its
hash ids, Vidur's and Splitwise's, or plain names), and vLLM's benchmark results (JSON).
Column names match whatever their case, spaces and underscores. Every bad row is named."""
import csv
import datetime
import json
import math
from typing import NamedTuple

import numpy as np

from nn40.errors import UsageError, read_json

COUNT_MAX = 10**9  # the largest count a flag or a row takes: past any run here, inside 64 bits
BAD_ROWS_SHOWN = 3  # the bad rows an error names (then how many more)


class TraceFormat(NamedTuple):
    """One accepted set of columns: the prompt's, the output's, the arrival's (None: the
    format has none) and the arrival's unit in seconds (None: a date and time, or seconds)."""
    name: str
    prompt: str
    output: str
    time: str = None
    time_s: float = None
    skip_failed: bool = False  # rows of 0 output tokens are failed requests, left out


# in the order tried; an optional time column is read where present
TRACE_FORMATS = (
    TraceFormat("Azure", "ContextTokens", "GeneratedTokens", "TIMESTAMP"),
    TraceFormat("BurstGPT", "Request tokens", "Response tokens", "Timestamp", 1.0,
                skip_failed=True),
    TraceFormat("Mooncake without hash_ids", "input_length", "output_length", "timestamp",
                1e-3),
    TraceFormat("Vidur and Splitwise", "num_prefill_tokens", "num_decode_tokens",
                "arrived_at", 1.0),
    TraceFormat("plain", "prompt_tokens", "output_tokens", "arrival_s", 1.0),
)


def key(name):
    """A column's name as matched: lowercase, without spaces, underscores or dashes."""
    return "".join(c for c in str(name).lower() if c not in " _-")


def accepted():
    """Every accepted set of columns, as an error lists them."""
    return "; ".join(f"{f.name}: {f.prompt}, {f.output}" + (f" [, {f.time}]" if f.time else "")
                     for f in TRACE_FORMATS) + "; vLLM's benchmark JSON: input_lens, " \
        "output_lens [, start_times]"


def trace_format(path, names):
    """The format whose columns the header names (see key). -> (TraceFormat, {role: column
    index or None})"""
    index = {key(n): i for i, n in enumerate(names)}
    for form in TRACE_FORMATS:
        if key(form.prompt) in index and key(form.output) in index:
            return form, {"prompt": index[key(form.prompt)], "output": index[key(form.output)],
                          "time": index.get(key(form.time)) if form.time else None}
    found = ", ".join(str(n) for n in names) or "none"
    raise UsageError(f"{path}:1: no recognised columns (found: {found}; accepted: "
                     f"{accepted()})")


def seconds(text, unit):
    """A timestamp: a number (times `unit` seconds, 1 where the format has none), or a date
    and time ('2023-11-16 18:15:46.6805900', '2024-05-10 00:00:00.009930+00:00', ISO 8601),
    read as UTC where it names no zone. -> POSIX seconds; ValueError where it is neither."""
    text = str(text).strip()
    try:
        value = float(text) * (unit or 1.0)
    except ValueError:
        try:
            return date_seconds(text)
        except ValueError:
            raise ValueError(f"timestamp {text!r} is neither seconds nor a date and time")
    if not math.isfinite(value):
        raise ValueError(f"timestamp {text!r} is not finite")
    return value


def date_seconds(text):
    """A date and time -> POSIX seconds (fractions past microseconds kept)."""
    head, dot, rest = text.replace("T", " ").replace("Z", "+00:00").partition(".")
    digits = rest[:len(rest) - len(rest.lstrip("0123456789"))]  # (the fraction's digits)
    zone = rest[len(digits):]
    stamp = datetime.datetime.fromisoformat(head + zone)
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=datetime.timezone.utc)
    return stamp.timestamp() + (float("0." + digits) if digits else 0.0)


def count(value, what):
    """A token count: a whole number from 0 to COUNT_MAX (ValueError naming `what`)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} {value!r} is not a number")
    if not (math.isfinite(number) and number == int(number) and 0 <= number <= COUNT_MAX):
        raise ValueError(f"{what} must be a whole number from 0 to {COUNT_MAX:,}")
    return int(number)


class Rows:
    """Requests gathered row by row, and the rows that were bad, each with its line."""

    def __init__(self, path, form):
        self.path, self.form = path, form
        self.prompt, self.output, self.stamps, self.bad, self.failed = [], [], [], [], 0

    def add(self, where, prompt, output, stamp):
        """One row's values (raw: checked here); a bad one remembered with where and why."""
        try:
            p, o = count(prompt, "the prompt's tokens"), count(output, "the output's tokens")
            t = None if stamp is None else seconds(stamp, self.form.time_s)
        except (ValueError, TypeError, OverflowError) as e:
            self.bad.append(f"{where}: {e}")
            return
        if o == 0 and self.form.skip_failed:
            self.failed += 1
        elif o == 0:
            self.bad.append(f"{where}: an output of 0 tokens")
        elif t is not None and self.stamps and t < self.stamps[-1]:
            self.bad.append(f"{where}: a timestamp earlier than the row before")
        else:
            self.prompt.append(p)
            self.output.append(o)
            self.stamps.append(t)

    def result(self):
        """-> Trace; a UsageError naming the bad rows (the first few, and how many)."""
        if self.bad:
            more = len(self.bad) - BAD_ROWS_SHOWN
            raise UsageError(f"{self.path}: bad rows: " + "; ".join(
                self.bad[:BAD_ROWS_SHOWN]) + (
                f"; and {more:,} more" if more > 0 else ""))
        if not self.prompt:
            raise UsageError(f"{self.path}: no requests in the trace")
        timed = self.stamps[0] is not None
        times = np.array(self.stamps) - self.stamps[0] if timed else None
        return Trace(np.maximum(np.array(self.prompt, dtype=np.int64), 1),
                     np.array(self.output, dtype=np.int64), times, self.form.name,
                     self.failed)


class Trace(NamedTuple):
    prompt: np.ndarray
    output: np.ndarray
    arrival_s: np.ndarray  # from the first request (None: the file has no times)
    form: str              # the format it was read as
    failed: int = 0        # rows left out as failed requests (BurstGPT's 0-token responses)


def read_csv_trace(path, limit=None):
    """A CSV trace (see TRACE_FORMATS) -> Trace."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            lines = csv.reader(f)
            header = next(lines, None)
            if header is None:
                raise UsageError(f"{path}: empty trace")
            form, cols = trace_format(path, [h.strip() for h in header])
            rows = Rows(path, form)
            for line, row in enumerate(lines, 2):
                if limit is not None and len(rows.prompt) >= limit:
                    break
                if any(cell.strip() for cell in row):
                    rows.add(f"line {line}", *(row_cell(row, cols[k])
                                               for k in ("prompt", "output", "time")))
    except OSError as e:
        raise UsageError(f"cannot read trace {path}: {e.strerror}")
    except (UnicodeDecodeError, csv.Error) as e:
        raise UsageError(f"{path}: not a CSV text file ({e})")
    return rows.result()


def row_cell(row, index):
    """A row's cell (None: no such column; '' where the row is short)."""
    if index is None:
        return None
    return row[index] if index < len(row) else ""


def read_jsonl_trace(path, limit=None):
    """A JSONL trace, one request an object (see TRACE_FORMATS; the first line's names decide
    the format) -> Trace."""
    try:
        with open(path, encoding="utf-8") as f:
            rows, cols = None, None
            for line, text in enumerate(f, 1):
                if not text.strip():
                    continue
                try:
                    obj = json.loads(text)
                except ValueError:
                    obj = None
                if not isinstance(obj, dict):
                    raise UsageError(f"{path}:{line}: expected a JSON object a line")
                if rows is None:
                    form, _ = trace_format(path, list(obj))
                    rows, cols = Rows(path, form), {key(k): k for k in obj}
                if limit is not None and len(rows.prompt) >= limit:
                    break
                rows.add(f"line {line}", *(obj.get(cols.get(key(name), name)) if name else None
                                           for name in (form.prompt, form.output, form.time)))
    except OSError as e:
        raise UsageError(f"cannot read trace {path}: {e.strerror}")
    except UnicodeDecodeError as e:
        raise UsageError(f"{path}: not a text file ({e})")
    if rows is None:
        raise UsageError(f"{path}: empty trace")
    return rows.result()


def read_bench_json(path, limit=None):
    """vLLM's benchmark result (`vllm bench serve --save-result --save-detailed`): input_lens
    and output_lens, a request each, and where saved, start_times (the client's clock at each
    request's start: only differences mean anything) and errors (a failed request's is not
    empty; its output 0): failed requests left out and counted -> Trace."""
    data = read_json(path, "trace ", detail=True)
    if not isinstance(data, dict) or not all(isinstance(data.get(k), list)
                                             for k in ("input_lens", "output_lens")):
        raise UsageError(f"{path}: a JSON trace is vLLM's benchmark result with input_lens and "
                         f"output_lens (--save-detailed); the other accepted forms: {accepted()}")
    starts, errors = data.get("start_times"), data.get("errors")
    lists = {k: data[k] for k in ("input_lens", "output_lens", "start_times", "errors")
             if isinstance(data.get(k), list)}
    if len({len(v) for v in lists.values()}) > 1:
        raise UsageError(f"{path}: its lists differ in length (" + ", ".join(
            f"{k} {len(v):,}" for k, v in lists.items()) + "): one entry a request")
    form = TraceFormat("vLLM's benchmark JSON", "input_lens", "output_lens",
                       "start_times" if isinstance(starts, list) else None, 1.0,
                       skip_failed=True)
    rows = Rows(path, form)
    order = range(len(data["input_lens"]))
    if form.time:  # (requests in the order they started)
        order = sorted(order, key=lambda i: starts[i] if i < len(starts) and isinstance(
            starts[i], (int, float)) else math.inf)
    for i in list(order)[:limit]:
        failed = isinstance(errors, list) and errors[i]
        rows.add(f"request {i}", data["input_lens"][i], 0 if failed else data["output_lens"][i],
                 starts[i] if form.time else None)
    return rows.result()


def read_named_trace(path, limit=None):
    """A trace file by its kind: .json (vLLM's benchmark), .jsonl, else CSV -> Trace."""
    if path.endswith(".json"):
        return read_bench_json(path, limit)
    if path.endswith(".jsonl"):
        return read_jsonl_trace(path, limit)
    return read_csv_trace(path, limit)
