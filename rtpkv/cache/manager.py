"""KVCacheManager: the one owner of block state.

Everything that reads or writes a block — references, pins, keys, priorities, the free list,
the prefix index, the eviction policy, the tiers below the device pool — goes through the
request-level API here; the scheduler, the engine, the pipeline and the task registry hold
block tables (handed to the attention backend) and opaque `PinnedPrefix` handles, nothing else.

A request's life in the cache:
    match = lookup(seq)          which prefix the device pool holds
    can_admit(seq, match, ...)   whether the blocks it needs can be had (device hits decide)
    lookup_tiers(seq, match)     what the tiers hold after the device hits (once, at admission)
    admit(seq, match)            share the device hits, onboard the tier hits
    grow(seq, tokens)            append fresh blocks for the next chunk (never rewrites a table)
    commit(seq)                  blocks that filled become hittable (and written through)
    release_out_of_window(seq)   with an attention window: drop blocks no future query reads
    free(seq)                    drop its references, tail first, with its retention priority
    pin(seq) / unpin(handle)     a task prompt's blocks stay in memory until unpinned

Block tables are append-only: a block id stays at its place in a running request's table until
the request ends, or until it falls out of the attention window (`window`): a block whose every
position is older than what the next query attends to is released during the request
(`release_out_of_window`) and its entry becomes `RELEASED`, so positions never shift and the
table keeps its length; attention backends read only inside the window, never such an entry.
A released block is released as at the end of a request: a full, indexed one stays cached
(evictable) and findable, the rest go back to the free list.

When a block fills with content that is already indexed, the request keeps its own copy
(unindexed; it shares the content's serial so the chain behind it still matches), and it is
indexed when it is released if the other copy has gone by then.

Only the engine thread calls it (under the engine lock).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Optional, Protocol, Sequence

from rtpkv.cache.block import Block
from rtpkv.cache.block_pool import BlockPool
from rtpkv.cache.eviction import EvictionPolicy, PriorityEvictionPolicy
from rtpkv.cache.events import KVEventBuffer
from rtpkv.cache.prefix_index import PrefixIndex
from rtpkv.cache.retention import KvCacheRetentionConfig

if TYPE_CHECKING:
    from concurrent.futures import Future

    from rtpkv.cache.tiers.base import BlockMeta, KVTier

log = logging.getLogger("rtpkv")

_DEFAULT_RETENTION = KvCacheRetentionConfig()

RELEASED = -1  # a block table entry whose block fell out of the attention window


class CacheSequence(Protocol):
    """What the manager needs of a request."""

    token_ids: list[int]
    block_table: list[int]       # written by the manager only
    block_keys: list[bytes]      # keys of the table's full blocks, written by the manager only
    salt: bytes
    num_computed: int
    prefill_only: bool
    prefix_handle: Optional["PinnedPrefix"]

    @property
    def num_prompt(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def wants_reuse(self) -> bool: ...

    @property
    def retention(self) -> Optional[KvCacheRetentionConfig]: ...

    def allows_tier(self, name: str) -> bool: ...


@dataclass(frozen=True)
class PinnedPrefix:
    """An opaque handle on a pinned prompt prefix (a task prompt's full blocks)."""

    block_ids: tuple[int, ...]
    num_tokens: int


@dataclass
class TierHit:
    tier: "KVTier"
    metas: list  # BlockMeta of each block to onboard, in chain order


@dataclass
class PrefixMatch:
    """What lookup found: device blocks to share, then tier blocks to onboard."""

    device: list[int] = field(default_factory=list)
    revived: int = 0                     # device hits that are cached (unreferenced) now
    tiers: list[TierHit] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.device) + sum(len(h.metas) for h in self.tiers)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, index: PrefixIndex, *,
                 pool: Optional[BlockPool] = None, reuse_enabled: bool = False,
                 policy: Optional[EvictionPolicy] = None,
                 events: Optional[KVEventBuffer] = None,
                 tiers: Sequence["KVTier"] = (), offload_min_priority: int = 35,
                 window: Optional[int] = None,
                 clock: Callable[[], float] = time.monotonic):
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        if tiers and pool is None:
            raise ValueError("tiers need the KV pool to copy blocks from and to")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.index = index
        self.pool = pool
        self.reuse_enabled = reuse_enabled
        self.policy = policy or PriorityEvictionPolicy()
        self.events = events or KVEventBuffer(0)
        self.tiers = list(tiers)
        self.offload_min_priority = offload_min_priority
        self.window = window              # tokens each query attends to; None: all
        self.clock = clock
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))
        self._next_serial = 1
        self.num_pinned = 0               # blocks with pin_count > 0
        self.query_tokens = 0
        self.hit_tokens = 0
        self.evictions = 0
        self.evictions_by_priority: Counter[int] = Counter()
        self.offloaded = Counter()        # tier name -> blocks stored on eviction
        self.onboarded = Counter()        # tier name -> blocks loaded on a hit

    # ------------------------------------------------------------------ policy
    def reuse_applies(self, seq: CacheSequence) -> bool:
        """The one place that decides whether a request looks up and registers cached blocks:
        reuse is on for the engine (REUSE_CACHE) and the request did not turn it off. A task
        request starts from its pinned prompt whatever this says."""
        return self.reuse_enabled and seq.wants_reuse

    # ------------------------------------------------------------------ capacity
    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    @property
    def num_cached(self) -> int:
        return len(self.policy)

    @property
    def usable_blocks(self) -> int:
        """Blocks a request may ever hold: the pool less the pinned ones."""
        return self.num_blocks - self.num_pinned

    def num_allocatable(self) -> int:
        """Blocks an allocation can take now: free ones, then evictable cached ones."""
        return len(self.free_ids) + len(self.policy)

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def blocks_held_at_most(self, num_tokens: int, chunk: Optional[int] = None) -> int:
        """The most blocks a request growing to num_tokens holds at once, computing at most
        `chunk` tokens a step (default: all at once). With a window W a step's table spans
        the W - 1 positions before its chunk plus the chunk: at most cdiv(W + chunk - 1, B) + 1
        blocks (the span need not start on a block boundary)."""
        blocks = cdiv(num_tokens, self.block_size)
        if self.window is None:
            return blocks
        chunk = num_tokens if chunk is None else min(chunk, num_tokens)
        return min(blocks, cdiv(self.window + chunk - 1, self.block_size) + 1)

    @staticmethod
    def num_held(seq: CacheSequence) -> int:
        """Blocks `seq` holds: its table less the entries released out of the window."""
        return sum(1 for b in seq.block_table if b != RELEASED)

    def blocks_to_grow(self, seq: CacheSequence, num_tokens: int,
                       chunk: Optional[int] = None) -> int:
        """Blocks `seq` may still take from the pool on its way to num_tokens tokens."""
        return max(0, self.blocks_held_at_most(num_tokens, chunk) - self.num_held(seq))

    def can_admit(self, seq: CacheSequence, match: PrefixMatch, tokens: int,
                  reserved: int = 0, chunk: Optional[int] = None) -> bool:
        """Whether `seq` can be admitted with `match` and grow to `tokens` tokens (`chunk` at
        most per step) while `reserved` blocks stay promised to requests already running."""
        need = min(cdiv(tokens, self.block_size) - len(match.device),
                   self.blocks_held_at_most(tokens, chunk))
        return need <= self.num_allocatable() - match.revived - reserved

    def pin_shortfall(self, num_tokens: int) -> Optional[str]:
        """Why pinning a prompt of num_tokens would break the budget (pinned blocks may take at
        most half the pool), or None when it fits."""
        after = self.num_pinned + num_tokens // self.block_size
        if after <= self.num_blocks // 2:
            return None
        return (f"pinned task prompts would take {after} KV blocks ({num_tokens} tokens in this "
                f"one), more than half of the pool ({self.num_blocks} blocks of "
                f"{self.block_size} tokens)")

    # ------------------------------------------------------------------ lookup and admission
    def lookup(self, seq: CacheSequence) -> PrefixMatch:
        """The longest cached prefix of `seq` in the device pool (at most all but its last
        token, whose logits are needed): the pinned task prefix, then device hits. Read-only;
        `lookup_tiers` extends it below the pool."""
        B = self.block_size
        limit = (seq.num_tokens - 1) // B
        match = PrefixMatch()
        parent_key, parent_serial = self.index.root, 0
        handle = seq.prefix_handle
        if handle is not None:
            for i, block_id in enumerate(handle.block_ids[:limit]):
                block = self.blocks[block_id]  # verified as a hit is: unpinned, it may be gone
                if (block.tokens != tuple(seq.token_ids[i * B:(i + 1) * B])
                        or block.parent_serial != parent_serial):
                    break
                match.device.append(block_id)
                match.revived += block.ref_count == 0
                parent_key, parent_serial = block.key, block.serial
        if not self.reuse_applies(seq):
            return match
        for i in range(len(match.device), limit):
            tokens = tuple(seq.token_ids[i * B:(i + 1) * B])
            extra = seq.salt if i == 0 else b""
            key = self.index.key(parent_key, tokens, extra)
            block_id = self.index.get(key)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.tokens != tokens or block.extra != extra or block.parent_serial != parent_serial:
                break
            match.device.append(block_id)
            match.revived += block.ref_count == 0
            parent_key, parent_serial = key, block.serial
        return match

    def _tier_metas(self, seq: CacheSequence, start: int, parent_key: bytes,
                    limit: int) -> list["BlockMeta"]:
        """The BlockMeta of `seq`'s full blocks start..limit-1, chained from parent_key."""
        from rtpkv.cache.tiers.base import BlockMeta

        B = self.block_size
        metas = []
        for i in range(start, limit):
            tokens = tuple(seq.token_ids[i * B:(i + 1) * B])
            extra = seq.salt if i == 0 else b""
            key = self.index.key(parent_key, tokens, extra)
            metas.append(BlockMeta(key=key, parent_key=parent_key, tokens=tokens, extra=extra))
            parent_key = key
        return metas

    def _chain_end(self, match: PrefixMatch) -> bytes:
        """The key the blocks after `match`'s device hits chain from."""
        return self.blocks[match.device[-1]].key if match.device else self.index.root

    def _metas_past_device_hits(self, seq: CacheSequence, match: PrefixMatch) -> list["BlockMeta"]:
        """The prompt's full blocks after its device hits, keyed: what the tiers are asked for
        (the last prompt token is always computed)."""
        return self._tier_metas(seq, len(match.device), self._chain_end(match),
                                (seq.num_tokens - 1) // self.block_size)

    def lookup_tiers(self, seq: CacheSequence, match: PrefixMatch) -> None:
        """Extend `match` with the tier hits that continue its device hits (each tier asked
        once, in order). Asked once, at admission: a waiting request's fit depends on its
        device hits alone, since tier hits need fresh blocks like computed ones."""
        if not self.tiers or not self.reuse_applies(seq):
            return
        metas = self._metas_past_device_hits(seq, match)
        pos = 0
        for tier in self.tiers:
            if pos == len(metas):
                break
            if not seq.allows_tier(tier.name):
                continue
            n = tier.lookup([m.key for m in metas[pos:]])
            if n:
                match.tiers.append(TierHit(tier, metas[pos:pos + n]))
                pos += n

    def prefetch(self, seq: CacheSequence) -> list["Future[int]"]:
        """Start fetching `seq`'s prompt blocks from the tiers that fetch in the background (the
        Redis tier's `prefetch`), so that its admission finds them in memory and the engine
        thread never waits on the network. Returns the futures to wait for (maybe none)."""
        fetching = [t for t in self.tiers if hasattr(t, "prefetch") and seq.allows_tier(t.name)]
        if not fetching or not self.reuse_applies(seq):
            return []
        metas = self._metas_past_device_hits(seq, self.lookup(seq))
        pos = 0
        for tier in self.tiers:
            if pos == len(metas):
                break
            if tier in fetching:
                return [tier.prefetch(metas[pos:])]
            if seq.allows_tier(tier.name):
                pos += tier.lookup([m.key for m in metas[pos:]])
        return []

    def admit(self, seq: CacheSequence, match: PrefixMatch) -> dict[str, int]:
        """Give `seq` its cached prefix: share the device hits, onboard tier hits into fresh
        blocks (a tier block that fails verification ends the prefix there). Returns the
        tokens reused from each source: "local" (the device pool) and each tier's name."""
        assert not seq.block_table, "admit a request once, or again after free"
        for block_id in match.device:
            self._acquire(block_id)
        seq.block_table.extend(match.device)
        seq.block_keys.extend(self.blocks[b].key for b in match.device)
        reused = {"local": len(match.device) * self.block_size}
        for hit in match.tiers:
            loaded = self._onboard(seq, hit)
            if loaded:
                reused[hit.tier.name] = loaded * self.block_size
            if loaded < len(hit.metas):
                break
        seq.num_computed = len(seq.block_table) * self.block_size
        return reused

    def _onboard(self, seq: CacheSequence, hit: TierHit) -> int:
        loaded = 0
        for meta in hit.metas:
            payload = hit.tier.load(meta)
            if payload is None:
                break
            block_id = self._allocate_one()
            self.pool.write_block(block_id, payload)
            parent_serial = self.blocks[seq.block_table[-1]].serial if seq.block_table else 0
            block = self.blocks[block_id]
            self._fill(block, meta.key, meta.parent_key, parent_serial, meta.tokens, meta.extra)
            self._index(block)
            seq.block_table.append(block_id)
            seq.block_keys.append(meta.key)
            loaded += 1
        self.onboarded[hit.tier.name] += loaded
        return loaded

    def record_lookup(self, seq: CacheSequence) -> None:
        """Count a request's first admission in the token-weighted hit statistics."""
        if self.reuse_applies(seq):
            self.query_tokens += seq.num_prompt
            self.hit_tokens += seq.num_computed

    # ------------------------------------------------------------------ growth
    def grow(self, seq: CacheSequence, num_tokens: int) -> bool:
        """Append blocks so `seq`'s table covers its first num_tokens positions. False (and
        nothing taken) when the blocks cannot be had: the caller pauses someone."""
        need = cdiv(num_tokens, self.block_size) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self.num_allocatable():
            return False
        seq.block_table.extend(self._allocate_one() for _ in range(need))
        return True

    def _allocate_one(self) -> int:
        """A block with one reference: a fresh one, else the policy's victim (offloaded to the
        first tier that takes it)."""
        if self.free_ids:
            block_id = self.free_ids.popleft()
        else:
            self.lapse_priorities()
            block_id = self.policy.pop()
            block = self.blocks[block_id]
            self.evictions += 1
            self.evictions_by_priority[block.priority] += 1
            self._offload(block)
            self._unindex(block)
            block.clear()
        self.blocks[block_id].ref_count = 1
        return block_id

    def _offload(self, block: Block) -> None:
        if not self.tiers or block.priority < self.offload_min_priority:
            return
        from rtpkv.cache.tiers.base import BlockMeta

        for tier in self.tiers:
            if tier.name in block.tiers:
                meta = BlockMeta(key=block.key, parent_key=block.parent_key, tokens=block.tokens,
                                 extra=block.extra, priority=block.priority)
                tier.store(meta, self.pool.read_block(block.block_id))
                self.offloaded[tier.name] += 1
                return

    # ------------------------------------------------------------------ commit
    def commit(self, seq: CacheSequence) -> None:
        """Blocks of `seq` that now hold B computed tokens get their key, tokens and lineage,
        and become hittable at once, even while `seq` runs (and are written through to the
        tiers that want it). Requests without reuse commit nothing, except a prompt to pin."""
        if not (self.reuse_applies(seq) or seq.prefill_only):
            return
        B = self.block_size
        retention = seq.retention or _DEFAULT_RETENTION
        for i in range(len(seq.block_keys), seq.num_computed // B):
            block = self.blocks[seq.block_table[i]]
            tokens = tuple(seq.token_ids[i * B:(i + 1) * B])
            extra = seq.salt if i == 0 else b""
            parent_key = seq.block_keys[i - 1] if i else self.index.root
            parent_serial = self.blocks[seq.block_table[i - 1]].serial if i else 0
            key = self.index.key(parent_key, tokens, extra)
            seq.block_keys.append(key)
            if block.full:  # a shared hit
                continue
            existing_id = self.index.get(key)
            if existing_id is not None:
                existing = self.blocks[existing_id]
                if (existing.tokens == tokens and existing.extra == extra
                        and existing.parent_serial == parent_serial):
                    # same content and lineage: keep our copy, unindexed, with its identity
                    self._fill(block, key, parent_key, parent_serial, tokens, extra,
                               serial=existing.serial)
                    continue
                self._drop_from_index(existing)  # stale or colliding
            self._fill(block, key, parent_key, parent_serial, tokens, extra)
            block.priority, block.duration_s = retention.block_retention(i * B, seq.num_prompt)
            self._index(block)
            self._write_through(block, seq)

    def _fill(self, block: Block, key: bytes, parent_key: bytes, parent_serial: int,
              tokens: tuple[int, ...], extra: bytes, serial: int = 0) -> None:
        if not serial:
            serial, self._next_serial = self._next_serial, self._next_serial + 1
        block.key, block.parent_key, block.serial, block.parent_serial = key, parent_key, serial, parent_serial
        block.tokens, block.extra = tokens, extra

    def _write_through(self, block: Block, seq: CacheSequence) -> None:
        from_tiers = [t for t in self.tiers if getattr(t, "write_through", False)
                      and seq.allows_tier(t.name)]
        if not from_tiers:
            return
        from rtpkv.cache.tiers.base import BlockMeta

        meta = BlockMeta(key=block.key, parent_key=block.parent_key, tokens=block.tokens,
                         extra=block.extra, priority=block.priority)
        payload = self.pool.read_block(block.block_id)
        for tier in from_tiers:
            tier.store(meta, payload)

    # ------------------------------------------------------------------ index
    def _index(self, block: Block) -> None:
        self.index.insert(block.key, block.block_id)
        block.indexed = True
        self.events.stored([block.key], block.parent_key, [block.tokens], block.priority,
                           extra=block.extra)

    def _unindex(self, block: Block) -> None:
        if block.indexed:
            self.index.remove(block.key)
            block.indexed = False
            self.events.removed([block.key])

    def _drop_from_index(self, block: Block) -> None:
        """A stale or colliding block leaves the index (its content stays while in use)."""
        self._unindex(block)
        if block.ref_count == 0:
            self.policy.remove(block)
            self._put_free(block)

    def _put_free(self, block: Block) -> None:
        block.clear()
        self.free_ids.append(block.block_id)

    # ------------------------------------------------------------------ release
    def release_out_of_window(self, seq: CacheSequence) -> int:
        """Release the blocks of `seq` that no future query attends to: those wholly before
        the window of the next query (position num_computed). Their entries become RELEASED.
        A prompt being pinned keeps every block; a request that commits keeps the parent of
        its next block to commit (its lineage). Returns the blocks released."""
        if self.window is None or seq.prefill_only:
            return 0
        end = max(0, seq.num_computed - self.window + 1) // self.block_size
        if self.reuse_applies(seq):
            end = min(end, len(seq.block_keys) - 1)
        retention = seq.retention or _DEFAULT_RETENTION
        tiers = frozenset(t.name for t in self.tiers if seq.allows_tier(t.name))
        released = 0
        for i in reversed(range(end)):
            if seq.block_table[i] == RELEASED:
                break
            self._release_entry(seq, i, retention, tiers)
            seq.block_table[i] = RELEASED
            released += 1
        return released

    def _acquire(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.policy.remove(block)
        block.ref_count += 1

    def free(self, seq: CacheSequence) -> None:
        """Drop `seq`'s references, tail first, stamping each block with `seq`'s retention
        priority (the last request to release a block decides it). Unreferenced full blocks
        stay cached (evictable); the rest go back to the free list."""
        retention = seq.retention or _DEFAULT_RETENTION
        tiers = frozenset(t.name for t in self.tiers if seq.allows_tier(t.name))
        for i in reversed(range(len(seq.block_table))):
            if seq.block_table[i] != RELEASED:
                self._release_entry(seq, i, retention, tiers)
        seq.block_table.clear()
        seq.block_keys.clear()

    def _release_entry(self, seq: CacheSequence, i: int, retention: KvCacheRetentionConfig,
                       tiers: frozenset[str]) -> None:
        """Drop `seq`'s reference on its i-th block, stamping a full block with the
        retention priority of its position."""
        block = self.blocks[seq.block_table[i]]
        if block.full:
            priority, duration = retention.block_retention(i * self.block_size, seq.num_prompt)
            if block.indexed and priority != block.priority:
                self.events.updated(block.key, block.priority, priority)
            block.priority, block.duration_s, block.tiers = priority, duration, tiers
        self._release(block)

    def _release(self, block: Block) -> None:
        block.ref_count -= 1
        if block.ref_count:
            return
        if block.full and not block.indexed and self.index.get(block.key) is None:
            self._index(block)  # the indexed copy went first: this one takes its place
        if block.indexed:
            self.policy.add(block, self.clock())
        else:
            self._put_free(block)

    def lapse_priorities(self) -> None:
        """Blocks whose retention duration ran out drop to the default priority (also done
        before every eviction); emits `updated` events."""
        for block, old in self.policy.lapse(self.clock()):
            self.events.updated(block.key, old, block.priority)

    # ------------------------------------------------------------------ pins
    def pin(self, seq: CacheSequence) -> PinnedPrefix:
        """Pin the full blocks of `seq`'s computed prompt; they stay until unpinned."""
        n = min(seq.num_computed, seq.num_tokens) // self.block_size
        ids = tuple(seq.block_table[:n])
        for block_id in ids:
            self._acquire(block_id)
            block = self.blocks[block_id]
            block.pin_count += 1
            self.num_pinned += block.pin_count == 1
        return PinnedPrefix(ids, n * self.block_size)

    def unpin(self, handle: PinnedPrefix) -> None:
        for block_id in reversed(handle.block_ids):
            block = self.blocks[block_id]
            block.pin_count -= 1
            self.num_pinned -= block.pin_count == 0
            self._release(block)

    # ------------------------------------------------------------------ visibility
    def stats(self) -> dict[str, object]:
        self.lapse_priorities()
        in_use = sum(1 for b in self.blocks if b.ref_count)
        stats: dict[str, object] = {
            "queries": self.query_tokens,
            "hits": self.hit_tokens,
            "hit_rate": self.hit_tokens / self.query_tokens if self.query_tokens else 0.0,
            "blocks_total": self.num_blocks,
            "blocks_free": self.num_free,
            "blocks_cached": self.num_cached,
            "blocks_in_use": in_use,
            "blocks_pinned": self.num_pinned,
            "blocks_cached_by_priority": self.policy.counts(),
            "evictions": self.evictions,
            "evictions_by_priority": dict(sorted(self.evictions_by_priority.items())),
            "block_size": self.block_size,
            "events_dropped": self.events.dropped,
        }
        for tier in self.tiers:
            stats[f"{tier.name}_offloaded_blocks"] = self.offloaded[tier.name]
            stats[f"{tier.name}_onboarded_blocks"] = self.onboarded[tier.name]
            stats.update(tier.stats())
        return stats

    def check_integrity(self, live: Optional[Iterable[CacheSequence]] = None) -> None:
        """Assert the accounting invariant free + cached + in use == total, that each block is
        in exactly one state, that every indexed key maps to a block holding exactly the
        tokens the key was computed from, that each cached block sits in its priority's queue,
        that every tier's own invariant holds, and (given the live requests) that every
        reference count equals its holders plus its pins and no block inside a request's
        attention window was released."""
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
        for block_id in cached:
            assert blocks[block_id].indexed and blocks[block_id].ref_count == 0
        for block in blocks:
            assert block.ref_count >= block.pin_count >= 0, f"block {block.block_id} refs"
        assert self.num_pinned == sum(1 for b in blocks if b.pin_count), "pinned count drifted"
        assert sum(b.indexed for b in blocks) == len(self.index), "index and blocks disagree"
        for key, block_id in self.index.items():
            block = blocks[block_id]
            assert block.indexed and block.key == key, f"index key of block {block_id} is stale"
            assert len(block.tokens) == self.block_size, f"block {block_id} is not full"
            assert self.index.key(block.parent_key, block.tokens, block.extra) == key, \
                f"block {block_id} does not hold the tokens of its key"
        check = getattr(self.policy, "check", None)
        if check is not None:
            check()
        for tier in self.tiers:
            tier.check_integrity()
        if live is not None:
            expected = [b.pin_count for b in blocks]
            for seq in live:
                for block_id in seq.block_table:
                    if block_id != RELEASED:
                        expected[block_id] += 1
                if self.window is not None:
                    first = max(0, seq.num_computed - self.window + 1) // self.block_size
                    assert RELEASED not in seq.block_table[first:], \
                        "a block inside the attention window was released"
            actual = [b.ref_count for b in blocks]
            assert expected == actual, "reference counts differ from the live block tables"
