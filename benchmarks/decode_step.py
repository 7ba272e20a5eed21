"""Where a single-stream decode step's time goes (workload d of peers.py: one 512-token prompt
alone, 128 new tokens): the step's wall time split into the linear layers' GEMVs, attention (the
KV write included), the small ops (embedding, RMSNorm, RoPE, SiLU-and-mul, splits and views),
the batch's metadata (ModelRunner.batch and the backend's build), sampling, the scheduler's
bookkeeping, handing the token out, and the rest (the step's own Python); plus the gap between
steps (the engine loop and waking up).

    python benchmarks/decode_step.py [--runs 3] [--dtype float32] [--weight-type auto]

Wall-clock times on the engine thread (perf_counter around each part), medians over the decode
steps of a run, then the median of the runs. The wrappers cost well under a microsecond a call.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Callable

import torch

from common import bench_parser, pipeline, random_ids, setup_threads, table

PROMPT, NEW = 512, 128
PARTS = ("GEMV", "attention", "small ops", "metadata", "sampling", "scheduling", "emit")


class Clock:
    """Seconds per part within the current step; nested timings count to the innermost part."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)
        self.stack: list[list] = []

    def wrap(self, fn: Callable, part: str) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            frame = [part, time.perf_counter(), 0.0]   # part, start, time of nested parts
            self.stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self.stack.pop()
                total = time.perf_counter() - frame[1]
                self.spent[part] += total - frame[2]
                if self.stack:
                    self.stack[-1][2] += total
        return timed


@contextmanager
def patched(obj: Any, name: str, clock: Clock, part: str):
    original = getattr(obj, name)
    setattr(obj, name, clock.wrap(original, part))
    try:
        yield
    finally:
        setattr(obj, name, original)


def one_run(dtype: str, weight_type: str) -> dict[str, float]:
    """Median milliseconds per part over the run's decode steps (+ 'step', 'between', 'other')."""
    from rtpkv.engine import engine as engine_module

    clock = Clock()
    with pipeline(dtype=dtype, weight_type=weight_type, seq_size_per_block=32) as pipe:
        engine, module = pipe.engine, pipe.engine.runner.module
        layers = [m for m in module.modules() if type(m).__name__ in ("InferenceLinear", "Int8Linear")]
        attention = module.attention
        per_step: list[dict[str, float]] = []
        last_end = [None]
        step = engine.step

        def timed_step() -> bool:
            clock.spent.clear()
            t0 = time.perf_counter()
            between = None if last_end[0] is None else t0 - last_end[0]
            result = step()
            t1 = time.perf_counter()
            last_end[0] = t1
            decoding = engine.step_log and engine.step_log[-1][0][2] == "decode"
            if result and decoding and between is not None:
                parts = dict(clock.spent)
                parts["step"] = t1 - t0
                parts["other"] = parts["step"] - sum(clock.spent.values())
                parts["between"] = between
                per_step.append(parts)
            return result

        patches = [patched(type(layers[0]), "forward", clock, "GEMV"),
                   patched(type(attention), "forward", clock, "attention"),
                   patched(type(attention), "build", clock, "metadata"),
                   patched(type(engine.runner), "batch", clock, "metadata"),
                   patched(engine.runner, "run", clock, "small ops"),
                   patched(engine_module, "sample_batch", clock, "sampling"),
                   patched(engine.scheduler, "schedule", clock, "scheduling"),
                   patched(engine.scheduler, "postprocess", clock, "scheduling"),
                   patched(engine, "_emit", clock, "emit")]
        for p in patches:
            p.__enter__()
        engine.step = timed_step
        try:
            list(pipe(random_ids(PROMPT, seed=4), top_k=1, ignore_eos=True, max_new_tokens=NEW))
        finally:
            engine.step = step
            for p in reversed(patches):
                p.__exit__(None, None, None)
    keys = ("step", "between", "other") + PARTS
    return {k: 1e3 * statistics.median(s.get(k, 0.0) for s in per_step) for k in keys}


def main() -> None:
    parser = bench_parser(__doc__, block=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--weight-type", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    setup_threads(args.threads)
    one_run(args.dtype, args.weight_type)   # warm-up: probes, first-call allocations
    runs = [one_run(args.dtype, args.weight_type) for _ in range(args.runs)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    step = med["step"]
    rows = [(part, f"{med[part]:.3f}", f"{med[part] / step * 100:.1f}%")
            for part in PARTS + ("other",)]
    rows.append(("step (wall)", f"{step:.3f}", "100%"))
    rows.append(("between steps", f"{med['between']:.3f}", f"{med['between'] / step * 100:.1f}%"))
    print(f"{args.dtype}, weights {args.weight_type}, one stream: {PROMPT}-token prompt, {NEW} new "
          f"tokens; medians of {args.runs} runs of the per-step medians, torch threads "
          f"{torch.get_num_threads()}")
    print(table(["part", "ms per decode step", "share of the step"], rows))
    print(f"non-GEMV share of the step: {(step - med['GEMV']) / step * 100:.1f}%; "
          f"of step + gap: {(step + med['between'] - med['GEMV']) / (step + med['between']) * 100:.1f}%")


if __name__ == "__main__":
    main()
