"""EvictionOrder: which stored block a tier gives up first — the lowest retention priority, and
within a priority the least recently used (the device pool's rule, TensorRT-LLM's too)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator


class EvictionOrder:
    """Keys grouped by priority, each group in least recently used first order. Not thread-safe:
    the owning tier holds its lock around every call."""

    def __init__(self) -> None:
        self._groups: dict[int, OrderedDict[bytes, None]] = {}
        self._priority: dict[bytes, int] = {}

    def add(self, key: bytes, priority: int) -> None:
        """List `key` as the most recently used of `priority` (moving it if already listed)."""
        if key in self._priority:
            self.remove(key)
        self._groups.setdefault(priority, OrderedDict())[key] = None
        self._priority[key] = priority

    def remove(self, key: bytes) -> None:
        priority = self._priority.pop(key)
        group = self._groups[priority]
        del group[key]
        if not group:
            del self._groups[priority]

    def touch(self, key: bytes) -> None:
        self._groups[self._priority[key]].move_to_end(key)

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
        assert all(self._groups.values()), "an empty priority group is kept"
