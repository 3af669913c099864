"""Queues and orders: who takes a free seat first (pure Python)

The waiting requests in arrival order, or by a key (true or predicted length), with the
starvation guard; the Ledger holds every request's state and times; and the blocks a prefix
cache frees, in the order it takes them back (BlockQueue).
"""
import collections
import heapq
import itertools
import math
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np

from nn40.stats import percentiles


ORDERS = ("fcfs", "sjf", "predicted", "longest")


@dataclass(frozen=True)
class Order:
    """Who takes a free seat first: the waiting queue's order.

    fcfs       first come, first served (the servers' default)
    sjf        the shortest output first, by the true lengths: an oracle, the bound
    predicted  the shortest predicted output first: each true length times e^N(0, sigma^2),
               a length predictor's error (Kendall's tau against the truth says how good)
    longest    the longest output first (longest processing time first: the makespan's rule)
    keys: what the order sorts by (None: arrival); rank: each request's place in that order,
    ties by arrival (its integers make the queue's heap cheap), and ranked: the request at each
    place. max_wait_s: the starvation guard, once a request has waited this long it goes first.
    """
    name: str = "fcfs"
    keys: list = None
    rank: list = None
    ranked: list = None
    max_wait_s: float = None
    sigma: float = 0.0


def queue_order(name, output, sigma=0.0, seed=0, max_wait_s=None):
    """The Order `name` for requests of these output lengths (in arrival order)."""
    output = np.asarray(output, dtype=np.float64)
    keys = {"fcfs": lambda: None, "sjf": lambda: output, "longest": lambda: -output,
            "predicted": lambda: output * np.exp(np.random.default_rng(seed).normal(
                0.0, sigma, len(output)))}[name]()
    sigma = sigma if name == "predicted" else 0.0
    if keys is None:
        return Order(name, max_wait_s=max_wait_s)
    ranked = np.argsort(keys, kind="stable")  # (stable: ties by arrival)
    rank = np.empty_like(ranked)
    rank[ranked] = np.arange(len(ranked))
    return Order(name, keys.tolist(), rank.tolist(), ranked.tolist(), max_wait_s, sigma)


def kendall_tau(x, y, max_n=3000, seed=0):
    """Kendall's tau-b of two rankings (a pair tied in either counts neither way), on max_n
    of them drawn at random when there are more (its standard error is then about 0.01)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(x) > max_n:
        pick = np.random.default_rng(seed).choice(len(x), max_n, replace=False)
        x, y = x[pick], y[pick]
    agree = pairs_x = pairs_y = 0
    for i in range(0, len(x), 500):  # (the pair matrix, 500 rows at a time)
        dx, dy = (np.sign(v[i:i + 500, None] - v[None, :]) for v in (x, y))
        agree += float((dx * dy).sum())
        pairs_x, pairs_y = pairs_x + np.count_nonzero(dx), pairs_y + np.count_nonzero(dy)
    return agree / math.sqrt(pairs_x * pairs_y) if pairs_x and pairs_y else 0.0


class RequestTimes(NamedTuple):
    """A run's per-request record, simulated (ServingSim) or measured (D's Engine) alike:
    when each request arrived, was admitted, emitted its first token and its last (s), the
    steps of those two tokens, and its output tokens. Summarised once, by summary."""
    arrival: np.ndarray
    start: np.ndarray
    first_token: np.ndarray
    finish: np.ndarray
    first_step: np.ndarray
    finish_step: np.ndarray
    output: np.ndarray

    def ttft(self):
        return self.first_token - self.arrival

    def e2e(self):
        return self.finish - self.arrival

    def tpot(self):
        """Seconds per output token after the first, of the requests emitting more than one."""
        multi = self.output > 1
        return (self.finish[multi] - self.first_token[multi]) / (self.output[multi] - 1)

    def summary(self):
        """The makespan and the TTFT, TPOT and E2E percentiles (see percentiles)."""
        return {"makespan_s": float(self.finish.max() - self.arrival.min()),
                "ttft_s": percentiles(self.ttft()), "tpot_s": percentiles(self.tpot()),
                "e2e_s": percentiles(self.e2e())}


class Ledger:
    """Every request's state and times, written by whichever simulation serves it (one, or
    one of a fleet's replicas: each request is served by exactly one)."""

    def __init__(self, req):
        self.arrival, self.prompt, self.output = (a.tolist() for a in (req.arrival_s, req.prompt,
                                                                       req.output))
        n = len(self.output)
        self.start, self.first_token, self.finish = [math.nan] * n, [math.nan] * n, \
            [math.nan] * n
        self.first_step, self.finish_step = [0] * n, [0] * n  # (in the serving simulation's steps)
        self.to_prefill, self.remaining = list(self.prompt), list(self.output)
        self.cached = [0] * n if req.cached is None else req.cached.tolist()  # (at admission)
        self.identity = req.identity  # what the prompts are made of (None: unknown)
        self.generated = [0] * n  # tokens each request has emitted
        self.taken = bytearray(n)  # taken out of a waiting queue (see PriorityQueue)

    def times(self):
        """The record of the run written here (built once, at its end)."""
        return RequestTimes(*(np.array(v) for v in (
            self.arrival, self.start, self.first_token, self.finish, self.first_step,
            self.finish_step, self.output)))


