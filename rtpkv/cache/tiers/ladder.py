"""TierLadder: the only code that calls a tier.

The tiers below the device pool form a ladder, asked in order (host memory, disk, remote, a
user connector). A block climbs down when the device pool evicts it (`offload`, to the first tier
its last request allowed) or as soon as it fills (`write_through`, to the tiers that keep
everything: disk, Redis, a connector), and back up when a request hits it (`load`).

A tier that evicts a block to make room (host memory) hands it to the next tier down that takes
evictions (disk), through the `on_evict` hook the ladder sets.

One walk per request
--------------------
A request's chain is walked down the ladder once. Without a tier that fetches in the background
the walk happens at admission (`walk`). With one (Redis), it starts when the request arrives
(`begin`): the tiers above it are asked, and it is handed the rest of the chain to fetch off the
engine thread; the request waits in the queue until the fetch is done (`ready`), and admission
then reads the recorded answers instead of asking again, and asks only the tiers the first part
did not reach. An answer is reused when it covers the block the admission walk is at; the one
case that asks a tier again is a request whose device hits shrank since it arrived (blocks
evicted meanwhile), where no answer covers the new start.

The ladder never touches a `Block`: the cache manager hands it `BlockMeta` and payloads.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Optional, Sequence

import torch

from rtpkv.cache.events import KVEventBuffer
from rtpkv.cache.tiers.base import BlockMeta, KVTier

Allows = Callable[[str], bool]   # a request's per-tier switch (enable_<name>_cache)


@dataclass
class TierHit:
    """Blocks of a request's chain that one tier holds, in chain order."""

    tier: KVTier
    metas: list[BlockMeta]


@dataclass
class TierPlan:
    """What a request's walk learned so far: per tier asked, the chain position it was asked
    from and how many blocks it holds from there (a future while a fetch runs)."""

    answers: dict[str, tuple[int, "int | Future[int]"]] = field(default_factory=dict)

    def held(self, name: str, pos: int) -> Optional[int]:
        """Blocks the tier holds from chain position `pos`, if its answer covers `pos`."""
        answer = self.answers.get(name)
        if answer is None or answer[0] > pos:
            return None
        start, count = answer
        if isinstance(count, Future):
            count = count.result()
        return max(0, start + count - pos)


