"""Routers: each one class, registered by name in ROUTERS; pick(servers, r, pair) -> the index of
the replica request r goes to, from what each replica is doing now. in_all: among the routers
--router all compares (else only where the KV cache keeps prefixes).
"""
import collections
import math
from typing import Protocol

from nn40.kv import leading
from nn40.workload import every_block_key


class Server(Protocol):
    """What a router reads of a replica (a pool's FleetReplica is one): its load, the KV it
    has committed, and its KV manager's prefix lookup in the requests' ledger."""
    ledger: object  # the Ledger of the requests it is routed
    kv: object      # its KVManager: lookup(ledger, r) -> r's leading tokens it holds; its
    # block, capacity and total (tokens allocated)

    def load(self) -> int:
        """Requests queued, preempted and running."""

    def waiting_requests(self) -> int:
        """Requests queued and preempted."""

    def committed_kv(self) -> int:
        """KV tokens allocated (else held), prompt tokens admitted and not yet prefilled, and
        the prompts waiting."""


class Router(Protocol):
    """A routing rule: pick(servers, r, pair) -> the index of the server request r goes to
    (pair: two indices drawn at random for power-of-two); in_all: whether --router all runs
    it. One for each pool (make_router): a rule may keep a record of what it sent where."""
    in_all: bool

    def pick(self, servers: "list[Server]", r: int, pair: "tuple[int, int]") -> int:
        ...


class RoundRobin:
    """The r-th request to replica r mod N."""
    in_all = True

    def pick(self, servers, r, pair):
        return r % len(servers)


class LeastRequests:
    """The fewest requests queued, preempted and running (Vidur's LOR); ties to the lowest
    index."""
    in_all = True

    def pick(self, servers, r, pair):
        loads = [server.load() for server in servers]
        return loads.index(min(loads))


class PowerOfTwo:
    """Of two replicas drawn at random (`pair`), the less loaded; ties to the first."""
    in_all = True

    def pick(self, servers, r, pair):
        a, b = pair
        return b if servers[b].load() < servers[a].load() else a


class LeastKV:
    """The fewest KV tokens allocated (or held) plus prompt tokens waiting."""
    in_all = True

    def pick(self, servers, r, pair):
        kv = [server.committed_kv() for server in servers]
        return kv.index(min(kv))


class CacheAware:
    """SGLang's cache-aware router, as sgl-router writes it (src/policies/cache_aware.rs, its
    default thresholds). Out of balance (the most loaded replica's requests exceed the least's
    by more than `balance_abs` and by more than `balance_rel` times), the least loaded.
    Otherwise by its own approximate tree of each replica (what it sent there, not what the
    replica still caches): the replica matching the longest run of r's leading blocks (ties to
    the less loaded, then the smaller tree), where that run is over `cache_threshold` of the
    prompt, else the replica with the smallest tree. The prompt then joins that replica's
    tree, whose least recently used blocks (tails first) go past `max_tree_tokens` (its
    2**26 characters, ~4 a token; sgl-router trims every 120 s, here as it grows)."""
    in_all = False
    cache_threshold, balance_abs, balance_rel = 0.3, 64, 1.5
    max_tree_tokens = 2**26 // 4

    def __init__(self):
        self.trees = None  # per replica: its blocks' keys, least recently sent first

    def pick(self, servers, r, pair):
        if self.trees is None:
            self.trees = [collections.OrderedDict() for _ in servers]
        loads = [server.load() for server in servers]
        most, least = max(loads), min(loads)
        ledger, block = servers[0].ledger, servers[0].kv.block
        keys = every_block_key(ledger.identity, r, int(ledger.prompt[r]), block)
        if most - least > self.balance_abs and most > self.balance_rel * least:
            i = loads.index(least)
        else:
            i = self.by_tree(keys, int(ledger.prompt[r]), block, loads)
        self.insert(self.trees[i], keys, block)
        return i

    def by_tree(self, keys, prompt, block, loads):
        """The replica by the trees (balanced load): best match over the threshold, else the
        smallest tree."""
        trees = self.trees
        matched = [len(leading(tree.get, keys, 0, len(keys))) for tree in trees]
        best = min(range(len(trees)), key=lambda i: (-matched[i], loads[i], len(trees[i]), i))
        if prompt and matched[best] * block > self.cache_threshold * prompt:
            return best
        return min(range(len(trees)), key=lambda i: (len(trees[i]), i))

    def insert(self, tree, keys, block):
        """The prompt's blocks join a replica's tree, most recently used its head."""
        for key in reversed(keys):
            tree[key] = True
            tree.move_to_end(key)
        while len(tree) * block > self.max_tree_tokens:
            tree.popitem(last=False)


class PrecisePrefix:
    """llm-d's precise prefix-cache routing (its precise-prefix-cache-aware guide's scheduling
    profile): each replica scored 3 x its prefix score + 2 x its KV cache's free share + 2 x its
    queue score, the highest taken (ties at random: max-score-picker's shuffle). The prefix
    score reads the replicas' real caches (vLLM's KV events): the leading tokens of r each
    holds, min-max normalised over the replicas holding any (1 where they hold as many); the
    queue score is (most waiting - its waiting) / (most - fewest), 1 where all wait as many
    (the inference extension's queue scorer)."""
    in_all = False
    weights = (3.0, 2.0, 2.0)  # prefix, KV cache free, queue

    def pick(self, servers, r, pair):
        ledger = servers[0].ledger
        held = [server.kv.lookup(ledger, r) for server in servers]
        prefix = min_max([h if h > 0 else None for h in held])
        waiting = [server.waiting_requests() for server in servers]
        queue = min_max([-w for w in waiting])
        free = [1.0 if math.isinf(s.kv.capacity) else 1.0 - s.kv.total / s.kv.capacity
                for s in servers]
        a, b, c = self.weights
        scores = [a * p + b * f + c * q for p, f, q in zip(prefix, free, queue)]
        top, m = max(scores), len(servers)
        return next(i % m for i in range(pair[0], pair[0] + m) if scores[i % m] == top)


def min_max(values):
    """Scores in [0, 1] by min-max over the values given (None: no score, 0); all equal: 1."""
    given = [v for v in values if v is not None]
    if not given:
        return [0.0] * len(values)
    lo, hi = min(given), max(given)
    return [0.0 if v is None else 1.0 if hi == lo else (v - lo) / (hi - lo) for v in values]


ROUTERS: "dict[str, type]" = {  # a router's name -> its class (a pool makes its own router)
    "round-robin": RoundRobin, "least-requests": LeastRequests, "power-of-two": PowerOfTwo,
    "least-kv": LeastKV, "cache-aware": CacheAware, "precise-prefix": PrecisePrefix}


def make_router(name):
    """A new router of the rule named (ROUTERS), for one pool: some keep a record of their own."""
    return ROUTERS[name]()
