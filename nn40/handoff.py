"""The KV hand-off between a prefill pool and a decode pool: the link it crosses (KVLink: the
card's own within a node, else the network's; kv_link), the sends in flight on each link
(KVSends) and the hand-off itself (HandOff: a finished prefill's KV reserved on a decode
replica, sent, then admitted there)
"""
import functools
import collections
import heapq
from dataclasses import dataclass

from nn40.accounting import kv_bytes_per_token
from nn40.config import HOST_LINKS, card_key
from nn40.errors import UsageError
from nn40.events import ARRIVE, PLAN, SENT


class HandOff:
    """A prefill pool's requests handed to the decode pool at their first token, each an
    event: the decode replica is chosen then (by its router), and the blocks for the prompt and
    that token are reserved there (taken out of its capacity until the KV lands) when the KV
    starts to cross (KVSends, or at once). Where that replica's cache has no room for them, the
    request waits, first come first served at that replica, until a request finishes there;
    meanwhile and while it crosses, its KV is held on its prefill replica, in that replica's
    memory integrals and out of its admissions' reach, as the engines keep it until the
    decode side has read it (DistServe's context stage frees a request's blocks once it has
    migrated; vLLM's NIXL connector delays freeing them, request_finished): a prefill pool
    whose KV cannot leave stops taking new prompts (back-pressure). Nothing is dropped: a
    replica holding nothing takes a request whatever it needs."""

    def __init__(self, ledger, prefill, decode, queue, link=None):
        self.ledger, self.prefill, self.decode, self.queue = ledger, prefill, decode, queue
        self.sends = KVSends(link, len(prefill.servers), queue, self.landed) if link else None
        self.waiting = [collections.deque() for _ in decode.servers]
        self.reserved = [0] * len(decode.servers)  # tokens reserved at each decode replica
        self.handed = {}  # request -> (its prefill replica, tokens held there, since, reserved)
        self.totals = {"waited": 0, "wait_s": 0.0, "held_token_s": 0.0}
        for i, server in enumerate(prefill.servers):
            server.on_finish = functools.partial(self.first_token, i)
        for j, server in enumerate(decode.servers):
            server.on_finish = functools.partial(self.freed, j)
        decode.on_arrive = self.land

    def first_token(self, replica, r, t):
        """Request r has its first token at t on prefill replica `replica`: it is handed on
        to emit the rest (if any)."""
        ledger = self.ledger
        left = ledger.output[r] - 1
        if not left:
            return
        ledger.remaining[r] = left
        ledger.to_prefill[r] = ledger.cached[r] = ledger.prompt[r] + 1
        j = self.decode.place(r)
        prompt = int(ledger.prompt[r])
        kept = self.prefill.servers[replica].kv.blocks(prompt)  # (as memory.hold counts: the
        # prompt's KV; its first token's the decode pool writes)
        self.prefill.servers[replica].kv.reserve(kept)  # (its blocks, until the KV is read)
        self.handed[r] = (replica, prompt, t, 0, kept)
        if self.waiting[j] or not self.fits(j, r):
            self.waiting[j].append(r)
            self.totals["waited"] += 1
            return
        self.send(j, r, t)

    def need(self, j, r):
        prompt = int(self.ledger.prompt[r])
        return self.decode.servers[j].kv.need(prompt, prompt + 1, 0, 0)

    def fits(self, j, r):
        """Whether decode replica j has room for r now, past what the requests waiting there
        (landed, or preempted) will take first: at most their tokens and a block each."""
        server = self.decode.servers[j]
        ahead = server.queued_tokens()
        if not (server.kv.total or self.reserved[j] or ahead):
            return True  # (holding nothing, it takes r whatever r needs)
        return server.kv.has_room(self.need(j, r), ahead)

    def send(self, j, r, t):
        """Reserve r's blocks at decode replica j and send its KV from t."""
        replica, tokens, since, _, kept = self.handed[r]
        need = self.need(j, r)
        self.decode.servers[j].kv.reserve(need)
        self.reserved[j] += need
        self.handed[r] = (replica, tokens, since, need, kept)
        self.totals["wait_s"] += t - since
        if self.sends:  # (layer-wise, its layers went as the prefill made them, unless it
            self.sends.send(replica, tokens, t, r,  # waited for room: then none had)
                            since - self.ledger.start[r] if t == since else 0.0)
        else:
            self.landed(r, t)

    def landed(self, r, t):
        """r's KV is in the decode pool at t: it arrives there."""
        self.decode.ledger.arrival[r] = t
        self.queue.push(t, ARRIVE, self.decode, r)

    def land(self, r, t):
        """r's KV is in at decode replica j: its reservation is given back for its own
        admission, and its prefill replica's memory counts what it held until now."""
        j = self.decode.where[r]
        replica, tokens, since, need, kept = self.handed.pop(r)
        self.decode.servers[j].kv.unreserve(need)
        self.reserved[j] -= need
        server = self.prefill.servers[replica]  # (held there until its last byte left)
        server.kv.unreserve(kept)
        if server.wake(t):  # (idle, its room back: it plans from t)
            self.queue.push(t, PLAN, server)
        held_s = max(t - (self.sends.link.latency_s if self.sends else 0.0) - since, 0.0)
        server.memory.hold(tokens, server.kv.blocks(tokens), held_s)
        self.totals["held_token_s"] += tokens * held_s

    def freed(self, j, r, t):
        """A request finished at decode replica j at t: those waiting there go while they fit."""
        waiting = self.waiting[j]
        while waiting and self.fits(j, waiting[0]):
            self.send(j, waiting.popleft(), t)


