"""HostTier: a bounded region of host memory that keeps blocks evicted from the device pool.

TensorRT-LLM calls it the secondary (host) pool, rtp-llm its memory cache. The tier owns one
buffer preallocated at start-up, `num_blocks` slots of one block each, so offloading never
allocates. With a CUDA pool the buffer is pinned and device-to-host copies run on a side stream:
`store` returns as soon as the copy is queued, and the engine's stream waits for it before it
overwrites the source block. On CPU the tier is simply a second bounded region of memory.

Eviction inside the tier is the device pool's rule: lowest retention priority first, least
recently used within a priority. A block the tier evicts is shown to `on_evict` (the ladder hands
it to the disk tier when there is one). The tier is inclusive: onboarding a block copies it back to the device and keeps the
host copy, so evicting that block from the device again costs no copy.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from rtpkv.cache.block import parents_first
from rtpkv.cache.tiers.base import BlockMeta, KVTier, TierLayout
from rtpkv.cache.tiers.order import EvictionOrder


@dataclass
class _Slot:
    index: int
    meta: BlockMeta
    copied: Optional["torch.cuda.Event"] = None  # set while a device-to-host copy is in flight


class HostTier(KVTier):
    name = "memory"

    def __init__(self, layout: TierLayout, capacity_bytes: int,
                 device: torch.device | str = "cpu"):
        self.layout = layout
        self.block_bytes = layout.nbytes
        self.num_blocks = capacity_bytes // self.block_bytes
        if self.num_blocks < 1:
            raise ValueError(f"host cache size {capacity_bytes} bytes holds no block: one block "
                             f"takes {self.block_bytes} bytes")
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.buffer = torch.empty((self.num_blocks, *layout.shape), dtype=layout.dtype,
                                  pin_memory=self.cuda)
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._lock = threading.Lock()
        self._free: deque[int] = deque(range(self.num_blocks))
        self._slots: dict[bytes, _Slot] = {}
        self._order = EvictionOrder()
        self.counters = dict(offloaded_blocks=0, onboarded_blocks=0, lookup_blocks=0,
                             lookup_hits=0, evictions=0, handed_off=0, mismatches=0)

    # ------------------------------------------------------------------ KVTier
    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._slots

    def lookup(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            found = 0
            for key in keys:
                if key not in self._slots:
                    break
                # touched in chain order: while the chain is onboarded (and each device block it
                # needs offloads another block here), its blocks already loaded go first
                self._order.touch(key)
                found += 1
            self.counters["lookup_blocks"] += len(keys)
            self.counters["lookup_hits"] += found
            return found

    def load(self, meta: BlockMeta) -> Optional[torch.Tensor]:
        """The stored payload. On CPU a copy; with a CUDA pool the pinned slot itself (valid
        until this key is evicted from the tier), so the caller's copy to the device can be
        asynchronous — a later store into the slot runs on a stream ordered after it."""
        with self._lock:
            slot = self._slots.get(meta.key)
            if slot is None:
                return None
            if not slot.meta.same_block(meta):
                self.counters["mismatches"] += 1
                return None
            self._wait(slot)
            self.counters["onboarded_blocks"] += 1
            data = self.buffer[slot.index]
            return data if self.cuda else data.clone()

    def store(self, meta: BlockMeta, payload: torch.Tensor) -> None:
        self.layout.check_payload(payload)
        with self._lock:
            slot = self._slots.get(meta.key)
            if slot is not None and slot.meta.same_block(meta):
                # already here (the tier is inclusive): refresh recency; the newest priority wins
                slot.meta = meta
                self._order.add(meta.key, meta.priority)
                return
            if slot is not None:
                self._remove(meta.key)
            if not self._free:
                self._evict_one()
            index = self._free.popleft()
            self._slots[meta.key] = _Slot(index, meta, self._copy_in(index, payload))
            self._order.add(meta.key, meta.priority)
            self.counters["offloaded_blocks"] += 1
            if self.events is not None:
                self.events.stored([meta.key], meta.parent_key, [meta.tokens], meta.priority,
                                   tier=self.name, extra=meta.extra)

    def announce(self) -> None:
        """Every block held now, as stored events, parents first."""
        if self.events is None:
            return
        with self._lock:
            for meta in parents_first(slot.meta for slot in self._slots.values()):
                self.events.stored([meta.key], meta.parent_key, [meta.tokens], meta.priority,
                                   tier=self.name, extra=meta.extra)

    def drop(self, key: bytes) -> None:
        with self._lock:
            if key in self._slots:
                self._remove(key)

    def residency_stats(self) -> Optional[dict[str, Any]]:
        with self._lock:
            return self._order.residency.stats()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            c = self.counters
            return {
                "memory_blocks_total": self.num_blocks,
                "memory_blocks_used": len(self._slots),
                "memory_bytes_total": self.num_blocks * self.block_bytes,
                "memory_offloaded_blocks": c["offloaded_blocks"],
                "memory_offloaded_bytes": c["offloaded_blocks"] * self.block_bytes,
                "memory_onboarded_blocks": c["onboarded_blocks"],
                "memory_onboarded_bytes": c["onboarded_blocks"] * self.block_bytes,
                "memory_lookup_blocks": c["lookup_blocks"],
                "memory_hits": c["lookup_hits"],
                "memory_hit_rate": c["lookup_hits"] / c["lookup_blocks"] if c["lookup_blocks"] else 0.0,
                "memory_evictions": c["evictions"],
                "memory_handed_off": c["handed_off"],
                "memory_mismatches": c["mismatches"],
            }

    def check_integrity(self) -> None:
        """free + used == total; every slot is either free or held by exactly one key, and every
        held key is listed once in the eviction order under its own priority."""
        with self._lock:
            free = set(self._free)
            used = {slot.index for slot in self._slots.values()}
            assert len(free) == len(self._free), "a host slot is twice in the free list"
            assert len(used) == len(self._slots), "two keys share a host slot"
            assert not free & used, "a host slot is both free and used"
            assert len(free) + len(used) == self.num_blocks, \
                f"host tier: free {len(free)} + used {len(used)} != total {self.num_blocks}"
            self._order.check()
            assert len(self._order) == len(self._slots), "host eviction order and slots differ"
            for key, slot in self._slots.items():
                assert slot.meta.key == key and self._order.priority(key) == slot.meta.priority, \
                    "host eviction order lists a block under another priority"

    def close(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    # ------------------------------------------------------------------ internals
    def _copy_in(self, index: int, payload: torch.Tensor) -> Optional["torch.cuda.Event"]:
        """Copy `payload` into slot `index`; with CUDA asynchronously on the side stream, and the
        caller's stream made to wait for the copy before it can reuse the source memory."""
        target = self.buffer[index]
        if not (self.cuda and payload.is_cuda):
            if self.cuda:
                # a copy into the slot's last occupant (side stream) or out of it (an onboard on
                # the engine's stream) may still be in flight: the CPU writes after both
                self._stream.synchronize()
                torch.cuda.current_stream(self.device).synchronize()
            target.copy_(payload)
            return None
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)          # the source block is written on `current`
        with torch.cuda.stream(self._stream):
            target.copy_(payload, non_blocking=True)
            payload.record_stream(self._stream)
        event = torch.cuda.Event()
        event.record(self._stream)
        current.wait_event(event)                  # the engine overwrites the source after this
        return event

    @staticmethod
    def _wait(slot: _Slot) -> None:
        if slot.copied is not None:
            slot.copied.synchronize()
            slot.copied = None

    def _evict_one(self) -> None:
        key = self._order.victim()
        self._order.evicted(key)
        slot = self._slots[key]
        if self.on_evict is not None:
            self._wait(slot)
            self.on_evict(slot.meta, self.buffer[slot.index])
            self.counters["handed_off"] += 1
        self._remove(key)
        self.counters["evictions"] += 1

    def _remove(self, key: bytes) -> None:
        slot = self._slots.pop(key)
        self._order.remove(key)
        self._free.append(slot.index)
        if self.events is not None:
            self.events.removed([key], tier=self.name)