class TierLadder:
    def __init__(self, tiers: Sequence[KVTier], offload_min_priority: int,
                 events: Optional[KVEventBuffer] = None):
        self.tiers = list(tiers)
        self.offload_min_priority = offload_min_priority
        for i, tier in enumerate(self.tiers):
            tier.events = events      # tier moves are KV events too (rtpkv.fleet)
            below = next((t for t in self.tiers[i + 1:] if t.takes_evictions), None)
            if below is not None:
                tier.on_evict = partial(self._hand_down, below)
        self.lookups: Counter[str] = Counter()      # requests whose chain each tier was asked for
        self.offloaded: Counter[str] = Counter()    # blocks stored on a device eviction
        self.onboarded: Counter[str] = Counter()    # blocks loaded into the device pool

    def __bool__(self) -> bool:
        return bool(self.tiers)

    def allowed(self, allows: Allows) -> frozenset[str]:
        """The names of the tiers a request allows (kept on its blocks for their offload)."""
        return frozenset(t.name for t in self.tiers if allows(t.name))

    # ------------------------------------------------------------------ the walk
    def begin(self, metas: list[BlockMeta], start: int, allows: Allows) -> Optional[TierPlan]:
        """On a request's arrival: when an allowed tier fetches in the background, ask the tiers
        above it and start its fetch of the rest of the chain (blocks `start`...). None when no
        such tier applies (the whole walk then happens at admission)."""
        if not any(t.fetches_in_background and allows(t.name) for t in self.tiers):
            return None
        plan, pos = TierPlan(), start
        for tier in self.tiers:
            if pos - start == len(metas):
                break
            if not allows(tier.name):
                continue
            self.lookups[tier.name] += 1
            if tier.fetches_in_background:
                plan.answers[tier.name] = (pos, tier.prefetch(metas[pos - start:]))
                break
            held = tier.lookup([m.key for m in metas[pos - start:]])
            plan.answers[tier.name] = (pos, held)
            pos += held
        return plan

    @staticmethod
    def ready(plan: Optional[TierPlan]) -> bool:
        """Whether the background fetches `plan` started are done."""
        return plan is None or all(not isinstance(c, Future) or c.done()
                                   for _, c in plan.answers.values())

    def begin_walk(self) -> None:
        """A request's admission walk begins: its lookups (one chain per KV cache group) come
        next, then its loads (`KVTier.begin_walk`)."""
        for tier in self.tiers:
            tier.begin_walk()

    def walk(self, metas: list[BlockMeta], start: int, allows: Allows,
             plan: Optional[TierPlan] = None) -> list[TierHit]:
        """At admission: the tier hits that continue a request's device hits (its chain from
        block `start`, as `metas`), each tier asked at most once (answers in `plan` are
        reused), in order, each hit continuing the previous one."""
        hits: list[TierHit] = []
        pos = start
        for tier in self.tiers:
            if pos - start == len(metas):
                break
            if not allows(tier.name):
                continue
            held = None if plan is None else plan.held(tier.name, pos)
            if held is None:
                self.lookups[tier.name] += 1
                held = tier.lookup([m.key for m in metas[pos - start:]])
            held = min(held, len(metas) - (pos - start))
            if held:
                hits.append(TierHit(tier, metas[pos - start:pos - start + held]))
                pos += held
        return hits

    def held_by_skipped(self, key: bytes, allows: Allows) -> bool:
        """Whether a tier the request turned off holds `key` (as far as the tiers can tell
        without a network call: `KVTier.contains`)."""
        return any(not allows(t.name) and t.contains(key) for t in self.tiers)

    def load(self, tier: KVTier, meta: BlockMeta) -> Optional[torch.Tensor]:
        """A hit's payload, verified by the tier against `meta`; None on a miss."""
        payload = tier.load(meta)
        if payload is not None:
            self.onboarded[tier.name] += 1
        return payload

    # ------------------------------------------------------------------ down the ladder
    def offload(self, meta: BlockMeta, allowed: frozenset[str],
                read: Callable[[], torch.Tensor]) -> None:
        """A block the device pool evicts goes to the first tier its last request allowed,
        when its priority is at least the offload threshold (`read` copies it out)."""
        if meta.priority < self.offload_min_priority:
            return
        for tier in self.tiers:
            if tier.name in allowed:
                tier.store(meta, read())
                self.offloaded[tier.name] += 1
                return

    @staticmethod
    def _hand_down(tier: KVTier, meta: BlockMeta, payload: torch.Tensor) -> None:
        """A block the tier above evicted to make room."""
        tier.store(meta, payload)

    def write_through(self, meta: BlockMeta, allows: Allows,
                      read: Callable[[], torch.Tensor]) -> None:
        """A block that just filled goes to every allowed tier that keeps everything."""
        tiers = [t for t in self.tiers if t.write_through and allows(t.name)]
        if tiers:
            payload = read()
            for tier in tiers:
                tier.store(meta, payload)

    # ------------------------------------------------------------------ visibility
    def residency(self) -> dict[str, Any]:
        """Residency histograms per tier that keeps them."""
        return {tier.name: stats for tier in self.tiers
                if (stats := tier.residency_stats()) is not None}

    def stats(self) -> dict[str, Any]:
        """Each tier's own counters, with the ladder's: `<name>_lookups` (requests asked),
        `<name>_offloaded_blocks` and `<name>_onboarded_blocks` where the tier keeps none."""
        stats: dict[str, Any] = {}
        for tier in self.tiers:
            stats.update(tier.stats())
            stats[f"{tier.name}_lookups"] = self.lookups[tier.name]
            stats.setdefault(f"{tier.name}_offloaded_blocks", self.offloaded[tier.name])
            stats.setdefault(f"{tier.name}_onboarded_blocks", self.onboarded[tier.name])
        return stats

    def check_integrity(self) -> None:
        for tier in self.tiers:
            tier.check_integrity()

    def announce(self) -> None:
        """Each tier reports what it held before events were listened to (see KVTier)."""
        for tier in self.tiers:
            tier.announce()

    def close(self) -> None:
        """Flush and close every tier (queued disk and Redis writes land first)."""
        for tier in self.tiers:
            tier.close()
