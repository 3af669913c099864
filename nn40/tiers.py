"""A prefix cache's host-memory tier: which blocks it stores, and when (pure Python)

The card's prefix cache (nn40.kv.PrefixCache) tells its tier three things: blocks computed on
the card, blocks the card evicted, blocks loaded back from the tier. What the tier does with
each is its write policy, one class each, registered by name in HOST_TIERS:

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

    def __init__(self, blocks, order="lru"):
        self.blocks, self.keys = blocks, EVICTION_ORDERS[order]()
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
            self.keys.pop(len(self.keys) - self.blocks)

    def computed(self, keys):
        """Blocks just computed (cached) on the card."""
        if self.stores_computed:
            self.store(keys)

    def evicted(self, keys):
        """Blocks the card gave up."""
        if not self.stores_computed:
            self.store(keys)

    def loaded(self, keys):
        """Blocks loaded back to the card: the copy stays, stored again (a hit, for an order
        that counts them)."""
        self.keys.hit(keys)
        self.store(keys)


class WriteThrough(HostTier):
    """write-through: every block stored as computed (vLLM's offloading connector, LMCache)."""
    stores_computed = True


class WriteBack(HostTier):
    """write-back: a block stored as the card evicts it (SGLang HiCache's write_back)."""


HOST_TIERS = {"write-through": WriteThrough, "write-back": WriteBack}  # by --host-write-policy
