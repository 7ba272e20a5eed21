"""StateGroup: a recurrent model's states as a KV cache group of kind "mamba" (vLLM's name for
the group of its hybrid KV cache manager that holds Mamba and linear-attention states).

A recurrent layer (model_factory/recurrent.py) keeps one state per sequence, overwritten at
every token, so a cached prefix is reusable only where the state at its end was saved. The group
has two kinds of slots in one StatePool:
- live slots, one per running request (CONCURRENCY_LIMIT of them): taken at admission (zeroed,
  or a copy of the checkpoint the hit ends on) and given back when the request leaves;
- checkpoints, the group's blocks: the state of every recurrent layer after block i of a
  request, for every LINEAR_STEP-th block boundary, in its prompt and in what it generates (so a
  chat's next turn resumes within its last answer), and after the last whole block of a task
  prompt, which a pin holds; keyed by the same chained key as block i of the attention groups.
  They live in a BlockPool of their own, so indexing, retention priorities, eviction (lowest
  priority first, LRU within), salts (the key chains through them), pins and KV events (vLLM's
  group fields, `kv_cache_spec_kind` "mamba") follow the pool's rules, each checkpoint block id
  being its StatePool slot.

A checkpoint is written by the recurrent kernel itself, at the exact token inside the prefill
chunk (`RecurrentBatch.snapshots`): the manager plans the boundaries a chunk crosses when it
grows the request (`plan`), taking a checkpoint block for each; the commit after the step
indexes them. The state after n tokens has the same bits however it was computed (chunks,
batches), so a checkpoint found by key and verified by its tokens and salt is the state a
recomputation would reach: the hit is the longest prefix whose attention blocks are held and
whose end has a checkpoint (`hit`), and prefill continues from the checkpoint's copy.

Tiers (`tiers`: tiers/factory.py's `build_state_tiers`, a ladder of their own): a checkpoint
the pool evicts is offloaded like a KV block (to the first tier its last request allowed, at
the offload priority threshold), one that commits is written through to the tiers that keep
everything, as one record whose layout names the state group (`state_tier_layout`) under
`tier_key` of its block's key (the model root and salts are in that key). `from_tiers` finds
the longest prefix of a tier hit whose end has a record, loads it into a checkpoint block
(written back into the StatePool slot) and indexes it; a record that is missing, corrupt or of
another layout is a miss, so the hit is shorter, never wrong.
"""

from __future__ import annotations

import hashlib
import time
from typing import Callable, Optional, Sequence

import torch

from rtpkv.cache.block_pool import BlockPool
from rtpkv.cache.events import KVEventBuffer
from rtpkv.cache.prefix_index import KeyChain, PrefixIndex
from rtpkv.cache.retention import KvCacheRetentionConfig
from rtpkv.cache.block import DEFAULT_PRIORITY, Block
from rtpkv.cache.sequence import CacheSequence
from rtpkv.cache.tiers.base import BlockMeta, KVTier
from rtpkv.cache.tiers.ladder import Allows, TierLadder
from rtpkv.model_factory.recurrent import StatePool, StateSpec

MAMBA = "mamba"   # vLLM's KVCacheSpecKind of a state group
_TIER_KEY_TAG = b"rtpkv-state\0"


def tier_key(key: bytes) -> bytes:
    """A state record's key in the tiers, from the chained key of the block it ends: never a
    KV block's key (a connector or Redis may hold both), with that key's root and salts."""
    return hashlib.sha256(_TIER_KEY_TAG + key).digest()


