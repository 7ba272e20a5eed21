"""What the int8 KV cache buys in hits: the same KV_CACHE_MEM_MB holding float32 or int8 blocks.
Not a timing: counts only.

    python benchmarks/kv_capacity.py [--block 16] [--prefixes 16] [--requests 240] [--mem-mb 0.1875]

Workload (docs/BENCHMARKS.md): `--prefixes` shared prefixes of 4 blocks each, asked for in a
seeded random order, each request with a unique 8-token question and 8 new tokens
(common.prefix_workload, as in ghost_hits.py). The pool is `--mem-mb` (default: 24 float32 blocks of the small counting model,
a third of what the prefixes need); the int8 pool of the same bytes holds 3.56x the blocks
(head_dim 32: a row of 32 int8 values and a 4-byte scale against 32 float32 values).
"""

from __future__ import annotations

from common import bench_parser, prefix_workload, setup_threads, table


def main() -> None:
    parser = bench_parser(__doc__, block=16)
    parser.add_argument("--prefixes", type=int, default=16)
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--mem-mb", type=float, default=0.1875)
    args = parser.parse_args()
    setup_threads()
    rows = []
    for dtype in ("auto", "int8"):
        stats = prefix_workload(args.prefixes, args.requests, args.block,
                                kv_cache_mem_mb=args.mem_mb, kv_cache_dtype=dtype)
        rows.append(("float32" if dtype == "auto" else "int8", stats["blocks_total"],
                     f"{stats['hit_rate']:.3f}", stats["evictions"]))
    print(f"KV_CACHE_MEM_MB={args.mem_mb}: {args.prefixes} prefixes of {4 * args.block} tokens, "
          f"{args.requests} requests, SEQ_SIZE_PER_BLOCK={args.block}")
    print(table(["KV cache", "pool (blocks)", "hit rate", "evictions"], rows))


if __name__ == "__main__":
    main()
