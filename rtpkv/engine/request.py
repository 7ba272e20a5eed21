"""Request: one generation as the engine sees it — its tokens, blocks, progress and timings."""

from __future__ import annotations

import enum
import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

import torch

from rtpkv.cache.retention import KvCacheRetentionConfig
from rtpkv.cache.tiers.base import TIER_NAMES
from rtpkv.generate_config import GenerateConfig

if TYPE_CHECKING:
    from rtpkv.cache import KeyChain, PinnedPrefix
    from rtpkv.cache.sequence import GroupTable
    from rtpkv.cache.tiers.ladder import TierPlan

_ids = itertools.count(1)


class FinishReason(str, enum.Enum):
    EOS = "eos"
    LENGTH = "length"
    STOP = "stop"
    PREFILLED = "prefilled"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"
    ERROR = "error"


class OutputSink(Protocol):
    """Where the engine hands a request's outputs: a queue.Queue, or an asyncio bridge."""

    def put(self, item: "StepOutput") -> None: ...


@dataclass
class StepOutput:
    """What one engine step hands a request's consumer."""

    new_token_ids: list[int]
    finished: bool = False
    logits: Optional[torch.Tensor] = None    # (len(new_token_ids), vocab) with return_logits
    error: Optional[BaseException] = None


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    config: GenerateConfig
    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    prefill_only: bool = False              # a task prompt: prefill, pin, finish
    prewarm: bool = False                   # with prefill_only: prefill, finish (nothing pinned)
    prefix_handle: Optional["PinnedPrefix"] = None   # the task prompt this request starts from
    stop_text: Optional[Callable[[list[int]], bool]] = None  # stop_words_str check on output
    request_id: int = field(default_factory=lambda: next(_ids))
    # cache state (see manager.CacheSequence); the manager writes the table, keys and plan
    token_ids: list[int] = field(init=False)
    block_table: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)
    key_chain: Optional["KeyChain"] = None
    group_tables: list["GroupTable"] = field(default_factory=list)   # KV cache groups 1..
    tier_plan: Optional["TierPlan"] = None
    salt: bytes = b""
    num_computed: int = 0
    state_slot: Optional[int] = None          # a recurrent model's live state (StatePool)
    state_pending: list[tuple[int, int]] = field(default_factory=list)   # its checkpoints
    pinned: Optional["PinnedPrefix"] = None   # what a prefill_only request pinned
    # reporting: tokens reused from the device pool and from each tier, at first admission
    local_reuse_len: Optional[int] = None
    partial_reuse_len: int = 0               # of local_reuse_len: copied from a partial block
    reuse_stop: Optional[str] = None         # why reuse stopped there (diagnostics.REUSE_STOPS)
    reuse_stop_tokens: int = 0
    reuse_by_tier: dict[str, int] = field(default_factory=dict)
    iter_count: int = 0
    num_preemptions: int = 0
    arrival: float = field(default_factory=time.monotonic)
    admitted_at: Optional[float] = None
    first_token_at: Optional[float] = None
    finished_at: Optional[float] = None
    finish_reason: Optional[FinishReason] = None
    error: Optional[BaseException] = None
    # hand-off to the consumer
    outputs: OutputSink = field(default_factory=queue.Queue)
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False
    generator: Optional[torch.Generator] = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_ids)
        self.salt = (self.config.cache_salt or "").encode()
        if self.config.random_seed is not None:
            self.generator = torch.Generator().manual_seed(self.config.random_seed)

    @property
    def wants_reuse(self) -> bool:
        """The request's own reuse switch; the cache manager decides whether reuse applies."""
        return self.config.reuse_cache

    @property
    def retention(self) -> Optional[KvCacheRetentionConfig]:
        return self.config.kv_cache_retention_config

    def allows_tier(self, name: str) -> bool:
        """rtp-llm's per-request switches: enable_memory_cache, enable_disk_cache,
        enable_remote_cache (a user connector has no switch: always allowed)."""
        return getattr(self.config, f"enable_{name}_cache", True)

    @property
    def is_decoding(self) -> bool:
        """The prompt is computed: each step computes the one token sampled last."""
        return self.num_tokens - self.num_computed == 1 and self.num_output > 0

    @property
    def min_new_tokens_reached(self) -> bool:
        """min_new_tokens are out: EOS is no longer banned and a stop may end the output."""
        return self.num_output >= self.config.min_new_tokens

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids):]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def deadline(self) -> Optional[float]:
        ms = self.config.timeout_ms
        return None if ms is None else self.arrival + ms / 1000.0

    def aux_info(self) -> dict[str, Any]:
        now = time.monotonic()
        end = self.finished_at or now
        first = self.first_token_at
        admitted = self.admitted_at
        tiers = {f"{name}_reuse_len": self.reuse_by_tier.get(name, 0) for name in TIER_NAMES}
        local = self.local_reuse_len or 0
        return {
            "reuse_len": local + sum(tiers.values()),
            "local_reuse_len": local,
            "partial_reuse_len": self.partial_reuse_len,
            "reuse_stop": self.reuse_stop,
            "reuse_stop_tokens": self.reuse_stop_tokens,
            **tiers,
            "output_len": self.num_output,
            "iter_count": self.iter_count,
            "cost_time": (end - self.arrival) * 1000.0,
            "first_token_cost_time": ((first - self.arrival) * 1000.0) if first else None,
            "wait_time": ((admitted if admitted else now) - self.arrival) * 1000.0,
            "num_preemptions": self.num_preemptions,
            "finish_reason": self.finish_reason.value if self.finish_reason else None,
        }