@dataclass(frozen=True)
class KVLink:
    """The link a prefill replica sends its requests' KV over to the decode pool: bytes_per_s
    and a latency a send; kv_bytes_per_token: the model's K and V of one token, every layer.
    layers: 0, the KV sent once the prefill is done; else sent layer by layer as the prefill
    computes them (DistServe's and Splitwise's overlap), the link taken as free meanwhile:
    of a prompt's bytes B prefilled in P seconds, max(B / layers, B - rate P (layers - 1) /
    layers) are left at its first token."""
    bytes_per_s: float
    latency_s: float
    kv_bytes_per_token: float
    name: str = ""
    layers: int = 0

    def bytes_left(self, size, prefill_s):
        """Of a prompt's `size` bytes prefilled in prefill_s, those still to send at its end."""
        if not self.layers:
            return size
        return max(size / self.layers,
                   size - self.bytes_per_s * prefill_s * (self.layers - 1) / self.layers)


# A GPU's network between nodes, one way, and a send's latency: the HGX/DGX boards give each
# GPU a NIC of its own (NVIDIA's DGX spec sheets: DGX A100 eight ConnectX-6 HDR InfiniBand,
# 200 Gb/s each; DGX H100, H200 and B200 eight ConnectX-7 NDR, 400 Gb/s each); the PCIe cards a
# 100 Gb/s Ethernet NIC (assumed: their servers vary). 2 us: an RDMA write through one
# switch, the order perftest's ib_write_lat reports (assumed, not measured here).
NETWORK_LINKS = {"a100-40gb": ("HDR InfiniBand", 25.0), "a100-80gb": ("HDR InfiniBand", 25.0),
                 "h100": ("NDR InfiniBand", 50.0), "h200": ("NDR InfiniBand", 50.0),
                 "b200": ("NDR InfiniBand", 50.0)}
NETWORK_DEFAULT, NETWORK_LATENCY_US, GPUS_PER_NODE = ("100 GbE", 12.5), 2.0, 8


def network_link(card):
    """(name, GB/s, latency us) of the network a GPU reaches another node's over."""
    return (*NETWORK_LINKS.get(card_key(card), NETWORK_DEFAULT), NETWORK_LATENCY_US)


def card_link(card):
    """(name, GB/s, latency us) of the card's own link to another card in its node."""
    return card.link, card.link_gbs, 0.0


def nvlink(card):
    if not card.link.startswith("NVLink"):
        raise UsageError(f"--kv-link nvlink: the {card.name} has no NVLink (its cards talk "
                         f"over {card.link}): give --kv-link pcie or a network")
    return card_link(card)


def pcie(card):
    """The card's PCIe slot (a card to card copy through the host's root complex)."""
    name, gbs = HOST_LINKS.get(card_key(card), (card.link, card.link_gbs))
    return name, gbs, 0.0


