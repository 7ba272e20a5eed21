"""What the cache needs of a request, and the handles it gives back.

The engine's `Request` is a `CacheSequence`: the manager writes its block tables, keys, key
chains and tier plan and reads the rest. A model with KV cache groups (groups.py) keeps group
0's table on the request itself and every other group's in a `GroupTable`, which the manager
reaches through a `GroupView`, so every per-table rule is written once. A pinned task prompt
is an opaque `PinnedPrefix`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Protocol

if TYPE_CHECKING:
    from rtpkv.cache.prefix_index import KeyChain
    from rtpkv.cache.retention import KvCacheRetentionConfig
    from rtpkv.cache.tiers.ladder import TierPlan

RELEASED = -1  # a block table entry whose block fell out of the attention window


class CacheSequence(Protocol):
    """What the manager needs of a request. It writes `block_table`, `block_keys`, `key_chain`
    and `tier_plan`; the rest it reads."""

    token_ids: list[int]
    block_table: list[int]
    block_keys: list[bytes]      # keys of the table's full blocks, in order
    key_chain: Optional["KeyChain"]
    tier_plan: Optional["TierPlan"]
    salt: bytes
    num_computed: int
    prefill_only: bool
    prewarm: bool                # with prefill_only: nothing is pinned
    prefix_handle: Optional["PinnedPrefix"]
    group_tables: list["GroupTable"]   # the tables of KV cache groups 1.. (see groups.py)
    # a recurrent model's (state_group.py): its live state slot, and the checkpoints planned
    # and not committed yet, as (block index, checkpoint block)
    state_slot: Optional[int]
    state_pending: list[tuple[int, int]]

    @property
    def num_prompt(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def wants_reuse(self) -> bool: ...

    @property
    def retention(self) -> Optional["KvCacheRetentionConfig"]: ...

    def allows_tier(self, name: str) -> bool: ...


@dataclass
class GroupTable:
    """A request's block table, keys, key chain and tier plan in one KV cache group other than
    group 0."""

    block_table: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)
    key_chain: Optional["KeyChain"] = None
    tier_plan: Optional["TierPlan"] = None


_GROUP_FIELDS = frozenset(("block_table", "block_keys", "key_chain", "tier_plan"))


class GroupView:
    """A request as one KV cache group sees it: the group's table, keys, chain and tier plan,
    the request's everything else (read and written through)."""

    __slots__ = ("_seq", "_table")

    def __init__(self, seq: CacheSequence, table: GroupTable):
        object.__setattr__(self, "_seq", seq)
        object.__setattr__(self, "_table", table)

    def __getattr__(self, name: str):
        return getattr(self._table if name in _GROUP_FIELDS else self._seq, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._table if name in _GROUP_FIELDS else self._seq, name, value)


@dataclass(frozen=True)
class PinnedPrefix:
    """An opaque handle on a pinned prompt prefix (a task prompt's full blocks), in every KV
    cache group: `block_ids` group 0's, `group_block_ids` the other groups', `state_block` a
    recurrent model's checkpoint at its end (state_group.py)."""

    block_ids: tuple[int, ...]
    num_tokens: int
    group_block_ids: tuple[tuple[int, ...], ...] = ()
    state_block: Optional[int] = None
