"""A bounded load test of `rtpkv serve` over loopback: C concurrent streaming clients for D
seconds, a fraction of them disconnecting mid-stream. It checks what must hold under load and
samples the server's memory; it claims no speed.

    python benchmarks/load.py [--clients 64] [--duration 120] [--disconnect 0.2]

Checks: no error among the clients that stay; afterwards no request in flight and no block in
use (beyond pinned ones); the server's RSS, sampled every --sample seconds, after the first
--warm-up seconds. RSS figures depend on the machine and what else runs on it: measure on a
quiet machine. Method notes: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from typing import Any

import httpx

from common import bench_checkpoint, random_ids

PROMPT_TOKENS = (16, 400)   # each request's prompt length is drawn from this range
NEW_TOKENS = (4, 48)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def start_server(port: int, kv_mb: int) -> subprocess.Popen:
    env = {**os.environ, "CHECKPOINT_PATH": str(bench_checkpoint()), "START_PORT": str(port),
           "HOST": "127.0.0.1", "REUSE_CACHE": "1", "KV_CACHE_MEM_MB": str(kv_mb),
           "CONCURRENCY_LIMIT": "64"}
    proc = subprocess.Popen([sys.executable, "-m", "rtpkv", "serve", "--no-access-log"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"rtpkv serve exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("rtpkv serve did not come up within 300 s")


def is_error_event(line: str) -> bool:
    """An SSE `data:` line carrying an error object (not a completion whose text says "error")."""
    payload = line[len("data:"):].strip()
    if payload == "[DONE]":
        return False
    event = json.loads(payload)
    return isinstance(event, dict) and "error" in event


class Tally:
    def __init__(self) -> None:
        self.done = self.disconnected = self.refused = 0
        self.errors: list[str] = []


async def client(http: httpx.AsyncClient, rng: random.Random, stop_at: float,
                 disconnect: float, tally: Tally) -> None:
    """One client: streaming requests back to back until the deadline; some leave early."""
    while time.monotonic() < stop_at:
        body = {"prompt": random_ids(rng.randint(*PROMPT_TOKENS), rng.randrange(1 << 30)),
                "max_tokens": rng.randint(*NEW_TOKENS), "ignore_eos": True, "stream": True}
        leave_after = rng.randint(1, 3) if rng.random() < disconnect else None
        chunks = 0
        try:
            async with http.stream("POST", "/v1/completions", json=body) as res:
                if res.status_code == 409:          # over CONCURRENCY_LIMIT: retry
                    tally.refused += 1
                    await asyncio.sleep(0.05)
                    continue
                if res.status_code != 200:
                    tally.errors.append(f"HTTP {res.status_code}: {await res.aread()!r}")
                    continue
                async for line in res.aiter_lines():
                    if line.startswith("data:"):
                        chunks += 1
                        if is_error_event(line):
                            tally.errors.append(line)
                        if leave_after is not None and chunks >= leave_after:
                            break
            if leave_after is not None and chunks >= leave_after:
                tally.disconnected += 1
            else:
                tally.done += 1
        except httpx.HTTPError as exc:
            tally.errors.append(f"{type(exc).__name__}: {exc}")


async def sample_rss(pid: int, every: float, stop_at: float, samples: list[tuple[float, float]],
                     began: float) -> None:
    while time.monotonic() < stop_at:
        samples.append((time.monotonic() - began, rss_mb(pid)))
        await asyncio.sleep(every)


async def run(args: argparse.Namespace, url: str, pid: int) -> tuple[Tally, list, dict[str, Any]]:
    tally, samples = Tally(), []
    began = time.monotonic()
    stop_at = began + args.duration
    limits = httpx.Limits(max_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        rngs = [random.Random(args.seed * 1000 + i) for i in range(args.clients)]
        await asyncio.gather(sample_rss(pid, args.sample, stop_at, samples, began),
                             *(client(http, rng, stop_at, args.disconnect, tally) for rng in rngs))
        samples.append((time.monotonic() - began, rss_mb(pid)))
        settle = time.monotonic() + 30
        while True:                                 # cancellations take one engine step
            stats = (await http.get("/cache_status")).json()
            idle = (stats["requests_in_flight"] == 0 and stats["requests_running"] == 0
                    and stats["blocks_in_use"] == stats["blocks_pinned"])
            if idle or time.monotonic() > settle:
                return tally, samples, stats
            await asyncio.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    parser.add_argument("--disconnect", type=float, default=0.2,
                        help="fraction of requests whose client leaves mid-stream")
    parser.add_argument("--sample", type=float, default=10.0, help="seconds between RSS samples")
    parser.add_argument("--warm-up", type=float, default=30.0,
                        help="seconds of load before RSS is expected to be flat")
    parser.add_argument("--kv-mb", type=int, default=512, help="KV_CACHE_MEM_MB of the server")
    parser.add_argument("--port", type=int, default=8199)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    server = start_server(args.port, args.kv_mb)
    try:
        tally, samples, stats = asyncio.run(run(args, f"http://127.0.0.1:{args.port}", server.pid))
    finally:
        server.terminate()
        server.wait(60)
    print(f"{args.clients} clients, {args.duration:.0f} s, {args.disconnect:.0%} leaving "
          f"mid-stream: {tally.done} finished, {tally.disconnected} left early, "
          f"{tally.refused} refused (409, retried), {len(tally.errors)} errors")
    for error in tally.errors[:10]:
        print("  error:", error)
    print(f"afterwards: requests_in_flight {stats['requests_in_flight']}, requests_running "
          f"{stats['requests_running']}, blocks_in_use {stats['blocks_in_use']} "
          f"(pinned {stats['blocks_pinned']})")
    print("server RSS (s: MiB): " + ", ".join(f"{t:.0f}: {m:.0f}" for t, m in samples))
    after = [m for t, m in samples if t >= args.warm_up]
    if len(after) >= 2:
        print(f"after warm-up ({args.warm_up:.0f} s): min {min(after):.0f} MiB, max "
              f"{max(after):.0f} MiB, last - first {after[-1] - after[0]:+.0f} MiB")
    leaked = (stats["requests_in_flight"] or stats["requests_running"]
              or stats["blocks_in_use"] != stats["blocks_pinned"])
    sys.exit(1 if tally.errors or leaked else 0)


if __name__ == "__main__":
    main()
