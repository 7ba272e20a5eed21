"""Retention priorities (TensorRT-LLM's KvCacheRetentionConfig): how long a request's blocks
should stay cached once it no longer uses them.

Priorities are integers 0..100, higher kept longer, 35 the default. A prompt block takes the
priority of the token range that contains its first token (positions count from the start of
the full prompt, task prompt included); a block of generated tokens takes the decode priority.
A duration starts when a block becomes unreferenced; when it runs out the block drops to 35.
"""

from __future__ import annotations

import datetime
from typing import Any, ClassVar, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rtpkv.cache.block import DEFAULT_PRIORITY


class TokenRangeRetentionConfig(BaseModel):
    """Priority (and optional duration) of the prompt tokens [token_start, token_end);
    token_end None reaches the end of the prompt."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    token_start: int = Field(ge=0)
    token_end: Optional[int] = None
    priority: int = Field(DEFAULT_PRIORITY, ge=0, le=100)
    duration_ms: Optional[int] = Field(None, gt=0)

    def __init__(self, token_start: int = 0, token_end: Optional[int] = None,
                 priority: int = DEFAULT_PRIORITY, duration_ms: Any = None, **extra: Any):
        """Positional like TensorRT-LLM's: TokenRangeRetentionConfig(0, 4, 100, None)."""
        super().__init__(token_start=token_start, token_end=token_end, priority=priority,
                         duration_ms=duration_ms, **extra)

    @field_validator("duration_ms", mode="before")
    @classmethod
    def _timedelta_ms(cls, value: Any) -> Any:
        return _as_ms(value)

    @model_validator(mode="after")
    def _positive_length(self) -> "TokenRangeRetentionConfig":
        if self.token_end is not None and self.token_end <= self.token_start:
            raise ValueError(f"token_end ({self.token_end}) must be greater than token_start "
                             f"({self.token_start})")
        return self


class KvCacheRetentionConfig(BaseModel):
    """A request's retention priorities, accepted as this object or the same plain dict."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    token_range_retention_configs: list[TokenRangeRetentionConfig] = Field(default_factory=list)
    decode_retention_priority: int = Field(DEFAULT_PRIORITY, ge=0, le=100)
    decode_duration_ms: Optional[int] = Field(None, gt=0)

    # TensorRT-LLM spells it nested: KvCacheRetentionConfig.TokenRangeRetentionConfig(0, 4, 100, None)
    TokenRangeRetentionConfig: ClassVar[type[TokenRangeRetentionConfig]] = TokenRangeRetentionConfig

    @field_validator("decode_duration_ms", mode="before")
    @classmethod
    def _timedelta_ms(cls, value: Any) -> Any:
        return _as_ms(value)

    @model_validator(mode="after")
    def _sorted_disjoint(self) -> "KvCacheRetentionConfig":
        ranges = self.token_range_retention_configs
        for i, (a, b) in enumerate(zip(ranges, ranges[1:])):
            if a.token_end is None:
                raise ValueError(f"token_range_retention_configs[{i}] is open-ended (token_end "
                                 "None) but is not the last range")
            if b.token_start < a.token_end:
                raise ValueError(f"token_range_retention_configs[{i + 1}] starts at "
                                 f"{b.token_start}, before the end of range {i} ({a.token_end}): "
                                 "ranges must be sorted and must not overlap")
        return self

    def block_retention(self, first_token: int, num_prompt: int) -> tuple[int, Optional[float]]:
        """(priority, duration in seconds) of the block whose first token is at `first_token`."""
        if first_token >= num_prompt:
            return self.decode_retention_priority, _seconds(self.decode_duration_ms)
        for r in self.token_range_retention_configs:
            if r.token_start <= first_token and (r.token_end is None or first_token < r.token_end):
                return r.priority, _seconds(r.duration_ms)
        return DEFAULT_PRIORITY, None


def _as_ms(value: Any) -> Any:
    """Durations may be given as a datetime.timedelta, as TensorRT-LLM's Python API takes them."""
    if isinstance(value, datetime.timedelta):
        return round(value.total_seconds() * 1000)
    return value


def _seconds(ms: Optional[int]) -> Optional[float]:
    return None if ms is None else ms / 1000.0
