"""The tier interface: what the cache manager asks of every store below the device pool.

The manager holds an ordered list of tiers (host memory, disk, remote) and calls them only
through `KVTier`. A tier stores a block's K/V payload (a CPU tensor of `TierLayout.shape`)
together with its `BlockMeta`; on a load it checks that the stored block is exactly the one
asked for (key, tokens, parent key and extra bytes), so a hash collision or a stale entry costs a
miss, never a wrong answer — the same rule as a hit in the device index.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

if TYPE_CHECKING:
    from rtpkv.cache.events import KVEventBuffer

DEFAULT_PRIORITY = 35


@dataclass(frozen=True)
class BlockMeta:
    """What identifies a block's content everywhere: verified on every load."""

    key: bytes                  # chained SHA-256 key (model fingerprint, block size, salt inside)
    parent_key: bytes           # key of the previous block (the root key for the first block)
    tokens: tuple[int, ...]     # the block's B token ids
    extra: bytes = b""          # extra key material (cache salt, first block only)
    priority: int = DEFAULT_PRIORITY  # retention priority 0..100 at the time it was stored

    def same_block(self, other: "BlockMeta") -> bool:
        """Whether `other` describes the same content (the priority is not part of it)."""
        return (self.key == other.key and self.parent_key == other.parent_key
                and self.tokens == other.tokens and self.extra == other.extra)


@dataclass(frozen=True)
class TierLayout:
    """What a payload is: every tier of one engine shares it; a record says it in its header."""

    fingerprint: str            # model fingerprint (hex)
    block_size: int
    dtype: torch.dtype
    shape: tuple[int, ...]      # payload shape: (2, num_layers, kv_heads, block_size, head_dim)

    @property
    def nbytes(self) -> int:
        """Bytes of one block's payload."""
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * torch.empty((), dtype=self.dtype).element_size()

    def check_payload(self, payload: torch.Tensor) -> None:
        """Refuse a payload of another shape or dtype (a caller bug, not a cache miss)."""
        if tuple(payload.shape) != self.shape or payload.dtype != self.dtype:
            raise ValueError(f"payload of shape {tuple(payload.shape)} and dtype {payload.dtype}"
                             f" does not match the tier layout {self.shape} {self.dtype}")


class KVTier(ABC):
    """A bounded store of KV blocks below the device pool.

    Every method is called from the engine thread; an implementation that works in the
    background (a writer thread, a connection pool) synchronises internally.
    """

    name: str  # "memory" | "disk" | "remote": aux_info reports <name>_reuse_len
    # True: the manager also stores each block here as soon as it is committed (filled), not only
    # when it is evicted, so the block survives a restart (rtp-llm's write-through disk cache).
    write_through: bool = False
    # The engine's KV event buffer: a tier that can list what it holds reports the blocks it
    # takes in and lets go (`stored`/`removed` with tier=name), so a router sees tier moves.
    events: Optional["KVEventBuffer"] = None

    @abstractmethod
    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many of `keys` (a chain, from its start) this tier holds, contiguous.

        Cheap: no payload is read (one round trip for the whole chain on a remote tier)."""

    @abstractmethod
    def load(self, meta: BlockMeta) -> Optional[torch.Tensor]:
        """The block's payload (`TierLayout.shape`, `TierLayout.dtype`, on CPU), or None on a
        miss. A stored block whose tokens, parent key or extra bytes differ from `meta`'s is a
        miss; corrupt data is a miss too (warned about, dropped and counted)."""

    @abstractmethod
    def store(self, meta: BlockMeta, payload: torch.Tensor) -> None:
        """Keep a copy of `payload` (the caller reuses its memory right after this returns).

        The tier is bounded: it makes room by evicting its lowest priority, least recently used
        blocks, and may hand what it evicts to the next tier."""

    @abstractmethod
    def drop(self, key: bytes) -> None:
        """Forget the block stored under `key` (nothing happens when there is none)."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters, each name prefixed with the tier's name (``memory_blocks_used``, ...)."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Assert the tier's accounting invariant (raises AssertionError when broken)."""

    def close(self) -> None:
        """Flush writers and release resources; the tier is not used afterwards."""
