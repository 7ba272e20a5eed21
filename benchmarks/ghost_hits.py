"""Ghost hits as a forecast: does `cache_stats()["hit_rate_with_ghosts"]` on a pool of P
blocks predict the hit rate a pool of 2P blocks then measures? Not a timing: counts only.

    python benchmarks/ghost_hits.py [--block 16] [--prefixes 16] [--requests 240] [--small]

Workload (docs/BENCHMARKS.md): `--prefixes` shared prefixes of 4 blocks each, asked for in a
seeded random order, each request with a unique 8-token question and 8 new tokens; the prefixes
alone are twice the pool of the first run (P = 2 blocks a prefix), so about half of them are
evicted at any time. The ghost list holds as many keys as the pool has blocks (the default).
The model is benchmarks/common.py's small counting model: hit rates do not depend on it.
"""

from __future__ import annotations

from common import bench_parser, prefix_workload, setup_threads, table


def run(prefixes: int, requests: int, block: int, pool_blocks: int) -> dict:
    return prefix_workload(prefixes, requests, block, kv_cache_max_tokens=pool_blocks * block)


def main() -> None:
    parser = bench_parser(__doc__, block=16)
    parser.add_argument("--prefixes", type=int, default=16)
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--small", action="store_true", help="8 prefixes, 60 requests")
    args = parser.parse_args()
    setup_threads()
    prefixes, requests = (8, 60) if args.small else (args.prefixes, args.requests)
    pool = 2 * prefixes                       # the prefixes need 4 blocks each: twice the pool
    small = run(prefixes, requests, args.block, pool)
    big = run(prefixes, requests, args.block, 2 * pool)
    predicted, measured = small["hit_rate_with_ghosts"], big["hit_rate"]
    print(f"Ghost hits: {prefixes} prefixes of {4 * args.block} tokens, {requests} requests, "
          f"SEQ_SIZE_PER_BLOCK={args.block}")
    print(table(["pool (blocks)", "ghost list", "hit rate", "ghost-hit tokens",
                 "hit rate + ghosts", "evictions"],
                [(pool, small["ghost_capacity"], small["hit_rate"], small["ghost_hit_tokens"],
                  predicted, small["evictions"]),
                 (2 * pool, big["ghost_capacity"], big["hit_rate"], big["ghost_hit_tokens"],
                  big["hit_rate_with_ghosts"], big["evictions"])]))
    error = abs(predicted - measured) / measured
    print(f"predicted {predicted:.3f} (pool {pool}) vs measured {measured:.3f} (pool "
          f"{2 * pool}): {error * 100:.1f}% apart")


if __name__ == "__main__":
    main()
