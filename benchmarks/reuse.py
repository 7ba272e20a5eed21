"""Prefix reuse: time to first token cold and warm, with reuse on and off.

    python benchmarks/reuse.py [--runs 3] [--block 64]

Workloads (docs/BENCHMARKS.md):
  a      shared system prompt: 2,000-token prefix + 16 different 64-token questions, one after
         another, 16 new tokens each. Cold TTFT = the first request; warm = mean of the other 15.
  b      8-turn chat: turn 1 is 512 tokens; each turn appends the previous 32-token answer and
         128 new tokens; 32 new tokens per turn. Mean TTFT of turns 2-8.
  task   the 2,000-token prefix as a pinned task prompt: TTFT of a 64-token question with
         task_id, against the concatenated prompt computed from scratch.
  none   nothing to reuse: 16 unrelated 512-token prompts, 16 new tokens: the cost of reuse.
Every figure is the median of --runs runs, each on a fresh pipeline. Greedy outputs with reuse
are checked equal to those without.
"""

from __future__ import annotations

import statistics

from common import (bench_parser, interleaved, pipeline, random_ids, setup_threads, table, time_calls,
                    timed_request)


def workload_a(reuse: bool, block: int) -> tuple[float, float, list[list[int]]]:
    prefix = random_ids(2000, seed=1)
    with pipeline(reuse_cache=reuse, seq_size_per_block=block) as pipe:
        ttfts, outs = [], []
        for q in range(16):
            ttft, _, res = timed_request(pipe, prefix + random_ids(64, seed=100 + q), 16)
            ttfts.append(ttft)
            outs.append(res.output_ids)
    return ttfts[0], statistics.mean(ttfts[1:]), outs


def workload_b(reuse: bool, block: int) -> tuple[float, list[list[int]]]:
    history = random_ids(512, seed=2)
    ttfts, outs = [], []
    with pipeline(reuse_cache=reuse, seq_size_per_block=block) as pipe:
        for turn in range(8):
            ttft, _, res = timed_request(pipe, history, 32)
            ttfts.append(ttft)
            outs.append(res.output_ids)
            history = history + res.output_ids + random_ids(128, seed=200 + turn)
    return statistics.mean(ttfts[1:]), outs


def workload_task(block: int) -> tuple[float, float]:
    prefix = random_ids(2000, seed=1)
    question = random_ids(64, seed=300)
    with pipeline(seq_size_per_block=block) as pipe:
        pipe.add_task("system", prefix)
        with_task, _, res = timed_request(pipe, question, 16, task_id="system")
        assert res.aux_info["prefix_len"] == 2000
    with pipeline(seq_size_per_block=block) as pipe:
        plain, _, _ = timed_request(pipe, prefix + question, 16)
    return with_task, plain


def workload_none(reuse: bool, block: int) -> tuple[float, float, float]:
    """Mean TTFT, total time, and the seconds spent in reuse bookkeeping (hashing, matching,
    registering blocks), timed around the cache manager's own calls."""
    with pipeline(reuse_cache=reuse, seq_size_per_block=block) as pipe:
        bookkeeping = time_calls([(pipe.engine.cache, "lookup"), (pipe.engine.cache, "commit")])
        ttfts, totals = [], []
        for i in range(16):
            ttft, total, _ = timed_request(pipe, random_ids(512, seed=400 + i), 16)
            ttfts.append(ttft)
            totals.append(total)
    return statistics.mean(ttfts), sum(totals), bookkeeping[0]


def main() -> None:
    parser = bench_parser(__doc__)
    args = parser.parse_args()
    setup_threads()
    a_on, a_off = interleaved(lambda reuse: workload_a(reuse, args.block), args.runs)
    assert a_on[0][2] == a_off[0][2], "reuse changed greedy outputs in workload a"
    rows = []
    for name, results in (("a, reuse on", a_on), ("a, reuse off", a_off)):
        cold = statistics.median(r[0] for r in results)
        warm = statistics.median(r[1] for r in results)
        rows.append((name, cold, warm, cold / warm))
    print(f"Workload a: 2,000-token shared prefix + 16 x 64-token questions "
          f"(TTFT, seconds; SEQ_SIZE_PER_BLOCK={args.block})")
    print(table(["run", "cold TTFT", "warm TTFT", "cold/warm"], rows))

    b_on, b_off = interleaved(lambda reuse: workload_b(reuse, args.block), args.runs)
    assert b_on[0][1] == b_off[0][1], "reuse changed greedy outputs in workload b"
    on, off = statistics.median(r[0] for r in b_on), statistics.median(r[0] for r in b_off)
    print("\nWorkload b: 8-turn chat, mean TTFT of turns 2-8 (seconds)")
    print(table(["reuse on", "reuse off", "off/on"], [(on, off, off / on)]))

    task = [workload_task(args.block) for _ in range(args.runs)]
    with_task, plain = statistics.median(t[0] for t in task), statistics.median(t[1] for t in task)
    print("\nTask prompt: 2,000-token pinned task prompt + 64-token question (TTFT, seconds)")
    print(table(["with task_id", "concatenated, no reuse", "ratio"], [(with_task, plain, plain / with_task)]))

    none_on, none_off = interleaved(lambda reuse: workload_none(reuse, args.block), args.runs)
    ttft_on, ttft_off = (statistics.median(r[0] for r in x) for x in (none_on, none_off))
    tot_on, tot_off = (statistics.median(r[1] for r in x) for x in (none_on, none_off))
    book = statistics.median(r[2] for r in none_on)
    print("\nNothing to reuse: 16 unrelated 512-token prompts, 16 new tokens (seconds)")
    print(table(["", "reuse on", "reuse off", "on/off - 1"],
                [("mean TTFT", ttft_on, ttft_off, f"{(ttft_on / ttft_off - 1) * 100:+.1f}%"),
                 ("total", tot_on, tot_off, f"{(tot_on / tot_off - 1) * 100:+.1f}%"),
                 ("reuse bookkeeping", book, 0.0, f"{book / tot_on * 100:.2f}% of total")]))


if __name__ == "__main__":
    main()
