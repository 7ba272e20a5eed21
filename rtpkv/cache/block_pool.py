"""BlockPool: the state of every block, and the only code that changes it.

vLLM v1 splits its cache the same way: the pool owns block state (free list, prefix index,
eviction order, reference counts, pins, serials, events), and `KVCacheManager` on top of it
speaks in requests. Every write to a `Block` is a method here, so each rule has one home:

- one insert into the `PrefixIndex` (`_index`), used by commit, release and onboard alike: it
  drops a stale holder of the same key from the index first, so the index and the blocks never
  disagree;
- one way out of the index (`_unindex`), one way back to the free list (`_put_free`);
- events are emitted where the state changes: `stored` on insertion, `removed` on removal,
  `updated` when an indexed block's priority changes;
- the `PartialIndex` (partial-block hit candidates) follows the index, plus the kept tails
  (`keep_tail`), which are never indexed, offloaded or announced;
- per-tenant quotas (`quota`: a tenant's bound, or None): each tenant's indexed blocks and
  tails are counted (`tenants`, rtpkv/cache/tenants.py) where they enter and leave; when the
  pool must evict, a tenant over its bound gives up its own least valuable cached block first
  (`TenantEvictionPolicy`).

A block is in exactly one state: free (in `free_ids`), cached (unreferenced, indexed or a kept
tail, ordered by the eviction policy) or in use (ref_count > 0; a pinned block holds a
reference too).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import Callable, Optional

from rtpkv.cache.block import DEFAULT_PRIORITY, Block, parents_first
from rtpkv.cache.eviction import EvictionPolicy, PriorityEvictionPolicy, TenantEvictionPolicy
from rtpkv.cache.events import KVEventBuffer
from rtpkv.cache.ghost_list import GhostList
from rtpkv.cache.partial_index import PartialIndex
from rtpkv.cache.prefix_index import PrefixIndex
from rtpkv.cache.residency import ResidencyHistograms
from rtpkv.cache.tenants import Quota, Tenants


class BlockPool:
    def __init__(self, num_blocks: int, index: PrefixIndex, events: KVEventBuffer, *,
                 policy: Optional[EvictionPolicy] = None,
                 on_evict: Optional[Callable[[Block], None]] = None,
                 clock: Callable[[], float] = time.monotonic, ghosts: Optional[int] = None,
                 quota: Optional[Quota] = None):
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.index = index
        if quota is not None and not isinstance(policy, (TenantEvictionPolicy, type(None))):
            raise ValueError("per-tenant quotas need a TenantEvictionPolicy")
        self.policy = policy or (TenantEvictionPolicy() if quota else PriorityEvictionPolicy())
        self.tenants = Tenants(quota)
        self.events = events
        self.on_evict = on_evict          # sees a victim (read-only) before it is cleared
        self.clock = clock
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.children = PartialIndex()    # partial-hit candidates: indexed blocks and tails
        self.ghosts = GhostList(num_blocks if ghosts is None else ghosts)   # evicted keys
        self.free_ids: deque[int] = deque(range(num_blocks))
        self._next_serial = 1
        self.num_pinned = 0               # blocks with pin_count > 0
        self.changes = 0                  # insertions into and removals from the index, ever
        self.evictions = 0
        self.evictions_by_priority: Counter[int] = Counter()
        self.residency = ResidencyHistograms()   # of indexed blocks, on the device

    # ------------------------------------------------------------------ reading
    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    @property
    def num_cached(self) -> int:
        return len(self.policy)

    @property
    def num_tails(self) -> int:
        return sum(1 for b in self.blocks if b.tail)

    def num_allocatable(self) -> int:
        """Blocks an allocation can take now: free ones, then evictable cached ones."""
        return len(self.free_ids) + len(self.policy)

    def cached(self, key: bytes) -> Optional[Block]:
        """The indexed block under `key`, if any (a candidate: the caller verifies it)."""
        block_id = self.index.get(key)
        return None if block_id is None else self.blocks[block_id]

    # ------------------------------------------------------------------ references
    def allocate(self) -> int:
        """A block with one reference: a free one, else the eviction policy's victim (shown
        to `on_evict` first, so it can be offloaded)."""
        if self.free_ids:
            block_id = self.free_ids.popleft()
        else:
            self.lapse_priorities()
            block_id = self.tenants.quota_victim(self.policy)
            if block_id is None:
                block_id = self.policy.pop()
            block = self.blocks[block_id]
            self.evictions += 1
            self.evictions_by_priority[block.priority] += 1
            if block.indexed:
                self.residency.evicted(self.clock(), block.stored_at, block.released_at)
                self.ghosts.add(block.key)
                if self.on_evict is not None:
                    self.on_evict(block)
            self._unindex(block)
            self._drop_tail(block)
            self.blocks[block_id] = Block(block_id)
        self.blocks[block_id].ref_count = 1
        return block_id

    def acquire(self, block_id: int) -> None:
        """One more reference (a hit): a cached block stops being evictable."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.policy.remove(block)
            if block.indexed:
                self.residency.observe("reuse_gap", self.clock() - block.released_at)
        block.ref_count += 1

    def release(self, block_id: int) -> None:
        """One reference less. An unreferenced indexed block stays cached (evictable); a full
        copy whose indexed twin has gone takes its place in the index; the rest go free."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count:
            return
        if block.full and not block.indexed and self.index.get(block.key) is None:
            self._index(block)
        if block.indexed or block.tail:
            now = self.clock()
            held = block.duration_s is not None and block.priority != DEFAULT_PRIORITY
            block.held_until = now + block.duration_s if held else None
            block.released_at = now
            self.policy.add(block, now)
        else:
            self._put_free(block)

    # ------------------------------------------------------------------ content
    def commit(self, block_id: int, key: bytes, parent_key: bytes, parent_serial: int,
               tokens: tuple[int, ...], extra: bytes, priority: int,
               duration_s: Optional[float], tenant: Optional[bytes], group: int = 0) -> bool:
        """A block of a running request filled with computed tokens: give it its content and
        lineage and make it hittable. When the index already holds the same content with the
        same lineage, the block stays an unindexed copy sharing that serial (so the chain
        computed behind it still matches). Returns whether the block was indexed."""
        block = self.blocks[block_id]
        held = self.cached(key)
        if (held is not None and held.tokens == tokens and held.extra == extra
                and held.parent_serial == parent_serial):
            self._fill(block, key, parent_key, parent_serial, tokens, extra, tenant, held.serial)
            block.group = group
            return False
        self._fill(block, key, parent_key, parent_serial, tokens, extra, tenant)
        block.group = group
        block.priority, block.duration_s = priority, duration_s
        self._index(block)
        return True

    def onboard(self, block_id: int, key: bytes, parent_key: bytes, parent_serial: int,
                tokens: tuple[int, ...], extra: bytes, tenant: Optional[bytes],
                group: int = 0) -> None:
        """A fresh block just loaded from a tier: it takes the content and the lineage of the
        request's chain and is indexed (over any stale holder of the key)."""
        block = self.blocks[block_id]
        self._fill(block, key, parent_key, parent_serial, tokens, extra, tenant)
        block.group = group
        self._index(block)

    def keep_tail(self, block_id: int, parent_key: bytes, parent_serial: int,
                  tokens: tuple[int, ...], extra: bytes, tenant: Optional[bytes],
                  group: int = 0) -> bool:
        """The partly filled last block of a request about to release it: keep it as a
        partial-hit source (cached once released, device only), unless a candidate of the same
        lineage already starts with the same tokens. Returns whether it was kept."""
        for other in self.children.candidates(parent_key, extra):
            held = self.blocks[other]
            if held.parent_serial == parent_serial and held.tokens[:len(tokens)] == tokens:
                return False
        block = self.blocks[block_id]
        block.parent_key, block.parent_serial = parent_key, parent_serial
        block.tokens, block.extra, block.tail, block.tenant = tokens, extra, True, tenant
        block.group = group
        self.children.add(parent_key, extra, block_id)
        self.tenants.count(tenant, 1)
        return True

    def stamp(self, block_id: int, priority: int, duration_s: Optional[float],
              tiers: frozenset[str], keep_hold: bool = False) -> None:
        """The retention a releasing request gives a full block (the last release decides).
        `keep_hold`: the request gave no retention config, so a priority the block holds and
        whose duration has not run out stays, for what is left of it (a prefix held for an hour
        is not dropped, nor held longer, by requests that only read it)."""
        block = self.blocks[block_id]
        if keep_hold and block.priority != DEFAULT_PRIORITY:
            if block.held_until is None:   # held without end, or not yet released: as it is
                priority, duration_s = block.priority, block.duration_s
            elif block.held_until > (now := self.clock()):
                priority, duration_s = block.priority, block.held_until - now
        if block.indexed and priority != block.priority:
            self.events.updated(block.key, block.priority, priority)
        block.priority, block.duration_s, block.tiers = priority, duration_s, tiers

    def lapse_priorities(self) -> None:
        """Blocks whose retention duration ran out drop to the default priority (done before
        every eviction); emits `updated` events, for indexed blocks only (a kept tail has no
        key and is never announced)."""
        for block in self.policy.lapse(self.clock()):
            if block.indexed:
                self.events.updated(block.key, block.priority, DEFAULT_PRIORITY)
            block.priority, block.duration_s, block.held_until = DEFAULT_PRIORITY, None, None

    # ------------------------------------------------------------------ pins
    def pin(self, block_id: int) -> None:
        self.acquire(block_id)
        block = self.blocks[block_id]
        block.pin_count += 1
        self.num_pinned += block.pin_count == 1

    def unpin(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.pin_count -= 1
        self.num_pinned -= block.pin_count == 0
        self.release(block_id)

    def announce(self) -> None:
        """A stored event for every indexed block (what a request can hit now), parents first:
        a consumer that subscribed late learns the pool's contents."""
        for block in parents_first(b for b in self.blocks if b.indexed):
            self.events.stored([block.key], block.parent_key, [block.tokens], block.priority,
                               extra=block.extra, group=block.group)

    # ------------------------------------------------------------------ internals
    def _fill(self, block: Block, key: bytes, parent_key: bytes, parent_serial: int,
              tokens: tuple[int, ...], extra: bytes, tenant: Optional[bytes],
              serial: int = 0) -> None:
        if not serial:
            serial, self._next_serial = self._next_serial, self._next_serial + 1
        block.key, block.parent_key = key, parent_key
        block.serial, block.parent_serial = serial, parent_serial
        block.tokens, block.extra, block.tenant = tokens, extra, tenant

    def _index(self, block: Block) -> None:
        """The one insertion into the index. A stale holder of the key (another lineage of the
        same content, or a collision) leaves the index first: freed if unreferenced, kept
        unindexed by the requests that still read it."""
        held = self.cached(block.key)
        if held is not None and held is not block:
            self._unindex(held)
            if held.ref_count == 0:
                self.policy.remove(held)
                self._put_free(held)
        self.index.insert(block.key, block.block_id)
        block.stored_at = block.released_at = self.clock()
        self.changes += 1
        self.ghosts.discard(block.key)
        self.children.add(block.parent_key, block.extra, block.block_id)
        self.tenants.count(block.tenant, 1)
        block.indexed = True
        self.events.stored([block.key], block.parent_key, [block.tokens], block.priority,
                           extra=block.extra, group=block.group)

    def _unindex(self, block: Block) -> None:
        if block.indexed:
            self.index.remove(block.key)
            self.changes += 1
            self.children.discard(block.parent_key, block.extra, block.block_id)
            self.tenants.count(block.tenant, -1)
            block.indexed = False
            self.events.removed([block.key], group=block.group)

    def _drop_tail(self, block: Block) -> None:
        if block.tail:
            self.children.discard(block.parent_key, block.extra, block.block_id)
            self.tenants.count(block.tenant, -1)
            block.tail = False

    def _put_free(self, block: Block) -> None:
        self._drop_tail(block)
        self.blocks[block.block_id] = Block(block.block_id)
        self.free_ids.append(block.block_id)

    # ------------------------------------------------------------------ checks
    def cached_by_priority(self) -> dict[int, int]:
        """Cached blocks per effective priority now (a lapsed duration counts as lapsed);
        read-only: nothing is lapsed and no event is emitted."""
        return self.policy.counts(self.clock())

    def check_integrity(self) -> None:
        """free + cached + in use == total, each block in exactly one state, every indexed key
        mapping to a block that holds exactly the tokens the key was computed from, each cached
        block in its priority's queue, and the pin count."""
        blocks = self.blocks
        free = set(self.free_ids)
        assert len(free) == len(self.free_ids), "a block is twice in the free list"
        in_use = {b.block_id for b in blocks if b.ref_count > 0}
        cached = {b.block_id for b in blocks if b.block_id in self.policy}
        assert len(cached) == len(self.policy), "the eviction policy holds unknown blocks"
        assert not (free & cached) and not (free & in_use) and not (cached & in_use), \
            "a block is in two states"
        assert len(free) + len(cached) + len(in_use) == self.num_blocks, \
            f"free {len(free)} + cached {len(cached)} + in use {len(in_use)} != total {self.num_blocks}"
        for block_id in free:
            assert not blocks[block_id].indexed and not blocks[block_id].full
            assert not blocks[block_id].tail, f"free block {block_id} is a kept tail"
        for block_id in cached:
            block = blocks[block_id]
            assert (block.indexed or block.tail) and block.ref_count == 0
        for block in blocks:
            if block.tail:
                assert not block.full and not block.indexed, f"tail {block.block_id} is full"
                assert 0 < len(block.tokens) < self.index.block_size, \
                    f"tail {block.block_id} holds {len(block.tokens)} tokens"
        listed = {block_id for _, block_id in self.children.items()}
        assert len(listed) == len(self.children), "a partial-hit candidate is listed twice"
        assert listed == {b.block_id for b in blocks if b.indexed or b.tail}, \
            "partial-hit candidates differ from the indexed blocks and tails"
        self.tenants.check_integrity(blocks)
        for (parent_key, extra), block_id in self.children.items():
            assert (blocks[block_id].parent_key, blocks[block_id].extra) == (parent_key, extra), \
                f"partial-hit candidate {block_id} is listed under another parent"
        for block in blocks:
            assert block.ref_count >= block.pin_count >= 0, f"block {block.block_id} refs"
        assert self.num_pinned == sum(1 for b in blocks if b.pin_count), "pinned count drifted"
        assert sum(b.indexed for b in blocks) == len(self.index), "index and blocks disagree"
        for key, block_id in self.index.items():
            block = blocks[block_id]
            assert block.indexed and block.key == key, f"index key of block {block_id} is stale"
            assert len(block.tokens) == self.index.block_size, f"block {block_id} is not full"
            assert self.index.key(block.parent_key, block.tokens, block.extra) == key, \
                f"block {block_id} does not hold the tokens of its key"
        self.policy.check()
