"""Partial-block reuse on and off (ENABLE_PARTIAL_REUSE), reuse on in both: workloads a and b
of docs/BENCHMARKS.md.

    python benchmarks/partial_reuse.py [--runs 3] [--block 32] [--small]

  b  8-turn chat (turn 1: 512 tokens; each turn appends the previous 32-token answer and 128
     new tokens; 32 new tokens a turn): mean TTFT of turns 2-8, and every turn's reuse_len
     against the exact common prefix with what the cache holds (the previous turns' tokens but
     the last generated one), which partial reuse must equal and block reuse rounds down.
  a  shared system prompt (2,000 tokens + 16 x 64-token questions, 16 new tokens): mean TTFT
     of questions 2-16 and their reuse_len.
Greedy tokens and every logit are checked identical with partial reuse on and off (the CPU
path is batch-invariant). `--small` shrinks every size (a check that it runs, not a figure).
Every figure is the median of --runs runs, each on a fresh pipeline, on and off interleaved.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
from common import (bench_parser, interleaved, pipeline, random_ids, setup_threads, table,
                    timed_request)


@dataclass(frozen=True)
class Sizes:
    first: int = 512
    answer: int = 32
    new: int = 128
    turns: int = 8
    prefix: int = 2000
    question: int = 64
    questions: int = 16


SMALL = Sizes(first=40, answer=6, new=10, turns=4, prefix=50, question=8, questions=4)


def _run(pipe, ids, n):
    ttft, _, res = timed_request(pipe, ids, n, return_logits=True)
    return ttft, res


def workload_b(partial: bool, block: int, sizes: Sizes):
    """TTFTs of turns 2..n, each turn's (reuse_len, exact common prefix), tokens, logits."""
    history = random_ids(sizes.first, seed=2)
    ttfts, reuse, outs, logits = [], [], [], []
    cached = 0                          # tokens whose K/V the cache holds, as a prefix of history
    with pipeline(reuse_cache=True, enable_partial_reuse=partial, seq_size_per_block=block) as pipe:
        for turn in range(sizes.turns):
            ttft, res = _run(pipe, history, sizes.answer)
            if turn:
                ttfts.append(ttft)
            reuse.append((res.aux_info["reuse_len"], min(cached, len(history) - 1), len(history)))
            outs.append(res.output_ids)
            logits.append(res.logits)
            cached = len(history) + len(res.output_ids) - 1
            history = history + res.output_ids + random_ids(sizes.new, seed=200 + turn)
    return statistics.mean(ttfts), reuse, outs, logits


def workload_a(partial: bool, block: int, sizes: Sizes):
    prefix = random_ids(sizes.prefix, seed=1)
    ttfts, reuse, outs, logits = [], [], [], []
    with pipeline(reuse_cache=True, enable_partial_reuse=partial, seq_size_per_block=block) as pipe:
        for q in range(sizes.questions):
            ttft, res = _run(pipe, prefix + random_ids(sizes.question, seed=100 + q), 16)
            if q:
                ttfts.append(ttft)
            reuse.append(res.aux_info["reuse_len"])
            outs.append(res.output_ids)
            logits.append(res.logits)
    return statistics.mean(ttfts), reuse, outs, logits


def _identical(on, off, name: str) -> None:
    assert on[2] == off[2], f"partial reuse changed greedy tokens in workload {name}"
    assert all(torch.equal(a, b) for a, b in zip(on[3], off[3])), \
        f"partial reuse changed logits in workload {name}"


def main() -> None:
    parser = bench_parser(__doc__, block=32)
    parser.add_argument("--small", action="store_true", help="tiny sizes: check that it runs")
    args = parser.parse_args()
    setup_threads()
    sizes = SMALL if args.small else Sizes()
    B = args.block

    b_on, b_off = interleaved(lambda p: workload_b(p, B, sizes), args.runs)
    _identical(b_on[0], b_off[0], "b")
    on, off = statistics.median(r[0] for r in b_on), statistics.median(r[0] for r in b_off)
    print(f"Workload b: {sizes.turns}-turn chat, mean TTFT of turns 2-{sizes.turns} (seconds; "
          f"SEQ_SIZE_PER_BLOCK={B}); tokens and logits identical on and off")
    computed = [statistics.mean(n - got for got, _, n in r[0][1][1:]) for r in (b_on, b_off)]
    print(table(["partial on", "partial off", "on/off - 1", "prompt tokens computed a turn, on",
                 "off"], [(on, off, f"{(on / off - 1) * 100:+.1f}%", *computed)]))
    rows = []
    for turn, ((got, exact, n), (got_off, _, _)) in enumerate(zip(b_on[0][1], b_off[0][1]), 1):
        assert got == exact, f"turn {turn}: reuse_len {got} != exact common prefix {exact}"
        assert got_off == exact // B * B
        rows.append((turn, n, exact, got, got_off))
    print(table(["turn", "prompt", "exact common prefix", "reuse_len, partial on",
                 "reuse_len, off"], rows))

    a_on, a_off = interleaved(lambda p: workload_a(p, B, sizes), args.runs)
    _identical(a_on[0], a_off[0], "a")
    on, off = statistics.median(r[0] for r in a_on), statistics.median(r[0] for r in a_off)
    print(f"\nWorkload a: {sizes.prefix}-token shared prefix + {sizes.questions} questions, mean "
          f"TTFT of questions 2-{sizes.questions} (seconds); reuse_len of question 2")
    print(table(["partial on", "partial off", "on/off - 1", "reuse_len on", "reuse_len off"],
                [(on, off, f"{(on / off - 1) * 100:+.1f}%", a_on[0][1][1], a_off[0][1][1])]))


if __name__ == "__main__":
    main()
