"""GhostList: the keys of recently evicted blocks, without their K/V.

A request whose reuse stops at a block whose key is here missed only because that block was
evicted: `aux_info["reuse_stop"] == "evicted"`, and the prompt tokens such blocks would have
served add up in `cache_stats()["ghost_hit_tokens"]`, the number that says a bigger pool (or a
host tier) would have served them. With as many ghosts as the pool has blocks, hits plus ghost
hits predict the hit rate of a pool twice the size (ARC's ghost lists, used as a gauge only).
Keys are chained and salted, so a ghost only ever matches the chain of its own tenant. Bounded:
the oldest ghost is forgotten first; a key that is cached again leaves.

GhostTails does the same for the partly filled last block a request leaves when partial reuse
is off (ENABLE_PARTIAL_REUSE keeps such a block to copy from; without it the block goes free):
its token ids, by the chain key it follows, so that a follow-up whose next tokens it held is
told `reuse_stop == "partial_block"` with the tokens partial reuse would take, not "not_cached".
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import Sequence


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


TAILS_PER_PARENT = 4   # the most recent continuations kept after one chain position
MAX_TAIL_PARENTS = 16384   # chain positions remembered at most (about 16 MB at 64-token blocks)


class GhostTails:
    """(parent key, extra bytes) -> the lineage (`parent_serial`) and token ids of the tails
    left after it, newest first; the oldest parent is forgotten first past `capacity` (at most
    MAX_TAIL_PARENTS)."""

    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError("the ghost tails' capacity must be >= 0")
        self.capacity = min(capacity, MAX_TAIL_PARENTS)
        self._tails: OrderedDict[tuple[bytes, bytes], list[tuple[int, array]]] = OrderedDict()

    def add(self, parent_key: bytes, extra: bytes, parent_serial: int,
            tokens: Sequence[int]) -> None:
        if not self.capacity or not tokens:
            return
        pair = (parent_key, extra)
        tails = [(parent_serial, array("i", tokens))] + self._tails.pop(pair, [])
        self._tails[pair] = tails[:TAILS_PER_PARENT]
        while len(self._tails) > self.capacity:
            self._tails.popitem(last=False)

    def longest(self, parent_key: bytes, extra: bytes, parent_serial: int,
                want: Sequence[int]) -> int:
        """How many of `want`'s first tokens the best remembered tail of that lineage held."""
        best = 0
        for serial, tokens in self._tails.get((parent_key, extra), ()):
            if serial == parent_serial:
                k = 0
                for a, b in zip(tokens, want):
                    if a != b:
                        break
                    k += 1
                best = max(best, k)
        return best

    def __len__(self) -> int:
        return len(self._tails)
