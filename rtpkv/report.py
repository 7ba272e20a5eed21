"""Human-readable tables of a response's aux_info and of cache_stats(), for the CLI: each field
under its own name, with its unit, and the reuse arithmetic spelled out."""

from __future__ import annotations

from typing import Any, Mapping

# field -> unit; a field not listed is shown as it is
AUX_UNITS = {
    "input_len": "tokens", "prefix_len": "tokens (task prompt)", "reuse_len": "tokens",
    "local_reuse_len": "tokens", "output_len": "tokens", "iter_count": "engine steps",
    "first_token_cost_time": "ms", "cost_time": "ms", "wait_time": "ms",
    "num_preemptions": "times",
}
STATS_UNITS = {
    "queries": "prompt tokens looked up", "hits": "prompt tokens reused", "hit_rate": "%",
    "block_size": "tokens per block", "evictions": "blocks", "requests_running": "requests",
    "requests_waiting": "requests",
}


def _value(value: Any, unit: str) -> str:
    if isinstance(value, float):
        return f"{value * 100:.1f}" if unit == "%" else f"{value:.1f}"
    return "-" if value is None else str(value)


def _table(rows: list[tuple[str, str, str]]) -> str:
    name_w = max(len(r[0]) for r in rows)
    value_w = max(len(r[1]) for r in rows)
    return "\n".join(f"  {n:<{name_w}}  {v:>{value_w}} {u}".rstrip() for n, v, u in rows)


def reuse_arithmetic(aux: Mapping[str, Any], block_size: int) -> str:
    """`reuse_len 8 = 2 blocks of 4 of 14 prompt tokens`."""
    prompt = aux.get("input_len", 0) + aux.get("prefix_len", 0)
    reused = aux.get("reuse_len", 0)
    return (f"reuse_len {reused} = {reused // block_size} blocks of {block_size} "
            f"of {prompt} prompt tokens")


def aux_table(aux: Mapping[str, Any], block_size: int) -> str:
    rows = []
    for key, value in aux.items():
        unit = AUX_UNITS.get(key, "")
        if key == "reuse_len":  # "8 tokens = 2 blocks of 4 of 14 prompt tokens"
            unit = "tokens =" + reuse_arithmetic(aux, block_size).split("=", 1)[1]
        rows.append((key, _value(value, unit), unit))
    return _table(rows)


def stats_table(stats: Mapping[str, Any]) -> str:
    rows = []
    for key, value in stats.items():
        unit = STATS_UNITS.get(key, "blocks" if key.startswith("blocks_") else "")
        rows.append((key, _value(value, unit), unit))
    return _table(rows)