class FifoQueue:
    """The waiting requests, first come first served: their ids in arrival order, and the
    next one to take."""

    def __init__(self, ledger, ids=()):
        self.arrival, self.prompt = ledger.arrival, ledger.prompt
        self.ids, self.i = ids if isinstance(ids, range) else list(ids), 0
        self.tokens = sum(self.prompt[r] for r in self.ids)  # their prompt tokens

    def push(self, r):  # (r arrives no earlier than every id before it)
        self.ids.append(r)
        self.tokens += self.prompt[r]

    def __len__(self):
        return len(self.ids) - self.i

    def head(self, t):
        """The request admission takes next at time t; None while none has arrived."""
        if self.i < len(self.ids) and self.arrival[self.ids[self.i]] <= t:
            return self.ids[self.i]
        return None

    def pop(self):  # (takes the head just returned)
        self.tokens -= self.prompt[self.ids[self.i]]
        self.i += 1

    def next_arrival(self):
        """When the next request not yet taken arrives (math.inf: none is left)."""
        return self.arrival[self.ids[self.i]] if self.i < len(self.ids) else math.inf


class PriorityQueue(FifoQueue):
    """The waiting requests by a key, lowest first, ties by arrival. Non-preemptive: the key
    decides who takes a free seat, never who leaves one. With max_wait_s, the starvation
    guard: once a request has waited that long it goes first (the longest-waiting first)."""

    def __init__(self, ledger, ids, rank, ranked, max_wait_s=None):
        super().__init__(ledger, ids)
        self.rank, self.ranked, self.max_wait_s = rank, ranked, max_wait_s
        self.heap = []                      # the ranks of the requests that have arrived
        self.arrived = 0                    # ids[:arrived] have joined the heap
        self.front = 0                      # ids[front]: the oldest not yet taken
        self.gone = ledger.taken            # taken (a fleet's queues share it)
        self.chosen = None

    def head(self, t):
        ids, arrival, n = self.ids, self.arrival, self.arrived
        if n < len(ids) and arrival[ids[n]] <= t:  # the newly arrived join the heap
            end = n + 1
            while end < len(ids) and arrival[ids[end]] <= t:
                end += 1
            rank = self.rank
            new = [rank[r] for r in ids[n:end]]
            if len(new) > len(self.heap):  # (a crowd at once: a sorted list is a heap)
                self.heap = sorted(self.heap + new)
            else:
                for item in new:
                    heapq.heappush(self.heap, item)
            self.arrived = end
        heap, gone, ranked = self.heap, self.gone, self.ranked
        while heap and gone[ranked[heap[0]]]:
            heapq.heappop(heap)
        self.chosen = ranked[heap[0]] if heap else None
        if self.max_wait_s is not None and heap:
            while gone[ids[self.front]]:
                self.front += 1
            oldest = ids[self.front]  # (arrived: no later than the heap's top)
            if t - arrival[oldest] >= self.max_wait_s:
                self.chosen = oldest
        return self.chosen

    def pop(self):
        r = self.chosen
        self.gone[r] = 1
        if self.ranked[self.heap[0]] == r:
            heapq.heappop(self.heap)
        self.tokens -= self.prompt[r]
        self.i += 1

    def next_arrival(self):
        ids, n = self.ids, self.arrived
        return self.arrival[ids[n]] if n < len(ids) else math.inf


