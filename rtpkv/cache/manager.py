"""KVCacheManager: the request-level cache operations over BlockPool, PrefixIndex and
EvictionPolicy — match a prompt's cached prefix, allocate, register blocks as they fill,
release, pin — with the statistics and the integrity check the tests rely on.

Only the engine thread calls it (under the engine lock).
"""

from __future__ import annotations

import time
from typing import Iterable, Optional, Protocol, Sequence

from rtpkv.cache.block_pool import BlockPool
from rtpkv.cache.eviction import EvictionPolicy, LRUEvictionPolicy
from rtpkv.cache.prefix_index import PrefixIndex


class CacheSequence(Protocol):
    """What the manager needs of a request: its tokens, its blocks, and its chain keys."""

    token_ids: list[int]
    block_table: list[int]
    block_keys: list[bytes]
    salt: bytes


class KVCacheManager:
    def __init__(self, pool: BlockPool, index: PrefixIndex,
                 policy: Optional[EvictionPolicy] = None):
        self.pool = pool
        self.index = index
        self.policy = policy or LRUEvictionPolicy()
        self.block_size = pool.block_size
        self._next_serial = 1
        self.num_pinned = 0               # blocks with pin_count > 0
        self.query_tokens = 0
        self.hit_tokens = 0
        self.evictions = 0

    # ------------------------------------------------------------------ capacity
    @property
    def num_free(self) -> int:
        return len(self.pool.free_ids)

    @property
    def num_cached(self) -> int:
        return len(self.policy)

    def num_allocatable(self) -> int:
        """Blocks that an allocation can take now: free ones, then evictable cached ones."""
        return len(self.pool.free_ids) + len(self.policy)

    def allocate(self, n: int) -> Optional[list[int]]:
        """n blocks with one reference each, fresh blocks before evicting cached ones;
        None (and nothing taken) when fewer than n can be had."""
        if n > self.num_allocatable():
            return None
        ids = []
        for _ in range(n):
            if self.pool.free_ids:
                block_id = self.pool.take_free()
            else:
                block_id = self.policy.pop()
                block = self.pool.blocks[block_id]
                self.index.remove(block.key)
                block.clear()
                self.evictions += 1
            self.pool.blocks[block_id].ref_count = 1
            ids.append(block_id)
        return ids

    # ------------------------------------------------------------------ reuse
    def match(self, token_ids: Sequence[int], salt: bytes, max_blocks: int) -> list[int]:
        """Ids of the longest chain of cached blocks that hold exactly the first blocks of
        `token_ids` (at most max_blocks). Read-only: nothing is referenced."""
        B = self.block_size
        parent_key, parent_serial, hits = self.index.root, 0, []
        for i in range(max_blocks):
            tokens = tuple(token_ids[i * B:(i + 1) * B])
            extra = salt if i == 0 else b""
            key = self.index.key(parent_key, tokens, extra)
            block_id = self.index.get(key)
            if block_id is None:
                break
            block = self.pool.blocks[block_id]
            if block.tokens != tokens or block.extra != extra or block.parent_serial != parent_serial:
                break
            hits.append(block_id)
            parent_key, parent_serial = key, block.serial
        return hits

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached or in-use blocks (a hit)."""
        now = time.monotonic()
        for block_id in block_ids:
            block = self.pool.blocks[block_id]
            if block.ref_count == 0:
                self.policy.remove(block)
            block.ref_count += 1
            block.last_used = now

    def record_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        self.query_tokens += queried_tokens
        self.hit_tokens += hit_tokens

    def commit_full_blocks(self, seq: CacheSequence, num_filled: int) -> None:
        """Blocks of `seq` whose B slots now hold K/V (num_filled tokens in all) get their key,
        tokens and lineage, and become hittable at once, even while `seq` runs.
        A block already cached under the same key with the same content replaces the fresh
        copy in `seq`'s table (the copy is freed)."""
        B = self.block_size
        for i in range(len(seq.block_keys), num_filled // B):
            block_id = seq.block_table[i]
            block = self.pool.blocks[block_id]
            tokens = tuple(seq.token_ids[i * B:(i + 1) * B])
            extra = seq.salt if i == 0 else b""
            parent_key = seq.block_keys[i - 1] if i else self.index.root
            parent_serial = self.pool.blocks[seq.block_table[i - 1]].serial if i else 0
            key = self.index.key(parent_key, tokens, extra)
            seq.block_keys.append(key)
            if block.serial == 0:
                block.serial, self._next_serial = self._next_serial, self._next_serial + 1
                block.parent_serial, block.parent_key = parent_serial, parent_key
                block.tokens, block.extra = tokens, extra
            if block.key is not None:  # a hit: already registered
                continue
            existing_id = self.index.get(key)
            if existing_id is not None:
                existing = self.pool.blocks[existing_id]
                if (existing.tokens == tokens and existing.extra == extra
                        and existing.parent_serial == parent_serial):
                    self.acquire([existing_id])
                    seq.block_table[i] = existing_id
                    self.release([block_id])
                    continue
                self._unregister(existing_id)
            self.index.insert(key, block_id)
            block.key = key

    def _unregister(self, block_id: int) -> None:
        """Drop a stale or colliding block from the index (its content stays where in use)."""
        block = self.pool.blocks[block_id]
        self.index.remove(block.key)
        block.key = None
        if block.ref_count == 0:
            self.policy.remove(block)
            self.pool.put_free(block_id)

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block, tail first: unreferenced registered blocks stay
        cached (evictable), unregistered ones go back to the free list."""
        now = time.monotonic()
        for block_id in reversed(block_ids):
            block = self.pool.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count:
                continue
            block.last_used = now
            if block.key is not None:
                self.policy.add(block)
            else:
                self.pool.put_free(block_id)

    def pin(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            self.acquire([block_id])
            block = self.pool.blocks[block_id]
            block.pin_count += 1
            self.num_pinned += block.pin_count == 1

    def unpin(self, block_ids: Sequence[int]) -> None:
        for block_id in block_ids:
            block = self.pool.blocks[block_id]
            block.pin_count -= 1
            self.num_pinned -= block.pin_count == 0
        self.release(block_ids)

    # ------------------------------------------------------------------ visibility
    def stats(self) -> dict[str, float]:
        in_use = sum(1 for b in self.pool.blocks if b.ref_count)
        return {
            "queries": self.query_tokens,
            "hits": self.hit_tokens,
            "hit_rate": self.hit_tokens / self.query_tokens if self.query_tokens else 0.0,
            "blocks_total": self.pool.num_blocks,
            "blocks_free": self.num_free,
            "blocks_cached": self.num_cached,
            "blocks_in_use": in_use,
            "blocks_pinned": self.num_pinned,
            "evictions": self.evictions,
            "block_size": self.block_size,
        }

    def check_integrity(self, holders: Optional[Iterable[Sequence[int]]] = None) -> None:
        """Assert the accounting invariant free + cached + in use == total, that each block is
        in exactly one state, that every indexed key maps to a block holding exactly the tokens
        the key was computed from, and (given the block tables of live requests) that every
        reference count equals its holders plus its pins."""
        blocks = self.pool.blocks
        free = set(self.pool.free_ids)
        assert len(free) == len(self.pool.free_ids), "a block is twice in the free list"
        in_use = {b.block_id for b in blocks if b.ref_count > 0}
        cached = {b.block_id for b in blocks if b.block_id in self.policy}
        assert len(cached) == len(self.policy), "the eviction policy holds unknown blocks"
        assert not (free & cached) and not (free & in_use) and not (cached & in_use), \
            "a block is in two states"
        assert len(free) + len(cached) + len(in_use) == self.pool.num_blocks, \
            f"free {len(free)} + cached {len(cached)} + in use {len(in_use)} != total {self.pool.num_blocks}"
        for block_id in free:
            assert blocks[block_id].key is None and blocks[block_id].ref_count == 0
        for block_id in cached:
            assert blocks[block_id].key is not None and blocks[block_id].ref_count == 0
        for block in blocks:
            assert block.ref_count >= block.pin_count >= 0, f"block {block.block_id} refs"
        assert self.num_pinned == sum(1 for b in blocks if b.pin_count), "pinned count drifted"
        for key, block_id in self.index.items():
            block = blocks[block_id]
            assert block.key == key, f"index key of block {block_id} is stale"
            assert len(block.tokens) == self.block_size, f"block {block_id} is not full"
            assert self.index.key(block.parent_key, block.tokens, block.extra) == key, \
                f"block {block_id} does not hold the tokens of its key"
        if holders is not None:
            expected = [b.pin_count for b in blocks]
            for table in holders:
                for block_id in table:
                    expected[block_id] += 1
            actual = [b.ref_count for b in blocks]
            assert expected == actual, "reference counts differ from the live block tables"
