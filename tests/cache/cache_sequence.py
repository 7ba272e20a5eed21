"""Seq: the CacheSequence a Request provides to the cache manager, with nothing else (the cache
tests drive the manager without a model or an engine)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rtpkv.cache import KvCacheRetentionConfig
from rtpkv.cache.sequence import PinnedPrefix
from rtpkv.cache.prefix_index import KeyChain
from rtpkv.cache.tiers.ladder import TierPlan


@dataclass(eq=False)
class Seq:
    token_ids: list[int]
    num_prompt_tokens: int = 0          # 0: every token is a prompt token
    retention: Optional[KvCacheRetentionConfig] = None
    wants_reuse: bool = True
    prefill_only: bool = False
    prewarm: bool = False
    prefix_handle: Optional[PinnedPrefix] = None
    salt: bytes = b""
    block_table: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)
    key_chain: Optional[KeyChain] = None
    group_tables: list = field(default_factory=list)
    tier_plan: Optional[TierPlan] = None
    num_computed: int = 0

    @property
    def num_prompt(self) -> int:
        return self.num_prompt_tokens or len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def allows_tier(self, name: str) -> bool:
        return True
