"""Experiment D: a real serving engine on the model, against C's simulation (device code)

A queue of requests, `slots` rows of one static KV cache, and a scheduler that picks who runs
each step. The running requests always occupy rows 0..B-1 (a finished request's row is
refilled by moving the last row into it), so a decode step reads views of the cache, and
rows admitted together share a position and one attention span.
"""
import collections
import hashlib
import heapq
import math
import time
from typing import NamedTuple

import numpy as np
import torch

from nn40.model import attention_spans, decode_step, prefill, ragged_step
from nn40.queues import Ledger, waiting_queue
from nn40.workload import Requests


class EngineRequests(NamedTuple):
    """What D's engine serves. prompts: (n, P) tokens on the model's device; output_lens:
    tokens each request generates (exactly that many: end-of-sequence is ignored, as serving
    benchmarks do); arrival_s: each one's arrival on the wall clock, seconds after the start
    (None: all at once); pool: its KV blocks, an EngineBlocks (a prefix cache, or paged blocks
    caching nothing; None: its rows alone, every prompt prefilled whole, nothing preempted);
    drafts: its speculative decoding, EngineDrafts (None: a token a decode step)."""
    prompts: torch.Tensor
    output_lens: list
    arrival_s: object = None
    pool: object = None
    drafts: object = None


class EngineDrafts(NamedTuple):
    """D's speculative decoding: each decoder verifies its last token and k drafts in one
    pass, and emits `gains[r][i]` tokens at request r's i-th verify step (the accepted drafts
    and the target's own token after them), as C draws them for the same request
    (Speculation.gains_for): vLLM's synthetic acceptance for benchmarks, which accepts by a
    given law whatever the drafts are. The drafts are random tokens drawn on the host from
    `seed`, as cheap as an n-gram lookup's."""
    k: int
    gains: list
    seed: int = 0


def run_engine(model, cache, requests, policy, pad=False, order=None):
    """Serve every request (EngineRequests) under `policy` ("static" or "continuous"),
    greedily. Requests wait in the simulation's own queue (order: an Order; None: first come,
    first served), each from its arrival on the wall clock. Each step admits waiting requests
    into free rows (continuous: every step; static: only once the batch has emptied), prefills
    them (the prefill emits their first token), then decodes every other running request one
    token (or, with drafts, verifies each one's drafts). pad: a decode whose rows sit at several
    positions attends in one call padded to the longest row (see decode_step).
    -> generated tokens per request, and a log: every pass timed, every step's time and
    occupancy, and log["times"], a RequestTimes: per request the seconds (from the run's start)
    of its admission, first token and last, and the steps of those two tokens.
    """
    return Engine(model, cache, requests, policy, pad, order).serve()


