"""Multi-turn reuse on a sliding-window model: a conversation's turn k re-sends every earlier
turn, and with reuse on (REUSE_CACHE=1) its prefill starts after the blocks the cache can serve.
On a Gemma-3-shaped model (five sliding layers to one full, KV cache groups) the hit is the
longest prefix every group serves (the full group's blocks, and the sliding groups' blocks of
the last W tokens before the hit, which they keep for a running conversation's prefix); on the
same weights with full attention in every layer (the dense model of the same size) it is every
block. Per turn, both models: the prompt's length, reuse_len, and TTFT with reuse on and off
(medians over --runs conversations of distinct tokens, on and off interleaved).

    python benchmarks/multi_turn.py [--turns 6] [--first 1024] [--turn-tokens 256] [--new 16]
                                    [--window 512] [--block 16] [--runs 3]

A turn's prompt is the previous turn's prompt, its answer (--new greedy tokens) and
--turn-tokens new user tokens; the first is --first tokens.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from common import bench_parser, random_ids, setup_threads, table, timed_request
from kv_groups import checkpoints

from rtpkv import ModelConfig, ModelFactory, Pipeline


def conversation(pipe: Pipeline, seed: int, args) -> list[tuple[int, int, float]]:
    """(prompt tokens, reuse_len, TTFT seconds) of each turn of one conversation."""
    history, turns = random_ids(args.first, seed=seed, vocab=1000), []
    for turn in range(args.turns):
        ttft, _, res = timed_request(pipe, history, args.new)
        turns.append((len(history), res.aux_info["reuse_len"], ttft))
        history = history + res.output_ids + random_ids(args.turn_tokens,
                                                        seed=seed * 100 + turn, vocab=1000)
    return turns


def measure(path: Path, args) -> list[tuple[int, int, float, float]]:
    """Per turn: (prompt tokens, reuse_len with reuse on, median TTFT on, median TTFT off)."""
    longest = args.first + (args.turns - 1) * (args.new + args.turn_tokens) + args.new
    pipes = {}
    for reuse in (True, False):
        model = ModelFactory.from_huggingface(path, ModelConfig(
            seq_size_per_block=args.block, reuse_cache=reuse, max_seq_len=longest,
            kv_cache_max_tokens=4 * longest), show_progress=False)
        pipes[reuse] = Pipeline(model, model.tokenizer)
        timed_request(pipes[reuse], random_ids(args.turn_tokens, seed=1, vocab=1000), 2)  # warm
    try:
        runs = {True: [], False: []}
        for run in range(args.runs):
            for reuse in ((True, False) if run % 2 == 0 else (False, True)):
                runs[reuse].append(conversation(pipes[reuse], 1000 + run, args))
    finally:
        for pipe in pipes.values():
            pipe.stop()
    rows = []
    for turn in range(args.turns):
        on = [conv[turn] for conv in runs[True]]
        off = [conv[turn] for conv in runs[False]]
        rows.append((on[0][0], min(r[1] for r in on), statistics.median(r[2] for r in on),
                     statistics.median(r[2] for r in off)))
    return rows


def main() -> None:
    parser = bench_parser(__doc__, block=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--first", type=int, default=1024)
    parser.add_argument("--turn-tokens", type=int, default=256)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--window", type=int, default=512)
    args = parser.parse_args()
    setup_threads()
    longest = args.first + args.turns * (args.new + args.turn_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        hybrid, full = checkpoints(Path(tmp), longest, args.window)
        sliding = measure(hybrid, args)
        dense = measure(full, args)
    print(f"{args.turns} turns from {args.first} tokens, +{args.new} answered and "
          f"+{args.turn_tokens} asked a turn; window {args.window}, SEQ_SIZE_PER_BLOCK="
          f"{args.block}; TTFT medians of {args.runs} conversations (seconds)")
    rows = []
    for turn, (s, d) in enumerate(zip(sliding, dense), 1):
        rows.append((turn, s[0], s[1], s[2], s[3], 1 - s[2] / s[3], d[1], d[2], d[3],
                     1 - d[2] / d[3]))
    print(table(["turn", "prompt", "sliding: reuse_len", "TTFT on", "TTFT off", "fall",
                 "dense: reuse_len", "TTFT on", "TTFT off", "fall"], rows))


if __name__ == "__main__":
    main()
