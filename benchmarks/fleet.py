"""Many replicas behind a cache-aware router, on a real conversation trace.

Replays Mooncake's conversation trace (`mooncake-conversation.jsonl`, FAST'25: one JSON object a
line with `timestamp`, `input_length`, `output_length`, `hash_ids` of 512-token blocks) through
vllm-router to N `rtpkv serve` replicas (rtpkv.fleet.Fleet) and prints, per setup: prefix hit
rate (sum of cached_tokens / sum of prompt tokens), TTFT p50/p90/p99, output tokens/s and
requests failed. Setups: round_robin; round_robin with every replica on one Redis tier;
cache_aware (the router's approximate tree over request text); kv_aware (fed by the replicas'
KV events); kv_aware+sessions (the same, with the router's session affinity: a conversation's
first request is placed by the events, its later turns stay on that replica); dynamo-* (NVIDIA
Dynamo's frontend and KV router over `rtpkv dynamo-worker`s, fed by the same events, with its
overlap score credit at 0, 0.5, 1 or 2, and with --dynamo-temperature); and one replica
alone without a router, with every replica's threads (the
ceiling: it sees every turn).

Trace scaled down: each 512-token hash id becomes a fixed run of --words-per-id words drawn from
the id alone (equal ids, equal text), prompts are the runs of their first --max-ids ids in
order, outputs are
min(trace output, --max-new-tokens) tokens (ignore_eos). Order is kept. `--arrivals closed`
(the default): a fixed number of clients (--concurrency) replays it back to back (arrival times
are not used); `--arrivals trace`: open loop, each request sent at its trace timestamp divided
by --speedup, whatever is still running (the same offered load for every setup, so queueing
shows in TTFT). Each setup starts from cold replicas. Replicas share the machine: each runs --threads-per-replica torch threads
(replicas x threads <= cores), and the device pool per replica is --kv-tokens tokens, small
enough that the trace evicts.

    python benchmarks/fleet.py --trace PATH/mooncake-conversation.jsonl [--requests 1000]
        [--replicas 2] [--concurrency 4 | --arrivals trace --speedup 2]
        [--setups round_robin round_robin+redis cache_aware kv_aware kv_aware+sessions
                  dynamo-credit0 dynamo-credit0.5 dynamo-credit1 dynamo-credit2
                  dynamo-credit1-temp dynamo-credit2-temp alone]

Method and machine: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import httpx

from common import bench_checkpoint, bench_parser, table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from redis_server import RedisServer  # noqa: E402

from rtpkv.fleet.launcher import Fleet  # noqa: E402

# NVIDIA Dynamo's frontend and KV router over `rtpkv dynamo-worker`s, its knobs swept: the
# overlap score credit (0 ignores cached blocks, 1 is Dynamo's default, 2 favours them) and the
# softmax temperature of its worker choice (0: always the cheapest worker).
DYNAMO_SETUPS = {"dynamo-credit0": {"overlap_score_credit": 0.0},
                 "dynamo-credit0.5": {"overlap_score_credit": 0.5},
                 "dynamo-credit1": {"overlap_score_credit": 1.0},
                 "dynamo-credit2": {"overlap_score_credit": 2.0},
                 "dynamo-credit1-temp": {"overlap_score_credit": 1.0},
                 "dynamo-credit2-temp": {"overlap_score_credit": 2.0}}
SETUPS = ("round_robin", "round_robin+redis", "cache_aware", "kv_aware", "kv_aware+sessions",
          *DYNAMO_SETUPS, "alone")
SESSION_TTL_S = 600   # kv_aware+sessions: vllm-router's --kv-aware-session-affinity-ttl-secs
WORDS = ("the of and to in is was for on are with as by at from his her they this that have "
         "not but what all were when we there can an your which their said if will each about "
         "how up out them then she many some so these would other into has more two like him "
         "see time could no make than first been its who now people my made over did down only "
         "way find use may water long little very after words called just where most know get "
         "through back much before go good new write our used me man too any day same right "
         "look think also around another came come work three word must because does part").split()


Request = tuple[str, int, float, str]   # prompt text, output tokens, arrival s, conversation


def load_trace(path: Path, requests: int, words_per_id: int, max_ids: int, max_new_tokens: int
               ) -> list[Request]:
    """(prompt text, output tokens, arrival seconds, conversation) of the first `requests`
    requests, in trace order; a prompt keeps its first `max_ids` hash ids (a prefix: what it
    shares with others stays shared). The conversation is the prompt's second hash id: the
    first is the prompt every request shares, and a later turn repeats its conversation's
    earlier prompt, so it is what a chat client knows as its session."""
    runs: dict[int, str] = {}
    out = []
    with open(path) as f:
        for line in f:
            if len(out) == requests:
                break
            rec = json.loads(line)
            ids = rec["hash_ids"][:max_ids]
            for h in ids:
                if h not in runs:
                    rng = random.Random(h)
                    runs[h] = " ".join(rng.choice(WORDS) for _ in range(words_per_id))
            text = " ".join(runs[h] for h in ids)
            out.append((text, max(1, min(rec["output_length"], max_new_tokens)),
                        rec["timestamp"] / 1000, str(rec["hash_ids"][1 if len(ids) > 1 else 0])))
    if len(out) < requests:
        raise SystemExit(f"--requests {requests}: the trace has only {len(out)}")
    return out


async def replay(url: str, model: str, trace: list[Request], concurrency: int,
                 timeout: float, speedup: Optional[float] = None) -> dict[str, Any]:
    """Streams one completion per trace request, with its conversation in `x-session-id` as a
    chat client would send it (only a router set up for sessions reads it). Closed loop
    (`speedup` None): `concurrency` clients take the requests in order, one at a time each.
    Open loop: each request is sent at its arrival time divided by `speedup`. TTFT is the time
    from sending to the first chunk with text."""
    ttfts: list[float] = []
    errors: Counter[str] = Counter()
    prompt = cached = generated = failed = 0

    async def request(http: httpx.AsyncClient, text: str, new_tokens: int, session: str
                      ) -> None:
        nonlocal prompt, cached, generated, failed
        body = {"model": model, "prompt": text, "max_tokens": new_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        first: Optional[float] = None
        usage = None
        try:
            async with http.stream("POST", url + "/v1/completions", json=body,
                                   headers={"x-session-id": session}) as res:
                if res.status_code != 200:
                    failed += 1
                    errors[f"{res.status_code} {(await res.aread())[:160]!r}"] += 1
                    return
                async for line in res.aiter_lines():
                    if not line.startswith("data:") or line.endswith("[DONE]"):
                        continue
                    chunk = json.loads(line[5:])
                    if first is None and chunk.get("choices"):
                        first = time.perf_counter() - t0
                    usage = chunk.get("usage") or usage
        except httpx.HTTPError as exc:
            failed += 1
            errors[type(exc).__name__] += 1
            return
        if first is None or usage is None:
            failed += 1
            errors["stream ended without text or usage"] += 1
            return
        ttfts.append(first)
        prompt += usage["prompt_tokens"]
        cached += usage["prompt_tokens_details"]["cached_tokens"]
        generated += usage["completion_tokens"]

    async def client(http: httpx.AsyncClient, queue: Any) -> None:
        for text, new_tokens, _, session in queue:
            await request(http, text, new_tokens, session)

    async def arrivals(http: httpx.AsyncClient) -> None:
        start = time.perf_counter()
        first_arrival = trace[0][2]
        sent = []
        for text, new_tokens, arrival, session in trace:
            await asyncio.sleep(max(0.0, start + (arrival - first_arrival) / speedup
                                    - time.perf_counter()))
            sent.append(asyncio.create_task(request(http, text, new_tokens, session)))
        await asyncio.gather(*sent)

    t0 = time.perf_counter()
    # idle connections are let go after 2 s, before the server's 5 s keep-alive ends: a request
    # sent on a connection the server is closing fails with a ReadError, a client artifact
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64,
                          keepalive_expiry=2.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
        if speedup is None:
            queue = iter(trace)
            await asyncio.gather(*(client(http, queue) for _ in range(concurrency)))
        else:
            await arrivals(http)
    wall = time.perf_counter() - t0
    q = statistics.quantiles(ttfts, n=100) if len(ttfts) > 1 else [ttfts[0] if ttfts else 0] * 99
    return {"hit_rate": cached / prompt if prompt else 0.0, "ttft_p50": q[49],
            "ttft_p90": q[89], "ttft_p99": q[98], "tok_s": generated / wall, "failed": failed,
            "requests": len(ttfts) + failed, "wall_s": wall, "errors": errors}


def run_setup(setup: str, args: Any, trace: list[Request], redis: RedisServer,
              log_dir: Path) -> dict[str, Any]:
    replicas = 1 if setup == "alone" else args.replicas
    redis_url = redis.url if setup.endswith("+redis") else None   # the one setup that uses it
    open_loop = args.arrivals == "trace"
    limit = len(trace) if open_loop else args.concurrency    # open loop: never refuse for load
    env = {"KV_CACHE_MAX_TOKENS": str(args.kv_tokens), "CONCURRENCY_LIMIT": str(limit),
           "MAX_SEQ_LEN": str(args.max_seq_len)}
    dynamo = setup in DYNAMO_SETUPS
    with Fleet(args.model, replicas, replica_port=args.port + 10, events_port=args.port + 40,
               router_port=args.port, block_size=args.block, redis_url=redis_url,
               threads_per_replica=args.threads_per_replica * (args.replicas // replicas),
               env=env,
               log_dir=str(log_dir / setup), time_limit_s=args.time_limit,
               served_model_name="bench", dynamo=dynamo) as fleet:
        fleet.start_replicas()
        url = fleet.replicas[0].url
        if dynamo:
            policy = dict(DYNAMO_SETUPS[setup])
            if setup.endswith("-temp"):
                policy["router_temperature"] = args.dynamo_temperature
            fleet.start_router("dynamo", "kv", dynamo_policy=policy)
            url = fleet.router_url
        elif setup != "alone":
            sessions = ["--kv-aware-session-affinity-ttl-secs", str(SESSION_TTL_S)]
            fleet.start_router("vllm", setup.split("+")[0],
                               router_args=sessions if setup.endswith("+sessions") else ())
            url = fleet.router_url
        return asyncio.run(replay(url, "bench", trace, args.concurrency, args.request_timeout,
                                  args.speedup if open_loop else None))


def main() -> None:
    parser = bench_parser(__doc__, block=16)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--arrivals", choices=("closed", "trace"), default="closed",
                        help="closed: --concurrency clients back to back; trace: open loop at "
                             "the trace's arrival times divided by --speedup")
    parser.add_argument("--concurrency", type=int, default=4, help="closed-loop clients")
    parser.add_argument("--speedup", type=float, default=1.0,
                        help="open loop: arrival times are divided by this")
    parser.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    parser.add_argument("--dynamo-temperature", type=float, default=0.5,
                        help="router_temperature of the dynamo-*-temp setups")
    parser.add_argument("--trace", type=Path, required=True, help="mooncake-conversation.jsonl")
    parser.add_argument("--words-per-id", type=int, default=8)
    parser.add_argument("--max-ids", type=int, default=48,
                        help="hash ids kept per prompt (its prefix), to fit max_seq_len")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--kv-tokens", type=int, default=262144,
                        help="device pool per replica, tokens (small: the trace evicts)")
    parser.add_argument("--max-seq-len", type=int, default=4096)
    parser.add_argument("--threads-per-replica", type=int, default=1)
    parser.add_argument("--redis-maxmemory", default="8gb",
                        help="the shared Redis tier's bound (it evicts LRU past it): at least "
                             "what the replicas' pools hold, or it is the smaller cache")
    parser.add_argument("--model", help="checkpoint (default: the BENCHMARKS.md model)")
    parser.add_argument("--port", type=int, default=31000, help="router port; replicas above it")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--time-limit", type=float, default=7200.0,
                        help="hard limit on every process the benchmark starts, seconds")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/rtpkv-bench-fleet"))
    args = parser.parse_args()
    args.model = args.model or str(bench_checkpoint())
    trace = load_trace(args.trace, args.requests, args.words_per_id, args.max_ids,
                       args.max_new_tokens)
    print(f"{len(trace)} requests of {args.trace.name}, {args.words_per_id} words per hash id, "
          f"outputs <= {args.max_new_tokens} tokens; {args.replicas} replicas x "
          f"{args.threads_per_replica} threads, {args.kv_tokens} KV tokens each, block "
          f"{args.block}; " + (f"open loop at the trace's arrival times / {args.speedup:g}"
                               if args.arrivals == "trace" else
                               f"closed loop at concurrency {args.concurrency}")
          + "; routers: vllm-router, NVIDIA Dynamo's frontend (dynamo-*)",
          flush=True)
    rows = []
    with RedisServer(args=["--maxmemory", args.redis_maxmemory]) as redis:
        for setup in args.setups:
            r = run_setup(setup, args, trace, redis, args.log_dir)
            rows.append([setup, f"{r['hit_rate']:.3f}", f"{r['ttft_p50'] * 1e3:.0f}",
                         f"{r['ttft_p90'] * 1e3:.0f}", f"{r['ttft_p99'] * 1e3:.0f}",
                         f"{r['tok_s']:.1f}", f"{r['failed']}/{r['requests']}"])
            print(f"{setup}: done in {r['wall_s']:.0f} s: " + " ".join(rows[-1][1:])
                  + "".join(f"\n  {n} x {e}" for e, n in r["errors"].items()), flush=True)
    print(table(["setup", "hit rate", "TTFT p50 ms", "p90 ms", "p99 ms", "out tok/s", "failed"],
                rows))


if __name__ == "__main__":
    main()
