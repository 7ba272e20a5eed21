"""Per-step overhead of the engine loop at 32 running sequences: how much of a decode step is
not the model's forward (scheduling, building the batch and the attention metadata, sampling,
bookkeeping).

    python benchmarks/step_overhead.py [--runs 3] [--dtype float32]

32 prompts of 128 tokens, 32 new tokens each (workload c, shortened). Only steps where
all 32 sequences decode are counted. Times are CPU seconds of the engine thread
(`time.thread_time`), which other processes on a shared machine disturb less than wall time.
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import pipeline, random_ids, setup_threads, table

SEQS, PROMPT, NEW = 32, 128, 32


def one_run(dtype: str) -> tuple[float, float, int]:
    """(median step seconds, median forward seconds, steps counted) over full decode steps."""
    with pipeline(dtype=dtype, seq_size_per_block=32) as pipe:
        engine, module = pipe.engine, pipe.engine.runner.module
        steps, forwards = [], []
        current: dict[str, float] = {}
        forward, step = module.forward_logits, engine.step

        def timed_forward(ids, *args, **kwargs):
            t0 = time.thread_time()
            try:
                return forward(ids, *args, **kwargs)
            finally:
                current["forward"] = time.thread_time() - t0
                current["tokens"] = len(ids)

        def timed_step():
            current.clear()
            t0 = time.thread_time()
            result = step()
            spent = time.thread_time() - t0
            if current.get("tokens") == SEQS:
                steps.append(spent)
                forwards.append(current["forward"])
            return result

        module.forward_logits = timed_forward
        engine.step = timed_step
        streams = [pipe(random_ids(PROMPT, seed=500 + i), top_k=1, ignore_eos=True,
                        max_new_tokens=NEW) for i in range(SEQS)]
        for s in streams:
            list(s)
    return statistics.median(steps), statistics.median(forwards), len(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    setup_threads()
    results = [one_run(args.dtype) for _ in range(args.runs)]
    step = statistics.median(r[0] for r in results)
    fwd = statistics.median(r[1] for r in results)
    print(f"{args.dtype}, {SEQS} sequences decoding, medians of {args.runs} runs "
          f"({results[0][2]} full decode steps each), engine-thread CPU time")
    print(table(["step (ms)", "model forward (ms)", "outside the forward (ms)", "share outside"],
                [(step * 1e3, fwd * 1e3, (step - fwd) * 1e3, f"{(step - fwd) / step * 100:.1f}%")]))


if __name__ == "__main__":
    main()
