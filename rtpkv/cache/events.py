"""KV cache events (TensorRT-LLM's `get_kv_cache_events`): what a router needs to know which
prefixes a replica holds.

The manager records `stored` (a block became hittable), `removed` (it no longer is) and
`updated` (its retention priority changed) into a bounded buffer; `drain` hands them out. Each
event has a monotonically increasing `event_id`, so a consumer sees a gap when the buffer
overflowed (the oldest events are dropped first, and counted). A size of 0 turns the buffer off.

Listeners (`add_listener`, e.g. the ZeroMQ publisher of rtpkv.fleet) get every event as it is
made, buffered or not: events are on while the buffer or a listener wants them. A listener runs
on the thread that made the event (the engine's) and must only hand the event off.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from typing import Any, Callable, Optional, Sequence


class KVEventBuffer:
    def __init__(self, max_size: int):
        self.max_size = max_size
        self._events: deque[dict[str, Any]] = deque()
        self._ids = itertools.count(1)
        self._cond = threading.Condition()
        self.dropped = 0
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        # KV cache groups (rtpkv/cache/groups.py), where the model has several: each group's
        # vLLM fields, and the keys its first blocks chain from (a consumer's "no parent")
        self.groups: tuple[dict[str, Any], ...] = ()
        self.group_roots: frozenset[bytes] = frozenset()

    @property
    def enabled(self) -> bool:
        return self.max_size > 0 or bool(self._listeners)

    def add_listener(self, listener: Callable[[dict[str, Any]], None]) -> None:
        with self._cond:
            self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[dict[str, Any]], None]) -> None:
        with self._cond:
            self._listeners.remove(listener)

    def _put(self, event: dict[str, Any]) -> None:
        with self._cond:
            event["event_id"] = next(self._ids)
            for listener in self._listeners:
                listener(event)
            if self.max_size <= 0:
                return
            if len(self._events) >= self.max_size:
                self._events.popleft()
                self.dropped += 1
            self._events.append(event)
            self._cond.notify_all()

    def stored(self, keys: Sequence[bytes], parent_key: bytes, token_ids: Sequence[Sequence[int]],
               priority: int, tier: str = "device", extra: bytes = b"",
               group: Optional[int] = None) -> None:
        """`extra`: the first block's extra key material (its cache_salt), b"" for none;
        `group`: the blocks' KV cache group (its vLLM fields are added where there are several;
        None: not known where the event is made, as in a tier, which keeps no group)."""
        if self.enabled:
            self._put({"type": "stored", "block_hashes": [k.hex() for k in keys],
                       "parent_hash": parent_key.hex(), "token_ids": [list(t) for t in token_ids],
                       "priority": priority, "tier": tier, "extra": extra.hex(),
                       **(self.groups[group] if self.groups and group is not None else {}),
                       "timestamp": time.time()})

    def removed(self, keys: Sequence[bytes], tier: str = "device",
                group: Optional[int] = None) -> None:
        if self.enabled:
            self._put({"type": "removed", "block_hashes": [k.hex() for k in keys], "tier": tier,
                       **({"group_idx": group} if self.groups and group is not None else {}),
                       "timestamp": time.time()})

    def updated(self, key: bytes, old_priority: int, new_priority: int,
                tier: str = "device") -> None:
        if self.enabled:
            self._put({"type": "updated", "block_hash": key.hex(), "old_priority": old_priority,
                       "priority": new_priority, "tier": tier, "timestamp": time.time()})

    def drain(self, timeout: Optional[float] = None) -> list[dict[str, Any]]:
        """Every buffered event, oldest first; with a timeout, wait up to that long for one."""
        with self._cond:
            if not self._events and timeout:
                self._cond.wait_for(lambda: bool(self._events), timeout)
            events = list(self._events)
            self._events.clear()
            return events
