"""The linear kernels at each ISA level this CPU runs (RTPKV_ISA), interleaved in one process:
microseconds per call for the bench model's layer shapes (docs/BENCHMARKS.md: hidden 512,
intermediate 1408, vocab 8000), one row (a decode GEMV) and 64 rows (a prefill tile), per weight
kind (float32, BF16, INT8, W8A8), and bytes read per one-row call as GB/s. Every level gives the
same bits (tests/kernels/test_isa_levels.py); this shows what each costs.

    python benchmarks/linear_isa.py [--runs 5] [--threads 2]
"""

from __future__ import annotations

import statistics
import time

import torch

from common import bench_parser, setup_threads, table
from rtpkv.kernels import cpu_build
from rtpkv.kernels.bf16_linear import Bf16Linear
from rtpkv.kernels.int8_linear import Int8Linear
from rtpkv.kernels.linear import InferenceLinear
from rtpkv.kernels.w8a8_linear import W8A8Linear

SHAPES = {"qkv 512->1024": (512, 1024), "gate_up 512->2816": (512, 2816),
          "down 1408->512": (1408, 512), "lm_head 512->8000": (512, 8000)}
KINDS = {"float32": lambda l: InferenceLinear(l, "avx2"), "bf16": Bf16Linear,
         "int8": Int8Linear, "w8a8": W8A8Linear}


def _us(layer, x, repeats: int) -> float:
    layer(x)
    t0 = time.perf_counter()
    for _ in range(repeats):
        layer(x)
    return (time.perf_counter() - t0) / repeats * 1e6


def main() -> None:
    parser = bench_parser(__doc__, block=None)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    setup_threads(args.threads)
    levels = cpu_build.available_isas()
    print(f"CPU: {cpu_build.cpu_kind()}; levels {', '.join(levels)}; {args.threads} threads; "
          f"medians of {args.runs} interleaved runs")
    rows = []
    with torch.inference_mode():
        for kind, make in KINDS.items():
            for shape, (k, n) in SHAPES.items():
                layer = make(torch.nn.Linear(k, n, bias=False))
                nbytes = getattr(layer, "nbytes", 4 * k * n)
                for m in (1, 64):
                    x = torch.randn(m, k)
                    times = {level: [] for level in levels}
                    for run in range(args.runs):
                        for level in (levels if run % 2 == 0 else levels[::-1]):
                            cpu_build.select_isa(level)
                            times[level].append(_us(layer, x, 200 if m == 1 else 20))
                    med = {level: statistics.median(t) for level, t in times.items()}
                    row = [kind, shape, m] + [f"{med[level]:.1f}" for level in levels]
                    row += [f"{nbytes / med[level] / 1e3:.1f}" if m == 1 else "–"
                            for level in levels]
                    if len(levels) > 1:
                        row.append(f"{med[levels[0]] / med[levels[-1]]:.2f}")
                    rows.append(row)
    cpu_build.select_isa("auto")
    headers = (["weights", "layer", "rows"] + [f"us {level}" for level in levels]
               + [f"GB/s {level}" for level in levels]
               + ([f"{levels[0]} / {levels[-1]}"] if len(levels) > 1 else []))
    print(table(headers, rows))


if __name__ == "__main__":
    main()
