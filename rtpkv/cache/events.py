"""KV cache events (TensorRT-LLM's `get_kv_cache_events`): what a router needs to know which
prefixes a replica holds.

The manager records `stored` (a block became hittable), `removed` (it no longer is) and
`updated` (its retention priority changed) into a bounded buffer; `drain` hands them out. Each
event has a monotonically increasing `event_id`, so a consumer sees a gap when the buffer
overflowed (the oldest events are dropped first, and counted). A size of 0 turns events off.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from typing import Any, Optional, Sequence


class KVEventBuffer:
    def __init__(self, max_size: int):
        self.max_size = max_size
        self._events: deque[dict[str, Any]] = deque()
        self._ids = itertools.count(1)
        self._cond = threading.Condition()
        self.dropped = 0

    @property
    def enabled(self) -> bool:
        return self.max_size > 0

    def _put(self, event: dict[str, Any]) -> None:
        with self._cond:
            event["event_id"] = next(self._ids)
            if len(self._events) >= self.max_size:
                self._events.popleft()
                self.dropped += 1
            self._events.append(event)
            self._cond.notify_all()

    def stored(self, keys: Sequence[bytes], parent_key: bytes, token_ids: Sequence[Sequence[int]],
               priority: int, tier: str = "device") -> None:
        if self.enabled:
            self._put({"type": "stored", "block_hashes": [k.hex() for k in keys],
                       "parent_hash": parent_key.hex(), "token_ids": [list(t) for t in token_ids],
                       "priority": priority, "tier": tier, "timestamp": time.time()})

    def removed(self, keys: Sequence[bytes], tier: str = "device") -> None:
        if self.enabled:
            self._put({"type": "removed", "block_hashes": [k.hex() for k in keys], "tier": tier,
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