# The KV link by name (--kv-link): within a node the card's NVLink or PCIe (config.GPUS,
# HOST_LINKS: the spec sheets), between nodes the card's NIC (NETWORK_LINKS) or a named one:
# InfiniBand HDR 200 Gb/s and NDR 400 Gb/s, Ethernet (RoCE) 100 and 400 Gb/s, one way
LINKS = {"nvlink": nvlink, "pcie": pcie, "network": network_link,
         "infiniband-hdr": lambda card: ("HDR InfiniBand", 25.0, NETWORK_LATENCY_US),
         "infiniband-ndr": lambda card: ("NDR InfiniBand", 50.0, NETWORK_LATENCY_US),
         "ethernet-100g": lambda card: ("100 GbE", 12.5, NETWORK_LATENCY_US),
         "ethernet-400g": lambda card: ("400 GbE", 50.0, NETWORK_LATENCY_US)}


def kv_link(cfg, card, name=None, gbs=None, latency_us=None, layerwise=False):
    """The link between the pools: a named one (LINKS: "network", the card's NIC between
    nodes), else the card's own inside a node (NVLink or PCIe, at its spec), unless `gbs`
    (GB/s) and `latency_us` say otherwise; `layerwise`: the KV sent layer by layer during the
    prefill (KVLink)."""
    link = LINKS[name] if name else card_link
    title, rate, latency = link(card)
    rate = rate if gbs is None else gbs
    latency = latency if latency_us is None else latency_us
    if not rate > 0 or latency < 0:
        raise UsageError(f"a link of {rate:g} GB/s and {latency:g} us: the KV needs a "
                         "bandwidth above zero and a latency of at least zero")
    return KVLink(rate * 1e9, latency * 1e-6, kv_bytes_per_token(cfg),
                  title if gbs is None else f"{gbs:g} GB/s", cfg.layers if layerwise else 0)


class KVSends:
    """The KV hand-offs in flight: one link out of each prefill replica, its bandwidth shared
    fairly among the sends on it (each of n at bytes_per_s / n, as concurrent RDMA flows
    share a NIC), and the decode pool has a send a latency after its last byte. Kept per link
    as a virtual clock (the bytes each flow has been given since the link was last idle) and
    a heap of the clock at which each send ends: a send or an end is O(log n) events, and the
    next end is one event (SENT), put off again when a send joins. What moved is kept: the
    link's busy seconds (each send alone) and the seconds sharing added. (The sender's link is
    the one shared: sends from several prefill replicas into one decode replica do not share
    its link.)"""

    def __init__(self, link, replicas, queue, landed):
        self.link, self.queue, self.landed = link, queue, landed  # landed(request, t)
        self.links = [[0.0, 0.0, [], 0] for _ in range(replicas)]  # t, clock, heap, version
        self.totals = {"sends": 0, "bytes": 0.0, "link_s": 0.0, "queued_s": 0.0}

    def advance(self, state, t):
        """The link's virtual clock to t (each of its n flows given (t - then) rate / n)."""
        if state[2]:
            state[1] += (t - state[0]) * self.link.bytes_per_s / len(state[2])
        state[0] = t

    def send(self, replica, prompt_tokens, t, r, prefill_s=0.0):
        """Replica `replica` starts sending request r's prompt KV at t (prefilled in
        prefill_s: see KVLink.layers)."""
        link, totals, state = self.link, self.totals, self.links[replica]
        whole = prompt_tokens * link.kv_bytes_per_token
        size = link.bytes_left(whole, prefill_s)
        self.advance(state, t)
        heapq.heappush(state[2], (state[1] + size, r, t, size))
        totals["sends"] += 1
        totals["bytes"] += whole
        totals["link_s"] += size / link.bytes_per_s
        self.next_end(replica)

    def next_end(self, replica):
        state = self.links[replica]
        state[3] += 1  # (an end queued before is stale)
        if state[2]:
            left = state[2][0][0] - state[1]
            end = state[0] + max(left, 0.0) * len(state[2]) / self.link.bytes_per_s
            self.queue.push(end, SENT, self, (replica, state[3]))

    def sent(self, t, value):
        """A queued end at t: the sends whose last byte has gone land a latency later."""
        replica, version = value
        state = self.links[replica]
        if version != state[3]:
            return
        self.advance(state, t)
        heap, rate = state[2], self.link.bytes_per_s
        state[1] = max(state[1], heap[0][0])  # (the end queued is the first's, to the bit)
        while heap and heap[0][0] <= state[1] * (1 + 1e-12):
            _, r, start, size = heapq.heappop(heap)
            self.totals["queued_s"] += (t - start) - size / rate
            self.landed(r, t + self.link.latency_s)
        if not heap:
            state[1] = 0.0  # (idle: the clock starts again, keeping its sums small)
        self.next_end(replica)
