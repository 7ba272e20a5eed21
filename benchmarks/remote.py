"""The Redis tier: a second replica served from Redis against recomputation, and the cost of
writing every block through to Redis when nothing is reused.

    python benchmarks/remote.py [--runs 3] [--block 64]

Starts a private redis-server on a free loopback port (tests/redis_server.py; needs the
redis-server binary) and stops it at the end.

  repeat  workload a (docs/BENCHMARKS.md): process 1 computes the 2,000-token prefix + a
          64-token question (its blocks are written through to Redis) and exits; process 2, a
          fresh replica, asks the same prefix with another question: its TTFT, served from
          Redis, against the TTFT of a replica without the remote tier (recomputation). Each
          replica first runs a short unrelated request, so one-time start-up costs are not timed.
          Goal: >= 3x faster.
  none    nothing to reuse: 16 unrelated 512-token prompts, 16 new tokens each, in one pipeline
          with the remote tier on (every block written through) and off; Redis is emptied
          between runs. Goal: < 5% throughput cost.
Figures are medians of --runs runs; on and off runs are interleaved so machine noise hits both.
Greedy outputs with the tier are checked equal to those without.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import bench_parser, pipeline, random_ids, setup_threads, table, time_calls, timed_request

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from redis_server import RedisServer  # noqa: E402

PREFIX = 2000


def _child(args: argparse.Namespace) -> None:
    """One replica: a warm-up request, then workload a's request with question `args.question`."""
    setup_threads()
    options = dict(reuse_cache=True, seq_size_per_block=args.block)
    if args.url:
        options.update(enable_remote_cache=True, remote_cache_url=args.url)
    with pipeline(**options) as pipe:
        timed_request(pipe, random_ids(80, seed=9999), 2)
        prompt = random_ids(PREFIX, seed=1) + random_ids(64, seed=100 + args.question)
        ttft, _, res = timed_request(pipe, prompt, 16)
        stats = pipe.cache_stats()
    print(json.dumps({"ttft": ttft, "ids": res.output_ids, "aux": res.aux_info,
                      "remote": {k: v for k, v in stats.items() if k.startswith("remote")}}))


def _replica(block: int, question: int, url: str = "") -> dict:
    cmd = [sys.executable, __file__, "--child", "--block", str(block), "--question", str(question)]
    if url:
        cmd += ["--url", url]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise RuntimeError(f"replica failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def repeat(server: RedisServer, block: int) -> tuple[float, float, int]:
    """(TTFT from Redis, TTFT recomputing, remote_reuse_len) of one run."""
    server_flush(server)
    first = _replica(block, 0, server.url)
    assert first["aux"]["remote_reuse_len"] == 0 and first["remote"]["remote_stores"] > 0, first
    served = _replica(block, 1, server.url)
    assert served["aux"]["remote_reuse_len"] > 0, f"nothing served from Redis: {served['remote']}"
    recomputed = _replica(block, 1)
    assert served["ids"] == recomputed["ids"], "the remote tier changed a greedy answer"
    return served["ttft"], recomputed["ttft"], served["aux"]["remote_reuse_len"]


def none(server: RedisServer, remote: bool, block: int) -> tuple[float, float, int, list[list[int]]]:
    """(total seconds, seconds the engine thread spent handing blocks to the tier, blocks written
    to Redis, outputs) of the nothing-to-reuse workload."""
    server_flush(server)
    options = dict(reuse_cache=True, seq_size_per_block=block)
    if remote:
        options.update(enable_remote_cache=True, remote_cache_url=server.url)
    with pipeline(**options) as pipe:
        handing = time_calls([(pipe.engine.cache.ladder, "write_through")])
        timed_request(pipe, random_ids(80, seed=9999), 2)
        handing[0] = 0.0
        outs, t0 = [], time.perf_counter()
        for i in range(16):
            _, _, res = timed_request(pipe, random_ids(512, seed=400 + i), 16)
            outs.append(res.output_ids)
        total = time.perf_counter() - t0
        stores = pipe.cache_stats().get("remote_stores", 0)
    return total, handing[0], stores, outs


def server_flush(server: RedisServer) -> None:
    import redis

    with redis.Redis.from_url(server.url) as client:
        client.flushall()


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--question", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--url", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args)
        return
    setup_threads()
    with RedisServer() as server:
        served, recomputed, reuse = [], [], 0
        for _ in range(args.runs):
            s, r, reuse = repeat(server, args.block)
            served.append(s)
            recomputed.append(r)
        on, off, handing, stores = [], [], [], 0
        for _ in range(args.runs):
            t_off, _, _, outs_off = none(server, False, args.block)
            t_on, h, stores, outs_on = none(server, True, args.block)
            assert outs_on == outs_off, "the remote tier changed a greedy answer"
            off.append(t_off)
            on.append(t_on)
            handing.append(h)
    s, r = statistics.median(served), statistics.median(recomputed)
    t_on, t_off, h = statistics.median(on), statistics.median(off), statistics.median(handing)
    print(f"block {args.block}, {args.runs} runs (medians), loopback redis-server\n")
    print(table(["workload a, second replica", "TTFT (s)", "remote_reuse_len"],
                [["served from Redis", s, reuse], ["recomputed (no remote tier)", r, 0],
                 ["speed-up", f"{r / s:.1f}x (goal >= 3x)", ""]]))
    print()
    print(table(["nothing to reuse, 16 x 512 tokens", "total (s)", "blocks written to Redis"],
                [["remote tier off", t_off, 0], ["remote tier on (write-through)", t_on, stores],
                 ["throughput cost", f"{(t_on - t_off) / t_off * 100:+.1f}% (goal < 5%)", ""],
                 ["engine thread handing blocks to the tier", h,
                  f"{h / t_on * 100:.1f}% of the run"]]))


if __name__ == "__main__":
    main()
