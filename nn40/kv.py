"""KV allocators: the cache's memory counted in tokens, reserved or paged, and the prefix cache
that keeps computed blocks (pure Python)

What the scheduler asks of the cache: can this request be admitted, can this step grow, what
to free, what a lone request needs, what is held. One KV manager per policy answers, by name
in KV_MANAGERS; the event loop, the routers and the studies never ask which one they hold.
"""
import collections
import itertools
import math
from dataclasses import dataclass

import numpy as np

from nn40.errors import UsageError
from nn40.queues import EVICTION_ORDERS
from nn40.tiers import HOST_TIERS, TierLoads
from nn40.workload import every_block_key


@dataclass(frozen=True)
class KVBudget:
    """The KV cache's memory in the serving simulation, counted in tokens: a policy (a name in
    KV_MANAGERS, whose classes say what each does) and its sizes. A request holds one token of
    KV for every token it has prefilled or generated but its newest, whose KV the step after
    it is sampled writes."""
    policy: str                # "reserve", "paged", "prefix" or "radix" (KV_MANAGERS)
    capacity_tokens: float     # math.inf: unlimited
    block_tokens: int = 16
    max_output: int = 0        # reserve: output tokens reserved for every request
    watermark: float = 0.0     # paged: share of the blocks admission keeps free
    host_tokens: float = 0     # prefix: tokens of blocks a host-memory tier keeps
    host_token_s: float = 0.0  # prefix: seconds to load one token's KV from the host tier
    host_write: str = "write-through"  # prefix: the host tier's write policy (HOST_TIERS)
    eviction: str = "lru"      # prefix: the order cached blocks go in (EVICTION_ORDERS)
    disk_tokens: float = 0     # prefix: tokens of blocks a disk or remote tier keeps, below the
    #                            host's (its write policy the host's)
    disk_token_s: float = 0.0  # prefix: seconds to read one token's KV from the disk tier
    disk_prefetch: bool = False  # prefix: a disk read starts as its request arrives (SGLang's)


class KVUnfit(UsageError):
    """A KV budget some request can never fit (why: check_kv_budget's description)."""

    def __init__(self, policy, why):
        super().__init__(policy, why)
        self.policy, self.why = policy, why


def check_kv_budget(req, kv, speculation=None, handed=False):
    """Every request must fit alone (speculating, as a Speculation's decoders hold: see
    for_speculation; `handed`: each handed to this decode pool with its prompt computed), or
    the simulation could never finish it. -> None, or why not (a description for the tables)."""
    manager = kv_manager(kv)
    if speculation:
        manager.for_speculation(speculation, handed)
    return manager.unfit(req)


class Seq:
    """A request while it holds a slot (nano-vllm's Sequence).

    While it prefills, `prompt_left` prompt tokens are still to run and `num_cached` tokens are
    cached (admitted part-way: some cached already, or, with none left, all of it prefilled
    elsewhere). Once it decodes its DecodeBatch keeps only its start: decode_base, and the step
    `end_step` of its last token (speculating, the tokens its cache gains a verify step on
    average: `rate`; None: the batch's own gains).
    """
    __slots__ = ("id", "admitted", "prompt_left", "num_cached", "to_emit", "to_emit_admitted",
                 "decode_base", "end_step", "allocated", "rate")

    def __init__(self, rid, admitted, prompt_left, to_emit, num_cached=0):
        self.id, self.admitted = rid, admitted  # (admitted: its place in admission order)
        self.prompt_left, self.num_cached = prompt_left, num_cached
        self.to_emit = self.to_emit_admitted = to_emit  # tokens still to emit (at admission)
        self.decode_base = self.end_step = self.rate = None  # set when it starts to decode
        self.allocated = 0  # KV tokens allocated to it (a reservation; paged: its prefill's)

    def written(self, ctx):
        """The tokens whose KV it has written when it holds `ctx` tokens: all but its newest
        once it has emitted a token (a sampled token's KV is written by the next step)."""
        return ctx - 1 if self.decode_base is not None or self.to_emit < self.to_emit_admitted \
            else ctx


class CachedBlocks:
    """What a prefix cache keeps of one running request (PrefixCache.of[seq]): its prompt's
    block `keys`, the blocks it `held`s (hit or cached by it), how many of its keys are
    `registered` (cached), the tokens `loading` from the tiers below the card before it runs,
    and of those the tokens read from the disk tier (`from_disk`)."""
    __slots__ = ("keys", "held", "registered", "loading", "from_disk")

    def __init__(self, keys, held, registered, loading, from_disk=0):
        self.keys, self.held, self.registered, self.loading = keys, held, registered, loading
        self.from_disk = from_disk


