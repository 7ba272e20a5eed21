"""What the HTTP server costs: N concurrent streaming clients over loopback against
`rtpkv serve` (a subprocess), against the same workload through the Python API
(`pipeline_async` in this process). TTFT p50/p99 and output tokens/s, medians over interleaved
rounds. Goal: the server keeps > 90% of the Python API's throughput.

    python benchmarks/serve.py [--clients 1 8 32] [--rounds 3] [--route native|openai]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx

from common import BENCH_CHECKPOINT, bench_checkpoint, pipeline, random_ids, setup_threads, table

PROMPT_LEN, NEW_TOKENS, KV_MB = 128, 64, 2048


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def api_round(pipe: Any, prompts: list[list[int]]) -> tuple[list[float], float]:
    """(TTFT of each request, output tokens/s) through pipeline_async."""
    async def one(ids: list[int]) -> float:
        t0 = time.perf_counter()
        ttft = None
        async for _ in pipe.pipeline_async(ids, top_k=1, ignore_eos=True,
                                           max_new_tokens=NEW_TOKENS):
            if ttft is None:
                ttft = time.perf_counter() - t0
        return ttft

    t0 = time.perf_counter()
    ttfts = await asyncio.gather(*(one(p) for p in prompts))
    return list(ttfts), len(prompts) * NEW_TOKENS / (time.perf_counter() - t0)


async def http_round(client: httpx.AsyncClient, route: str, prompts: list[list[int]]
                     ) -> tuple[list[float], float]:
    """(TTFT of each request, output tokens/s) through streaming HTTP requests."""
    if route == "native":
        path, extra = "/", {"yield_generator": True, "return_incremental": True}
        body = lambda ids: {"prompt": ids, "top_k": 1, "ignore_eos": True,  # noqa: E731
                            "max_new_tokens": NEW_TOKENS, **extra}
    else:
        path = "/v1/completions"
        body = lambda ids: {"prompt": ids, "top_k": 1, "ignore_eos": True,  # noqa: E731
                            "max_tokens": NEW_TOKENS, "stream": True}

    async def one(ids: list[int]) -> float:
        t0 = time.perf_counter()
        ttft = None
        async with client.stream("POST", path, json=body(ids)) as res:
            res.raise_for_status()
            async for line in res.aiter_lines():
                if line.startswith("data:") and ttft is None:
                    ttft = time.perf_counter() - t0
        return ttft

    t0 = time.perf_counter()
    ttfts = await asyncio.gather(*(one(p) for p in prompts))
    return list(ttfts), len(prompts) * NEW_TOKENS / (time.perf_counter() - t0)


def start_server(port: int, threads: int) -> subprocess.Popen:
    env = {**os.environ, "CHECKPOINT_PATH": str(bench_checkpoint()), "START_PORT": str(port),
           "KV_CACHE_MEM_MB": str(KV_MB), "CONCURRENCY_LIMIT": "64",
           "OMP_NUM_THREADS": str(threads), "REUSE_CACHE": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "rtpkv", "serve"], env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("rtpkv serve did not come up")


async def measure(args: argparse.Namespace) -> list[list[Any]]:
    pipe = pipeline(concurrency_limit=64, kv_cache_mem_mb=KV_MB)
    server = start_server(args.port, args.threads)
    results: dict[tuple[str, int], list[tuple[list[float], float]]] = {}
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{args.port}", timeout=600,
                                     limits=httpx.Limits(max_connections=128)) as client:
            warm = [random_ids(PROMPT_LEN, seed=999)]
            await api_round(pipe, warm)
            await http_round(client, args.route, warm)
            for n in args.clients:
                for r in range(args.rounds):
                    prompts = [random_ids(PROMPT_LEN, seed=1000 * n + 100 * r + i)
                               for i in range(n)]
                    # interleaved, alternating which goes first: machine noise hits both alike
                    order = ["api", "server"] if r % 2 == 0 else ["server", "api"]
                    for mode in order:
                        run = api_round(pipe, prompts) if mode == "api" else \
                            http_round(client, args.route, prompts)
                        results.setdefault((mode, n), []).append(await run)
    finally:
        server.terminate()
        server.wait(60)
        pipe.stop()
    rows = []
    for n in args.clients:
        api, srv = results[("api", n)], results[("server", n)]
        row: list[Any] = [n]
        for runs in (api, srv):
            ttfts = [t for ttft, _ in runs for t in ttft]
            row += [percentile(ttfts, 0.5) * 1000, percentile(ttfts, 0.99) * 1000,
                    statistics.median(tps for _, tps in runs)]
        row.append(row[6] / row[3])
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--route", choices=["native", "openai"], default="native")
    parser.add_argument("--port", type=int, default=18931)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    setup_threads(args.threads)
    rows = asyncio.run(measure(args))
    print(f"model: {json.dumps(BENCH_CHECKPOINT)}")
    print(f"workload: N clients x 1 streaming request, {PROMPT_LEN}-token prompts, "
          f"{NEW_TOKENS} new tokens, greedy; route {args.route!r}; medians of {args.rounds} "
          f"interleaved rounds; TTFT percentiles over all requests")
    print(table(["N", "API TTFT p50 ms", "API TTFT p99 ms", "API tok/s", "server TTFT p50 ms",
                 "server TTFT p99 ms", "server tok/s", "server/API"], rows))


if __name__ == "__main__":
    main()