def waiting_queue(ledger, ids, order=None):
    """The queue of the requests `ids` (in arrival order) under an Order (None: first come,
    first served)."""
    if order is None or order.keys is None:
        return FifoQueue(ledger, ids)
    return PriorityQueue(ledger, ids, order.rank, order.ranked, order.max_wait_s)


class EvictionOrder(Protocol):
    """The order in which a prefix cache gives up the cached blocks no one holds (its free
    queue), and its host tier the blocks it stores. PrefixCache calls these alone, so an order
    is one class here, registered in EVICTION_ORDERS. BlockQueue is LRU: the least recently
    freed first, as vLLM's free block queue; FirstInQueue (fifo: by first caching) and
    LfuQueue (lfu: the fewest hits first, SGLang's) keep a heap (RankedQueue)."""
    where: dict  # key -> its entry while the key is in the queue (a lookup: is it here)

    def __len__(self) -> int:
        """The keys in the queue."""

    def push(self, keys):
        """Keys given up (freed, or stored), in the order they go."""

    def push_run(self, count):
        """`count` blocks with no key (never cached), at the tail."""

    def remove(self, keys):
        """Take these keys (all in the queue) out: hit again, they are held."""

    def pop(self, blocks):
        """Take up to `blocks` blocks from the head. -> the keys taken (evicted)."""

    def cached(self, keys):
        """Keys just cached (computed), before any is pushed: what FIFO ranks by."""

    def hit(self, keys):
        """Keys a request just hit, held or not: what LFU ranks by."""


class BlockQueue:
    """Block keys in the order they were pushed, oldest first, and runs of blocks with no key
    (`count` uncached blocks): a prefix cache's free queue, or its host tier. A key is in the
    queue while `where` names the batch that pushed it; a key removed leaves a stale entry
    behind, skipped when the head reaches it, and a batch all of whose keys were removed is
    dropped whole (`live`: its keys still in the queue). Every operation costs O(its keys) at C
    speed (maps over lists and dicts), none a Python step per block."""
    __slots__ = ("where", "batches", "ids", "live")

    def __init__(self):
        self.where = {}  # key -> the batch that pushed it
        self.batches = collections.deque()  # [batch id (None: a run), keys (count), next]
        self.ids = itertools.count()
        self.live = {}  # batch -> its keys still in the queue (none: not a key)

    def __len__(self):
        return len(self.where)

    def __iter__(self):
        """The keys, oldest first."""
        where = self.where
        for batch, keys, i in self.batches:
            if batch is not None:
                yield from (key for key in keys[i:] if where.get(key) == batch)

    def blocks(self):
        """Blocks in the queue: its keys and its runs' blocks."""
        return len(self.where) + sum(keys for batch, keys, _ in self.batches if batch is None)

    def push(self, keys):
        if keys:  # (keys not queued: a cache frees a block once, and stores it once)
            batch = next(self.ids)
            self.batches.append([batch, keys, 0])
            self.where.update(dict.fromkeys(keys, batch))
            self.live[batch] = len(keys)

    def push_run(self, count):
        batches = self.batches
        if batches and batches[-1][0] is None:  # (after a run: one longer run)
            batches[-1][1] += count
        else:
            batches.append([None, count, 0])

    def remove(self, keys):
        """Take these keys (all in the queue) out."""
        batches, live = list(map(self.where.pop, keys)), self.live
        if not batches:
            return
        counts = {batches[0]: len(batches)} if batches.count(batches[0]) == len(batches) \
            else collections.Counter(batches)  # (one batch, the usual: no dict step a key)
        for batch, n in counts.items():
            if live[batch] == n:
                del live[batch]
            else:
                live[batch] -= n

    def pop(self, blocks):
        """Take up to `blocks` blocks from the head. -> the keys taken (a run's blocks count
        but have none)."""
        batches, where, out = self.batches, self.where, []
        if batches and batches[0][0] is None and batches[0][1] > blocks > 0:  # (the usual:
            batches[0][1] -= blocks  # a run's blocks)
            return out
        while blocks > 0 and batches:
            head = batches[0]
            batch, keys, i = head
            if batch is None:  # a run of blocks with no key
                if keys > blocks:
                    head[1] = keys - blocks
                else:
                    batches.popleft()
                blocks -= keys
                continue
            if batch not in self.live:  # (every key of it taken out since)
                batches.popleft()
                continue
            part = keys[i:i + blocks]
            found = list(map(where.get, part, itertools.repeat(-1, len(part))))
            if found.count(batch) != len(part):  # (some taken out since)
                part = list(itertools.compress(part, map(batch.__eq__, found)))
            i += len(found)
            if i < len(keys):
                head[2] = i
            else:
                batches.popleft()
            blocks -= len(part)
            out += part
        if out:
            self.remove(out)
        return out

    def cached(self, keys):
        """(LRU ranks by the last push alone.)"""

    def hit(self, keys):
        """(LRU ranks by the last push alone.)"""


