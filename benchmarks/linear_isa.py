"""The linear and paged-attention kernels at each ISA level this CPU runs (RTPKV_ISA),
interleaved in one process: microseconds per call for the bench model's layer shapes
(docs/BENCHMARKS.md: hidden 512, intermediate 1408, vocab 8000), one row (a decode GEMV), 64 rows
(a prefill tile) and 2,064 rows (workload a's cold prefill), per weight kind (float32, BF16,
INT8, W8A8), and bytes read per one-row call as GB/s; then one layer's paged attention (8 query
heads, 4 KV heads, head dim 64, blocks of 32, float32) at the shapes of the peers.py workloads,
each level's kernel named by its query rows per vector. Every level gives the same bits
(tests/kernels/test_isa_levels.py); this shows what each costs.

    python benchmarks/linear_isa.py [--runs 5] [--threads 2]
"""

from __future__ import annotations

import statistics
import time

import torch

from common import bench_parser, setup_threads, table
from rtpkv.kernels import AttentionBatch, cpu_attention, cpu_build
from rtpkv.kernels.cpu_attention import CpuPagedAttention
from rtpkv.kernels.bf16_linear import Bf16Linear
from rtpkv.kernels.int8_linear import Int8Linear
from rtpkv.kernels.linear import InferenceLinear
from rtpkv.kernels.w8a8_linear import W8A8Linear

SHAPES = {"qkv 512->1024": (512, 1024), "gate_up 512->2816": (512, 2816),
          "down 1408->512": (1408, 512), "lm_head 512->8000": (512, 8000)}
KINDS = {"float32": lambda l: InferenceLinear(l, "avx2"), "bf16": Bf16Linear,
         "int8": Int8Linear, "w8a8": W8A8Linear}


def _us(layer, x, repeats: int) -> float:
    """Microseconds per call of layer(x) (of layer() where x is None)."""
    call = layer if x is None else lambda: layer(x)
    call()
    t0 = time.perf_counter()
    for _ in range(repeats):
        call()
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
                for m in (1, 64, 2064):
                    x = torch.randn(m, k)
                    times = {level: [] for level in levels}
                    for run in range(args.runs):
                        for level in (levels if run % 2 == 0 else levels[::-1]):
                            cpu_build.select_isa(level)
                            times[level].append(_us(layer, x, {1: 200, 64: 20}.get(m, 2)))
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
    attention(levels, args.runs)


# name -> (first position, new tokens) of each sequence: one layer's attention in a step
ATTENTION_STEPS = {"a warm: 64 tokens after 2,000": [(2000, 64)],
                   "a cold: 2,064 tokens": [(0, 2064)],
                   "b: 128 tokens after 1,000": [(1000, 128)],
                   "c: 4 x 512 tokens": [(0, 512)] * 4,
                   "c decode: 32 x 1 after 540": [(540, 1)] * 32,
                   "d decode: 1 after 600": [(600, 1)]}


def _attention_call(seqs: list[tuple[int, int]]):
    """A call of the paged-attention kernel at the current level over `seqs` (inputs made once)."""
    H, KVH, D, B = 8, 4, 64, 32
    tables, first = [], 0
    for start, n in seqs:
        blocks = -(-(start + n) // B)
        tables.append(list(range(first, first + blocks)))
        first += blocks
    positions = [p for start, n in seqs for p in range(start, start + n)]
    starts = [sum(n for _, n in seqs[:i]) for i in range(len(seqs))]
    batch = AttentionBatch(positions=positions, row_seq=[i for i, (_, n) in enumerate(seqs)
                                                         for _ in range(n)],
                           block_tables=tables, query_start=starts,
                           query_len=[n for _, n in seqs], context_len=[s + n for s, n in seqs],
                           block_size=B, num_blocks=first, kv_heads=KVH)
    g = torch.Generator().manual_seed(0)
    T = len(positions)
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (H, KVH, KVH))
    caches = [torch.randn(KVH * first * B, D, generator=g) for _ in range(2)]
    backend = CpuPagedAttention(torch.float32)
    meta = backend.build(batch)
    return lambda: backend.forward(q, k, v, caches[0], caches[1], meta, D ** -0.5)


def attention(levels: tuple[str, ...], runs: int) -> None:
    calls, names = {}, {}
    for level in levels:
        cpu_build.select_isa(level)
        names[level] = f"{level} ({cpu_attention.vector_lanes()} query rows a vector)"
        calls[level] = {step: _attention_call(seqs) for step, seqs in ATTENTION_STEPS.items()}
    rows = []
    with torch.inference_mode():
        for step in ATTENTION_STEPS:
            times = {level: [] for level in levels}
            for run in range(runs):
                for level in (levels if run % 2 == 0 else levels[::-1]):
                    times[level].append(_us(calls[level][step], None, 3))
            med = {level: statistics.median(t) for level, t in times.items()}
            row = [step] + [f"{med[level]:.1f}" for level in levels]
            if len(levels) > 1:
                row.append(f"{med[levels[0]] / med[levels[-1]]:.2f}")
            rows.append(row)
    cpu_build.select_isa("auto")
    print("\npaged attention, one layer (the KV write included): " + "; ".join(names.values()))
    print(table(["step"] + [f"us {level}" for level in levels]
                + ([f"{levels[0]} / {levels[-1]}"] if len(levels) > 1 else []), rows))


if __name__ == "__main__":
    main()
