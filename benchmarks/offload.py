"""Host-memory tier: the repeat of a long prompt after a flood evicted it from the device pool,
onboarded from host memory against recomputed; and the tier's cost when nothing is reused.

    python benchmarks/offload.py [--runs 3] [--block 64]

Workloads (the model of docs/BENCHMARKS.md):
  repeat  workload a's 2,000-token prefix + a 64-token question, then a flood of 4 other
          2,064-token prompts through a device pool of 4,096 tokens (it holds two such prompts,
          so the first one's blocks are evicted), then the first prompt again: its TTFT with a
          1 GiB host tier (the blocks come back from host memory) and without (recomputed).
  none    16 unrelated 512-token prompts, 16 new tokens, through a pool of 1,024 tokens: every
          admission evicts, so with the tier every eviction is a copy to host memory and every
          prompt a tier lookup that misses. Total time with and without the tier, and the time
          spent inside the tier's calls and the pool copies.
Every figure is the median of --runs runs, on and off interleaved, each on a fresh pipeline.
Greedy outputs with the tier are checked equal to those without.
"""

from __future__ import annotations

import statistics
import time

from common import (bench_parser, interleaved, pipeline, random_ids, setup_threads, table, time_calls,
                    timed_request)

HOST = 1 << 30


def tier_calls(pipe) -> list[float]:
    calls = [(pipe.engine.cache.memory, "read_block"), (pipe.engine.cache.memory, "write_block")]
    for tier in pipe.engine.cache.ladder.tiers:
        calls += [(tier, "lookup"), (tier, "load"), (tier, "store")]
    return time_calls(calls)


def repeat(tier: bool, block: int):
    first = random_ids(2000, seed=1) + random_ids(64, seed=100)
    flood = [random_ids(2064, seed=500 + k) for k in range(4)]
    with pipeline(reuse_cache=True, seq_size_per_block=block, kv_cache_max_tokens=4096,
                  host_cache_size=HOST if tier else 0) as pipe:
        cold, _, res0 = timed_request(pipe, first, 16)
        for ids in flood:
            timed_request(pipe, ids, 16)
        ttft, _, res = timed_request(pipe, first, 16)
        stats = pipe.cache_stats()
    assert res.output_ids == res0.output_ids
    return cold, ttft, res.aux_info, res.output_ids, stats


def none(tier: bool, block: int):
    with pipeline(reuse_cache=True, seq_size_per_block=block, kv_cache_max_tokens=1024,
                  host_cache_size=HOST if tier else 0) as pipe:
        inside = tier_calls(pipe)
        t0 = time.perf_counter()
        outs = [timed_request(pipe, random_ids(512, seed=400 + i), 16)[2].output_ids for i in range(16)]
        total = time.perf_counter() - t0
        stats = pipe.cache_stats()
    return total, inside[0], outs, stats


def main() -> None:
    parser = bench_parser(__doc__)
    args = parser.parse_args()
    setup_threads()

    on, off = interleaved(lambda t: repeat(t, args.block), args.runs)
    assert on[0][3] == off[0][3], "the host tier changed greedy outputs"
    aux, stats = on[0][2], on[0][4]
    cold = statistics.median(r[0] for r in on + off)
    with_tier, without = statistics.median(r[1] for r in on), statistics.median(r[1] for r in off)
    print(f"Repeat after a flood: 2,064-token prompt, device pool of 4,096 tokens, 1 GiB host tier "
          f"(TTFT, seconds; SEQ_SIZE_PER_BLOCK={args.block})")
    print(table(["", "TTFT", "recompute / this"],
                [("first time (cold)", cold, cold / cold),
                 ("repeat, host tier", with_tier, without / with_tier),
                 ("repeat, no tier (recomputed)", without, 1.0)]))
    print(f"repeat with the tier: reuse_len={aux['reuse_len']} (local {aux['local_reuse_len']}, "
          f"memory {aux['memory_reuse_len']}); host tier {stats['memory_blocks_used']}/"
          f"{stats['memory_blocks_total']} blocks, offloaded {stats['memory_offloaded_blocks']}, "
          f"onboarded {stats['memory_onboarded_blocks']}")

    n_on, n_off = interleaved(lambda t: none(t, args.block), args.runs)
    assert n_on[0][2] == n_off[0][2], "the host tier changed greedy outputs"
    tot_on, tot_off = statistics.median(r[0] for r in n_on), statistics.median(r[0] for r in n_off)
    inside = statistics.median(r[1] for r in n_on)
    s = n_on[0][3]
    print(f"\nNothing to reuse: 16 unrelated 512-token prompts, 16 new tokens, device pool of 1,024 "
          f"tokens (seconds); with the tier: {s['memory_offloaded_blocks']} blocks offloaded, "
          f"{s['memory_hits']} hits")
    print(table(["", "tier on", "tier off", "on/off - 1"],
                [("total", tot_on, tot_off, f"{(tot_on / tot_off - 1) * 100:+.1f}%"),
                 ("inside tier calls + pool copies", inside, 0.0, f"{inside / tot_on * 100:.2f}% of total")]))


if __name__ == "__main__":
    main()
