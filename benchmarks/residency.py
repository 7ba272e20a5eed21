"""What the residency histograms cost: the seconds spent recording block lifetimes, idle times
and reuse gaps, as a share of the engine's step time, under a workload that hits, releases and
evicts blocks on most steps.

    python benchmarks/residency.py [--runs 3] [--block 16] [--requests 200] [--small]

Workload (docs/BENCHMARKS.md): 16 shared prefixes of 4 blocks asked in a seeded random order,
each with a unique 8-token question and 8 new tokens, through a pool of 48 blocks, so requests
hit cached blocks, release them and evict others all along; the counting model of
benchmarks/common.py. The recording calls (`ResidencyHistograms.observe` and `.evicted` of the
device pool) and `Engine.step` are timed by wrappers on the engine thread; the wrappers' own
cost falls on the recording side, so the share is an upper bound. The clock reads the pool makes
for them (one per hit, index and eviction) are counted and priced at a separately timed
`time.monotonic()`. Medians over the runs.
"""

from __future__ import annotations

import random
import statistics
import time

from common import bench_parser, pipeline, random_ids, setup_threads, table, time_calls

POOL_BLOCKS = 48


def clock_cost(n: int = 200_000) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        time.monotonic()
    return (time.perf_counter() - t0) / n


def run(requests: int, block: int) -> tuple[float, float, int, int]:
    """(seconds in Engine.step, seconds recording, recorded events, steps)."""
    heads = [random_ids(4 * block, seed=1000 + i) for i in range(16)]
    order = random.Random(7)
    with pipeline(counts=True, reuse_cache=True, seq_size_per_block=block,
                  kv_cache_max_tokens=POOL_BLOCKS * block) as pipe:
        residency = pipe.engine.cache.pool.residency
        recording = time_calls([(residency, "observe"), (residency, "evicted")])
        stepping = time_calls([(pipe.engine, "step")])
        steps = [0]
        step = pipe.engine.step

        def counted() -> bool:
            steps[0] += 1
            return step()

        pipe.engine.step = counted
        for r in range(requests):
            prompt = heads[order.randrange(16)] + random_ids(8, seed=5000 + r)
            for _ in pipe(prompt, top_k=1, ignore_eos=True, max_new_tokens=8):
                pass
        stats = pipe.cache_stats()["residency"]["device"]
        events = sum(stats[kind]["count"] for kind in ("reuse_gap", "lifetime"))
        return stepping[0], recording[0], events, steps[0]


def main() -> None:
    parser = bench_parser(__doc__, block=16)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--small", action="store_true", help="20 requests, 1 run")
    args = parser.parse_args()
    setup_threads()
    runs, requests = (1, 20) if args.small else (args.runs, args.requests)
    per_clock = clock_cost()
    results = [run(requests, args.block) for _ in range(runs)]
    step_s = statistics.median(r[0] for r in results)
    record_s = statistics.median(r[1] + r[2] * per_clock for r in results)
    events, steps = results[0][2], results[0][3]
    print(f"Residency recording: {requests} requests over 16 prefixes, pool {POOL_BLOCKS} blocks "
          f"of {args.block}, {runs} run(s)")
    print(table(["engine steps", "recorded events", "step time (s)", "recording (s, upper "
                 "bound)", "share of step time"],
                [(steps, events, f"{step_s:.3f}", f"{record_s:.5f}",
                  f"{100 * record_s / step_s:.3f}%")]))


if __name__ == "__main__":
    main()