class StateGroup:
    def __init__(self, specs: Sequence[Sequence[StateSpec]], num_checkpoints: int,
                 live_slots: int, step: int, block_size: int, index: PrefixIndex,
                 events: KVEventBuffer, group: int,
                 device: torch.device = torch.device("cpu"),
                 tiers: Sequence[KVTier] = (), offload_min_priority: int = DEFAULT_PRIORITY,
                 clock: Callable[[], float] = time.monotonic):
        """`num_checkpoints` saved states and `live_slots` running requests' states; `step`:
        LINEAR_STEP (a checkpoint every `step` blocks); `group`: the group's index in events;
        `tiers`: where evicted (and, write-through, committed) checkpoints go (no KV events:
        a router knows the state group by its device blocks)."""
        self.states = StatePool(specs, num_checkpoints + live_slots, device)
        for block_id in range(num_checkpoints):   # checkpoint block b is StatePool slot b
            assert self.states.allocate() == block_id
        self.ladder = TierLadder(tiers, offload_min_priority)
        self.pool = BlockPool(num_checkpoints, index, events, clock=clock, ghosts=0,
                              on_evict=self._offload if self.ladder else None)
        self.live_slots = live_slots
        self.step = step
        self.block_size = block_size
        self.group = group

    @property
    def event_fields(self) -> dict[str, object]:
        return {"group_idx": self.group, "kv_cache_spec_kind": MAMBA,
                "kv_cache_spec_sliding_window": None}

    # ------------------------------------------------------------------ live slots
    def start(self, seq: CacheSequence, checkpoint: Optional[int]) -> None:
        """Give `seq` its live slot at admission: a copy of `checkpoint` (the state at the end
        of its hit), or zeros where it computes from its first token."""
        slot = self.states.allocate()
        seq.state_slot = slot
        if checkpoint is None:
            self.states.zero(slot)
        else:
            self.states.copy(checkpoint, slot)

    def release(self, seq: CacheSequence) -> None:
        """`seq` leaves (finished, paused, failed): its live slot and the checkpoints it had
        planned and not committed go back."""
        if seq.state_slot is not None:
            self.states.free(seq.state_slot)
            seq.state_slot = None
        for _, block_id in seq.state_pending:
            self.pool.release(block_id)
        seq.state_pending.clear()

    # ------------------------------------------------------------------ checkpoints
    def _wanted(self, seq: CacheSequence, i: int) -> bool:
        """Whether the state after block i of `seq` is to be saved: every `step`-th block,
        and a prefill-only prompt's last whole block (a task prompt's pin)."""
        return (i + 1) % self.step == 0 or (
            seq.prefill_only and i + 1 == seq.num_prompt // self.block_size)

    def plan(self, seq: CacheSequence, chain: KeyChain, end: int) -> None:
        """Take a checkpoint block for each boundary `seq` crosses up to token `end` that is
        wanted and not saved yet (none where every checkpoint is in use: fewer checkpoints,
        never a wrong one)."""
        B = self.block_size
        planned = {i for i, _ in seq.state_pending}
        for i in range(seq.num_computed // B, end // B):
            if i in planned or not self._wanted(seq, i) or self._held(chain, i) is not None:
                continue
            if not self.pool.num_allocatable():
                return
            seq.state_pending.append((i, self.pool.allocate()))

    def snapshots(self, seq: CacheSequence, start: int, n: int) -> list[tuple[int, int]]:
        """The (tokens into the chunk, slot) pairs of `seq`'s planned checkpoints inside its
        chunk of n tokens from `start` (RecurrentBatch.snapshots)."""
        B = self.block_size
        return [((i + 1) * B - start, block_id) for i, block_id in seq.state_pending
                if start < (i + 1) * B <= start + n]

    def commit(self, seq: CacheSequence, chain: KeyChain,
               retention: KvCacheRetentionConfig) -> None:
        """Planned checkpoints `seq` has now computed become hittable (keyed, stamped with
        their position's retention priority, cached)."""
        B = self.block_size
        done = [(i, b) for i, b in seq.state_pending if (i + 1) * B <= seq.num_computed]
        tiers = self.ladder.allowed(seq.allows_tier)
        for i, block_id in done:
            priority, duration = retention.block_retention(i * B, seq.num_prompt)
            if (self.pool.commit(block_id, chain.key(i), chain.parent(i), 0, chain.tokens(i),
                                 chain.extra(i), priority, duration, chain.tenant(i), self.group)
                    and self.ladder):
                self.pool.stamp(block_id, priority, duration, tiers)
                self.ladder.write_through(self._meta(chain.key(i), chain.tokens(i),
                                                     chain.extra(i), priority),
                                          seq.allows_tier, lambda: self._read(block_id))
            self.pool.release(block_id)
            seq.state_pending.remove((i, block_id))

    # ------------------------------------------------------------------ tiers
    @staticmethod
    def _meta(key: bytes, tokens: tuple[int, ...], extra: bytes,
              priority: int = DEFAULT_PRIORITY) -> BlockMeta:
        """The tier record's identity of the state after the block of `key`: its own key, the
        block's key as its parent, the block's tokens and extra bytes (verified on a load)."""
        return BlockMeta(key=tier_key(key), parent_key=key, tokens=tokens, extra=extra,
                         priority=priority)

    def _read(self, slot: int) -> torch.Tensor:
        """Slot `slot`'s state as one record payload: every tensor's bytes, in order."""
        return torch.cat([t.detach().to("cpu").contiguous().reshape(-1).view(torch.int8)
                          for t in self.states.read_slot(slot)])

    def _write(self, slot: int, payload: torch.Tensor) -> None:
        """Slot `slot` set from a `_read` payload."""
        specs = [spec for layer in self.states.specs for spec in layer]
        values = torch.split(payload, [spec.nbytes for spec in specs])
        self.states.write_slot(slot, [v.contiguous().view(spec.dtype).reshape(spec.shape)
                                      for v, spec in zip(values, specs)])

    def _offload(self, block: Block) -> None:
        """The pool is evicting checkpoint `block`: offer it to the tiers."""
        slot = block.block_id
        self.ladder.offload(self._meta(block.key, block.tokens, block.extra, block.priority),
                            block.tiers, lambda: self._read(slot))

    def from_tiers(self, chain: KeyChain, blocks: int, floor: int,
                   allows: Allows) -> Optional[tuple[int, int]]:
        """(j, checkpoint): the longest prefix of at most `blocks` and more than `floor` whole
        blocks whose end has a state record in an allowed tier (asked at every `step`-th
        boundary and at `blocks`), loaded into a checkpoint block the caller holds (one
        reference) and indexed; None where none loads."""
        self.ladder.begin_walk()   # a connector lets go of what an earlier walk staged
        for j in range(blocks, floor, -1):
            if j % self.step and j != blocks:
                continue
            i = j - 1
            meta = self._meta(chain.key(i), chain.tokens(i), chain.extra(i))
            for tier in self.ladder.tiers:
                if not allows(tier.name) or not tier.lookup([meta.key]):
                    continue
                if not self.pool.num_allocatable():
                    return None
                block_id = self.pool.allocate()   # before the load: an eviction may offload
                payload = self.ladder.load(tier, meta)
                if payload is None:
                    self.pool.release(block_id)
                    continue
                self._write(block_id, payload)
                self.pool.onboard(block_id, chain.key(i), chain.parent(i), 0, chain.tokens(i),
                                  chain.extra(i), chain.tenant(i), self.group)
                return j, block_id
        return None

    def _held(self, chain: KeyChain, i: int) -> Optional[int]:
        """The checkpoint after block i of `chain`, verified (tokens and extra bytes), if held."""
        block = self.pool.cached(chain.key(i))
        if block is None or block.tokens != chain.tokens(i) or block.extra != chain.extra(i):
            return None
        return block.block_id

    def hit(self, chain: KeyChain, blocks: int, pinned: Optional[tuple[int, int]],
            reuse: bool) -> tuple[int, Optional[int]]:
        """(j, checkpoint): the longest prefix of at most `blocks` whole blocks with a saved
        state at its end, and that state's block; (0, None) for none. `pinned`: a task
        prompt's (blocks, checkpoint), usable whether reuse applies or not."""
        floor = (0, None)
        if pinned is not None and 0 < pinned[0] <= blocks:
            block = self.pool.blocks[pinned[1]]
            i = pinned[0] - 1
            if block.tokens == chain.tokens(i) and block.extra == chain.extra(i):
                floor = pinned
        if reuse:
            for j in range(blocks, floor[0], -1):
                block_id = self._held(chain, j - 1)
                if block_id is not None:
                    return j, block_id
        return floor

    def pin(self, chain: KeyChain, n: int) -> Optional[int]:
        """Pin the checkpoint after block n - 1 (a task prompt's last whole block): it stays
        until unpinned. None where there is none."""
        block_id = self._held(chain, n - 1) if n else None
        if block_id is not None:
            self.pool.pin(block_id)
        return block_id

    def unpin(self, block_id: int) -> None:
        self.pool.unpin(block_id)

    # ------------------------------------------------------------------ visibility
    def stats(self) -> dict[str, object]:
        pool = self.pool
        return {"kind": MAMBA, "step": self.step, "checkpoints": pool.num_blocks,
                "checkpoints_cached": pool.num_cached,
                "checkpoints_in_use": sum(1 for b in pool.blocks if b.ref_count),
                "checkpoints_pinned": pool.num_pinned, "evictions": pool.evictions,
                "live_slots": self.live_slots,
                "live_slots_free": self.states.num_free,
                "bytes_per_state": self.states.bytes_per_slot,
                "tiers": self.ladder.stats()}

    def check_integrity(self, live: Optional[Sequence[CacheSequence]]) -> None:
        """The checkpoint pool's invariant; given the live requests, every checkpoint's
        reference count equals its pins plus the requests that planned it, and every live
        slot belongs to exactly one of them."""
        self.pool.check_integrity()
        self.ladder.check_integrity()
        if live is None:
            return
        expected = [b.pin_count for b in self.pool.blocks]
        slots = []
        for seq in live:
            for _, block_id in seq.state_pending:
                expected[block_id] += 1
            if seq.state_slot is not None:
                slots.append(seq.state_slot)
        assert expected == [b.ref_count for b in self.pool.blocks], \
            "checkpoint reference counts differ from the live requests' plans and the pins"
        assert len(set(slots)) == len(slots), "two requests share a live state slot"
        assert self.states.num_free + len(slots) == self.live_slots, \
            "a live state slot is neither free nor held by a live request"
