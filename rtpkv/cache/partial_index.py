"""PartialIndex: the blocks that may serve a partial-block hit, by the key they chain from.

With partial reuse (`ENABLE_PARTIAL_REUSE`) a request whose cached chain ends at block i may
copy the first k tokens of a device block that was computed right after the same block i - 1:
an indexed full block, or the partly filled last block of a finished request (a "tail"). The
candidates are found by `(parent_key, extra)`: the parent key carries the whole chain (the salt
included, from the first block a request owns on), and `extra` is the salt on that first block
itself, so a candidate of another salt is never even listed. A candidate is only that: the
manager still checks its lineage (`parent_serial`) and compares its token ids.
"""

from __future__ import annotations

from typing import Iterator


class PartialIndex:
    def __init__(self) -> None:
        self._children: dict[tuple[bytes, bytes], dict[int, None]] = {}

    def add(self, parent_key: bytes, extra: bytes, block_id: int) -> None:
        self._children.setdefault((parent_key, extra), {})[block_id] = None

    def discard(self, parent_key: bytes, extra: bytes, block_id: int) -> None:
        ids = self._children.get((parent_key, extra))
        if ids is not None:
            ids.pop(block_id, None)
            if not ids:
                del self._children[(parent_key, extra)]

    def candidates(self, parent_key: bytes, extra: bytes) -> list[int]:
        return list(self._children.get((parent_key, extra), ()))

    def items(self) -> Iterator[tuple[tuple[bytes, bytes], int]]:
        for pair, ids in self._children.items():
            for block_id in ids:
                yield pair, block_id

    def __len__(self) -> int:
        return sum(len(ids) for ids in self._children.values())
