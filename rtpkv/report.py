"""Human-readable tables of a response's aux_info and of cache_stats(), for the CLI: each field
under its own name, with its unit, and the reuse arithmetic spelled out."""

from __future__ import annotations

from typing import Any, Mapping

# field -> unit; a field not listed is shown as it is, a *_len field in tokens
AUX_UNITS = {
    "prefix_len": "tokens (task prompt)", "iter_count": "engine steps",
    "first_token_cost_time": "ms", "cost_time": "ms", "wait_time": "ms",
    "num_preemptions": "times", "reuse_stop_tokens": "tokens",
}
STATS_UNITS = {
    "queries": "prompt tokens looked up", "hits": "prompt tokens reused", "hit_rate": "%",
    "block_size": "tokens per block", "evictions": "blocks", "requests_running": "requests",
    "requests_waiting": "requests", "events_dropped": "events",
    "attention_window": "tokens per query", "hit_rate_with_ghosts": "%",
    "ghost_hit_tokens": "prompt tokens", "partial_hit_tokens": "prompt tokens",
    "quota_evictions": "blocks",
}


def _value(value: Any, unit: str) -> str:
    if isinstance(value, dict):  # e.g. blocks per retention priority
        return ", ".join(f"{k}: {v}" for k, v in sorted(value.items())) or "-"
    if isinstance(value, float):
        return f"{value * 100:.1f}" if unit == "%" else f"{value:.1f}"
    return "-" if value is None else str(value)


def _table(rows: list[tuple[str, str, str]]) -> str:
    name_w = max(len(r[0]) for r in rows)
    value_w = max(len(r[1]) for r in rows)
    return "\n".join(f"  {n:<{name_w}}  {v:>{value_w}} {u}".rstrip() for n, v, u in rows)


def reuse_arithmetic(aux: Mapping[str, Any], block_size: int) -> str:
    """`reuse_len 8 = 2 blocks of 4 of 14 prompt tokens` (`+ 3 tokens of a partial block`
    with partial reuse)."""
    prompt = aux.get("input_len", 0) + aux.get("prefix_len", 0)
    reused = aux.get("reuse_len", 0)
    partial = aux.get("partial_reuse_len", 0)
    shown = f" + {partial} tokens of a partial block" if partial else ""
    return (f"reuse_len {reused} = {(reused - partial) // block_size} blocks of {block_size}"
            f"{shown} of {prompt} prompt tokens")


def aux_table(aux: Mapping[str, Any], block_size: int) -> str:
    rows = []
    for key, value in aux.items():
        unit = AUX_UNITS.get(key, "tokens" if key.endswith("_len") else "")
        if key == "reuse_len":  # "8 tokens = 2 blocks of 4 of 14 prompt tokens"
            unit = "tokens =" + reuse_arithmetic(aux, block_size).split("=", 1)[1]
        rows.append((key, _value(value, unit), unit))
    return _table(rows)


def stats_table(stats: Mapping[str, Any]) -> str:
    rows = []
    for key, value in stats.items():
        if key == "residency":   # histograms: each tier's and kind's count and mean
            for tier, kinds in value.items():
                for kind, h in kinds.items():
                    mean = f"{h['sum_s'] / h['count']:.1f}" if h["count"] else "-"
                    rows.append((f"residency {tier} {kind}", mean,
                                 f"s mean of {h['count']} blocks"))
            continue
        unit = STATS_UNITS.get(key, "")
        if key.startswith(("blocks_", "evictions")):
            unit = "blocks (priority: count)" if isinstance(value, dict) else "blocks"
        rows.append((key, _value(value, unit), unit))
    return _table(rows)
