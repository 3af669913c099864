"""Workload: the requests C serves, their lengths and arrivals (pure NumPy)

The post's log-normal law, a lengths file or a trace; arrivals at t=0, Poisson or gamma, or
the trace's own timestamps. Imports errors, traces, config and host.
"""
import json
import math
import os
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from nn40.config import (
    LENGTH_MAX, LENGTH_MU, LENGTH_SIGMA, MAX_SPAN_S, REQUEST_BYTES, SEED_OFFSET, SWEEP_REQUESTS)
from nn40.errors import UsageError
from nn40.host import free_host_memory_bytes, gib, log, one_line
from nn40.traces import COUNT_MAX, read_named_trace


def seed_for(run, stream, k=0):
    """The seed of a run's random stream by name (SEED_OFFSET; k: the stream's k-th draw)."""
    return run.workload.seed + SEED_OFFSET[stream] + k


def random_stream(run, stream):
    """A run's NumPy generator for the stream `stream` (see seed_for)."""
    return np.random.default_rng(seed_for(run, stream))


def lognormal_lengths(n, seed, mu=LENGTH_MU, sigma=LENGTH_SIGMA, max_len=LENGTH_MAX):
    """n generated lengths: floor(e^x), x ~ N(mu, sigma^2) (median e^mu), in [1, max_len]."""
    draws = np.random.default_rng(seed).lognormal(mu, sigma, size=n)
    return np.clip(np.floor(draws), 1, max_len).astype(np.int64)


