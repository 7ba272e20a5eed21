"""Block: the bookkeeping of one KV block, kept apart from the KV memory (BlockPool) so the
cache manager, the eviction policy and the scheduler can be tested without a model.

A block is in exactly one state: free (in the BlockPool's free list), cached (unreferenced but
indexed, or a kept tail, so still hittable; the eviction policy orders these) or in use
(ref_count > 0; a pinned task block holds a reference too). A tail is the partly filled last
block of a finished request, kept on the device only as a source of partial-block hits
(`ENABLE_PARTIAL_REUSE`): never indexed, never offloaded, never an event.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Protocol, TypeVar

from rtpkv.config import DEFAULT_PRIORITY


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    pin_count: int = 0
    key: Optional[bytes] = None     # chained key of the content, once the block is full
    indexed: bool = False           # registered in the PrefixIndex under `key`
    parent_key: bytes = b""         # key of the previous block of the chain (root for the first)
    serial: int = 0                 # identity of the content and its lineage; 0 while not full
    parent_serial: int = 0          # serial of the block this one was computed after
    tokens: tuple[int, ...] = ()    # the token ids whose K/V the block holds (full, or a tail)
    extra: bytes = b""              # extra key material (cache salt on a first block)
    priority: int = DEFAULT_PRIORITY
    duration_s: Optional[float] = None    # priority lapses this long after the last release
    held_until: Optional[float] = None    # when that is (the pool's clock), once released
    stored_at: float = 0.0          # when it was indexed, and last released (residency)
    released_at: float = 0.0
    tiers: frozenset[str] = field(default_factory=frozenset)  # tiers it may be offloaded to
    tail: bool = False              # a kept, partly filled last block (partial-reuse source)
    tenant: Optional[bytes] = None  # the cache_salt it was computed under (b"": none; None:
                                    # a task prompt's, nobody's)
    group: int = 0                  # the KV cache group whose layers it holds (groups.py)

    @property
    def full(self) -> bool:
        return self.serial != 0


class _Chained(Protocol):
    key: Optional[bytes]
    parent_key: bytes


Chained = TypeVar("Chained", bound=_Chained)


def parents_first(blocks: Iterable[Chained]) -> list[Chained]:
    """`blocks` ordered so that a block whose parent is among them comes after it: announced
    in this order, a consumer that chains each block to its parent (Dynamo's radix tree) never
    sees a child before its parent."""
    by_key = {b.key: b for b in blocks}
    ordered: list[Chained] = []
    placed: set[Optional[bytes]] = set()
    for key in by_key:
        path = []
        while key in by_key and key not in placed:
            placed.add(key)
            path.append(by_key[key])
            key = by_key[key].parent_key
        ordered.extend(reversed(path))
    return ordered
