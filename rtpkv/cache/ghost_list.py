"""GhostList: the keys of recently evicted blocks, without their K/V.

A request whose reuse stops at a block whose key is here missed only because that block was
evicted: `aux_info["reuse_stop"] == "evicted"`, and the prompt tokens such blocks would have
served add up in `cache_stats()["ghost_hit_tokens"]`, the number that says a bigger pool (or a
host tier) would have served them. With as many ghosts as the pool has blocks, hits plus ghost
hits predict the hit rate of a pool twice the size (ARC's ghost lists, used as a gauge only).
Keys are chained and salted, so a ghost only ever matches the chain of its own tenant. Bounded:
the oldest ghost is forgotten first; a key that is cached again leaves.
"""

from __future__ import annotations

from collections import OrderedDict


class GhostList:
    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError("the ghost list's capacity must be >= 0")
        self.capacity = capacity
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def add(self, key: bytes) -> None:
        if not self.capacity:
            return
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def discard(self, key: bytes) -> None:
        self._keys.pop(key, None)

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)
