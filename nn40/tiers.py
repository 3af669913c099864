"""A prefix cache's tiers below the card: host memory, and a disk or remote store below it;
which blocks each stores, and when (pure Python)

The card's prefix cache (nn40.kv.PrefixCache) tells its host tier three things: blocks computed
on the card, blocks the card evicted, blocks loaded back from the tier; the host tier tells the
tier below it (its `below`: a disk, or a remote store) the same of its own: blocks computed,
blocks it gave up, blocks loaded from it. What a tier does with each is its write policy, one
class each, registered by name in HOST_TIERS, the same for both levels: SGLang's
--hicache-write-policy moves blocks from L1 to L2 and from L2 to L3 alike, and a block found in
L3 is prefetched into L2 (sglang docs/advanced_features/hicache_design.md); LMCache puts a chunk
in every backend it has and writes one found on disk back into its CPU backend
(lmcache/v1/storage_backend/storage_manager.py: batched_put, get):

write-through  every block is stored as it is computed, and a load leaves the copy: vLLM's KV
               offloading connector (vllm/v1/kv_offload: the scheduler side stores each new full
               block, the worker copies it by DMA beside the forward pass) and LMCache's
               store-on-compute; the tier's eviction order decides what it keeps
write-back     a block is stored when the card evicts it, and a load leaves the copy: SGLang's
               HiCache with --hicache-write-policy write_back (the card's radix tree backs up a
               node to host memory as it is evicted)
"""
from nn40.queues import EVICTION_ORDERS


class HostTier:
    """The blocks a host tier keeps: at most `blocks` of them, given up in `order`
    (EVICTION_ORDERS, the card's --eviction-policy); `where` answers whether a key is there.
    A block stored again is pushed again (under LRU, the most recent); a block loaded back
    keeps its copy and is stored again."""
    stores_computed = False  # computed blocks are stored at once (else: when evicted)

    def __init__(self, blocks, order="lru", below=None):
        self.blocks, self.keys, self.below = blocks, EVICTION_ORDERS[order](), below
        self.where = self.keys.where

    def __len__(self):
        return len(self.keys)

    def __iter__(self):
        """Its keys, the first to go first."""
        return iter(self.keys)

    def store(self, keys):
        """Keys stored, in order (the last the most recent); the oldest beyond `blocks` go."""
        where = self.where
        if not where.keys().isdisjoint(keys):
            self.keys.remove([key for key in keys if key in where])
        self.keys.push(list(keys))
        if len(self.keys) > self.blocks:
            gone = self.keys.pop(len(self.keys) - self.blocks)
            if self.below is not None:
                self.below.evicted(gone)

    def computed(self, keys):
        """Blocks just computed (cached) on the card."""
        if self.stores_computed:
            self.store(keys)
            if self.below is not None:
                self.below.computed(keys)

    def evicted(self, keys):
        """Blocks the card gave up."""
        if not self.stores_computed:
            self.store(keys)

    def loaded(self, keys):
        """Blocks loaded back to the card: the copy stays, stored again (a hit, for an order
        that counts them)."""
        self.keys.hit(keys)
        self.store(keys)

    def promoted(self, keys):
        """Blocks loaded to the card from the tier below, through this one: stored here (SGLang
        prefetches L3 into L2 before the card loads them), the tier below keeping its copy."""
        self.below.loaded(keys)
        self.store(keys)


class WriteThrough(HostTier):
    """write-through: every block stored as computed (vLLM's offloading connector, LMCache)."""
    stores_computed = True


class WriteBack(HostTier):
    """write-back: a block stored as the card evicts it (SGLang HiCache's write_back)."""


HOST_TIERS = {"write-through": WriteThrough, "write-back": WriteBack}  # by --host-write-policy


class TierLoads:
    """The loads from the tiers below the card, in time. A load crosses the card's host link
    at `host_token_s` a token, one load after another (the link is one: loads admitted
    together queue on it, as vLLM's offloading connector's transfers share the card's copy
    engine). Blocks from the disk tier are read first, at `disk_token_s` a token, one read
    after another, and stream on over the link as they come, the link busy with the copy
    alone: a load ends when both the read and the copy have. With `prefetch`, a disk read
    starts as its request arrives (SGLang HiCache's L3 prefetch, its wait_complete policy: the
    request runs once all of it is in), else as the request is admitted (LMCache's retrieve). `wait_s`: the seconds
    requests have waited for their loads."""

    def __init__(self, host_token_s, disk_token_s=0.0, prefetch=False):
        self.host_token_s, self.disk_token_s, self.prefetch = host_token_s, disk_token_s, prefetch
        self.link_free_s = 0.0  # when the host link has carried every load asked of it
        self.disk_free_s = 0.0  # when the disk tier has read every block asked of it
        self.wait_s = 0.0
        self.on_link = {}  # request -> (its copy's start and end on the link, its read's
        # (start, end) on the disk or None, the load's end), till it lands

    def load(self, key, tokens, from_disk, t, arrived):
        """A load of `tokens` (`from_disk` of them read from the disk tier first) for the
        request `key`, admitted at `t` (arrived at `arrived`). -> the seconds it waits."""
        start, copy = max(self.link_free_s, t), self.host_token_s * tokens
        end = self.link_free_s = start + copy  # (the link busy with its copy alone)
        wait, read = start - t + copy, None
        if from_disk:
            begin = max(self.disk_free_s, arrived if self.prefetch else t)
            self.disk_free_s = begin + self.disk_token_s * from_disk
            read = (begin, self.disk_free_s)
            if self.disk_free_s > end:
                end, wait = self.disk_free_s, self.disk_free_s - t
        self.on_link[key] = (start, self.link_free_s, read, end)
        self.wait_s += wait
        return wait

    def landed(self, key):
        self.on_link.pop(key, None)

    def cancel(self, key, t):
        """The request leaves at `t` before its load has landed: the wait it had left comes off
        its wait, and its time off the link and the disk where its copy or its read was the
        last queued there (a load queued behind it keeps its slot)."""
        start, link_end, read, end = self.on_link.pop(key, (t, t, None, t))
        self.wait_s -= max(end - t, 0.0)
        if link_end == self.link_free_s:
            self.link_free_s = max(start, t)
        if read is not None and read[1] == self.disk_free_s:
            self.disk_free_s = max(read[0], t)
