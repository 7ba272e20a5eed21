"""EvictionPolicy: which cached (unreferenced, still hittable) block gives way first.

TensorRT-LLM's retention rule: the lowest retention priority goes first, and within a priority
the least recently released. The manager releases a finished sequence's blocks tail first, so
among blocks of one priority a sequence's tail goes before its head and a shared prefix
survives longest. A block released with a duration keeps its priority only that long: when it
lapses the block drops to the default priority (DEFAULT_PRIORITY), keeping its place in the LRU order.

Each priority is a heap of (release order, block id) with lazy deletion, so add, remove, pop
and lapse are O(log n). With per-tenant quotas (`CACHE_SALT_QUOTA_BLOCKS`) the pool uses
`TenantEvictionPolicy`: the same order, plus one queue per tenant, so the victim can be taken
from a tenant over its quota first.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import Counter
from typing import Optional

from rtpkv.cache.block import DEFAULT_PRIORITY, Block


class EvictionPolicy(ABC):
    @abstractmethod
    def add(self, block: Block, now: float) -> None:
        """`block` just became unreferenced while still indexed: it may be evicted."""

    @abstractmethod
    def remove(self, block: Block) -> None:
        """`block` is referenced again (a hit) or was unindexed: it must not be evicted."""

    @abstractmethod
    def pop(self) -> int:
        """Choose, forget and return the id of the next block to evict (call `lapse` first)."""

    @abstractmethod
    def lapse(self, now: float) -> list[Block]:
        """Requeue the blocks whose priority duration ran out at the default priority, keeping
        their place in the LRU order, and return them (the caller updates the blocks)."""

    @abstractmethod
    def counts(self, now: float) -> dict[int, int]:
        """Cached blocks per priority as of `now` (a priority whose duration ran out counts at
        the default priority); changes nothing."""

    @abstractmethod
    def check(self) -> None:
        """Assert the policy's own invariant (integrity check)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, block_id: int) -> bool: ...


class PriorityEvictionPolicy(EvictionPolicy):
    def __init__(self) -> None:
        self._order = itertools.count()
        self._entry: dict[int, tuple[int, int, Block]] = {}   # block id -> (priority, order, block)
        self._heaps: dict[int, list[tuple[int, int]]] = {}    # priority -> [(order, block id)]
        self._expiry: list[tuple[float, int, int]] = []       # (expires_at, order, block id)

    def add(self, block: Block, now: float) -> None:
        order = next(self._order)
        self._push(block, block.priority, order)
        if block.duration_s is not None and block.priority != DEFAULT_PRIORITY:
            heapq.heappush(self._expiry, (now + block.duration_s, order, block.block_id))

    def _push(self, block: Block, priority: int, order: int) -> None:
        self._entry[block.block_id] = (priority, order, block)
        heapq.heappush(self._heaps.setdefault(priority, []), (order, block.block_id))
        if sum(map(len, self._heaps.values())) > 2 * len(self._entry) + 1024:
            self._compact()

    def _compact(self) -> None:
        """Rebuild the heaps without the entries lazy deletion left behind."""
        self._heaps = {}
        for block_id, (priority, order, _) in self._entry.items():
            self._heaps.setdefault(priority, []).append((order, block_id))
        for heap in self._heaps.values():
            heapq.heapify(heap)
        self._expiry = [e for e in self._expiry if self._entry.get(e[2], (0, -1))[1] == e[1]]
        heapq.heapify(self._expiry)

    def remove(self, block: Block) -> None:
        self._entry.pop(block.block_id, None)

    def _valid(self, priority: int, order: int, block_id: int) -> bool:
        entry = self._entry.get(block_id)
        return entry is not None and entry[0] == priority and entry[1] == order

    def pop(self) -> int:
        for priority in sorted(self._heaps):
            heap = self._heaps[priority]
            while heap:
                order, block_id = heapq.heappop(heap)
                if self._valid(priority, order, block_id):
                    del self._entry[block_id]
                    return block_id
        raise IndexError("no cached block to evict")

    def lapse(self, now: float) -> list[Block]:
        lapsed = []
        while self._expiry and self._expiry[0][0] <= now:
            _, order, block_id = heapq.heappop(self._expiry)
            entry = self._entry.get(block_id)
            if entry is None or entry[1] != order:
                continue
            self.demote(block_id)
            lapsed.append(entry[2])
        return lapsed

    def demote(self, block_id: int) -> None:
        """Requeue a queued block at the default priority, keeping its place in the LRU order."""
        _, order, block = self._entry[block_id]
        self._push(block, DEFAULT_PRIORITY, order)

    def counts(self, now: float) -> dict[int, int]:
        lapsed = {block_id for expires, order, block_id in self._expiry
                  if expires <= now and self._entry.get(block_id, (0, -1))[1] == order}
        return dict(sorted(Counter(DEFAULT_PRIORITY if block_id in lapsed else p
                                   for block_id, (p, _, _) in self._entry.items()).items()))

    def check(self) -> None:
        """Assert each cached block sits in its own priority's queue (integrity check)."""
        queued = {(p, entry) for p, heap in self._heaps.items() for entry in heap}
        for block_id, (priority, order, block) in self._entry.items():
            assert block.priority == priority, f"block {block_id} queued at the wrong priority"
            assert (priority, (order, block_id)) in queued, \
                f"block {block_id} missing from its priority queue"

    def __len__(self) -> int:
        return len(self._entry)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._entry


