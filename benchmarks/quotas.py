"""Per-tenant quotas: does tenant A's prefix survive tenant B's flood of one-off prompts? Not a
timing: counts only.

    python benchmarks/quotas.py [--block 16] [--rounds 30] [--flood 4] [--small]

Workload (docs/BENCHMARKS.md): a pool of 64 blocks; tenant A (cache_salt "a") asks a 256-token
prefix (16 blocks) with a new 16-token question each round; between two of A's requests tenant
B ("b") sends `--flood` one-off 240-token prompts (16 blocks each with their 16 new tokens).
Without a quota B's blocks push A's prefix out of the pool (LRU); with
`CACHE_SALT_QUOTA_BLOCKS=24`, B past 24 cached blocks loses its own first. A's hit rate is over
the prefix tokens of its requests after the first (the question is never reusable). The model is
benchmarks/common.py's small counting model: what the cache keeps does not depend on it.
"""

from __future__ import annotations

from typing import Optional

from common import bench_parser, pipeline, random_ids, setup_threads, table

POOL_BLOCKS = 64
QUOTA = 24


def run(quota: Optional[int], rounds: int, flood: int, block: int) -> tuple[float, int, dict]:
    prefix = random_ids(16 * block, seed=11)
    reused, survived = 0, 0
    with pipeline(counts=True, reuse_cache=True, seq_size_per_block=block,
                  kv_cache_max_tokens=POOL_BLOCKS * block, cache_salt_quota_blocks=quota) as pipe:
        for r in range(rounds + 1):
            ids = prefix + random_ids(block, seed=20_000 + r)
            res = list(pipe(ids, top_k=1, ignore_eos=True, max_new_tokens=4, cache_salt="a"))[-1]
            if r:
                reused += min(res.aux_info["reuse_len"], len(prefix))
                survived += res.aux_info["reuse_len"] >= len(prefix)
            for f in range(flood):
                one_off = random_ids(15 * block, seed=30_000 + r * flood + f)
                for _ in pipe(one_off, top_k=1, ignore_eos=True, max_new_tokens=block,
                              cache_salt="b"):
                    pass
        return reused / (rounds * len(prefix)), survived, pipe.cache_stats()


def main() -> None:
    parser = bench_parser(__doc__, block=16)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--flood", type=int, default=4)
    parser.add_argument("--small", action="store_true", help="5 rounds")
    args = parser.parse_args()
    setup_threads()
    rounds = 5 if args.small else args.rounds
    rows = []
    for quota in (None, QUOTA):
        rate, survived, stats = run(quota, rounds, args.flood, args.block)
        rows.append(("none" if quota is None else f"{quota} blocks", f"{rate:.3f}",
                     f"{survived}/{rounds}", stats["evictions"], stats["quota_evictions"]))
    print(f"Quotas: tenant a's 16-block prefix, {args.flood} one-off 16-block prompts of tenant b "
          f"between its requests, {rounds} rounds, pool {POOL_BLOCKS} blocks of {args.block}")
    print(table(["CACHE_SALT_QUOTA_BLOCKS", "a's prefix hit rate", "a's requests with the "
                 "whole prefix", "evictions", "quota evictions"], rows))


if __name__ == "__main__":
    main()