class RankedQueue:
    """Keys given up by a rank, the lowest first, ties to the earliest pushed; blocks with no
    key (runs: never cached) always before any key, since a free block holds nothing worth
    keeping (vLLM puts a block without a hash at the head of its free queue). A subclass names
    the rank (FirstInQueue: when the key was first cached; LfuQueue: how often it was hit,
    held or free). A heap of (rank, push, key) whose entries go stale when the key is taken
    out or pushed again (skipped when popped, and dropped when they outnumber the live ones)."""
    __slots__ = ("where", "heap", "runs", "ticks", "seen")

    def __init__(self):
        self.where = {}  # key -> its live entry's push
        self.heap, self.runs, self.ticks = [], 0, itertools.count()
        self.seen = {}  # key -> what its rank remembers while it is cached (see rank)

    def __len__(self):
        return len(self.where)

    def __iter__(self):
        """The keys, the first to go first."""
        return (key for _, tick, key in sorted(self.heap) if self.where.get(key) == tick)

    def blocks(self):
        return len(self.where) + self.runs

    def push(self, keys):
        where, heap, seen = self.where, self.heap, self.seen
        for key in keys:
            tick = next(self.ticks)
            where[key] = tick
            heapq.heappush(heap, (self.rank(seen, key, tick), tick, key))
        if len(heap) > 4 * len(where) + 64:  # (mostly stale: rebuilt from the live ones)
            self.heap = [e for e in heap if where.get(e[2]) == e[1]]
            heapq.heapify(self.heap)

    def push_run(self, count):
        self.runs += count

    def remove(self, keys):
        for key in keys:
            del self.where[key]

    def pop(self, blocks):
        runs = min(blocks, self.runs)
        self.runs, blocks, out = self.runs - runs, blocks - runs, []
        where, heap, seen = self.where, self.heap, self.seen
        while blocks > 0 and heap:
            _, tick, key = heapq.heappop(heap)
            if where.get(key) == tick:
                del where[key]
                seen.pop(key, None)  # (evicted: forgotten)
                out.append(key)
                blocks -= 1
        return out

    def rank(self, seen, key, tick):
        raise NotImplementedError

    def cached(self, keys):
        pass

    def hit(self, keys):
        pass


class FirstInQueue(RankedQueue):
    """fifo: the key cached first goes first, however recently it was used (SGLang's fifo:
    its creation time, remembered while it stays cached; a key pushed uncached is ranked by
    that push)."""
    __slots__ = ()

    def rank(self, seen, key, tick):
        return seen.setdefault(key, tick)

    def cached(self, keys):
        seen, ticks = self.seen, self.ticks
        for key in keys:
            seen.setdefault(key, next(ticks))


class LfuQueue(RankedQueue):
    """lfu: the key hit least often goes first, the least recently pushed of those (SGLang's
    --radix-eviction-policy lfu: its radix tree evicts the leaf of the fewest hits); its hits
    remembered while it stays cached."""
    __slots__ = ()

    def rank(self, seen, key, tick):
        return seen.get(key, 0)

    def hit(self, keys):
        seen = self.seen
        for key in keys:
            seen[key] = seen.get(key, 0) + 1


EVICTION_ORDERS = {"lru": BlockQueue, "fifo": FirstInQueue,  # a prefix cache's eviction order
                   "lfu": LfuQueue}
