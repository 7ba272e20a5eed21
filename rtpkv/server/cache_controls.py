"""Client APIs' prompt-cache words mapped onto rtpkv's retention priorities
(rtpkv.cache.retention): the one table of what each word means here.

OpenAI's `prompt_cache_retention` and Anthropic's `cache_control.ttl` both ask that a prefix
stay cached for a while. Here a word becomes a priority above the default (35: a marked prefix
outlives unmarked ones under pressure) held for the word's duration, after which the blocks
drop back to 35 and age like any other:

    word                               priority   for
    OpenAI "in_memory"                 60         10 minutes
    OpenAI "24h"                       80         24 hours
    Anthropic cache_control "5m"       60         5 minutes
    Anthropic cache_control "1h"       70         1 hour

A priority keeps blocks only while the pool has others to evict: it is a ranking, not a
reservation. Blocks of priority >= SECONDARY_OFFLOAD_MIN_PRIORITY go to the host and disk tiers
when evicted, where configured, so a "24h" prefix is found there after the device pool drops it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from rtpkv.cache.retention import KvCacheRetentionConfig, TokenRangeRetentionConfig


@dataclass(frozen=True)
class Hold:
    """A retention priority and how long it holds."""

    priority: int
    seconds: int


OPENAI_RETENTION = {"in_memory": Hold(60, 600), "24h": Hold(80, 24 * 3600)}
ANTHROPIC_TTL = {"5m": Hold(60, 300), "1h": Hold(70, 3600)}


def whole_prompt(hold: Hold) -> KvCacheRetentionConfig:
    """The whole prompt held at `hold` (generated tokens at the default)."""
    return prefixes([(None, hold)])


def prefixes(marks: Sequence[tuple[Optional[int], Hold]]) -> KvCacheRetentionConfig:
    """Retention of nested prefixes: `marks` are (end token, hold) in order of their end (None:
    the end of the prompt); the tokens before the first end take the first hold, those from it
    to the second end the second, and so on. Empty ranges (two marks at the same token) are
    left out."""
    ranges, start = [], 0
    for end, hold in marks:
        if end is not None and end <= start:
            continue
        ranges.append(TokenRangeRetentionConfig(start, end, hold.priority, hold.seconds * 1000))
        if end is None:
            break
        start = end
    return KvCacheRetentionConfig(token_range_retention_configs=ranges)
