"""Replicas and schedulers: what one replica is, what a step prefills, who decodes (pure Python)

A Replica is the spec every simulation and study is given (its seats, prices, scheduler, KV
budget and queue order); a study reads as what it varies: replace(replica, scheduler=s). The
running requests are a PrefillQueue and a DecodeBatch, each keeping its own aggregates.
"""
import heapq
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from nn40.kv import KVBudget
from nn40.queues import Order


SCHEDULERS = ("static", "continuous", "chunked")


def schedule_prefill(prefilling, decode_tokens, chunk_tokens, cap=None):
    """This step's prefill: [(request, tokens)], oldest first. Whole prompts, or (chunked)
    what the step's token budget leaves after the decodes' tokens, a chunk at most `cap`
    tokens where given (one of the batches a pipeline keeps in flight)."""
    if chunk_tokens is None:
        return [(s, s.prompt_left) for s in prefilling]
    room, plan = chunk_tokens - decode_tokens, []
    for s in prefilling:
        if room <= 0:
            break
        plan.append((s, min(s.prompt_left, room, cap or room)))
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


class DecodeTokens(NamedTuple):
    """What one decode step does for each decoding request, the one place the rule lives: the
    query tokens it `runs` through the model (what it takes of a step's token budget, and what
    the decode pass is priced for) and the tokens it `gains` (appended to its KV cache and
    emitted; its last step emits what is left). Plain decoding runs one and gains one; a step
    that verifies k drafted tokens runs k + 1 and gains from 1 to k + 1 (speculative decoding,
    multi-token prediction). A paged cache's block must hold whole steps (gains divides it)."""
    runs: int = 1
    gains: int = 1


class DecodeBatch:
    """The decoding requests, kept as aggregates: how many (`size`), the sum of their bases,
    the `tokens` a step runs for them (what they take of a chunked step's budget), the
    `growth` of their cache a step, and a heap of the steps at which they end. A decoder gains
    `gains` cached tokens and emits as many every step (DecodeTokens), so only its start is
    kept: joining at step s with c tokens cached, it holds decode_base + gains s' = c + gains
    (s' - s) tokens at step s'. (Read as attributes: the event loop reads them at every
    event.)"""
    __slots__ = ("size", "tokens", "growth", "base_sum", "ends", "runs", "gains")

    def __init__(self, decode_tokens=DecodeTokens()):
        self.size = self.tokens = self.growth = self.base_sum = 0
        self.runs, self.gains = decode_tokens
        self.ends = []  # heap of (end step, admitted); a preempted decoder's entry stays behind

    def join(self, seqs, steps):
        """The requests `seqs` start to decode after step `steps`."""
        ends, base_sum, gains = self.ends, self.base_sum, self.gains
        for seq in seqs:
            seq.decode_base = seq.num_cached - gains * steps
            seq.end_step = steps + (seq.to_emit if gains == 1 else -(-seq.to_emit // gains))
            base_sum += seq.decode_base
            heapq.heappush(ends, (seq.end_step, seq.admitted))
        self.size += len(seqs)
        self.tokens += self.runs * len(seqs)
        self.growth += gains * len(seqs)
        self.base_sum = base_sum

    def leave(self, seq, steps):
        """A decoder leaves before its last step (preempted). -> (tokens it has still to emit,
        tokens it has cached) at step `steps`."""
        self.size -= 1
        self.tokens -= self.runs
        self.growth -= self.growth_of(seq)
        self.base_sum -= seq.decode_base
        cached = self.held_by(seq, steps)
        return seq.to_emit - self.emitted(seq, cached), cached

    def cached(self, steps):
        """Tokens the decoders hold at step `steps`."""
        return self.base_sum + self.growth * steps

    def held_by(self, seq, steps):
        """Tokens one decoder holds at step `steps`."""
        return seq.decode_base + self.gains * steps

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
                self.tokens -= self.runs
                self.growth -= self.growth_of(seq)
                out.append(seq)
        return out

    def growth_of(self, seq):
        """The tokens one decoder's cache gains a step."""
        return self.gains

    def emitted(self, seq, cached):
        """The tokens a decoder holding `cached` tokens has emitted since it started."""
        return cached - seq.num_cached


class SimulationStalled(RuntimeError):
    """The simulation can no longer make progress (nothing runs and nothing can be admitted)."""


class PassPrices(Protocol):
    """What prices a replica's passes for the loop: StepCosts (one pass of any tokens),
    PhaseCosts (prefill and decode apart), PipelineCosts (stages in flight)."""
    in_flight: int  # batches in flight at once (1 but on pipeline stages)

    def run_price(self, plan, decoders, cached, k, fused=False, growth=None):
        """(prefill_s, decode_s, first_s, growth_s, prompt tokens a step) of k steps: the plan's
        chunks, and `decoders` query tokens over `cached` tokens, their cache growing by
        `growth` a step (the loop passes its DecodeBatch's; None, for plain decoding alone:
        one a query token)."""

    def decode_steps_to(self, n, cached, t, when, k, growth=None):
        """The first step count in 1..k whose decode run ends at or after `when`."""

    def pass_s(self, tokens, kv_tokens=0, pairs=0):
        """Seconds of one pass of `tokens` new tokens over `kv_tokens` cached (D's check)."""

    def as_dict(self):
        """The prices for results.json."""


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
    decode_tokens  the tokens a decode step runs and gains for each decoder (DecodeTokens:
                 one and one)
    prompt_tokens  continuous: the most prompt tokens a step prefills, whole prompts in order
                 of admission, the first whatever its length (DistServe's
                 context-max-tokens-per-batch; vLLM's max_num_batched_tokens without chunked
                 prefill); None: every admitted prompt
    batch_tokens  chunked: the most tokens a prompt's chunk takes (a replica of pipeline
                 stages: one of the batches in flight's budget, chunk_tokens their sum;
                 stages.pipelined); None: chunk_tokens
    speculation  a Speculation (nn40.speculative): its decoders verify drafted tokens, each
                 taking its own drawn number of steps (its costs: a SpeculativeCosts); None:
                 plain decoding, by decode_tokens
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
    decode_tokens: DecodeTokens = DecodeTokens()
    prompt_tokens: int = None
    batch_tokens: int = None
    speculation: object = None
