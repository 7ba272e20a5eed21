"""Prometheus metrics of one server: requests by outcome, latencies, token counts, and the KV
cache read from `cache_stats()` at scrape time, under rtpkv's names and (for the load-aware
routers that read vLLM's) vLLM's. Each app has its own registry."""

from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

MAX_TENANT_LABELS = 20   # tenants labelled by name (digest) on /metrics; the rest are "other"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0)


class _CacheCollector(Collector):
    """KV blocks by state, hit rate and scheduler queues, straight from the engine."""

    def __init__(self, stats: Callable[[], dict[str, Any]], in_flight: Callable[[], int]):
        self._stats, self._in_flight = stats, in_flight

    def collect(self) -> Iterator[Any]:
        stats = self._stats()
        blocks = GaugeMetricFamily("rtpkv_kv_blocks", "KV cache blocks by state", labels=["state"])
        for state in ("free", "cached", "in_use", "pinned"):
            blocks.add_metric([state], stats[f"blocks_{state}"])
        yield blocks
        yield GaugeMetricFamily("rtpkv_kv_blocks_total", "KV cache blocks in the pool",
                                value=stats["blocks_total"])
        yield GaugeMetricFamily("rtpkv_cache_hit_rate",
                                "prompt tokens found in the cache / prompt tokens looked up",
                                value=stats["hit_rate"])
        yield CounterMetricFamily("rtpkv_cache_query_tokens", "prompt tokens looked up",
                                  value=stats["queries"])
        yield CounterMetricFamily("rtpkv_cache_hit_tokens", "prompt tokens found in the cache",
                                  value=stats["hits"])
        yield CounterMetricFamily("rtpkv_cache_evictions", "blocks evicted",
                                  value=stats["evictions"])
        stops = CounterMetricFamily("rtpkv_cache_reuse_stops",
                                    "requests by why their reuse stopped where it did",
                                    labels=["reason"])
        for reason, count in stats["reuse_stops"].items():
            stops.add_metric([reason], count)
        yield stops
        yield CounterMetricFamily("rtpkv_cache_ghost_hit_tokens",
                                  "prompt tokens that missed only because their block had been "
                                  "evicted (a bigger pool or a host tier would have served them)",
                                  value=stats["ghost_hit_tokens"])
        yield GaugeMetricFamily("rtpkv_cache_hit_rate_with_ghosts",
                                "(hit + ghost-hit tokens) / prompt tokens looked up: about the "
                                "hit rate of a pool larger by the ghost list's capacity",
                                value=stats["hit_rate_with_ghosts"])
        yield CounterMetricFamily("rtpkv_cache_quota_evictions",
                                  "blocks evicted first because their tenant was past its quota",
                                  value=stats["quota_evictions"])
        yield GaugeMetricFamily("rtpkv_cache_tenants_over_quota",
                                "tenants (cache_salt) holding more cached blocks than their quota",
                                value=stats["tenants_over_quota"])
        yield from _tenant_metrics(stats["tenants"])
        yield from _residency_metrics(stats["residency"])
        if "state_group" in stats:
            yield from _state_metrics(stats["state_group"])
        yield GaugeMetricFamily("rtpkv_requests_running", "requests in the running batch",
                                value=stats["requests_running"])
        yield GaugeMetricFamily("rtpkv_requests_waiting", "requests waiting for admission",
                                value=stats["requests_waiting"])
        yield GaugeMetricFamily("rtpkv_requests_in_flight", "engine requests the server holds",
                                value=self._in_flight())


def _state_metrics(group: dict[str, Any]) -> Iterator[Any]:
    """A linear-attention hybrid's recurrent states (rtpkv/cache/state_group.py): saved ones by
    state, live slots free, evictions, the size of one."""
    saved = GaugeMetricFamily("rtpkv_recurrent_states", "saved recurrent states by state",
                              labels=["state"])
    for state in ("cached", "in_use", "pinned"):
        saved.add_metric([state], group[f"checkpoints_{state}"])
    yield saved
    yield GaugeMetricFamily("rtpkv_recurrent_states_total", "saved recurrent states the pool "
                            "holds at most", value=group["checkpoints"])
    yield GaugeMetricFamily("rtpkv_recurrent_live_slots_free", "live recurrent state slots "
                            "free (one per running request)", value=group["live_slots_free"])
    yield CounterMetricFamily("rtpkv_recurrent_state_evictions", "saved recurrent states evicted",
                              value=group["evictions"])
    yield GaugeMetricFamily("rtpkv_recurrent_state_bytes", "bytes of one request's recurrent "
                            "state (every recurrent layer)", value=group["bytes_per_state"])


RESIDENCY_HELP = {
    "lifetime": "seconds from a block's store to its eviction, per tier",
    "idle_before_eviction": "seconds a block sat unused before its eviction, per tier",
    "reuse_gap": "seconds between a block's release (or last use) and its next hit, per tier",
}


