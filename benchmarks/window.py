"""Attention window: decode speed and KV blocks held for a long context, with and without
MAX_ATTENTION_WINDOW (the BENCHMARKS.md model, its positions extended to fit the context).

A request with an 8k-token prompt decodes 64 tokens; decode tokens/s counts the tokens after the
first over the time after the first. "blocks held" is the most blocks the request held between
two engine steps (recorded after each step's bookkeeping on the engine thread).

    python benchmarks/window.py [--context 8192] [--window 1024] [--new 64] [--runs 2]
"""

from __future__ import annotations

import argparse
import statistics

from common import BENCH_CHECKPOINT, random_ids, setup_threads, table, timed_request


def checkpoint(positions: int):
    from rtpkv.model_factory.tiny import cached_tiny_checkpoint

    return cached_tiny_checkpoint("bench-long", show_progress=False,
                                  **{**BENCH_CHECKPOINT, "max_position_embeddings": positions})


def measure(context: int, window, new: int, runs: int, block: int) -> tuple[float, int, list[int]]:
    from rtpkv.model_factory import ModelConfig, ModelFactory
    from rtpkv.pipeline import Pipeline

    model = ModelFactory.from_huggingface(
        checkpoint(context + new), ModelConfig(max_attention_window=window, kv_cache_mem_mb=2048,
                                               seq_size_per_block=block),
        show_progress=False)
    speeds, held = [], []
    with Pipeline(model, model.tokenizer) as pipe:
        scheduler, cache = pipe.engine.scheduler, pipe.engine.cache
        postprocess = scheduler.postprocess

        def recording(*args):
            finished = postprocess(*args)
            held.extend(cache.num_held(r) for r in scheduler.running)
            return finished

        scheduler.postprocess = recording
        for run in range(runs):
            ttft, total, res = timed_request(pipe, random_ids(context, seed=run), new)
            speeds.append((new - 1) / (total - ttft))
        pipe.check_integrity()
    return statistics.median(speeds), max(held), res.output_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--block", type=int, default=64, help="SEQ_SIZE_PER_BLOCK")
    args = parser.parse_args()
    setup_threads()
    rows, base = [], None
    for window in (None, args.window):
        speed, held, _ = measure(args.context, window, args.new, args.runs, args.block)
        base = base or speed
        rows.append([window or "off", f"{speed:.1f}", f"{speed / base:.2f}x", held,
                     f"{held * args.block} tokens"])
    print(f"context {args.context} tokens, {args.new} new tokens, {args.block}-token blocks, "
          f"median of {args.runs}")
    print(table(["window", "decode tok/s", "vs off", "KV blocks held", "KV held"], rows))


if __name__ == "__main__":
    main()