class TenantEvictionPolicy(EvictionPolicy):
    """PriorityEvictionPolicy over every cached block, and one per tenant (the `cache_salt` that
    computed the block), kept in the same order: `pop` takes the global victim, `pop_tenant` the
    victim among one tenant's blocks (a tenant over its quota gives way first)."""

    def __init__(self) -> None:
        self._all = PriorityEvictionPolicy()
        self._tenants: dict[bytes, PriorityEvictionPolicy] = {}
        self._blocks: dict[int, Block] = {}

    def add(self, block: Block, now: float) -> None:
        self._all.add(block, now)
        self._tenants.setdefault(block.tenant, PriorityEvictionPolicy()).add(block, now)
        self._blocks[block.block_id] = block

    def remove(self, block: Block) -> None:
        self._all.remove(block)
        self._forget(block.block_id)

    def _forget(self, block_id: int) -> None:
        block = self._blocks.pop(block_id, None)
        if block is None:                   # not queued: as PriorityEvictionPolicy.remove
            return
        own = self._tenants[block.tenant]
        own.remove(block)
        if not len(own):
            del self._tenants[block.tenant]

    def pop(self) -> int:
        block_id = self._all.pop()
        self._forget(block_id)
        return block_id

    def pop_tenant(self, tenant: bytes) -> Optional[int]:
        """The next victim among `tenant`'s cached blocks (forgotten), or None if it has none."""
        own = self._tenants.get(tenant)
        if own is None:
            return None
        block_id = own.pop()
        if not len(own):
            del self._tenants[tenant]
        self._all.remove(self._blocks.pop(block_id))
        return block_id

    def lapse(self, now: float) -> list[Block]:
        lapsed = self._all.lapse(now)
        for block in lapsed:
            self._tenants[block.tenant].demote(block.block_id)
        return lapsed

    def counts(self, now: float) -> dict[int, int]:
        return self._all.counts(now)

    def check(self) -> None:
        self._all.check()
        for own in self._tenants.values():
            assert len(own), "an empty tenant queue was kept"
            own.check()
        assert sum(len(own) for own in self._tenants.values()) == len(self._all) \
            == len(self._blocks), "the tenant queues and the global queue disagree"
        for block_id, block in self._blocks.items():
            assert block_id in self._all and block_id in self._tenants[block.tenant], \
                f"block {block_id} missing from a queue"

    def __len__(self) -> int:
        return len(self._all)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._all
