"""Workload d's figures from each token's arrival: shared by peers.py and the peer workers
(peers_vllm.py, peers_llamacpp.py), which run in other interpreters and import nothing else."""

from __future__ import annotations

import statistics


def token_timing(times: list[float]) -> dict[str, float]:
    """TTFT, decode tok/s and inter-token p50/p99 (ms) from each token's arrival, seconds after
    submission."""
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    return {"ttft": times[0], "decode_tok_s": len(gaps) / (times[-1] - times[0]),
            "itl_p50": 1000 * statistics.median(gaps),
            "itl_p99": 1000 * gaps[min(len(gaps) - 1, round(0.99 * (len(gaps) - 1)))]}
