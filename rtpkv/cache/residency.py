"""Residency histograms (vLLM's --kv-cache-metrics): how long a tier keeps a block, how long it
sat unused before it was evicted, and the gap between its uses, so an operator can size a pool
from them. A tier records on events it already handles (stored, released or touched, hit,
evicted): a clock read and a bucket increment, nothing per engine step.

    lifetime               stored -> evicted
    idle_before_eviction   last released (device) or last used (a tier) -> evicted
    reuse_gap              released / last used -> the next hit
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

# seconds; the last bucket is +Inf
RESIDENCY_BUCKETS_S = (0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0,
                       24 * 3600.0)
RESIDENCY_KINDS = ("lifetime", "idle_before_eviction", "reuse_gap")


class ResidencyHistograms:
    """One tier's three histograms. Not thread-safe: the owner records under its own lock."""

    def __init__(self) -> None:
        self.counts = {kind: [0] * (len(RESIDENCY_BUCKETS_S) + 1) for kind in RESIDENCY_KINDS}
        self.sums = dict.fromkeys(RESIDENCY_KINDS, 0.0)

    def observe(self, kind: str, seconds: float) -> None:
        self.counts[kind][bisect_left(RESIDENCY_BUCKETS_S, seconds)] += 1
        self.sums[kind] += seconds

    def evicted(self, now: float, stored_at: float, used_at: float) -> None:
        self.observe("lifetime", now - stored_at)
        self.observe("idle_before_eviction", now - used_at)

    def stats(self) -> dict[str, Any]:
        """Per kind: the buckets' upper bounds (seconds), the count in each (the last is above
        every bound), the sum of the seconds and the count."""
        return {kind: {"le_s": list(RESIDENCY_BUCKETS_S), "counts": list(self.counts[kind]),
                       "sum_s": self.sums[kind], "count": sum(self.counts[kind])}
                for kind in RESIDENCY_KINDS}