def _residency_metrics(residency: dict[str, dict[str, Any]]) -> Iterator[Any]:
    """rtpkv_kv_block_<kind>_seconds{tier}: cache_stats()["residency"] as histograms."""
    for kind, doc in RESIDENCY_HELP.items():
        family = HistogramMetricFamily(f"rtpkv_kv_block_{kind}_seconds", doc, labels=["tier"])
        for tier, kinds in residency.items():
            entry, total, buckets = kinds[kind], 0, []
            for le, count in zip(entry["le_s"] + [float("inf")], entry["counts"]):
                total += count
                buckets.append(("+Inf" if le == float("inf") else repr(le), total))
            family.add_metric([tier], buckets, sum_value=entry["sum_s"])
        yield family


def _tenant_metrics(tenants: dict[str, dict[str, Any]]) -> Iterator[Any]:
    """Cached blocks and quota per tenant (labelled by the digest of its salt): the
    MAX_TENANT_LABELS tenants holding the most blocks by name, the rest summed as "other", so
    the label set stays bounded however many salts clients send."""
    ranked = sorted(tenants.items(), key=lambda item: (-item[1]["blocks"], item[0]))
    shown, rest = ranked[:MAX_TENANT_LABELS], ranked[MAX_TENANT_LABELS:]
    blocks = GaugeMetricFamily("rtpkv_cache_tenant_blocks",
                               "cached blocks per tenant (cache_salt, as a digest)",
                               labels=["tenant"])
    quota = GaugeMetricFamily("rtpkv_cache_tenant_quota_blocks", "each tenant's quota",
                              labels=["tenant"])
    for label, entry in shown:
        blocks.add_metric([label], entry["blocks"])
        if entry["quota"] is not None:
            quota.add_metric([label], entry["quota"])
    if rest:
        blocks.add_metric(["other"], sum(entry["blocks"] for _, entry in rest))
    yield blocks
    yield quota


class _VllmCollector(Collector):
    """The same engine state under vLLM's metric names, which the load-aware policies of
    llm-d's scheduler and vllm-router read: requests running and waiting, KV cache usage (the
    fraction of the pool held by requests; cached blocks nobody holds are reusable, as in
    vLLM) and the prefix cache's query and hit counters, in tokens. Labelled as vLLM labels
    them (model_name, engine)."""

    def __init__(self, stats: Callable[[], dict[str, Any]], model_name: str):
        self._stats, self._labels = stats, [model_name, "0"]

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=["model_name", "engine"])
        family.add_metric(self._labels, value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=["model_name", "engine"])
        family.add_metric(self._labels, value)
        return family

    def collect(self) -> Iterator[Any]:
        stats = self._stats()
        yield self._gauge("vllm:num_requests_running", "requests in the running batch",
                          stats["requests_running"])
        yield self._gauge("vllm:num_requests_waiting", "requests waiting for admission",
                          stats["requests_waiting"])
        yield self._gauge("vllm:kv_cache_usage_perc",
                          "KV cache usage: 1 means 100 percent (blocks held by requests)",
                          stats["blocks_in_use"] / stats["blocks_total"])
        yield self._counter("vllm:prefix_cache_queries", "prompt tokens looked up in the prefix "
                            "cache", stats["queries"])
        yield self._counter("vllm:prefix_cache_hits", "prompt tokens found in the prefix cache",
                            stats["hits"])


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict[str, Any]], in_flight: Callable[[], int],
                 model_name: str = ""):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("rtpkv_requests", "HTTP generation requests by route and outcome",
                                ["route", "outcome"], registry=r)
        self.ttft = Histogram("rtpkv_time_to_first_token_seconds",
                              "engine arrival to first generated token, per request",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("rtpkv_time_per_output_token_seconds",
                              "mean time per generated token after the first, per request",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("rtpkv_prompt_tokens", "prompt tokens (task prompt included)",
                                     registry=r)
        self.generation_tokens = Counter("rtpkv_generation_tokens", "generated tokens",
                                         registry=r)
        self.reused_tokens = Counter("rtpkv_reused_tokens", "prompt tokens served from the cache",
                                     registry=r)
        r.register(_CacheCollector(stats, in_flight))
        r.register(_VllmCollector(stats, model_name))

    def observe(self, aux: dict[str, Any]) -> None:
        """Record one finished engine request from its aux_info."""
        self.prompt_tokens.inc(aux.get("input_len", 0) + aux.get("prefix_len", 0))
        self.generation_tokens.inc(aux.get("output_len", 0))
        self.reused_tokens.inc(aux.get("reuse_len", 0))
        first = aux.get("first_token_cost_time")
        if first is not None:
            self.ttft.observe(first / 1000.0)
            n = aux.get("output_len", 0)
            if n > 1:
                self.tpot.observe((aux["cost_time"] - first) / 1000.0 / (n - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