class EngineBlocks:
    """D's KV blocks, a prefix cache as vLLM's block pool runs it (vllm/v1/core/block_pool.py,
    kv_cache_manager.py allocate_slots, the scheduler's order), written out plainly: `capacity`
    blocks of `block` tokens, held by the running requests or free. A prompt's full block is
    keyed by a hash of its tokens and all before them, and cached as the step that computes it
    is scheduled; a newcomer hits the longest run of its prompt's leading blocks cached, short
    of its last token, has their K/V copied into its row and prefills the rest. A request's
    blocks go back to the tail of the free queue when it ends, its last block first; an
    allocation takes the head, and a cached block taken there is evicted (its key and the K/V
    kept here dropped). The engine's rows hold the running requests' K/V; the pool counts their
    blocks and keeps the K/V of the cached ones. Where a running request's next token finds no
    free block, the engine preempts (see Engine.grow_running): the request's computed blocks,
    its answer's too, are keyed and cached as vLLM keys every full block by its tokens, and it
    hits them when it comes back, where no allocation has taken them meanwhile. With `caching`
    off (vLLM's --no-enable-prefix-caching) nothing is keyed: paged blocks alone, a preempted
    request computing its prompt and answer again whole."""

    def __init__(self, prompts, capacity, block=16, caching=True):
        self.block, self.capacity, self.caching = block, capacity, caching
        self.rows = prompts.cpu().numpy()
        self.keys = [block_keys(row, block) if caching else [] for row in self.rows]  # request
        # -> its full blocks' keys (of its prompt; of its prompt and answer once preempted)
        self.free = collections.OrderedDict.fromkeys(range(capacity))  # head: taken first
        self.ref = [0] * capacity  # block -> running requests holding it
        self.cached, self.key_of = {}, {}  # key -> the block caching it; block -> its key
        self.kv = {}  # key -> its block's K/V, once computed
        self.table = {}  # request -> its blocks, in order
        self.evicted = 0  # cached blocks taken by an allocation

    def admit(self, r, prompt_len):
        """vLLM's get_computed_blocks then allocate_slots for a newcomer's whole prompt
        (`prompt_len` tokens: a preempted request's prompt and answer). -> its hit blocks
        (their number), or None where the free blocks cannot hold it (it waits, and those
        behind it)."""
        hit = []
        for key in self.keys[r][:(prompt_len - 1) // self.block]:
            if key not in self.cached:
                break
            hit.append(self.cached[key])
        evictable = sum(self.ref[blk] == 0 for blk in hit)  # (free, hit: taken out of the queue)
        if -(-prompt_len // self.block) - len(hit) + evictable > len(self.free):
            return None
        for blk in hit:  # (touched: out of the free queue while held)
            if not self.ref[blk]:
                del self.free[blk]
            self.ref[blk] += 1
        self.table[r] = list(hit)
        self.grow(r, prompt_len)
        for key, blk in zip(self.keys[r], self.table[r]):  # cached as scheduled
            if key not in self.cached:
                self.cached[key], self.key_of[blk] = blk, key
        return len(hit)

    def grow(self, r, tokens):
        """Request r's blocks made to hold `tokens`, each new one the free queue's head."""
        table = self.table[r]
        while len(table) * self.block < tokens:
            if not self.free:
                raise RuntimeError("D's block pool ran out of blocks (ask fits first)")
            blk = self.free.popitem(last=False)[0]
            key = self.key_of.pop(blk, None)
            if key is not None:  # (a cached block: evicted)
                del self.cached[key]
                self.kv.pop(key, None)
                self.evicted += 1
            self.ref[blk] = 1
            table.append(blk)

    def fits(self, r, tokens):
        """Whether the free blocks can make request r's blocks hold `tokens`."""
        return -(-tokens // self.block) - len(self.table[r]) <= len(self.free)

    def preempt(self, cache, r, row, tokens):
        """Request r, running in row `row` with `tokens` (its prompt and answer, the newest
        token's K/V not yet written), is preempted: the K/V of its computed full blocks is
        kept and their keys cached (the answer's blocks keyed by its tokens as the prompt's
        are), then its blocks go back as at its end."""
        b, table = self.block, self.table[r]
        self.keys[r] = keys = block_keys(tokens, b) if self.caching else []
        for i, (key, blk) in enumerate(zip(keys[:(len(tokens) - 1) // b], table)):
            if key not in self.cached:
                self.cached[key], self.key_of[blk] = blk, key
            if key not in self.kv:
                self.kv[key] = cache[:, :, row, :, i * b:(i + 1) * b].clone()
        self.release(r)

    def release(self, r):
        """Request r has ended: the blocks no one else holds go to the free queue's tail, its
        last block first."""
        for blk in reversed(self.table.pop(r)):
            self.ref[blk] -= 1
            if not self.ref[blk]:
                self.free[blk] = None

    def stored(self, r, hit):
        """Whether the K/V of request r's first `hit` blocks is here (computed by a pass
        before)."""
        return all(key in self.kv for key in self.keys[r][:hit])

    def load(self, cache, r, row, hit):
        """Request r's first `hit` blocks' K/V copied into row `row`."""
        b = self.block
        for i, key in enumerate(self.keys[r][:hit]):
            cache[:, :, row, :, i * b:(i + 1) * b].copy_(self.kv[key])

    def keep(self, cache, r, row):
        """Row `row` has just computed request r's prompt: the K/V of its blocks cached (as
        scheduled) and not yet kept is kept."""
        b = self.block
        for i, (key, blk) in enumerate(zip(self.keys[r], self.table[r])):
            if self.key_of.get(blk) == key and key not in self.kv:
                self.kv[key] = cache[:, :, row, :, i * b:(i + 1) * b].clone()


def block_keys(tokens, block):
    """The keys of a prompt's full blocks: each a hash of its block's tokens and the key
    before it (vLLM's block hashes, chained)."""
    keys, key = [], b""
    for start in range(0, len(tokens) - block + 1, block):
        key = hashlib.sha256(key + tokens[start:start + block].tobytes()).digest()
        keys.append(key)
    return keys


def engine_pool_blocks(slots, longest, block):
    """D's block pool: the memory of its rows, `slots` of the `longest` request's tokens, in
    blocks (its rows can never outgrow it, so the engine never preempts)."""
    return slots * -(-longest // block)


class Engine:
    """D's engine (see run_engine). Each step is admit, forward, retire, as the simulation's is
    plan and commit: admission from the simulation's own queue, then the passes on the device,
    then the tokens recorded and the finished requests' rows refilled."""

    def __init__(self, model, cache, requests, policy, pad, order):
        prompts, output_lens, arrival_s, self.pool, self.drafts = requests
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
        self.verified = [0] * n  # each request's verify steps run (with drafts)
        if self.drafts:
            self.draw = torch.Generator(device="cpu").manual_seed(self.drafts.seed)
        self.hit_blocks = {}  # a newcomer -> its blocks found cached (with a prefix cache)
        self.admitted = {}  # a request -> its place in the order of admission (its last)
        self.retry = []  # preempted requests (a heap: the oldest first, before the queue)
        self.admissions = 0  # admissions so far (a preempted request's return is one more)
        self.to_prefill = [self.prompt_len] * n  # tokens its next admission prefills
        self.running, self.position = [], []  # the request and next position of each row
        self.next_token = torch.zeros(self.slots, dtype=torch.long, device=self.device)
        self.sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        self.elog = {"t_s": [], "running": [], "prefill_s": 0.0, "decode_s": 0.0,
                    "attention_calls": 0, "decode_steps": 0, "padded_decode_steps": 0,
                    "verify_steps": 0,  # (with drafts: the decoders' verify steps, all passes)
                    "passes": [],  # (tokens, cached tokens, seconds)
                    "prefill_passes": [],  # their indices in passes
                    "hit_tokens": [0] * n, "idle_s": 0.0,
                    "preemptions": 0, "readmitted_hit_tokens": 0}

    def serve(self):
        self.sync()
        self.t0 = time.perf_counter()
        while self.waiting or self.running or self.retry:
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
        has emptied). With a block pool, as vLLM's scheduler orders it: the running requests'
        blocks for this step first (grow_running), then each newcomer's hit and blocks, the
        preempted first, the first that does not fit holding back those behind it. -> the
        newcomers, or None after idling to the next arrival."""
        new = []
        if self.pool:
            self.grow_running()
        if self.policy == "continuous" or not self.running:
            now = time.perf_counter() - self.t0
            while len(self.running) + len(new) < self.slots:
                r = self.retry[0] if self.retry else self.waiting.head(now)
                if r is None:
                    break
                if self.pool:
                    hit = self.pool.admit(r, self.to_prefill[r])
                    if hit is None:
                        break
                    self.hit_blocks[r], self.admitted[r] = hit, self.admissions
                    self.admissions += 1
                heapq.heappop(self.retry) if self.retry else self.waiting.pop()
                new.append(r)
                if math.isnan(self.ledger.start[r]):  # (its first admission)
                    self.ledger.start[r] = now
            if not self.running and not new:  # nothing runs: wait for the next arrival
                pause = max(self.waiting.next_arrival() - now, 0.0)
                time.sleep(pause)
                self.elog["idle_s"] += pause
                return None
        return new

    def grow_running(self):
        """The running requests' blocks for this step's token, oldest admission first; where
        the free blocks cannot hold one, the newest running request is preempted, until they
        can or it was the one growing (vLLM's scheduler: running requests allocate in order,
        preempting from the end of the running list)."""
        for r in sorted(self.running, key=self.admitted.get):
            if r not in self.running:  # (preempted meanwhile)
                continue
            tokens = self.position[self.running.index(r)] + 1  # (its decode writes position p)
            while not self.pool.fits(r, tokens):
                victim = max(self.running, key=self.admitted.get)
                self.preempt(victim)
                if victim == r:
                    break
            else:
                self.pool.grow(r, tokens)

    def preempt(self, r):
        """Request r leaves its row to come back later and prefill its prompt and answer
        again, finding in the pool what is still cached of them."""
        row = self.running.index(r)
        tokens = np.concatenate((self.pool.rows[r], np.asarray(self.generated[r],
                                                                  dtype=self.pool.rows.dtype)))
        self.pool.preempt(self.cache, r, row, tokens)
        self.to_prefill[r] = len(tokens)
        self.vacate(row)
        heapq.heappush(self.retry, r)
        self.elog["preemptions"] += 1

    def forward(self, new):
        """Prefill the newcomers into rows old..old+k-1 (the prefill emits their first tokens),
        a pass for each run of cached tokens they start from, those whose hit blocks are
        computed first (with a prefix cache, a newcomer hitting blocks cached by another
        newcomer of this step, as vLLM's blocks cached as scheduled are, runs in a pass after
        it); then one decode step for everyone else, each row at its own position; each pass
        timed. -> the newcomers in the order of their rows."""
        old, pool, left = len(self.running), self.pool, list(new)
        while left:
            ready = [r for r in left if not pool or pool.stored(r, self.hit_blocks[r])]
            hits = [(self.hit_blocks[r] if pool else 0, self.to_prefill[r]) for r in ready]
            for hit, length in dict.fromkeys(hits):
                group = [r for r, h in zip(ready, hits) if h == (hit, length)]
                first = len(self.running)
                self.prefill_rows(group, hit, length)
                for row, r in enumerate(group, first):
                    if pool:
                        pool.keep(self.cache, r, row)
            left = [r for r in left if r not in ready]
        self.decode_rows(old)
        return self.running[old:]

    def decode_rows(self, old):
        """One decode step for the `old` rows running before this step's newcomers."""
        if old and self.drafts:
            self.verify_rows(old)
        elif old:
            t_pass = time.perf_counter()
            positions = self.position[:old]
            logits = decode_step(self.model, self.cache, self.next_token[:old], positions,
                                 pad=self.pad)
            self.next_token[:old] = logits.argmax(-1)
            self.position[:old] = [p + 1 for p in positions]
            self.sync()
            self.log_decode(old, positions, 1, t_pass)

    def verify_rows(self, old):
        """One verify step for the `old` rows running before this step's newcomers: each
        row's last token and k drafts in one pass at its own positions; the row emits its
        drawn gain g: its first g - 1 drafts (accepted), then the target's token after them
        (its next token). The rejected drafts' K/V is left where the next step writes over it
        (vLLM's rollback)."""
        k = self.drafts.k
        t_pass = time.perf_counter()
        positions = self.position[:old]
        drafts = torch.randint(self.model.cfg.vocab, (old, k), generator=self.draw)
        tokens = torch.cat((self.next_token[:old, None], drafts.to(self.device)), dim=1)
        logits = ragged_step(self.model, self.cache, tokens, positions, pad=self.pad)
        gains = [self.drafts.gains[r][self.verified[r]] for r in self.running[:old]]
        taken = torch.tensor(gains, device=self.device)[:, None] - 1  # (the target's token)
        self.next_token[:old] = logits.argmax(-1).gather(1, taken)[:, 0]
        for row, (r, gain) in enumerate(zip(self.running[:old], gains)):
            self.verified[r] += 1
            self.generated[r] += drafts[row, :gain - 1].tolist()
            self.position[row] += gain
        self.sync()
        self.elog["verify_steps"] += old
        self.log_decode(old, positions, k + 1, t_pass)

    def log_decode(self, old, positions, width, t_pass):
        """A decode (or verify) pass of `old` rows at `positions`, `width` tokens a row,
        started at t_pass, has ended: its attention calls and seconds logged."""
        elog = self.elog
        spans = len(attention_spans(range(old), positions, width))
        padded = self.pad and spans > 1
        elog["attention_calls"] += 1 if padded else spans
        elog["padded_decode_steps"] += padded
        elog["decode_steps"] += 1
        elog["passes"].append((old * width, sum(positions), time.perf_counter() - t_pass))
        elog["decode_s"] += elog["passes"][-1][2]

    def prefill_rows(self, group, hit, length):
        """Prefill requests `group` into the next free rows, `length` tokens each (a prompt;
        a preempted request's prompt and answer), each with its first `hit` blocks cached
        (copied into its row first, with the copy timed as part of the pass)."""
        old, elog = len(self.running), self.elog
        cached = hit * self.pool.block if hit else 0
        t_pass = time.perf_counter()
        rows = torch.arange(old, old + len(group), device=self.device)
        for row, r in enumerate(group, old):
            if hit:
                self.pool.load(self.cache, r, row, hit)
            if self.generated[r]:  # (back after a preemption: its first hit stays)
                elog["readmitted_hit_tokens"] += cached
            else:
                elog["hit_tokens"][r] = cached
        tokens = self.prompts[group] if length == self.prompt_len else torch.stack([torch.cat((
            self.prompts[r], torch.tensor(self.generated[r], device=self.device)))
            for r in group])
        logits = prefill(self.model, self.cache, tokens[:, cached:], rows, cached)
        self.next_token[old:old + len(group)] = logits.argmax(-1)
        self.running += group
        self.position += [length] * len(group)
        self.sync()
        elog["prefill_passes"].append(len(elog["passes"]))
        elog["passes"].append((len(group) * (length - cached), len(group) * cached,
                               time.perf_counter() - t_pass))
        elog["prefill_s"] += elog["passes"][-1][2]

    def retire(self, new):
        """Record the step's tokens and times, and move the last row into each finished one."""
        running, elog, ledger = self.running, self.elog, self.ledger
        for r, token in zip(running, self.next_token[:len(running)].tolist()):
            self.generated[r].append(token)
        now, step = time.perf_counter() - self.t0, len(elog["t_s"]) + 1
        elog["t_s"].append(now)
        elog["running"].append(len(running))
        for r in new:
            if math.isnan(ledger.first_token[r]):  # (a readmitted request keeps its first)
                ledger.first_step[r], ledger.first_token[r] = step, now
        finished = [i for i, r in enumerate(running)
                    if len(self.generated[r]) == self.output_lens[r]]
        if self.pool:  # (in the order they were admitted: vLLM frees the finished requests
            # as its running list holds them)
            for r in sorted((running[row] for row in finished), key=self.admitted.get):
                self.pool.release(r)
        for row in reversed(finished):
            ledger.finish_step[running[row]], ledger.finish[running[row]] = step, now
            self.vacate(row)

    def vacate(self, row):
        """The request in `row` leaves it: the last row moves into it."""
        running, position = self.running, self.position
        last = len(running) - 1
        if row != last:
            m = position[last]
            self.cache[:, :, row, :, :m].copy_(self.cache[:, :, last, :, :m])
            self.next_token[row] = self.next_token[last]
            running[row], position[row] = running[last], position[last]
        running.pop()
        position.pop()
