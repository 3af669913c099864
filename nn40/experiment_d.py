"""Experiment D: a real serving engine on the model, against C's simulation (device code)

A queue of requests, `slots` rows of one static KV cache, and a scheduler that picks who runs
each step. The running requests always occupy rows 0..B-1 (a finished request's row is
refilled by moving the last row into it), so a decode step reads views of the cache, and
rows admitted together share a position and one attention span.
"""
import time
from typing import NamedTuple

import numpy as np
import torch

from nn40.model import attention_spans, decode_step, prefill
from nn40.queues import Ledger, waiting_queue
from nn40.workload import Requests


class EngineRequests(NamedTuple):
    """What D's engine serves. prompts: (n, P) tokens on the model's device; output_lens:
    tokens each request generates (exactly that many: end-of-sequence is ignored, as serving
    benchmarks do); arrival_s: each one's arrival on the wall clock, seconds after the start
    (None: all at once); prefix: an EnginePrefix, whose system prompts' K/V the engine keeps
    once computed (None: every prompt prefilled whole)."""
    prompts: torch.Tensor
    output_lens: list
    arrival_s: object = None
    prefix: object = None


def run_engine(model, cache, requests, policy, pad=False, order=None):
    """Serve every request (EngineRequests) under `policy` ("static" or "continuous"),
    greedily. Requests wait in the simulation's own queue (order: an Order; None: first come,
    first served), each from its arrival on the wall clock. Each step admits waiting requests
    into free rows (continuous: every step; static: only once the batch has emptied), prefills
    them (the prefill emits their first token), then decodes every other running request one
    token. pad: a decode whose rows sit at several positions attends in one call padded to the
    longest row (see decode_step).
    -> generated tokens per request, and a log: every pass timed, every step's time and
    occupancy, and log["times"], a RequestTimes: per request the seconds (from the run's start)
    of its admission, first token and last, and the steps of those two tokens.
    """
    return Engine(model, cache, requests, policy, pad, order).serve()


class EnginePrefix:
    """D's prefix cache: request r opens with system prompt system[r] (its first `tokens`
    prompt tokens; -1: none). The K/V of a system prompt is kept from the first row that
    computed it; a newcomer opening with it has that K/V copied into its row and prefills only
    the rest of its prompt. vLLM caches a block as the step that computes it is scheduled, so
    newcomers of that same step share it: here the step's first newcomer with a system prompt
    not kept yet computes it in the step's first pass, and those after it share it in its
    second (see Engine.forward)."""

    def __init__(self, system, tokens):
        self.system, self.tokens, self.kv = [int(s) for s in system], tokens, {}

    def hit(self, r):
        """Prompt tokens of request r found cached now."""
        return self.tokens if self.system[r] in self.kv else 0

    def load(self, cache, r, row):
        cache[:, :, row, :, :self.tokens].copy_(self.kv[self.system[r]])

    def keep(self, cache, r, row):
        """Row `row` has just computed request r's prompt: keep its system prompt's K/V."""
        s = self.system[r]
        if s >= 0 and s not in self.kv:
            self.kv[s] = cache[:, :, row, :, :self.tokens].clone()


