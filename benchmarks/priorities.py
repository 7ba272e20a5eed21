"""Retention priorities: a system prompt kept at priority 90 against a flood of one-off prompts.

    python benchmarks/priorities.py [--rounds 10] [--flood 12] [--block 64]

A 2,000-token system prompt (+ a 64-token question, 16 new tokens) is sent once per round,
each time after `--flood` one-off 512-token prompts; the KV pool holds the system prompt plus
a third of one round's flood. With `kv_cache_retention_config` giving the system prompt's
tokens priority 90, the flood (priority 35) evicts its own blocks first; without it, LRU evicts
the system prompt every round. Prints the system prompt's hit rate (reused tokens / system
prompt tokens, rounds 2..N) and its mean TTFT, with and without the priority; greedy outputs
are checked equal between the two runs.
"""

from __future__ import annotations

import argparse
import statistics

from common import pipeline, random_ids, setup_threads, table, timed_request

SYSTEM_TOKENS, QUESTION_TOKENS, FLOOD_TOKENS = 2000, 64, 512


def run(priority: bool, rounds: int, flood: int, block: int) -> tuple[float, float, list, dict]:
    system = random_ids(SYSTEM_TOKENS, seed=1)
    per_system = -(-(SYSTEM_TOKENS + QUESTION_TOKENS + 16) // block)
    per_flood = -(-(FLOOD_TOKENS + 1) // block)
    pool_tokens = (per_system + flood // 3 * per_flood) * block
    retention = {"token_range_retention_configs": [
        {"token_start": 0, "token_end": SYSTEM_TOKENS, "priority": 90}]} if priority else None
    ttfts, reused, outputs = [], [], []
    with pipeline(reuse_cache=True, seq_size_per_block=block, kv_cache_max_tokens=pool_tokens) as pipe:
        for r in range(rounds):
            for i in range(flood):
                timed_request(pipe, random_ids(FLOOD_TOKENS, seed=10_000 + r * flood + i), 1)
            ttft, _, res = timed_request(pipe, system + random_ids(QUESTION_TOKENS, seed=500 + r), 16,
                                         kv_cache_retention_config=retention)
            ttfts.append(ttft)
            reused.append(res.aux_info["reuse_len"])
            outputs.append(res.output_ids)
        stats = pipe.cache_stats()
    hit_rate = sum(reused[1:]) / (SYSTEM_TOKENS * (rounds - 1))
    return hit_rate, statistics.mean(ttfts[1:]), outputs, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--flood", type=int, default=12, help="one-off prompts before each system prompt")
    parser.add_argument("--block", type=int, default=64)
    args = parser.parse_args()
    setup_threads()
    results = {p: run(p, args.rounds, args.flood, args.block) for p in (True, False)}
    assert results[True][2] == results[False][2], "priorities changed greedy outputs"
    print(f"System prompt of {SYSTEM_TOKENS} tokens vs {args.flood} x {FLOOD_TOKENS}-token one-off "
          f"prompts per round, {args.rounds} rounds, SEQ_SIZE_PER_BLOCK={args.block}, pool = system "
          "prompt + a third of a round's flood")
    rows = []
    for p in (True, False):
        hit_rate, ttft, _, stats = results[p]
        rows.append(("priority 90" if p else "default (35)", f"{hit_rate * 100:.1f}%", ttft,
                     stats["evictions"], stats["evictions_by_priority"]))
    print(table(["system prompt", "hit rate", "mean TTFT (s)", "evictions", "evictions by priority"], rows))
    print(f"TTFT ratio default / priority 90: {results[False][1] / results[True][1]:.1f}x")


if __name__ == "__main__":
    main()
