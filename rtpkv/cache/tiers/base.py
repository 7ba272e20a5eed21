"""The tier interface: what the tier ladder asks of every store below the device pool.

`TierLadder` (tiers/ladder.py) holds the ordered tiers (host memory, disk, remote, a user
connector) and is the only caller of `KVTier`. A tier stores a block's K/V payload (a CPU tensor of `TierLayout.shape`)
together with its `BlockMeta`; on a load it checks that the stored block is exactly the one
asked for (key, tokens, parent key and extra bytes), so a hash collision or a stale entry costs a
miss, never a wrong answer — the same rule as a hit in the device index.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from rtpkv.cache.block import DEFAULT_PRIORITY

if TYPE_CHECKING:
    from concurrent.futures import Future

    from rtpkv.cache.events import KVEventBuffer

TIER_NAMES = ("memory", "disk", "remote", "connector")  # below the device pool, in lookup order


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

    name: str  # one of TIER_NAMES: aux_info reports <name>_reuse_len
    # True: the ladder also stores each block here as soon as it is committed (filled), not only
    # when it is evicted, so the block survives a restart (rtp-llm's write-through disk cache).
    write_through: bool = False
    # True: `prefetch` fetches a chain off the engine thread when a request arrives (a network
    # tier); `lookup` and `load` then answer from what was fetched.
    fetches_in_background: bool = False
    # True: a tier above hands this tier the blocks it evicts (the disk, below host memory).
    takes_evictions: bool = False
    # Set by the ladder: a tier that evicts a block to make room calls it with the block, so the
    # ladder can hand it down (the payload is valid only during the call).
    on_evict: Optional[Callable[[BlockMeta, torch.Tensor], None]] = None
    # Set by the ladder, the engine's KV event buffer: a tier that can list what it holds reports the blocks it
    # takes in and lets go (`stored`/`removed` with tier=name), so a router sees tier moves.
    events: Optional["KVEventBuffer"] = None

    def announce(self) -> None:
        """Report through `events`, as stored and parents first, the blocks this tier holds
        now: at start a disk tier's records found there, later everything, for a consumer that
        subscribed after the blocks arrived. The default (a tier that cannot list what it
        holds) reports nothing."""

    def begin_walk(self) -> None:
        """A request's walk down the ladder begins (its lookups, one chain per KV cache group,
        then its loads): a tier that stages what its lookups matched lets go of what an
        earlier walk left. The default does nothing."""

    @abstractmethod
    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many of `keys` (a chain, from its start) this tier holds, contiguous.

        Cheap: no payload is read (one round trip for the whole chain on a remote tier)."""

    def prefetch(self, metas: Sequence[BlockMeta]) -> "Future[int]":
        """Start fetching a chain's blocks in the background (tiers with
        `fetches_in_background` only). The future gives how many blocks, from the start of the
        chain, are then held; it never raises (a failure is a miss)."""
        raise NotImplementedError(f"the {self.name} tier does not fetch in the background")

    def contains(self, key: bytes) -> bool:
        """Whether the tier holds `key`, where it can tell without a network call and without
        touching its order or counters (only to explain a miss: `reuse_stop`); a tier that
        cannot answers False."""
        return False

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

    def residency_stats(self) -> Optional[dict[str, Any]]:
        """The tier's residency histograms (rtpkv.cache.residency), or None where it cannot see
        its evictions (a remote store that expires keys itself)."""
        return None

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters, each name prefixed with the tier's name (``memory_blocks_used``, ...)."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Assert the tier's accounting invariant (raises AssertionError when broken)."""

    def close(self) -> None:
        """Flush writers and release resources; the tier is not used afterwards."""