class KVManager:
    """What the event loop asks of the KV cache, and the null object: memory unlimited and not
    tracked (no KVBudget). Every policy answers the same calls.

    tracks     memory is accounted (the run's result has "kv")
    preempts   a step may need memory that is not free: max_steps bounds a run, and the newest
               request is preempted while the planned step does not fit
    served     the policy the serving engines run: a study takes it where every request fits
    in_both    one of the policies --kv-policy both compares; caching: the policy that is this
               one keeping computed prefixes (--enable-prefix-caching), if any
    tracks_prefixes   it keeps computed prefixes (its result has a prefix_cache report)
    caches_scheduled  it caches a prompt's blocks when their step is scheduled (see schedule),
               so that requests admitted in the same step share them
    loads      a newcomer may wait for KV loaded into the card (a host tier's): see load_s
    block      tokens per block (1: token-exact); capacity: tokens the cache holds; watermark:
               tokens admission keeps free; total: tokens allocated now
    A step's plan is [(Seq, prompt tokens it prefills)]; step j of a run of k takes
    a + e (j - 1) seconds.
    """
    tracks = preempts = served = tracks_prefixes = loads = caches_scheduled = False
    in_both, caching = True, None
    block, capacity, watermark, total = 1, math.inf, 0, 0
    shared = lent = 0  # tokens held by several requests (once more than held); lent to KV in flight
    gains = 1  # tokens a decode step adds to a decoder's cache (see for_decode_steps)
    lookahead = 0  # tokens a speculating decoder holds beyond its own (see for_speculation)
    verify_gains = None  # speculating: the most tokens a verify step adds to a decoder's cache
    handed = False  # speculating in a decode pool: its requests' prompts computed elsewhere
    unwritten = 0  # tokens of a request whose KV its blocks never hold (paged: its last one's)

    def lookup(self, ledger, r):
        """The tokens of request r already computed when it is admitted now: ledger.cached
        (computed elsewhere), or what a prefix cache holds of it."""
        return ledger.cached[r]

    def report(self):
        """What the run's result adds of the cache (a prefix cache's hits)."""
        return {}

    def load_s(self, seq, t):
        """The seconds seq, just admitted at `t`, waits for KV loaded into the card before its
        first step (a host tier's), parked, while the others run on (then 0: loaded once)."""
        return 0.0

    def cancel_load(self, seq, t):
        """Seq, parked for its load, leaves at `t` (preempted) before its KV has landed."""

    def blocks(self, tokens):
        """Tokens rounded up to whole blocks (a number or an array): the one rounding."""
        return -(-tokens // self.block) * self.block

    def output_held(self, output):
        """The output tokens a request's memory covers at its longest."""
        return output

    def alone(self, prompt, output):
        """Tokens a request of `prompt` and `output` tokens (arrays) holds at its longest,
        alone."""
        return self.blocks(prompt + self.output_held(output) - self.unwritten + self.lookahead)

    def unfit(self, req):
        """-> None when every request fits alone, else why the longest one does not."""
        alone = self.alone(req.prompt, req.output)
        worst = int(np.argmax(alone))
        needs = int(alone[worst]) + self.watermark
        if needs <= self.capacity:
            return None
        return {"kind": "kv_too_long", "request": worst, "needs": needs, "block": self.block,
                "prompt": int(req.prompt[worst]),
                "output": int(self.output_held(req.output[worst])), "holds": int(self.capacity)}

    def need(self, prompt, cached, chunk, to_prefill):
        """Tokens of free memory a newcomer needs to be admitted: its `cached` tokens held,
        `to_prefill` still to run, `chunk` of them in its first step."""
        return 0

    def admit(self, seq, need):
        """Seq is admitted on `need` (its num_cached tokens already computed)."""

    def schedule(self, seq, tokens):
        """Seq's next step prefills `tokens` of its prompt (where caches_scheduled)."""

    def schedule_decoders(self, steps):
        """The decoders' next step (step steps + 1) is scheduled (where caches_scheduled),
        before any newcomer is looked up."""

    def planned(self, steps, plan):
        """Tokens allocated once the planned step has run (can this step grow)."""
        return self.total

    def max_steps(self, steps, plan, k):
        """The most steps, up to k, whose memory fits (the first always does)."""
        return k

    def join(self, seq):
        """Seq starts to decode."""

    def release(self, seq, ctx):
        """Seq, holding ctx tokens, leaves (finished or preempted): what it held is freed."""

    def preempt(self, seq, ctx):
        """Seq, holding ctx tokens, is preempted (it will be admitted again): released."""
        self.release(seq, ctx)

    def advance(self, steps, plan, k, a, e):
        """Allocate for k steps; -> the integral of tokens allocated x seconds."""
        return self.total * (a * k + e * k * (k - 1) / 2)

    def committed(self, held, prompt_left):
        """Tokens allocated (else `held`) plus the admitted prompts' `prompt_left` tokens still
        to prefill, where the allocation does not cover them yet: what least-kv compares."""
        return held + prompt_left

    def reserve(self, tokens):
        """Lend `tokens` of the capacity to KV in flight (a hand-off's, on its way here): out
        of admission's reach until unreserve gives them back."""
        self.capacity -= tokens
        self.lent += tokens

    def unreserve(self, tokens):
        """The lent `tokens` are back (the KV landed: its request is admitted on them)."""
        self.capacity += tokens
        self.lent -= tokens

    def has_room(self, need, ahead):
        """Whether `need` tokens fit now past the watermark and the `ahead` tokens that
        requests queued before them will take first."""
        return self.capacity - self.total - self.watermark - ahead >= need

    def fragmentation(self, req, sim, utilization):
        """The share of the allocated memory x time never used."""
        return 1.0 - utilization

    def for_decode_steps(self, gains):
        """The manager for decode steps that gain `gains` tokens a decoder (DecodeTokens):
        what a manager whose arithmetic follows the decoders' growth sets. -> itself"""
        self.gains = gains
        return self

    def for_speculation(self, speculation, handed=False):
        """The manager for a Speculation's decoders (a SpeculativeBatch's: each growing at its
        own rate, at most k + 1 tokens a verify step), each holding its `lookahead` tokens
        beyond its own (the drafts a verify step writes, and the scheduler's lookahead);
        `handed`: a decode pool's, whose requests come with their prompts computed (their
        first step is a verify step: see PagedBlocks.need). -> itself"""
        self.lookahead, self.handed = speculation.lookahead, handed
        self.verify_gains = speculation.decode_tokens.runs
        return self


class Reservation(KVManager):
    """reserve: on admission a request reserves prompt + max_output tokens, contiguously, until
    it finishes (FasterTransformer, Orca); admission waits while that does not fit."""
    tracks = True

    def __init__(self, kv):
        self.capacity, self.max_output = kv.capacity_tokens, kv.max_output

    def output_held(self, output):
        return self.max_output

    def unfit(self, req):
        if req.output.max() > self.max_output:
            return {"kind": "kv_max_output", "max_output": self.max_output,
                    "longest": int(req.output.max())}
        return super().unfit(req)

    def need(self, prompt, cached, chunk, to_prefill):
        return prompt + self.max_output

    def admit(self, seq, need):
        seq.allocated = need
        self.total += need

    def release(self, seq, ctx):
        self.total -= seq.allocated

    def committed(self, held, prompt_left):
        return self.total  # (a reservation holds its prompt already)

    def fragmentation(self, req, sim, utilization):
        """Reserved for output the request never produced."""
        alloc_s = sim["kv"]["alloc_s"]
        unused = (self.max_output - req.output) * (sim["times"].finish - sim["times"].start)
        return float(unused.sum()) / alloc_s if alloc_s else 0.0


class PagedBlocks(KVManager):
    """paged: blocks of `block` tokens allocated as a sequence grows (PagedAttention). When a
    step needs a block and none is free, the most recently admitted request is preempted: its
    blocks are freed, and when it is readmitted its prompt and the tokens it had generated are
    prefilled again (recompute, vLLM's default). Admission (vLLM's can_allocate) needs free
    blocks for the whole prompt and leaves `watermark` of the budget's blocks free besides, so
    that a newcomer does not take the blocks the running requests are about to grow into; a
    watermark of 0 admits on the first step's blocks alone (the naive rule: under chunked
    prefill a prompt admitted on its first chunk is preempted by its own next one).

    A request's blocks hold the tokens whose KV is written: all but its newest once it has
    emitted one (vLLM's allocate_slots covers the tokens computed and those the step computes,
    vllm/v1/core/kv_cache_manager.py; a sampled token's KV is written by the next step). So a
    decoder holding base + g s tokens at step s (g: the tokens a decode step gains, which
    divides the block) has written base + g s - 1 and takes a new block every `period` =
    block / g steps, at the steps s with base + g s - 2 = 0, ..., g - 1 (mod block): one
    residue of s mod period (its phase). So the decoders are kept as counts by that phase, and
    a run of k steps costs O(phases) whatever k is.
    """
    tracks = preempts = served = True
    caching = "prefix"
    unwritten = 1  # (its last token ends it: no step writes its KV)

    def __init__(self, kv):
        b, self.capacity = kv.block_tokens, kv.capacity_tokens
        self.block, self.total = b, 0  # (total: tokens in allocated blocks)
        self.period = b  # a decoder's steps a block (see for_decode_steps)
        self.watermark = 0 if math.isinf(self.capacity) else \
            int(kv.watermark * (self.capacity // b)) * b
        self.phase = {}   # step (mod period) at which decoders take a block -> how many do
        self.fluid_rate = 0   # speculating decoders: the tokens their caches gain a step

    def need(self, prompt, cached, chunk, to_prefill):
        """With a watermark, vLLM's rule: blocks for all it will prefill, so that chunked
        prefill does not admit a prompt whose next chunks would preempt it again; with none,
        only its first step's. With nothing to prefill (its prompt computed elsewhere, its
        first token sampled there) its first step decodes: it writes that token and the rest of
        a decode step's gains."""
        first = self.gains - 1 if not to_prefill else 0  # (the tokens its first step writes
        # beyond its prompt)
        first += self.lookahead  # (speculating: the drafts' slots from its first decode step)
        need = self.blocks(cached + to_prefill + first) if self.watermark else \
            self.blocks(cached + chunk + (chunk == to_prefill) * first)
        if self.verify_gains and not to_prefill:  # (speculating from its first step, which
            # is the step it is admitted for: the blocks of its written tokens and its drafts'
            # slots, and its growth a step, at most k + 1 tokens: see join)
            need = max(need, self.blocks(cached - 1 + self.lookahead) + self.verify_gains)
        return need

    def alone(self, prompt, output):
        """(Speculating, the most of what vLLM's blocks would hold and of what join accounts
        a decoder: its written tokens' blocks with its drafts' slots, then the output - 1
        tokens it grows by; handed to a decode pool, at least a step's most: see need.)"""
        held = super().alone(prompt, output)
        if not self.verify_gains:
            return held
        grown = np.maximum(output - 1, self.verify_gains) if self.handed else output - 1
        return np.maximum(held, self.blocks(prompt + self.lookahead) +
                          np.where(output > 1, grown, 0))

    def admit(self, seq, need):  # blocks are taken by the steps, but for what it holds already
        if seq.num_cached:
            seq.allocated = self.blocks(self.written_at_admission(seq))
            self.total += seq.allocated

    @staticmethod
    def written_at_admission(seq):
        """Its cached tokens' KV, less the token sampled where its prompt was computed (with
        nothing left to prefill: its first decode step writes it)."""
        return seq.num_cached - (not seq.prompt_left)

    def prompt_blocks(self, seq, tokens, chunk):
        """Tokens of the blocks a prompt holds once `tokens` more of it have run in chunks of
        `chunk` (after its last chunk, speculating, the drafts' slots its first verify step
        writes too)."""
        return self.blocks(seq.num_cached + tokens + (chunk == seq.prompt_left) *
                           self.lookahead)

    def planned(self, steps, plan):
        grow = sum(self.prompt_blocks(s, c, c) - s.allocated for s, c in plan)
        return self.total + self.block * self.phase.get((steps + 1) % self.period, 0) + grow \
            + self.fluid_rate

    def for_decode_steps(self, gains):
        if self.block % gains:
            raise ValueError(f"a decode step gains {gains} tokens: {self.block}-token blocks "
                             "do not hold whole steps")
        self.gains, self.period = gains, self.block // gains
        return self

    def join(self, seq):
        if seq.rate is not None:  # speculating: its blocks (its tokens and the lookahead,
            # allocated with its prompt's last chunk, or at admission: see need), then its
            # growth at its rate (a fluid account: what it holds beyond its tokens is kept)
            held = self.blocks(seq.written(seq.num_cached) + self.lookahead)
            self.total += held - seq.allocated
            seq.allocated = held - seq.num_cached
            self.fluid_rate += seq.rate
            return
        key = self.phase_of(seq)
        self.phase[key] = self.phase.get(key, 0) + 1

    def phase_of(self, seq):
        """The residue mod period of the steps at which the decoder takes a block. After step
        s it has written base + gains s - 1 tokens, so its writes cross a block's boundary at
        the steps congruent to the least integer s with base + gains s - 1 >= 1, that is
        ceil((2 - base) / gains) (with gains 1: 2 - base mod block)."""
        return -((seq.decode_base - 2) // self.gains) % self.period

    def release(self, seq, ctx):
        if seq.rate is not None:  # (a speculating decoder: its fluid account, see join)
            self.total -= ctx + seq.allocated
            self.fluid_rate -= seq.rate
            if abs(self.fluid_rate) < 1e-9:  # (the last has left: no float residue kept,
                self.fluid_rate = 0             # the rest whole blocks)
                self.total = round(self.total)
            return
        self.total -= self.blocks(self.released(seq, ctx))
        if seq.decode_base is not None:
            key = self.phase_of(seq)
            self.phase[key] -= 1
            if not self.phase[key]:
                del self.phase[key]

    def committed(self, held, prompt_left):
        return self.total + prompt_left

    def crossings(self, s0, k):
        """The decoders' new blocks in steps s0+1..s0+k: [(first step j, times, rows)]."""
        b, phase = self.period, self.phase
        if k < len(phase):  # fewer steps than phases: look each step up
            return [(j, 1, phase[(s0 + j) % b]) for j in range(1, k + 1)
                    if (s0 + j) % b in phase]
        out = []
        for key, rows in phase.items():
            j = (key - s0 - 1) % b + 1
            if j <= k:
                out.append((j, (k - j) // b + 1, rows))
        return out

    @staticmethod
    def released(seq, ctx):
        """The tokens whose blocks a request leaving with `ctx` tokens gives back: a decoder's
        written ones, a prompt's as allocated (speculating, its last chunk took the drafts'
        slots too, which a request that ends with its prefill never decodes into)."""
        written = seq.written(ctx)
        return written if seq.decode_base is not None else max(written, seq.allocated)

    def decoders_take(self, steps, n):
        """Tokens the decoders' new blocks take in the next n steps (speculating: their fluid
        growth)."""
        return self.block * sum(m * rows for _, m, rows in self.crossings(steps, n)) + \
            self.fluid_rate * n

    def max_steps(self, steps, plan, k):
        free, b, period = self.capacity - self.total, self.block, self.period
        if not plan:  # decoders only: the block that does not fit, found by its period
            if self.decoders_take(steps, k) <= free:
                return k
            if self.fluid_rate:  # (speculating decoders alone: their growth is linear)
                return max(1, min(k, int(free // self.fluid_rate)))
            fit = int(free // b)  # blocks that still fit
            periods, rest = divmod(fit, sum(self.phase.values()))  # (every decoder's block)
            for j, rows in sorted(((key - steps - 1) % period + 1, rows)
                                  for key, rows in self.phase.items()):
                if rest < rows:
                    return min(k, periods * period + j - 1)
                rest -= rows
        (seq, c), = plan  # one prompt's chunks beside the decoders: bisect

        def fits(n):
            return self.decoders_take(steps, n) + self.blocks(seq.num_cached + c * n) - \
                seq.allocated <= free
        lo, hi = 1, k
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    def advance(self, steps, plan, k, a, e):
        b, p = self.block, self.period
        elapsed = a * k + e * k * (k - 1) / 2
        integral, grown = self.total * elapsed, 0
        for j0, m, rows in self.crossings(steps, k):
            # a block taken at step j is held from step j to k: D(k) - D(j - 1) seconds,
            # where D(x) = a x + e x (x - 1) / 2; summed over j = j0, j0 + p, ... (m of them)
            x0 = j0 - 1
            sx = m * x0 + p * m * (m - 1) / 2
            sxx = m * x0 * x0 + x0 * p * m * (m - 1) + p * p * (m - 1) * m * (2 * m - 1) / 6
            integral += b * rows * (m * elapsed - (a * sx + e * (sxx - sx) / 2))
            grown += b * rows * m
        if self.fluid_rate:  # speculating decoders: step j's growth held from step j to k
            r = self.fluid_rate
            integral += r * (a * k * (k + 1) / 2 + e * (k - 1) * k * (k + 1) / 3)
            grown += r * k
        for seq, c in plan:  # the prompts' chunks: blocks held from the step that takes them
            new = self.prompt_blocks(seq, c * k, c)
            if k == 1:
                integral += a * (new - seq.allocated)
            else:
                integral += sum((a + e * (j - 1))
                                * (self.blocks(seq.num_cached + c * j) - seq.allocated)
                                for j in range(1, k + 1))
            grown += new - seq.allocated
            seq.allocated = new
        self.total += grown
        return integral


PREFIX_REPORT = "prefix_cache"  # a run's result: what its prefix caches hit


def leading(get, keys, start, stop):
    """What `get` gives each of keys[start:stop], from the first, up to the first it gives None
    (C-speed, in slices growing from 32: a miss early costs little)."""
    out, i, size = [], start, 32
    while i < stop:
        part = list(map(get, keys[i:min(i + size, stop)]))
        if None in part:
            return out + part[:part.index(None)]
        out += part
        i, size = i + size, size * 4
    return out


class PrefixCache(PagedBlocks):
    """prefix: paged blocks that keep what they computed (vLLM's automatic prefix caching). A
    full block is keyed by its tokens and all before them (the prompt's identity, see
    HashedPrompts); a newcomer's hit is the longest run of its leading blocks cached, short of
    its last prompt token, and those tokens are not prefilled. A block is shared by reference
    count, held once however many run on it, and cached as soon as the step that computes it
    is scheduled, so requests admitted in the same step share it (vLLM's allocate_slots caches
    up to the tokens computed and scheduled, vllm/v1/core/kv_cache_manager.py); a preempted
    request's own blocks keep keys too, and it hits them when it comes back, where they are
    still cached (vLLM keys every full block by its tokens). A block no one holds keeps its
    key in a free queue, least recently freed first (a request frees its blocks last first, so
    a prefix's tail goes before its head), until an allocation takes it. With `host_tokens`, a
    host tier (nn40.tiers: write-through, stored as computed, or write-back, stored as
    evicted) keeps blocks too, and a hit past the card's blocks loads them back, the tier
    keeping its copy. Cost: O(blocks of the
    request) at admission and release, and O(blocks allocated) as steps allocate, each at C
    speed (see BlockQueue).
    """

    in_both, caching, tracks_prefixes, caches_scheduled = False, None, True, True

    def __init__(self, kv):
        super().__init__(kv)
        self.preempts = not math.isinf(self.capacity)
        self.ref = {}  # key -> running requests holding its block (0: cached, free)
        self.eviction = kv.eviction  # the order of its free queue and host tier
        order = EVICTION_ORDERS[self.eviction]
        self.free = order()  # the cached blocks no one holds, and the uncached blocks
        if self.preempts:
            self.free.push_run(int(self.capacity // self.block))  # (every block never used)
        self.host_blocks = int(kv.host_tokens // self.block)
        disk_blocks = int(kv.disk_tokens // self.block) if self.host_blocks else 0
        self.disk = HOST_TIERS[kv.host_write](disk_blocks, self.eviction) if disk_blocks \
            else None  # (the tier below the host's: a disk or remote store)
        self.host = HOST_TIERS[kv.host_write](self.host_blocks, self.eviction, self.disk) \
            if self.host_blocks else None  # (its host tier, a HostTier)
        self.loads = self.host_blocks > 0
        self.link = TierLoads(kv.host_token_s, kv.disk_token_s, kv.disk_prefetch)
        self.looked_up = None  # the last lookup: (r, keys, the card's hit blocks' holders,
        # blocks hit in host memory, then in the disk tier, hit blocks no one holds)
        # prompt tokens at first admissions (asked, found per tier), blocks evicted, hits readmitted
        self.queried = self.hit = self.host_hit = self.disk_hit = self.evicted = \
            self.readmitted_hit = 0
        self.hits = {}  # request -> tokens hit at its first admission
        self.of = {}  # Seq -> its CachedBlocks, while it runs
        self.own = set()  # preempted requests, whose own blocks are keyed (keys_of) till they end
        self.identity = None  # the prompts' (the ledger's, seen at lookup)
        self.arrival = None  # the requests' arrival times (the ledger's, seen at lookup)
        self.pending = 0  # speculating decoders' growth short of a whole block (see advance)
        self.scheduled = 0  # prompt tokens whose blocks schedule took before their step ran
        self.ahead = 0  # blocks the decoders' next step took as it was scheduled

    def lookup(self, ledger, r):
        self.identity = identity = ledger.identity
        self.arrival = ledger.arrival  # (a disk prefetch's start)
        if identity is None:
            self.looked_up = None
            return ledger.cached[r]
        b, to_prefill, looked_up = self.block, ledger.to_prefill[r], self.looked_up
        keys = looked_up[1] if looked_up and looked_up[0] == r else \
            self.keys_of(r, to_prefill) if r in self.own else \
            identity.block_keys(r, to_prefill, b)
        most = min(len(keys), (to_prefill - 1) // b)  # (one prompt token left to compute)
        counts = leading(self.ref.get, keys, 0, most)  # (the card's hit blocks' holders)
        host = self.host.where if self.host is not None else None
        host = len(leading(host.get, keys, len(counts), most)) if host else 0
        disk = len(leading(self.disk.where.get, keys, len(counts) + host, most)) \
            if self.disk is not None else 0
        self.looked_up = (r, keys, counts, host, disk, counts.count(0))
        return max(ledger.cached[r], (len(counts) + host + disk) * b)

    def need(self, prompt, cached, chunk, to_prefill):
        """As paged, less the hit blocks running requests hold already."""
        need, looked_up = super().need(prompt, cached, chunk, to_prefill), self.looked_up
        return need - self.block * (len(looked_up[2]) - looked_up[5]) if looked_up else need

    def admit(self, seq, need):
        b = self.block
        seq.allocated = self.blocks(self.written_at_admission(seq))
        looked_up, self.looked_up = self.looked_up, None
        if not looked_up or looked_up[0] != seq.id:
            self.of[seq] = CachedBlocks((), [], 0, 0)
            self.total += seq.allocated
            self.take(seq.allocated // b)
            return
        r, keys, counts, host, disk, taken = looked_up  # (taken: hit blocks no one held, now
        card = len(counts)                            # taken out of the free queue)
        hit = keys[:card]
        if taken and self.preempts:
            self.free.remove(itertools.compress(hit, map((0).__eq__, counts)))
        if self.preempts:
            self.free.hit(hit)  # (an order that counts hits counts held blocks' too)
        self.ref.update(zip(hit, map((1).__add__, counts)))
        self.shared += b * (card - taken)
        if host:  # loaded back from the host tier
            self.host.loaded(keys[card:card + host])
        self.of[seq] = blocks = CachedBlocks(keys, hit, card, (host + disk) * b, disk * b)
        if r in self.hits:  # readmitted after preemption: it finds what it had computed
            self.readmitted_hit += (card + host + disk) * b
        else:  # (the counts of the first admission only: each prompt queried once)
            self.queried += seq.prompt_left + seq.num_cached
            self.hit, self.host_hit = self.hit + card * b, self.host_hit + host * b
            self.disk_hit += disk * b
            self.hits[r] = (card + host + disk) * b
        fresh = seq.allocated // b - card  # blocks it holds beyond the card's hits
        self.total += b * (taken + fresh)
        self.take(fresh)  # (its blocks loading from the host: cached once landed)

    def keys_of(self, r, tokens):
        """The keys of request r's first tokens // block blocks: its prompt identity's, then
        keys of its own for the blocks no other request can share (its own text and answer:
        a preempted request finds them again when it comes back, as vLLM's blocks keyed by
        their tokens are found)."""
        return every_block_key(self.identity, r, tokens, self.block)

    def schedule(self, seq, tokens):
        """The blocks seq's next step fills are taken and cached now (vLLM's allocate_slots
        allocates and caches up to the tokens computed and scheduled), so a request admitted
        after it in the same step hits them, and is looked up after what they evicted."""
        blocks = self.of[seq]
        if blocks.registered < len(blocks.keys):
            self.register(blocks, seq.num_cached + tokens)
        if self.preempts:
            new = self.prompt_blocks(seq, tokens, tokens)
            if new > seq.allocated:
                self.total += new - seq.allocated
                self.scheduled += tokens
                self.take((new - seq.allocated) // self.block)
                seq.allocated = new

    def schedule_decoders(self, steps):
        """The blocks the decoders' next step writes into are taken now (vLLM's scheduler
        allocates its running requests' slots before it looks a waiting request up); advance
        counts them. A step planned again before it runs (a decoder preempted meanwhile) takes
        or gives back only the difference."""
        if self.preempts:
            blocks = self.phase.get((steps + 1) % self.period, 0)
            if blocks != self.ahead:
                self.settle_ahead(blocks)

    def settle_ahead(self, blocks):
        """`blocks` are the blocks taken ahead of the step now: take more, or give back (as
        never used) those no longer needed."""
        if blocks > self.ahead:
            self.take(blocks - self.ahead)
        elif blocks < self.ahead:
            self.free.push_run(self.ahead - blocks)
        self.ahead = blocks

    def committed(self, held, prompt_left):
        """(The prompts' tokens whose blocks schedule took are in total already.)"""
        return self.total + prompt_left - self.scheduled

    def landed(self, seq):
        """Seq's blocks loaded from the tiers below have landed: cached from now on (vLLM
        delays caching blocks still to be received), the host tier not told again (but of
        those read from the disk tier: see promote)."""
        blocks = self.of[seq]
        self.link.landed(seq)
        self.promote(blocks)
        if blocks.loading:
            self.register(blocks, seq.num_cached, store=False)
            blocks.loading = 0

    def register(self, blocks, tokens, store=True):
        """A request's blocks (its CachedBlocks) up to `tokens` are computed: cache those no
        block holds yet (and, `store`, tell the host tier)."""
        upto, ref = min(tokens // self.block, len(blocks.keys)), self.ref
        if upto <= blocks.registered:
            return
        new = blocks.keys[blocks.registered:upto]
        if not ref.keys().isdisjoint(new):
            new = [key for key in new if key not in ref]
        ref.update(dict.fromkeys(new, 1))
        blocks.held += new
        blocks.registered = upto
        if new and self.preempts:
            self.free.cached(new)
        if self.host is not None and new and store:
            self.host.computed(new)

    def take(self, blocks):
        """Allocate blocks from the head of the free queue, evicting the cached ones there."""
        if blocks <= 0 or not self.preempts:
            return
        evicted = self.free.pop(blocks)
        if evicted:
            collections.deque(map(self.ref.__delitem__, evicted), 0)
            self.evicted += len(evicted)
            if self.host is not None:
                self.host.evicted(evicted)

    def join(self, seq):
        before = self.total
        super().join(seq)
        if self.total > before:  # (a speculating decoder's lookahead blocks: whole ones)
            self.take(round((self.total - before) / self.block))

    def advance(self, steps, plan, k, a, e):
        before = self.total
        integral = super().advance(steps, plan, k, a, e)
        # blocks the run took; speculating decoders grow by fractions of one, so what is short
        # of a whole block waits in `pending` (whole blocks otherwise: pending stays 0)
        grown = self.total - before + self.pending
        taken = int(grown // self.block) if grown > 0 else 0
        if self.ahead > taken:  # (what the decoders' step took already, and no more)
            self.settle_ahead(taken)
        self.take(taken - self.ahead)
        self.pending, self.scheduled, self.ahead = grown - taken * self.block, 0, 0
        of = self.of
        for seq, c in plan:
            blocks = of[seq]
            if blocks.registered < len(blocks.keys):  # (keys beyond its hit: cached as computed)
                self.register(blocks, seq.num_cached + c * k)
        return integral

    def load_s(self, seq, t):
        """Its hit blocks in the tiers below load asynchronously (vLLM's offloading connector
        and LMCache: the request waits for its KV, the batch runs on; see TierLoads)."""
        blocks = self.of[seq]
        if not blocks.loading:
            return 0.0
        arrived = t if self.arrival is None else self.arrival[seq.id]  # (none: no lookup)
        wait = self.link.load(seq, blocks.loading, blocks.from_disk, t, arrived)
        if not wait:  # (landed at once)
            self.promote(blocks)
        return wait

    def promote(self, blocks):
        """A request's blocks read from the disk tier have landed: stored in host memory (the
        disk keeping its copy), once; a request that leaves before they land has stored none,
        and finds them on the disk again."""
        if blocks.from_disk:
            start = blocks.registered + (blocks.loading - blocks.from_disk) // self.block
            self.host.promoted(blocks.keys[start:start + blocks.from_disk // self.block])
            blocks.from_disk = 0

    def cancel_load(self, seq, t):
        self.link.cancel(seq, t)

    def preempt(self, seq, ctx):
        """Its own blocks keep keys it will find when it comes back (keys_of)."""
        if self.identity is None:
            return self.release(seq, ctx)
        self.of[seq].keys = self.keys_of(seq.id, int(seq.written(ctx) + 1e-9))
        self.release(seq, ctx)
        self.own.add(seq.id)

    def release(self, seq, ctx):
        """(A speculating decoder's ctx is fractional, its account fluid: its cached blocks
        are the whole ones it emitted into, and it gives back the blocks the others' tokens do
        not need, what is short of a block kept in `pending`.)"""
        blocks = self.of.pop(seq)
        keys, r = blocks.keys, seq.id
        tokens = seq.written(ctx)
        tokens = tokens if seq.rate is None else int(tokens + 1e-9)
        if self.own:  # (finished, or preempted again: see preempt)
            self.own.discard(r)
        if keys:
            n = tokens // self.block
            if n > len(keys) and self.identity.covers_output(r):  # (its answer: the
                # next turn's prompt)
                blocks.keys = keys = self.identity.block_keys(r, tokens, self.block)
            if min(n, len(keys)) > blocks.registered:  # (not blocks still loading)
                self.register(blocks, tokens - blocks.loading)
        out = (self.total - self.pending) / self.block  # (blocks out of the free queue)
        super().release(seq, ctx)
        ref, held = self.ref, blocks.held
        counts = list(map(ref.__getitem__, held))
        ref.update(zip(held, map((-1).__add__, counts)))
        last = counts.count(1)  # blocks it held alone: freed, its tail first
        freed = held[::-1] if last == len(held) else [] if not last else \
            list(itertools.compress(reversed(held), map((1).__eq__, reversed(counts))))
        still = self.block * (len(held) - last)
        self.total += still  # (held still by others)
        self.shared -= still
        if self.preempts:  # its uncached blocks first: they are its tail
            uncached = -(-self.released(seq, ctx) // self.block) - len(held)
            if seq.rate is not None:  # (a speculating decoder: as many as leave the blocks
                # out covering the rest, what is short of a block kept in pending)
                out = round(out) - last
                uncached = max(0, out - int((self.total + 1e-9) // self.block))
                self.pending = self.total - self.block * (out - uncached)
                if not self.fluid_rate:  # (no speculating decoder left: whole blocks)
                    self.pending = round(self.pending)
            if uncached:
                self.free.push_run(uncached)
            self.free.push(freed)

    def report(self):
        return {PREFIX_REPORT: {
            "queried_tokens": self.queried, "hit_tokens": self.hit,
            "host_hit_tokens": self.host_hit, "disk_hit_tokens": self.disk_hit,
            "evicted_blocks": self.evicted,
            "readmitted_hit_tokens": self.readmitted_hit, "host_load_s": self.link.wait_s,
            "hits": self.hits}}


class RadixCache(PrefixCache):
    """radix: SGLang's radix cache (sglang/srt/mem_cache/radix_cache.py) in this cache's terms:
    a hit is the longest common run of the prompt's tokens cached, matched page by page
    (--block-tokens: SGLang's --page-size, 1 by default on CUDA, where a hit is token-exact);
    a request's tokens join the tree once computed (cache_unfinished_req after each chunk,
    cache_finished_req at its end), so requests prefilled in the same step do not share; the
    tree's least recently used unlocked leaves go first (its blocks a request frees, last
    first, in the eviction order)."""
    caches_scheduled = False

    def preempt(self, seq, ctx):
        """SGLang's retraction frees what is past the tree's prefix without inserting it: the
        request finds again only what it had cached."""
        self.release(seq, ctx)


KV_MANAGERS = {"reserve": Reservation, "paged": PagedBlocks,  # KVBudget.policy -> its manager
               "prefix": PrefixCache, "radix": RadixCache}


def merged_reports(results, per_replica):
    """A fleet's prefix caches: each replica's counts (into per_replica) and their sums."""
    reports = [res.get(PREFIX_REPORT) for res in results]
    if not reports[0]:
        return {}
    merged = {key: sum(p[key] for p in reports) for key in reports[0] if key != "hits"}
    merged["hits"] = {r: t for p in reports for r, t in p["hits"].items()}
    for row, p in zip(per_replica, reports):
        row[PREFIX_REPORT] = {key: value for key, value in p.items() if key != "hits"}
    return {PREFIX_REPORT: merged}


def kv_manager(kv, gains=1):
    """The KV manager of a KVBudget (None: the null object, memory unlimited), for decode steps
    that gain `gains` tokens a decoder (DecodeTokens)."""
    return KVManager() if kv is None else KV_MANAGERS[kv.policy](kv).for_decode_steps(gains)


def plain_twin(policy):
    """The registered policy that `policy` is with its prefixes kept (its `caching`), or None
    where no policy names it: a caching policy's run without caching, where there is one."""
    return next((p for p, manager in KV_MANAGERS.items() if manager.caching == policy), None)
