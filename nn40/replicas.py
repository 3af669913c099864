"""Replicas and schedulers: what one replica is, what a step prefills, who decodes (pure Python)

A Replica is the spec every simulation and study is given (its seats, prices, scheduler, KV
budget and queue order); a study reads as what it varies: replace(replica, scheduler=s). The
running requests are a PrefillQueue and a DecodeBatch, each keeping its own aggregates.
"""
import heapq
from dataclasses import dataclass
from typing import Protocol

from nn40.kv import KVBudget
from nn40.queues import Order


SCHEDULERS = ("static", "continuous", "chunked")


def schedule_prefill(prefilling, decode_tokens, chunk_tokens):
    """This step's prefill: [(request, tokens)], oldest first. Whole prompts, or (chunked)
    what the step's token budget leaves after the decodes' tokens."""
    if chunk_tokens is None:
        return [(s, s.prompt_left) for s in prefilling]
    room, plan = chunk_tokens - decode_tokens, []
    for s in prefilling:
        if room <= 0:
            break
        plan.append((s, min(s.prompt_left, room)))
        room -= plan[-1][1]
    return plan


class PrefillQueue:
    """The running requests with prompt left, oldest first, and what they add up to: the
    prompt tokens `left` to prefill and the tokens `cached` so far."""
    __slots__ = ("seqs", "left", "cached")

    def __init__(self):
        self.seqs, self.left, self.cached = [], 0, 0

    def join(self, seqs):
        """The requests `seqs` (admitted in this order) join."""
        self.seqs += seqs
        for seq in seqs:
            self.left += seq.prompt_left
            self.cached += seq.num_cached

    def leave(self, seq):
        self.seqs.remove(seq)
        self.left -= seq.prompt_left
        self.cached -= seq.num_cached

    def advance(self, plan, k, tokens):
        """The plan's chunks (`tokens` a step) ran k steps."""
        for s, c in plan:
            s.prompt_left -= c * k
            s.num_cached += c * k
        self.left -= tokens * k
        self.cached += tokens * k

    def done(self, count, cached):
        """The `count` oldest requests' prefills have ended, holding `cached` tokens (chunks go
        oldest first)."""
        del self.seqs[:count]
        self.cached -= cached


class DecodeBatch:
    """The decoding requests, kept as aggregates: how many (`size`), the sum of their bases,
    the `tokens` a step adds to their cache (what they take of a chunked step's budget), and a
    heap of the steps at which they end. A decoder gains one cached token and emits one token
    every step (the rule lives here alone), so only its start is kept: joining at step s with
    c tokens cached, it holds decode_base + s' = c + (s' - s) tokens at step s'. (Read as
    attributes: the event loop reads them at every event.)"""
    __slots__ = ("size", "tokens", "base_sum", "ends")

    def __init__(self):
        self.size = self.tokens = self.base_sum = 0
        self.ends = []  # heap of (end step, admitted); a preempted decoder's entry stays behind

    def join(self, seqs, steps):
        """The requests `seqs` start to decode after step `steps`."""
        ends, base_sum = self.ends, self.base_sum
        for seq in seqs:
            seq.decode_base, seq.end_step = seq.num_cached - steps, steps + seq.to_emit
            base_sum += seq.decode_base
            heapq.heappush(ends, (seq.end_step, seq.admitted))
        self.size += len(seqs)
        self.tokens += len(seqs)
        self.base_sum = base_sum

    def leave(self, seq, steps):
        """A decoder leaves before its last step (preempted). -> (tokens it has still to emit,
        tokens it has cached) at step `steps`."""
        self.size -= 1
        self.tokens -= 1
        self.base_sum -= seq.decode_base
        return seq.end_step - steps, seq.decode_base + steps

    def cached(self, steps):
        """Tokens the decoders hold at step `steps`."""
        return self.base_sum + self.tokens * steps

    def due(self, steps, running):
        """The decoders whose last step has run by `steps`, in the order they end, taken out
        of the batch (running: admission order -> Seq, where a preempted decoder's entry is
        no longer)."""
        ends, out = self.ends, []
        while ends and (ends[0][0] <= steps or ends[0][1] not in running):
            admitted = heapq.heappop(ends)[1]
            if admitted in running:  # (else preempted since it was pushed)
                seq = running[admitted]
                self.base_sum -= seq.decode_base
                self.size -= 1
                self.tokens -= 1
                out.append(seq)
        return out


class SimulationStalled(RuntimeError):
    """The simulation can no longer make progress (nothing runs and nothing can be admitted)."""


class PassPrices(Protocol):
    """What prices a replica's passes for the loop: StepCosts (one pass of any tokens),
    PhaseCosts (prefill and decode apart), PipelineCosts (stages in flight)."""

    def run_price(self, plan, decoders, cached, k, fused=False):
        """(prefill_s, decode_s, first_s, growth_s, prompt tokens a step) of k steps."""

    def decode_steps_to(self, n, cached, t, when, k):
        """The first step count in 1..k whose decode run ends at or after `when`."""


@dataclass(frozen=True)
class Replica:
    """One replica of the served model, as the simulation sees it.

    slots        its seats: the most requests running at once (vLLM's max_num_seqs)
    costs        its PassPrices (a StepCosts, ...): the seconds of each forward pass
    scheduler    static      a batch forms from the waiting requests (up to `slots`), is
                             prefilled, and decodes until its longest request ends; then the
                             next batch forms
                 continuous  each step first prefills the newcomers admitted into free slots
                             (their first token comes out of the prefill), then decodes
                             everyone else one token
                 chunked     continuous, but a step runs at most `chunk_tokens` tokens: every
                             decode first, then prefill chunks of the admitted requests in
                             order of admission
    kv           a KVBudget: admission also waits for KV memory, and a paged cache preempts
                 (None: memory is unlimited and not tracked)
    order        an Order: who takes a free seat (None: first come, first served)
    fused        a step is one forward pass of its prefill chunks and decodes together, the
                 weights read once (vLLM's and TensorRT-LLM's in-flight batching); False: a
                 prefill pass, then a decode pass (the post's accounting, and D's engine)
    prefill_first  (not fused) a prompt's first token comes out of the step's prefill pass,
                 before its decode pass runs: an engine that runs its prefills as steps of
                 their own, ahead of the decodes (vLLM's scheduler before chunked prefill);
                 False: at the step's end
    A study reads as what it varies: dataclasses.replace(replica, scheduler="static").
    """
    slots: int
    costs: PassPrices
    scheduler: str = "continuous"
    chunk_tokens: int = None
    kv: KVBudget = None
    order: Order = None
    fused: bool = False
    prefill_first: bool = False