def read_lengths_file(path):
    """One positive integer per line; blank lines and '#' comments are allowed."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as e:
        raise UsageError(f"cannot read lengths file {path}: {e.strerror}")
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not a text file")
    lengths = []
    for lineno, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            value = int(text)
        except ValueError:
            value = 0
        if not 0 < value <= COUNT_MAX:
            raise UsageError(f"{path}:{lineno}: expected a positive integer up to "
                             f"{COUNT_MAX:,}, got {text!r}")
        lengths.append(value)
    if not lengths:
        raise UsageError(f"{path}: no lengths in the file")
    return np.array(lengths, dtype=np.int64)


def request_lengths(run):
    if run.workload.lengths_file:
        return read_lengths_file(run.workload.lengths_file)
    return lognormal_lengths(run.workload.requests, run.workload.seed)


@dataclass(frozen=True)
class Requests:
    arrival_s: np.ndarray  # (n,) sorted
    prompt: np.ndarray     # (n,) prompt tokens
    output: np.ndarray     # (n,) generated tokens (>= 1)
    cached: np.ndarray = None  # (n,) prompt tokens already cached on arrival (None: none)
    identity: object = None    # what the prompts are made of (HashedPrompts, SharedPrompts)

    def take(self, index=slice(None), arrival_s=None):
        """The requests at `index` (a slice or an index array), arriving at `arrival_s`
        instead of their own times when it is given."""
        return Requests(self.arrival_s[index] if arrival_s is None else arrival_s,
                        self.prompt[index], self.output[index],
                        None if self.cached is None else self.cached[index],
                        None if self.identity is None else self.identity.take(index))


# A prompt's identity: the key of each of its full KV blocks, equal keys for equal tokens (and
# equal tokens before them), so a cache can find the longest run of a prompt's leading blocks it
# holds. block_keys(r, tokens, block) -> the keys of the first tokens // block blocks of request
# r's context, fewer where the rest is its own text (no other request can share it).
HASH_BLOCK_TOKENS = 512  # Mooncake's traces: one hash id per 512 prompt tokens
CHAIN_MASK = (1 << 52) - 1  # a chain of hash ids, cut to leave 10 bits for a block's place


class HashedPrompts:
    """Prompts known by the hash ids of their 512-token blocks (Mooncake's traces): two prompts
    whose lists start with the same ids share those tokens. An engine block of b tokens (b
    divides 512) is keyed by the chain of ids up to its 512-token block and its place in it;
    the prompt's blocks only (no id names the answer a preempted request prefills again)."""

    def __init__(self, hash_ids, prompt, hash_tokens=HASH_BLOCK_TOKENS):
        self.hash_ids, self.prompt = hash_ids, prompt  # (n,): tuples of ids, prompt tokens
        self.hash_tokens, self.last = hash_tokens, (None, None)  # ((r, tokens, block), keys)

    def take(self, index):
        return HashedPrompts(self.hash_ids[index], self.prompt[index], self.hash_tokens)

    def block_keys(self, r, tokens, block):
        if self.last[0] != (r, tokens, block):
            self.last = ((r, tokens, block), self.chained_keys(r, tokens, block))
        return self.last[1]

    def chained_keys(self, r, tokens, block):
        per, ids = self.hash_tokens // block, self.hash_ids[r]
        n = min(tokens, int(self.prompt[r])) // block
        chains, chain = [], 0
        for i in range(min(-(-n // per), len(ids))):
            chain = hash((chain, ids[i]))
            chains.append(chain & CHAIN_MASK)
        # a block's key: its 512-token block's chain, shifted, and its place in that block
        return (np.left_shift(np.array(chains, dtype=np.int64), 10)[:, None]
                + np.arange(per)).ravel()[:n].tolist()

    def covers_output(self, r):
        return False


OWN_KEYS = 1 << 64  # keys of a request's own blocks: OWN_KEYS + (request << 24) + block, past
# every prompt identity's keys (they fit in 64 bits)


def every_block_key(identity, r, tokens, block):
    """The keys of request r's first tokens // block blocks, one a block: its prompt identity's
    (None: none), then keys of its own for the blocks no other request can share (its own text
    and answer: what only the request itself finds again, preempted, or a router's record of
    what it sent where)."""
    keys = identity.block_keys(r, tokens, block) if identity is not None else []
    n = tokens // block
    if n <= len(keys):
        return keys
    base = OWN_KEYS + (r << 24)
    return keys + list(range(base + len(keys), base + n))


class SharedPrompts:
    """Prompts that open with one of a few system prompts and go on with a conversation:
    request r's context is system prompt system[r] (system_tokens[system[r]] tokens; -1: none)
    then, where conversation[r] >= 0, that conversation's transcript (its earlier turns'
    messages and answers, then its own message and its answer), else text of its own."""

    def __init__(self, system, system_tokens, conversation):
        self.system, self.system_tokens, self.conversation = system, system_tokens, conversation
        # (as lists, read once a request: a NumPy scalar costs more than the keys)
        self.lists = (np.asarray(system).tolist(), np.asarray(system_tokens).tolist(),
                      np.asarray(conversation).tolist())
        self.opening = {}  # (system prompt, blocks) -> their keys, made once (not to be changed)

    def take(self, index):
        return SharedPrompts(self.system[index], self.system_tokens, self.conversation[index])

    def block_keys(self, r, tokens, block):
        system, system_tokens, conversation = self.lists
        s, c = system[r], conversation[r]
        shared = system_tokens[s] // block if s >= 0 else 0
        n = min(tokens // block, shared)
        keys = self.opening.get((s, n))
        if keys is None:  # (a system prompt's blocks)
            keys = self.opening[s, n] = list(range((s + 1) << 32, ((s + 1) << 32) + n))
        if c >= 0:  # then the conversation's: its transcript starts with its system prompt
            keys = keys + list(range(-((c + 1) << 32) - n, -((c + 1) << 32) - tokens // block,
                                     -1))
        return keys

    def covers_output(self, r):
        """The answer is part of the transcript the next turn sends again."""
        return self.lists[2][r] >= 0


def read_trace(path, limit=None):
    """A request trace -> (prompt, output, arrival seconds from the first or None): a real
    engine's log of its requests (see read_engine_run), else a trace in one of the forms
    nn40.traces reads (its failed requests left out, said once)."""
    if is_engine_run(path):
        logged = read_engine_run(path, limit)
        return logged["prompt"], logged["output"], logged["arrival_s"]
    trace = read_named_trace(path, limit)
    if trace.failed or trace.form.startswith("Mooncake"):
        log(f"{path}: read as {trace.form}" + (
            f", {trace.failed:,} failed requests (0 output tokens) left out" if trace.failed
            else "") + (": no hash ids, so no prompts share a prefix"
                        if trace.form.startswith("Mooncake") else ""))
    return trace.prompt, trace.output, trace.arrival_s


# Real engines' logs of their requests: LLMServingSim's vLLM runs (requests.jsonl, with the
# engine's settings in meta.json beside it) and DistServe's (*.exp, a Python list of dicts)


def first_jsonl_line(path):
    """A JSONL file's first non-blank line ("" where there is none; None where it cannot be
    read: its reader says why)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return next((line for line in f if line.strip()), "")
    except OSError:
        return None


def is_hashed_trace(path):
    """A JSONL trace whose first line names Mooncake's hash ids (without them, a trace of
    lengths and times: see nn40.traces)."""
    return path.endswith(".jsonl") and '"hash_ids"' in (first_jsonl_line(path) or "")


def is_engine_run(path):
    """DistServe's log (.exp), or LLMServingSim's requests.jsonl (its first line names
    input_toks; one that cannot be read goes to read_engine_run, which says why)."""
    if not path.endswith(".jsonl"):
        return path.endswith(".exp")
    first = first_jsonl_line(path)
    return first is None or '"input_toks"' in first


def hashed_trace_row(row, hash_tokens):
    """One line of a hash-id trace, checked. -> (timestamp ms, input, output, hash ids), or
    raises ValueError saying what is wrong with it."""
    if not isinstance(row, dict):
        raise ValueError("expected a JSON object")
    fields = ("timestamp", "input_length", "output_length", "hash_ids")
    missing = [k for k in fields if k not in row]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    stamp, prompt, output, ids = (row[k] for k in fields)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < math.inf
               for v in (stamp, prompt, output)) or not (prompt == int(prompt)
                                                        and output == int(output)):
        raise ValueError("timestamp, input_length and output_length must be finite numbers "
                         ">= 0 (the lengths whole)")
    if not 0 < output <= COUNT_MAX or not 0 < prompt <= COUNT_MAX:
        raise ValueError(f"input_length and output_length must be 1 to {COUNT_MAX:,}")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                            for i in ids):
        raise ValueError("hash_ids must be a list of integers")
    blocks = -(-int(prompt) // hash_tokens)
    if len(ids) != blocks:
        raise ValueError(f"{len(ids)} hash_ids for input_length {int(prompt)} at "
                         f"{hash_tokens} tokens a block (expected {blocks})")
    return float(stamp), int(prompt), int(output), tuple(ids)


def read_hashed_trace(path, limit=None, block=16, hash_tokens=HASH_BLOCK_TOKENS):
    """Mooncake's JSONL (timestamp in ms, input_length, output_length, hash_ids), each line
    checked -> Requests at its times, known by their blocks (HashedPrompts: `block` divides)."""
    if hash_tokens % block:
        raise UsageError(f"{path}: a block of {block} tokens does not divide the trace's "
                         f"{hash_tokens}-token hash blocks (--block-tokens)")
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if limit is not None and len(rows) >= limit:
                    break
                if not line.strip():
                    continue
                try:
                    rows.append(hashed_trace_row(json.loads(line), hash_tokens))
                except (ValueError, OverflowError) as e:  # (json's are ValueErrors too)
                    raise UsageError(f"{path}:{lineno}: {one_line(e)}")
                if len(rows) > 1 and rows[-1][0] < rows[-2][0]:
                    raise UsageError(f"{path}:{lineno}: timestamp earlier than the line before")
    except OSError as e:
        raise UsageError(f"cannot read trace {path}: {e.strerror}")
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not a text file")
    if not rows:
        raise UsageError(f"{path}: no requests in the trace")
    stamps, prompt, output, ids = zip(*rows)
    hash_ids = np.empty(len(ids), dtype=object)
    hash_ids[:] = ids
    arrival = (np.array(stamps) - stamps[0]) / 1e3
    return Requests(arrival, np.array(prompt, dtype=np.int64), np.array(output, dtype=np.int64),
                    identity=HashedPrompts(hash_ids, np.array(prompt), hash_tokens))


class PrefixWorkload(NamedTuple):
    """Shared prefixes in generated requests (see shared_prompts)."""
    prefix_len: int = 0         # tokens of each system prompt (0: none)
    num_prefixes: int = 1       # how many system prompts
    share: float = 1.0          # share of conversations opened by one
    zipf: float = 1.0           # popularity: the i-th system prompt drawn as 1 / i^zipf
    turns: int = 1              # turns per conversation (1: single requests)
    think_time_s: float = 0.0   # mean gap between a conversation's turns


def shared_prompts(req, prefix, rng):
    """Requests whose prompts share prefixes the way chat traffic does: system prompts opening
    a share of the conversations, and conversations of several turns, a turn's prompt the
    previous prompt, its answer and a new message (each request's own prompt length),
    arriving an exponential think time after the previous turn's arrival (the trace is
    open-loop: a turn may come before the answer it repeats has been computed). req's
    arrivals open the conversations. -> Requests in arrival order, with their identity."""
    n, turns = len(req.output), prefix.turns
    convs = -(-n // turns)
    weights = 1.0 / np.arange(1, prefix.num_prefixes + 1) ** prefix.zipf
    system = rng.choice(prefix.num_prefixes, size=convs, p=weights / weights.sum())
    system[(rng.random(convs) >= prefix.share) | (prefix.prefix_len == 0)] = -1
    conv, turn = np.arange(n) // turns, np.arange(n) % turns  # request i: a turn of conv
    think = rng.exponential(prefix.think_time_s, size=(convs, turns))
    think[:, 0] = 0.0
    arrival = (req.arrival_s[:convs, None] + np.cumsum(think, axis=1)).ravel()[:n]
    context = req.prompt + np.where(system[conv] >= 0, prefix.prefix_len, 0)
    for t in range(1, turns):  # the conversation so far, then the turn's message
        later = np.flatnonzero(turn == t)
        context[later] = context[later - 1] + req.output[later - 1] + req.prompt[later]
    order = np.argsort(arrival, kind="stable")
    identity = SharedPrompts(system[conv][order],
                             np.full(prefix.num_prefixes, prefix.prefix_len, dtype=np.int64),
                             (conv if turns > 1 else np.full(n, -1))[order])
    return Requests(arrival[order], context[order], req.output[order], identity=identity)


def read_engine_run(path, limit=None):
    """A real engine's log -> its requests in arrival order (prompt, output, arrival_s from
    the first), what it measured of each (ttft_s, tpot_s, e2e_s: the logs' own definitions,
    from the engine's queueing of the request) and its settings (meta.json, where beside)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if path.endswith(".jsonl"):
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
            cols = [(r["input_toks"], r["output_toks"], r["queued_ts"], r["first_token_ts"] -
                     r["queued_ts"], r["last_token_ts"] - r["first_token_ts"],
                     r["last_token_ts"] - r["queued_ts"]) for r in rows]
        else:
            import ast  # (its first line: the list; then a summary block, not Python)
            rows = ast.literal_eval(text.split("\n", 1)[0])
            cols = [(r["prompt_len"], r["output_len"], r["issue_time"], r["ttft_ms"] / 1e3,
                     r["tpot_ms"] * (r["output_len"] - 1) / 1e3, r["latency_ms"] / 1e3)
                    for r in rows]
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}")
    except (ValueError, SyntaxError, KeyError, TypeError) as e:
        raise UsageError(f"{path}: not a log of an engine's requests ({one_line(e)})")
    if not cols:
        raise UsageError(f"{path}: no requests in the log")
    a = np.array(sorted(cols, key=lambda c: c[2])[:limit], dtype=np.float64)
    prompt, output = a[:, 0].astype(np.int64), a[:, 1].astype(np.int64)
    if (prompt < 0).any() or (output < 1).any():
        raise UsageError(f"{path}: token counts must be at least 0 (prompt) and 1 (output)")
    multi = output > 1
    return {"prompt": np.maximum(prompt, 1), "output": output, "arrival_s": a[:, 2] - a[0, 2],
            "ttft_s": a[:, 3], "tpot_s": a[multi, 4] / (output[multi] - 1), "e2e_s": a[:, 5],
            "settings": engine_settings(path) if path.endswith(".jsonl") else {}}


def engine_settings(path):
    """What meta.json beside a vLLM log says of the engine's batch and cache, as the engine
    names them (see logged_meta; {} where there is none)."""
    logged = logged_meta(path)
    return {k: logged[k] for k in ("engine", "max_num_seqs", "max_num_batched_tokens",
                                   "tensor_parallel_size", "num_kv_tokens", "prefix_caching")
            if logged.get(k) is not None}


def meta_section(info, key, meta):
    """info[key], an object (a dict; {} where it is absent or null), else a one-line error."""
    section = info.get(key)
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise UsageError(f"{meta}: {key} must be an object, not {section!r}")
    return section


def meta_count(section, key, meta):
    """section[key], a whole number of at least 1 (None where it is absent or null), else a
    one-line error: the engine's seats, step budget, cards and cache are counts."""
    value = section.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{meta}: {key} must be a whole number of at least 1, not {value!r}")
    return value


def logged_prefix_caching(info, meta):
    """Whether a vLLM run cached prefixes, as its meta.json says (its kv_cache record, else
    the resolved config's cache_config): "on", "off", or None where it does not say (vLLM v1
    defaults it on; the log cannot tell)."""
    resolved = meta_section(meta_section(info, "resolved_config", meta), "cache_config", meta)
    for said in (meta_section(info, "kv_cache", meta).get("enable_prefix_caching"),
                 resolved.get("enable_prefix_caching")):
        if isinstance(said, bool):
            return "on" if said else "off"
    return None


def read_bench_result(path, result, engine):
    """A serving benchmark's saved result with its per-request detail -> its completed
    requests (as read_engine_run's: prompt, output, arrival_s, ttft_s, tpot_s, e2e_s) and what
    it says of the run. vLLM's `vllm bench serve --save-result --save-detailed` and SGLang's
    `bench_serving --output-details` both keep input_lens, output_lens, ttfts (s) and itls (s,
    a list a request), and errors ("" where a request completed); vLLM's newer versions keep
    each request's start_times, else the arrivals are drawn again at the run's request_rate
    and burstiness (seeded; "inf": all at once). TPOT and E2E as both tools define them:
    the gaps after the first token over output - 1, and TTFT plus those gaps."""
    n = len(result["input_lens"])
    errors = result.get("errors") or [""] * n
    done = [i for i in range(n) if result["output_lens"][i] > 0 and not errors[i]]
    if not done:
        raise UsageError(f"{path}: no completed requests in the run")
    prompt = np.array([result["input_lens"][i] for i in done], dtype=np.int64)
    output = np.array([result["output_lens"][i] for i in done], dtype=np.int64)
    ttft = np.array([result["ttfts"][i] for i in done], dtype=np.float64)
    decode = np.array([sum(result["itls"][i]) for i in done], dtype=np.float64)
    rate, burstiness = result.get("request_rate", "inf"), result.get("burstiness") or 1.0
    starts = result.get("start_times")
    if starts:
        arrival = np.array([starts[i] for i in done], dtype=np.float64)
        arrival = arrival - arrival.min()
    else:
        arrival = arrival_times(len(done), None if rate in ("inf", None) else float(rate),
                                float(burstiness), np.random.default_rng(0))
    order = np.argsort(arrival, kind="stable")
    multi = output[order] > 1
    server = result.get("server_info") or {}
    return {"prompt": np.maximum(prompt[order], 1), "output": output[order],
            "arrival_s": arrival[order], "ttft_s": ttft[order],
            "tpot_s": decode[order][multi] / (output[order][multi] - 1),
            "e2e_s": ttft[order] + decode[order],
            "settings": {"engine": engine, "model": result.get("model_id") or
                         server.get("model_path"), "date": result.get("date"),
                         "request_rate": rate, "arrivals": "logged" if starts else "drawn",
                         "tp": server.get("tp_size"), "dp": server.get("dp_size"),
                         "requests": n, "completed": len(done),
                         "prefix_caching": radix_cache(server)}}


def radix_cache(server):
    """Whether an SGLang run cached prefixes, as its server_info says (its radix cache is on
    unless --disable-radix-cache): "on", "off", or None where it does not say (vLLM's results
    keep no server settings)."""
    said = server.get("disable_radix_cache")
    return None if not isinstance(said, bool) else "off" if said else "on"


def logged_meta(path):
    """LLMServingSim's meta.json beside a vLLM requests.jsonl, checked (a field C uses that is
    not what vLLM writes is one line naming it), in vLLM's names: the version, the model, the
    card (its hardware record), the engine's counts (None where not logged), whether it
    cached prefixes, and the date ({} where there is no meta.json)."""
    meta = os.path.join(os.path.dirname(path), "meta.json")
    try:
        with open(meta, encoding="utf-8") as f:
            info = json.load(f)
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise UsageError(f"cannot read {meta}: {e.strerror}")
    except ValueError as e:
        raise UsageError(f"{meta}: not JSON ({one_line(e)})")
    if not isinstance(info, dict):
        raise UsageError(f"{meta}: expected a JSON object")
    kw, kv, hardware = (meta_section(info, key, meta)
                        for key in ("engine_kwargs", "kv_cache", "hardware"))
    return {"engine": f"vLLM {info.get('vllm_version', '')}".strip(),
            "model": info.get("model") or kw.get("model"), "gpu": hardware.get("device_name"),
            **{key: meta_count(kw, key, meta) for key in (
                "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size",
                "data_parallel_size", "max_model_len")},
            "num_kv_tokens": meta_count(kv, "num_kv_tokens", meta),
            "enable_expert_parallel": bool(kw.get("enable_expert_parallel")),
            "prefix_caching": logged_prefix_caching(info, meta), "date": info.get("started_at")}


def read_run_meta(path):
    """What LLMServingSim's meta.json beside a requests.jsonl says of the run (logged_meta), in
    C's names: the model, the card (its hardware record, else the folder's first word:
    RTXPRO6000_...), the engine's parallelism, batch limits, context and KV tokens, whether it
    cached prefixes, and the date ({} where there is no meta.json)."""
    logged = logged_meta(path)
    if not logged:
        return {}
    folder = os.path.basename(os.path.dirname(os.path.abspath(path)))
    return {"engine": logged["engine"], "model": logged["model"],
            "gpu": logged["gpu"] or folder.split("_")[0],
            "tp": logged["tensor_parallel_size"] or 1, "dp": logged["data_parallel_size"] or 1,
            "expert_parallel": logged["enable_expert_parallel"],
            "slots": logged["max_num_seqs"], "chunk_tokens": logged["max_num_batched_tokens"],
            "kv_tokens": logged["num_kv_tokens"], "max_model_len": logged["max_model_len"],
            "date": logged["date"], "prefix_caching": logged["prefix_caching"]}


def arrival_times(n, rate, burstiness, rng):
    """n arrival times: gamma-distributed gaps of mean 1/rate (shape = burstiness; 1 = Poisson,
    below 1 burstier); all at t=0 when rate is None."""
    if rate is None:
        return np.zeros(n)
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    return np.cumsum(gaps) - gaps[0]


def make_requests(run):
    """The requests of C: lengths (log-normal law, lengths file or trace) and arrivals."""
    work = run.workload
    if not (work.trace or work.lengths_file):
        need, free = work.requests * REQUEST_BYTES, free_host_memory_bytes()
        if need > 0.5 * free:
            raise UsageError(f"--requests {work.requests:,}: C would need about {gib(need)} of "
                             f"memory, and {gib(free)} is free")
    rng = random_stream(run, "arrivals")
    trace_times = identity = None
    if work.trace and is_hashed_trace(work.trace):
        if work.prefix_len or work.turns > 1:
            raise UsageError(f"{work.trace}: its hash ids say which prompts share what; "
                             "--prefix-len and --turns shape generated requests only")
        traced = read_hashed_trace(work.trace, work.trace_limit, run.scheduler.block_tokens)
        prompt, output, trace_times, identity = traced.prompt, traced.output, \
            traced.arrival_s, traced.identity
    elif work.trace:
        prompt, output, trace_times = read_trace(work.trace, work.trace_limit)
    else:
        output = request_lengths(run)
        prompt = np.full(len(output), work.prompt_len, dtype=np.int64)
    rates = [("--rate", work.rate, len(output))] if isinstance(work.rate, float) else []
    rates += [("--rates", rate, min(len(output), SWEEP_REQUESTS)) for rate in work.rates or ()]
    for flag, rate, n in rates:
        if n / rate > MAX_SPAN_S:
            raise UsageError(f"{flag} {rate:g}: {n:,} requests at that rate arrive over "
                             f"{n / rate:.3g} s, past the {MAX_SPAN_S:.0e} s C's clock keeps "
                             "to the millisecond; raise the rate")
    if work.rate == "trace":
        if trace_times is None or trace_times[-1] - trace_times[0] > MAX_SPAN_S:
            raise UsageError(f"--rate trace: {work.trace}'s timestamps " + (
                "are missing" if trace_times is None else f"span past the {MAX_SPAN_S:.0e} "
                "s C's clock keeps to the millisecond"))
        arrival = trace_times
    else:
        rate = work.rate  # (with turns: conversations open at rate / turns)
        if rate and identity is None:
            rate /= work.turns
        arrival = arrival_times(len(output), rate, work.burstiness, rng)
    prefix = PrefixWorkload(work.prefix_len, work.num_prefixes, work.prefix_share,
                            work.prefix_zipf, work.turns, work.think_time_s)
    if identity is None and (prefix.prefix_len or prefix.turns > 1):
        return shared_prompts(Requests(arrival, prompt, output), prefix,
                              random_stream(run, "prefixes"))
    return Requests(arrival, prompt, output, identity=identity)
