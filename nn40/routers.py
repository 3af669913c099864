"""Routers: each one class, registered by name in ROUTERS; pick(servers, r, pair) -> the index of
the replica request r goes to, from what each replica is doing now. in_all: among the routers
--router all compares (else only where the KV cache keeps prefixes).
"""
from typing import Protocol


class Server(Protocol):
    """What a router reads of a replica (a pool's FleetReplica is one): its load, the KV it
    has committed, and its KV manager's prefix lookup in the requests' ledger."""
    ledger: object  # the Ledger of the requests it is routed
    kv: object      # its KVManager: lookup(ledger, r) -> r's leading tokens it holds

    def load(self) -> int:
        """Requests queued, preempted and running."""

    def committed_kv(self) -> int:
        """KV tokens allocated (else held), prompt tokens admitted and not yet prefilled, and
        the prompts waiting."""


class Router(Protocol):
    """A routing rule: pick(servers, r, pair) -> the index of the server request r goes to
    (pair: two indices drawn at random for power-of-two); in_all: whether --router all runs
    it."""
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


class CacheAware(LeastRequests):
    """The replica whose prefix cache holds the longest run of r's leading blocks, where that
    run is over `cache_threshold` of its prompt, unless that replica is out of balance with the
    least loaded (its requests exceed the least's by more than `balance_abs` and by more than
    `balance_rel` times): then, as otherwise, the least loaded (SGLang's cache-aware router,
    its default thresholds; it compares the replicas' caches themselves, not a copy)."""
    in_all = False
    cache_threshold, balance_abs, balance_rel = 0.3, 64, 1.5

    def pick(self, servers, r, pair):
        ledger = servers[0].ledger
        loads = [server.load() for server in servers]
        least = loads.index(min(loads))
        matched = [server.kv.lookup(ledger, r) for server in servers]
        best = max(range(len(servers)), key=lambda i: (matched[i], -loads[i], -i))
        if matched[best] <= self.cache_threshold * ledger.to_prefill[r]:
            return least
        if loads[best] - loads[least] > self.balance_abs and \
                loads[best] > self.balance_rel * loads[least]:
            return least
        return best


ROUTERS: "dict[str, Router]" = {
    "round-robin": RoundRobin(), "least-requests": LeastRequests(), "power-of-two": PowerOfTwo(),
    "least-kv": LeastKV(), "cache-aware": CacheAware()}


def route(router, servers, r, pair):
    """The replica that request r goes to (ROUTERS[router]'s pick)."""
    return ROUTERS[router].pick(servers, r, pair)
