"""EvictionOrder: which stored block a tier gives up first — the lowest retention priority, and
within a priority the least recently used (the device pool's rule, TensorRT-LLM's too). It also
keeps the tier's residency histograms (rtpkv.cache.residency): a key's store, uses and eviction
pass through it."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Iterator

from rtpkv.cache.residency import ResidencyHistograms


class EvictionOrder:
    """Keys grouped by priority, each group in least recently used first order. Not thread-safe:
    the owning tier holds its lock around every call."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._groups: dict[int, OrderedDict[bytes, None]] = {}
        self._priority: dict[bytes, int] = {}
        self._times: dict[bytes, tuple[float, float]] = {}   # key -> (stored, last used)
        self.clock = clock
        self.residency = ResidencyHistograms()

    def add(self, key: bytes, priority: int) -> None:
        """List `key` as the most recently used of `priority` (moving it if already listed:
        stored again, it keeps its residency times)."""
        times = self._times.get(key)
        if key in self._priority:
            self.remove(key)
        self._groups.setdefault(priority, OrderedDict())[key] = None
        self._priority[key] = priority
        if times is None:
            now = self.clock()
            times = (now, now)
        self._times[key] = times

    def remove(self, key: bytes) -> None:
        priority = self._priority.pop(key)
        self._times.pop(key, None)
        group = self._groups[priority]
        del group[key]
        if not group:
            del self._groups[priority]

    def touch(self, key: bytes) -> None:
        """A hit: `key` becomes the most recently used of its priority."""
        self._groups[self._priority[key]].move_to_end(key)
        stored, used = self._times[key]
        now = self.clock()
        self.residency.observe("reuse_gap", now - used)
        self._times[key] = (stored, now)

    def evicted(self, key: bytes) -> None:
        """Record `key`'s residency as it is evicted (the caller then removes it)."""
        stored, used = self._times[key]
        self.residency.evicted(self.clock(), stored, used)

    def victim(self) -> bytes:
        """The key to evict next (KeyError when empty)."""
        if not self._groups:
            raise KeyError("nothing to evict")
        return next(iter(self._groups[min(self._groups)]))

    def priority(self, key: bytes) -> int:
        return self._priority[key]

    def __contains__(self, key: bytes) -> bool:
        return key in self._priority

    def __len__(self) -> int:
        return len(self._priority)

    def __iter__(self) -> Iterator[bytes]:
        """Keys in eviction order."""
        for priority in sorted(self._groups):
            yield from self._groups[priority]

    def check(self) -> None:
        """Assert that the groups and the priority map agree."""
        listed = {key: p for p, group in self._groups.items() for key in group}
        assert len(listed) == sum(len(g) for g in self._groups.values()), "a key is listed twice"
        assert listed == self._priority, "eviction groups and priorities differ"
        assert self._times.keys() == self._priority.keys(), "residency times drifted"
        assert all(self._groups.values()), "an empty priority group is kept"
