"""Where a single-stream decode step's time goes (workload d of peers.py: one 512-token prompt
alone, 128 new tokens): the step's wall time split into the linear layers' GEMVs (the LM head
included), attention (the KV write included), the elementwise kernels (RMSNorm, RoPE,
SiLU-and-mul), the forward's own Python (the C call's arguments and the logits' tensor; with
`--layers` also the embedding and every layer's tensors and calls), the batch's metadata
(ModelRunner.batch and the backend's build), sampling, the scheduler's bookkeeping, handing the
token out, and the rest of the step (mostly the timing wrappers themselves: seven patched
calls); plus the gap between steps (the engine loop, waking up).

    python benchmarks/decode_step.py [--runs 3] [--dtype float32] [--weight-type auto]
                                     [--kv-cache-dtype auto] [--threads 2] [--layers]
                                     [--scheduler-steps 1] [--checkpoint DIR]

With `--scheduler-steps N` (NUM_SCHEDULER_STEPS) a call of the engine runs up to N decode steps
in one C call; each part of such a call is divided by the steps it ran, so the table stays per
decode step (per token), and "the forward's Python" then holds the C loop's arg-max too.

`--checkpoint` runs another checkpoint than the BENCHMARKS.md model (e.g. moe.py's mixture,
whose path moe.py prints); a mixture's sparse layers count as GEMV (router, routing and experts
are one C call).

By default the model runs as it would in service: with the fused decoder where it applies
(kernels/fused_decoder.py), whose C code times its own parts (FusedDecoder.seconds);
`--layers` runs the layers one by one from Python, timed by wrappers around each call. Wall
clock (perf_counter) on the engine thread, medians over the decode steps of a run, then the
median of the runs. The wrappers cost well under a microsecond a call.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from common import bench_parser, kernel_paths, pipeline, random_ids, setup_threads, table

PROMPT, NEW = 512, 128
PARTS = ("GEMV", "attention", "elementwise kernels", "forward's Python", "metadata", "sampling",
         "scheduling", "emit")
FUSED_PARTS = ("GEMV", "attention", "elementwise kernels")   # FusedDecoder.seconds, in order


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


def one_run(options: dict[str, Any], layers: bool,
            checkpoint: Optional[Path] = None) -> dict[str, float]:
    """Median milliseconds per part over the run's decode steps (+ 'step', 'between', 'other')."""
    from rtpkv.engine import engine as engine_module
    from rtpkv.model_factory import llama

    clock = Clock()
    with pipeline(checkpoint=checkpoint, seq_size_per_block=32, **options) as pipe:
        engine, module = pipe.engine, pipe.engine.runner.module
        if layers:
            module.fused = None
        fused = module.fused
        if fused is not None:
            fused.seconds = torch.zeros(len(FUSED_PARTS), dtype=torch.float64)
        linear = next(type(m) for m in module.modules()
                      if type(m).__name__ in ("InferenceLinear", "Int8Linear", "W8A8Linear",
                                              "Bf16Linear"))
        one_run.paths = kernel_paths(module)
        attention = module.attention
        per_step: list[dict[str, float]] = []
        last_end = [None]
        step = engine.step

        def timed_step() -> bool:
            clock.spent.clear()
            if fused is not None:
                fused.seconds.zero_()
            steps_before = engine.steps
            t0 = time.perf_counter()
            between = None if last_end[0] is None else t0 - last_end[0]
            result = step()
            t1 = time.perf_counter()
            last_end[0] = t1
            ran = engine.steps - steps_before   # decode steps this call ran (a burst: several)
            decoding = engine.step_log and engine.step_log[-1][0][2] == "decode"
            if result and decoding and between is not None and ran:
                parts = dict(clock.spent)
                if fused is not None:   # the C call's parts, out of the forward's Python
                    for part, seconds in zip(FUSED_PARTS, fused.seconds.tolist()):
                        parts[part] = parts.get(part, 0.0) + seconds
                        parts["forward's Python"] -= seconds
                parts["step"] = t1 - t0
                parts["other"] = parts["step"] - sum(v for k, v in parts.items() if k != "step")
                parts["between"] = between
                per_step.append({k: v / ran for k, v in parts.items()})
            return result

        with ExitStack() as stack:
            for obj, name, part in [
                    (linear, "forward", "GEMV"), (type(attention), "forward", "attention"),
                    (llama, "rms_norm", "elementwise kernels"),
                    (llama, "apply_rope_", "elementwise kernels"),
                    (llama, "silu_and_mul", "elementwise kernels"),
                    (type(attention), "build", "metadata"),
                    (type(engine.runner), "batch", "metadata"),
                    (engine.runner, "run", "forward's Python"),
                    (engine.runner, "run_burst", "forward's Python"),
                    (engine_module, "sample_batch", "sampling"),
                    (engine.scheduler, "schedule", "scheduling"),
                    (engine.scheduler, "postprocess", "scheduling"),
                    (engine, "_emit", "emit")]:
                stack.enter_context(patched(obj, name, clock, part))
            engine.step = timed_step
            try:
                list(pipe(random_ids(PROMPT, seed=4), top_k=1, ignore_eos=True,
                          max_new_tokens=NEW))
            finally:
                engine.step = step
    keys = ("step", "between", "other") + PARTS
    return {k: 1e3 * statistics.median(s.get(k, 0.0) for s in per_step) for k in keys}


def main() -> None:
    parser = bench_parser(__doc__, block=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--weight-type", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--scheduler-steps", type=int, default=1,
                        help="NUM_SCHEDULER_STEPS: decode steps per call of the fused decoder")
    parser.add_argument("--checkpoint", type=Path,
                        help="a checkpoint directory (default: the BENCHMARKS.md model)")
    parser.add_argument("--layers", action="store_true",
                        help="run the layers one by one, not through the fused decoder")
    args = parser.parse_args()
    setup_threads(args.threads)
    options = dict(dtype=args.dtype, weight_type=args.weight_type,
                   kv_cache_dtype=args.kv_cache_dtype, num_scheduler_steps=args.scheduler_steps)
    one_run(options, args.layers, args.checkpoint)   # warm-up: probes, first-call allocations
    runs = [one_run(options, args.layers, args.checkpoint) for _ in range(args.runs)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    step = med["step"]
    rows = [(part, f"{med[part]:.3f}", f"{med[part] / step * 100:.1f}%")
            for part in PARTS + ("other",)]
    rows.append(("step (wall)", f"{step:.3f}", "100%"))
    rows.append(("between steps", f"{med['between']:.3f}", f"{med['between'] / step * 100:.1f}%"))
    print(f"{args.dtype}, weights {args.weight_type}, KV {args.kv_cache_dtype}, "
          f"NUM_SCHEDULER_STEPS={args.scheduler_steps}, "
          f"{'layers one by one' if args.layers else 'as in service'}, one stream: {PROMPT}-token "
          f"prompt, {NEW} new tokens; medians of {args.runs} runs of the per-step medians, "
          f"torch threads {torch.get_num_threads()}")
    print(one_run.paths)
    print(table(["part", "ms per decode step", "share of the step"], rows))
    print(f"non-GEMV share of the step: {(step - med['GEMV']) / step * 100:.1f}%; "
          f"of step + gap: {(step + med['between'] - med['GEMV']) / (step + med['between']) * 100:.1f}%")


if __name__ == "__main__":
    main()