class Engine:
    """D's engine (see run_engine). Each step is admit, forward, retire, as the simulation's is
    plan and commit: admission from the simulation's own queue, then the passes on the device,
    then the tokens recorded and the finished requests' rows refilled."""

    def __init__(self, model, cache, requests, policy, pad, order):
        prompts, output_lens, arrival_s, self.prefix = requests
        self.model, self.cache, self.prompts, self.policy, self.pad = model, cache, prompts, \
            policy, pad
        self.device, self.prompt_len = prompts.device, prompts.shape[1]
        self.slots, n = cache.shape[2], len(output_lens)
        self.output_lens = list(output_lens)
        arrival = np.zeros(n) if arrival_s is None else np.asarray(arrival_s, dtype=np.float64)
        self.ledger = Ledger(Requests(arrival, np.full(n, self.prompt_len),
                                      np.asarray(output_lens)))
        self.waiting = waiting_queue(self.ledger, range(n), order)
        self.generated = [[] for _ in output_lens]
        self.running, self.position = [], []  # the request and next position of each row
        self.next_token = torch.zeros(self.slots, dtype=torch.long, device=self.device)
        self.sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        self.elog = {"t_s": [], "running": [], "prefill_s": 0.0, "decode_s": 0.0,
                    "attention_calls": 0, "decode_steps": 0, "padded_decode_steps": 0,
                    "passes": [],  # (tokens, cached tokens, seconds)
                    "prefill_passes": [],  # their indices in passes
                    "hit_tokens": [0] * n, "idle_s": 0.0}

    def serve(self):
        self.sync()
        self.t0 = time.perf_counter()
        while self.waiting or self.running:
            new = self.admit()
            if new is None:  # (nothing ran: it waited for the next arrival)
                continue
            self.retire(self.forward(new))
        self.sync()
        self.elog["wall_s"] = time.perf_counter() - self.t0
        self.elog["times"] = self.ledger.times()  # (its times on the wall clock from t0)
        return self.generated, self.elog

    def admit(self):
        """Waiting requests into free rows (continuous: at every step; static: once the batch
        has emptied). -> the newcomers, or None after idling to the next arrival."""
        new = []
        if self.policy == "continuous" or not self.running:
            now = time.perf_counter() - self.t0
            while len(self.running) + len(new) < self.slots:
                r = self.waiting.head(now)
                if r is None:
                    break
                self.waiting.pop()
                new.append(r)
                self.ledger.start[r] = now
            if not self.running and not new:  # nothing runs: wait for the next arrival
                pause = max(self.waiting.next_arrival() - now, 0.0)
                time.sleep(pause)
                self.elog["idle_s"] += pause
                return None
        return new

    def forward(self, new):
        """Prefill the newcomers into rows old..old+k-1 (the prefill emits their first tokens):
        those computing their whole prompt first (kept: the step's later newcomers opening
        with their system prompt share it), then those whose system prompt is cached; then one
        decode step for everyone else, each row at its own position; each pass timed. -> the
        newcomers in the order of their rows."""
        old, prefix = len(self.running), self.prefix
        computing, sharing, kept = [], [], set()
        for r in new:
            s = prefix.system[r] if prefix else -1
            if s >= 0 and (prefix.hit(r) or s in kept):
                sharing.append(r)
            else:
                computing.append(r)
                kept.add(s)  # (-1, no system prompt: never looked up)
        if computing:
            self.prefill_rows(computing, 0)
            if prefix:
                for row, r in enumerate(self.running[old:], old):
                    prefix.keep(self.cache, r, row)
        if sharing:
            self.prefill_rows(sharing, prefix.tokens)
        self.decode_rows(old)
        return self.running[old:]

    def decode_rows(self, old):
        """One decode step for the `old` rows running before this step's newcomers."""
        elog = self.elog
        if old:
            t_pass = time.perf_counter()
            positions = self.position[:old]
            logits = decode_step(self.model, self.cache, self.next_token[:old], positions,
                                 pad=self.pad)
            spans = len(attention_spans(range(old), positions))
            padded = self.pad and spans > 1
            elog["attention_calls"] += 1 if padded else spans
            elog["padded_decode_steps"] += padded
            elog["decode_steps"] += 1
            self.next_token[:old] = logits.argmax(-1)
            self.position[:old] = [p + 1 for p in positions]
            self.sync()
            elog["passes"].append((old, sum(positions), time.perf_counter() - t_pass))
            elog["decode_s"] += elog["passes"][-1][2]

    def prefill_rows(self, group, hit):
        """Prefill requests `group` into the next free rows, each with `hit` prompt tokens
        cached (copied into its row first, with the copy timed as part of the pass)."""
        old, elog, P = len(self.running), self.elog, self.prompt_len
        t_pass = time.perf_counter()
        rows = torch.arange(old, old + len(group), device=self.device)
        for row, r in enumerate(group, old):
            if hit:
                self.prefix.load(self.cache, r, row)
            elog["hit_tokens"][r] = hit
        logits = prefill(self.model, self.cache, self.prompts[group][:, hit:], rows, hit)
        self.next_token[old:old + len(group)] = logits.argmax(-1)
        self.running += group
        self.position += [P] * len(group)
        self.sync()
        elog["prefill_passes"].append(len(elog["passes"]))
        elog["passes"].append((len(group) * (P - hit), len(group) * hit,
                               time.perf_counter() - t_pass))
        elog["prefill_s"] += elog["passes"][-1][2]

    def retire(self, new):
        """Record the step's tokens and times, and move the last row into each finished one."""
        running, position, elog, ledger = self.running, self.position, self.elog, self.ledger
        for r, token in zip(running, self.next_token[:len(running)].tolist()):
            self.generated[r].append(token)
        now, step = time.perf_counter() - self.t0, len(elog["t_s"]) + 1
        elog["t_s"].append(now)
        elog["running"].append(len(running))
        for r in new:
            ledger.first_step[r], ledger.first_token[r] = step, now
        finished = [i for i, r in enumerate(running)
                    if len(self.generated[r]) == self.output_lens[r]]
        for row in reversed(finished):
            ledger.finish_step[running[row]], ledger.finish[running[row]] = step, now
            last = len(running) - 1
            if row != last:
                m = position[last]
                self.cache[:, :, row, :, :m].copy_(self.cache[:, :, last, :, :m])
                self.next_token[row] = self.next_token[last]
                running[row], position[row] = running[last], position[last]
            running.pop()
            position.pop()
