"""EvictionPolicy: which cached (unreferenced, still hittable) block gives way first.

The default is least recently used. Blocks of a finished sequence are handed in tail first, so
among equally old blocks a sequence's tail goes before its head and the shared prefix survives
longest. The retention-priority work replaces this ordering through the same interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict

from rtpkv.cache.block_pool import Block


class EvictionPolicy(ABC):
    @abstractmethod
    def add(self, block: Block) -> None:
        """`block` just became unreferenced while still registered: it may be evicted."""

    @abstractmethod
    def remove(self, block: Block) -> None:
        """`block` is referenced again (a hit) or was unregistered: it must not be evicted."""

    @abstractmethod
    def pop(self) -> int:
        """Choose, forget and return the id of the next block to evict."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, block_id: int) -> bool: ...


class LRUEvictionPolicy(EvictionPolicy):
    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def add(self, block: Block) -> None:
        self._order[block.block_id] = None

    def remove(self, block: Block) -> None:
        self._order.pop(block.block_id, None)

    def pop(self) -> int:
        block_id, _ = self._order.popitem(last=False)
        return block_id

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._order
