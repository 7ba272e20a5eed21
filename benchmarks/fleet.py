"""Many replicas behind a cache-aware router, on a real conversation trace, against the goals.

Replays Mooncake's conversation trace (`mooncake-conversation.jsonl`, FAST'25: one JSON object a
line with `timestamp`, `input_length`, `output_length`, `hash_ids` of 512-token blocks) through a
router to N replicas (rtpkv.fleet.Fleet), for each replica count in --replicas and each load, and
prints per setup: prefix hit rate (sum of cached_tokens / sum of prompt tokens), the one-replica
ceiling, TTFT p50/p90/p99, output tokens/s and requests failed; then a pass/fail line per goal.
Setups: round_robin; round_robin with every replica on one Redis tier; cache_aware (vllm-router's
approximate tree over what it routed); kv_aware (vllm-router fed by the replicas' KV events);
kv_aware+sessions (the same, with its session affinity: a conversation's first request is placed
by the events, its later turns stay on that replica); dynamo-* (NVIDIA Dynamo's frontend and KV
router over `rtpkv dynamo-worker`s, fed by the same events, its overlap score credit at 0 to 8,
with --dynamo-temperature, and its other load knobs: DYNAMO_SETUPS). The ceiling: the same
trace on one replica alone, without a router, whose pool is the N replicas' pools together (its
threads: one replica's); it sees every turn, and runs once per replica count, closed loop at 4
clients (CEILING_CLIENTS: no request's earlier turn is still in flight, so nothing is lost to a
queue). --simulate starts no fleet: an LRU simulation of the pools (simulate()).

Trace scaled down: each hash id becomes a fixed run of --tokens-per-id token ids drawn from the
id alone (equal ids, equal tokens; by default one id is one KV block, so requests that share a
leading run of ids share exactly those blocks), sent as the prompt's token ids; a prompt keeps
its first --max-ids ids; outputs are min(trace output, --max-new-tokens) tokens. Order is kept.
`--arrivals trace` (the default): open loop, each request sent at its trace timestamp divided by
the load's speedup (--speedup, one or more: the same offered load for every setup, so queueing
shows in TTFT); `--arrivals closed`: a fixed number of clients (--concurrency, one or more)
replays it back to back. Every setup starts from cold replicas. Replicas share the machine: each
runs --threads-per-replica torch threads, and its device pool is --kv-tokens tokens, small
enough that the trace evicts.

The goals (issue 39), for Dynamo's best setting (the dynamo-* setup that passes the most goals,
then the highest mean hit rate), at every load: at 2 replicas, hit rate >= 95% of the ceiling
and >= 1.5x round_robin's, TTFT p90 >= 1.5x better than round_robin's and no worse than
kv_aware's, 0 failed requests; at 4 replicas, hit rate >= 2x round_robin's.

    python benchmarks/fleet.py --trace PATH/mooncake-conversation.jsonl [--requests 1000]
        [--replicas 2 4] [--speedup 16 32 | --arrivals closed --concurrency 4 8]
        [--setups round_robin round_robin+redis cache_aware kv_aware kv_aware+sessions
                  dynamo-credit0 dynamo-credit0.5 dynamo-credit1 dynamo-credit2
                  dynamo-credit4 dynamo-credit8 dynamo-credit4-decay1 dynamo-credit4-requests4
                  dynamo-credit2-prefill0.5 dynamo-credit2-output-blocks
                  dynamo-credit2-no-prefill-tokens dynamo-credit1-temp dynamo-credit2-temp
                  dynamo-credit2-sessions dynamo-credit2-sessions-soft]
        [--model-size counts|prefill] [--connections fresh|kept]
    python benchmarks/fleet.py --trace PATH --simulate KV_TOKENS... [--requests N] [--replicas ...]

The model is the small counting model of benchmarks/common.py with a byte-level tokenizer
(FLEET_CHECKPOINT), or with --model-size prefill a heavier one (PREFILL_CHECKPOINT), unless
--model names another. Method: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import statistics
import sys
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import httpx

from common import COUNTS_CHECKPOINT, bench_parser, table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from redis_server import RedisServer  # noqa: E402

from rtpkv.fleet.launcher import Fleet  # noqa: E402
from rtpkv.model_factory.tiny import cached_tiny_checkpoint  # noqa: E402

# NVIDIA Dynamo's frontend and KV router over `rtpkv dynamo-worker`s, its knobs swept (the
# parameters of its cost function's policy YAML, which 1.6.1 reads and 1.7 keeps): the overlap
# score credit (0 ignores cached blocks, 1 is Dynamo's default, above 1 favours them), the
# credit's decay with the holder's excess prefill load, a decode cost per request in flight,
# the weight of prefill load, and the softmax temperature of its worker choice (0: always the
# cheapest worker); DYNAMO_FRONTEND_ARGS: the frontend's own flags some setups add.
DYNAMO_SETUPS = {"dynamo-credit0": {"overlap_score_credit": 0.0},
                 "dynamo-credit0.5": {"overlap_score_credit": 0.5},
                 "dynamo-credit1": {"overlap_score_credit": 1.0},
                 "dynamo-credit2": {"overlap_score_credit": 2.0},
                 "dynamo-credit4": {"overlap_score_credit": 4.0},
                 "dynamo-credit8": {"overlap_score_credit": 8.0},
                 "dynamo-credit4-decay1": {"overlap_score_credit": 4.0,
                                           "overlap_score_credit_decay": 1.0},
                 "dynamo-credit4-requests4": {"overlap_score_credit": 4.0,
                                              "decode_active_request_weight": 4.0},
                 "dynamo-credit2-prefill0.5": {"overlap_score_credit": 2.0,
                                               "prefill_load_scale": 0.5},
                 "dynamo-credit2-output-blocks": {"overlap_score_credit": 2.0},
                 "dynamo-credit2-no-prefill-tokens": {"overlap_score_credit": 2.0},
                 "dynamo-credit1-temp": {"overlap_score_credit": 1.0},
                 "dynamo-credit2-temp": {"overlap_score_credit": 2.0},
                 "dynamo-credit2-sessions": {"overlap_score_credit": 2.0},
                 "dynamo-credit2-sessions-soft": {"overlap_score_credit": 2.0}}
# output-blocks: a request's output counts as load as it grows; no-prefill-tokens: prompt
# tokens in flight do not count as load (what is left weighs cached blocks against decoding);
# sessions: Dynamo's session affinity (the client's `x-dynamo-session-id`, its conversation):
# a conversation's first request is placed by the cost function, its later turns go to the
# same worker (hard); soft: unless that worker is busy, its prompt tokens in flight above
# SOFT_AFFINITY_BUSY_TOKENS, when the cost function places the turn as it would any request
# (Dynamo answers 529 while every worker is busy: at 2,048, one step's budget, 2-8 of 1,000
# requests were refused at speedup 16-32 in trials; at two steps' budget none)
SESSION_TTL_S = 600   # kv_aware+sessions and dynamo-*-sessions: the bindings' idle lifetime
SOFT_AFFINITY_BUSY_TOKENS = 4096
DYNAMO_SESSIONS = ("--router-session-affinity-ttl-secs", str(SESSION_TTL_S))
DYNAMO_FRONTEND_ARGS = {"dynamo-credit2-output-blocks": ("--router-track-output-blocks",),
                        "dynamo-credit2-no-prefill-tokens": ("--no-router-track-prefill-tokens",),
                        "dynamo-credit2-sessions": DYNAMO_SESSIONS,
                        "dynamo-credit2-sessions-soft": (
                            *DYNAMO_SESSIONS, "--router-session-affinity-mode", "soft",
                            "--active-prefill-tokens-threshold",
                            str(SOFT_AFFINITY_BUSY_TOKENS))}
SETUPS = ("round_robin", "round_robin+redis", "cache_aware", "kv_aware", "kv_aware+sessions",
          *DYNAMO_SETUPS)
# What the goals need (round_robin, kv_aware), the credit sweep, the knob that did best beside
# credit 2 in trials on the shared machine (the other knobs' hit rates were within run-to-run
# noise of it or below) and session affinity both ways, sized for ~9 minutes a replica count
# at the default loads on an idle 2-core machine.
DEFAULT_SETUPS = ("round_robin", "kv_aware", "dynamo-credit0", "dynamo-credit1",
                  "dynamo-credit2", "dynamo-credit2-no-prefill-tokens", "dynamo-credit2-sessions",
                  "dynamo-credit2-sessions-soft")
# The counting model (what a cache does with a request does not depend on the model) with
# Qwen2's byte-level tokenizer, whose every id it can emit: Dynamo's frontend detokenizes the
# replies, and fails a stream whose decoded text changes behind what it sent, which random
# replies do through the sentencepiece byte-fallback tokenizer (2 of 40 requests in a trial).
FLEET_CHECKPOINT = dict(COUNTS_CHECKPOINT, architecture="Qwen2ForCausalLM", vocab_size=1024,
                        tokenizer_vocab_size=1024)
# --model-size prefill: the same with 4 layers of hidden 256, so a prompt token's prefill costs
# about 10x the counting model's (0.08 ms against 0.008 on one thread): a reused block saves
# more than a router's per-request path costs, and queues form at lower loads (where the TTFT
# goals can tell routers apart).
PREFILL_CHECKPOINT = dict(FLEET_CHECKPOINT, hidden_size=256, intermediate_size=704, num_layers=4,
                          num_heads=4, num_kv_heads=2)
MODEL_SIZES = {"counts": ("fleet", FLEET_CHECKPOINT),
               "prefill": ("fleet-prefill", PREFILL_CHECKPOINT)}
CEILING = "alone (ceiling)"
LOWEST_TOKEN_ID = 100   # prompt ids are drawn above the tokenizer's special tokens
# The ceiling's clients, back to back: a request's nearest earlier one with a shared prefix
# (beyond the first id, which all share) is at least 5 requests back in the whole trace (35 in
# its first 1,000), so it has been served: the most reuse the pool allows, without a queue.
CEILING_CLIENTS = 4


@dataclass(frozen=True)
class Request:
    prompt: list[int]   # token ids
    new_tokens: int
    arrival: float      # seconds from the trace's start
    session: str        # its conversation, as a chat client knows it


def id_tokens(hash_id: int, tokens: int, vocab: int) -> list[int]:
    """The fixed run of token ids a trace hash id stands for (derived from the id alone)."""
    rng = random.Random(hash_id)
    return [rng.randrange(LOWEST_TOKEN_ID, vocab) for _ in range(tokens)]


def load_trace(path: Path, requests: int, tokens_per_id: int, max_ids: int,
               max_new_tokens: int, vocab: int) -> list[Request]:
    """The first `requests` requests, in trace order; a prompt keeps its first `max_ids` hash
    ids (a prefix: what it shares with others stays shared). The conversation is the prompt's
    second hash id: the first is the prompt every request shares, and a later turn repeats its
    conversation's earlier prompt."""
    runs: dict[int, list[int]] = {}
    out = []
    with open(path) as f:
        for line in f:
            if len(out) == requests:
                break
            rec = json.loads(line)
            ids = rec["hash_ids"][:max_ids]
            prompt = []
            for h in ids:
                if h not in runs:
                    runs[h] = id_tokens(h, tokens_per_id, vocab)
                prompt += runs[h]
            out.append(Request(prompt, max(1, min(rec["output_length"], max_new_tokens)),
                               rec["timestamp"] / 1000,
                               str(rec["hash_ids"][1 if len(ids) > 1 else 0])))
    if len(out) < requests:
        raise SystemExit(f"--requests {requests}: the trace has only {len(out)}")
    return out


async def replay(url: str, model: str, trace: list[Request], concurrency: int,
                 timeout: float, speedup: Optional[float] = None, keep_alive: bool = False
                 ) -> dict[str, Any]:
    """Streams one completion per trace request, with its conversation in `x-session-id` (as
    vllm-router reads it) and `x-dynamo-session-id` (Dynamo's) as a chat client would send it
    (only a router set up for sessions reads it). Closed loop
    (`speedup` None): `concurrency` clients take the requests in order, one at a time each.
    Open loop: each request is sent at its arrival time divided by `speedup`. TTFT is the time
    from sending to the first chunk with text. Each request on a connection of its own unless
    `keep_alive` (Dynamo 1.6.1's HTTP server leaves Nagle's algorithm on: on a kept-alive
    connection the client's delayed ACK holds a stream's first event back up to 40 ms)."""
    ttfts: list[float] = []
    errors: Counter[str] = Counter()
    prompt = cached = generated = failed = 0

    async def request(http: httpx.AsyncClient, req: Request) -> None:
        nonlocal prompt, cached, generated, failed
        body = {"model": model, "prompt": req.prompt, "max_tokens": req.new_tokens,
                "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        first: Optional[float] = None
        usage = None
        try:
            async with http.stream("POST", url + "/v1/completions", json=body,
                                   headers={"x-session-id": req.session,
                                            "x-dynamo-session-id": req.session}) as res:
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
        for req in queue:
            await request(http, req)

    async def arrivals(http: httpx.AsyncClient) -> None:
        start = time.perf_counter()
        first_arrival = trace[0].arrival
        sent = []
        for req in trace:
            await asyncio.sleep(max(0.0, start + (req.arrival - first_arrival) / speedup
                                    - time.perf_counter()))
            sent.append(asyncio.create_task(request(http, req)))
        await asyncio.gather(*sent)

    t0 = time.perf_counter()
    # fresh: a connection per request. kept: idle connections are let go after 2 s, before the
    # server's 5 s keep-alive ends (a request sent on a connection the server is closing fails
    # with a ReadError, a client artifact)
    limits = httpx.Limits(max_connections=None, keepalive_expiry=2.0,
                          max_keepalive_connections=64 if keep_alive else 0)
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


def run_setup(setup: str, replicas: int, load: float, args: Any, trace: list[Request],
              redis: Optional[RedisServer], log_dir: Path) -> dict[str, Any]:
    """One setup at one load from cold replicas. CEILING (`load` ignored): one replica without
    a router, with the pool of `replicas` replicas together, CEILING_CLIENTS clients back to
    back."""
    alone = setup == CEILING
    open_loop = args.arrivals == "trace" and not alone
    load = CEILING_CLIENTS if alone else load
    limit = len(trace) if open_loop else int(load)   # open loop: never refuse for load
    env = {"KV_CACHE_MAX_TOKENS": str(args.kv_tokens * (replicas if alone else 1)),
           "CONCURRENCY_LIMIT": str(limit), "MAX_SEQ_LEN": str(args.max_seq_len)}
    dynamo = setup in DYNAMO_SETUPS
    with Fleet(args.model, 1 if alone else replicas, replica_port=args.port + 10,
               events_port=args.port + 40, router_port=args.port, block_size=args.block,
               redis_url=redis.url if setup.endswith("+redis") else None,
               threads_per_replica=args.threads_per_replica,
               env=env, log_dir=str(log_dir / ("alone" if alone else setup)),
               time_limit_s=args.time_limit, served_model_name="bench",
               dynamo=dynamo) as fleet:
        fleet.start_replicas()
        url = fleet.replicas[0].url
        if dynamo:
            policy = dict(DYNAMO_SETUPS[setup])
            if setup.endswith("-temp"):
                policy["router_temperature"] = args.dynamo_temperature
            fleet.start_router("dynamo", "kv", dynamo_policy=policy,
                               router_args=DYNAMO_FRONTEND_ARGS.get(setup, ()))
            url = fleet.router_url
        elif not alone:
            sessions = ["--kv-aware-session-affinity-ttl-secs", str(SESSION_TTL_S)]
            fleet.start_router("vllm", setup.split("+")[0],
                               router_args=sessions if setup.endswith("+sessions") else ())
            url = fleet.router_url
        return asyncio.run(replay(url, "bench", trace, int(load), args.request_timeout,
                                  load if open_loop else None, args.connections == "kept"))


# ----------------------------------------------------------------------------- simulation
SIMULATED = ("round_robin", "prefix-aware", CEILING)


def simulate(trace: list[Request], replicas: int, pool_tokens: int, block: int
             ) -> dict[str, float]:
    """Hit rates of an LRU block cache per replica replaying `trace` in order, one request at
    a time (no queue, outputs not cached; a request's blocks released tail first, so the head
    is the most recently used): round_robin; prefix-aware (the replica holding the
    longest cached prefix beyond the first block, which every request shares; ties to the one
    that served fewest: what a cache-aware router can reach at best); and CEILING (one replica
    with the N pools together). A request reuses its cached leading blocks, all but its last
    token at most, as rtpkv does. What the pool size and slice length do to the room a router
    has (the ceiling over round robin), without starting a fleet."""
    def hit_rate(pools: list["OrderedDict[tuple[int, ...], None]"], capacity: int,
                 choose: Callable[[list[tuple[int, ...]], list[int]], int]) -> float:
        served = [0] * len(pools)
        cached = total = 0
        for req in trace:
            blocks = [tuple(req.prompt[i:i + block])
                      for i in range(0, len(req.prompt) - block + 1, block)]
            chosen = choose(blocks, served)
            pool = pools[chosen]
            hits = 0
            while hits < len(blocks) and blocks[hits] in pool:
                hits += 1
            cached += min(hits * block, len(req.prompt) - 1)
            total += len(req.prompt)
            for b in reversed(blocks):   # released tail first, as rtpkv's pool releases them:
                pool[b] = None           # a shared head outlives the tails
                pool.move_to_end(b)
            while len(pool) > capacity:
                pool.popitem(last=False)
            served[chosen] += 1
        return cached / total if total else 0.0

    def round_robin(pools: list[Any]) -> Callable[..., int]:
        turn = iter(range(len(trace)))
        return lambda blocks, served: next(turn) % len(pools)

    def prefix_aware(pools: list[Any]) -> Callable[..., int]:
        def choose(blocks: list[tuple[int, ...]], served: list[int]) -> int:
            def held(i: int) -> int:
                n = 0
                while n < len(blocks) and blocks[n] in pools[i]:
                    n += 1
                return n if n > 1 else 0
            return max(range(len(pools)), key=lambda i: (held(i), -served[i]))
        return choose

    capacity = pool_tokens // block
    out = {}
    for name, make, n, cap in (("round_robin", round_robin, replicas, capacity),
                               ("prefix-aware", prefix_aware, replicas, capacity),
                               (CEILING, round_robin, 1, capacity * replicas)):
        pools = [OrderedDict() for _ in range(n)]
        out[name] = hit_rate(pools, cap, make(pools))
    return out


def simulation_table(trace: list[Request], replicas: list[int], pools: list[int], block: int
                     ) -> str:
    """simulate() for every replica count and pool size: the rows of BENCHMARKS' table."""
    rows = []
    for pool in pools:
        for n in replicas:
            r = simulate(trace, n, pool, block)
            rows.append([f"{pool:,}", str(n), *(f"{r[s]:.3f}" for s in SIMULATED),
                         f"{_ratio(r[CEILING], r['round_robin']):.2f}x",
                         f"{_ratio(r['prefix-aware'], r[CEILING]):.0%}"])
    return table(["KV tokens per replica", "replicas", *SIMULATED, "ceiling / round robin",
                  "prefix-aware / ceiling"], rows)


# ---------------------------------------------------------------------------------- goals
Result = dict[str, Any]


@dataclass(frozen=True)
class Goal:
    """One of issue 39's goals: `figure(dynamo, baseline, ceiling)` at every load passes."""
    text: str
    baseline: Optional[str]   # the setup it compares with (None: the ceiling, or none)
    figure: Callable[[Result, Optional[Result], float], float]
    passes: Callable[[float], bool]
    shown: str                # how a figure prints


def _ratio(a: float, b: float) -> float:
    return a / b if b else (float("inf") if a else 1.0)


GOALS = {
    2: (Goal("hit rate >= 95% of the one-replica ceiling", None,
             lambda d, b, c: _ratio(d["hit_rate"], c), lambda f: f >= 0.95, "{:.1%}"),
        Goal("hit rate >= 1.5x round_robin's", "round_robin",
             lambda d, b, c: _ratio(d["hit_rate"], b["hit_rate"]), lambda f: f >= 1.5,
             "{:.2f}x"),
        Goal("TTFT p90 >= 1.5x better than round_robin's", "round_robin",
             lambda d, b, c: _ratio(b["ttft_p90"], d["ttft_p90"]), lambda f: f >= 1.5,
             "{:.2f}x"),
        Goal("TTFT p90 no worse than kv_aware's", "kv_aware",
             lambda d, b, c: _ratio(b["ttft_p90"], d["ttft_p90"]), lambda f: f >= 1.0,
             "{:.2f}x"),
        Goal("0 failed requests", None, lambda d, b, c: d["failed"], lambda f: f == 0,
             "{:.0f} failed")),
    4: (Goal("hit rate >= 2x round_robin's", "round_robin",
             lambda d, b, c: _ratio(d["hit_rate"], b["hit_rate"]), lambda f: f >= 2.0,
             "{:.2f}x"),),
}


def check(goal: Goal, setting: str, by_load: dict[float, dict[str, Result]], ceiling: float
          ) -> tuple[Optional[bool], str]:
    """Whether `setting` meets `goal` at every load (None: a setup it needs was not run), and
    its figure at each load."""
    if goal.baseline is not None and any(goal.baseline not in r for r in by_load.values()):
        return None, f"not checked: needs {goal.baseline} in --setups"
    figures = {load: goal.figure(r[setting], r.get(goal.baseline), ceiling)
               for load, r in by_load.items()}
    return (all(goal.passes(f) for f in figures.values()),
            ", ".join(f"{goal.shown.format(f)} at {load:g}" for load, f in figures.items()))


def best_dynamo(replicas: int, by_load: dict[float, dict[str, Result]], ceiling: float
                ) -> Optional[str]:
    """The dynamo-* setup that passes the most of this replica count's goals, then the one with
    the highest mean hit rate."""
    settings = [s for s in next(iter(by_load.values())) if s in DYNAMO_SETUPS]

    def merit(setting: str) -> tuple[int, float]:
        passed = sum(check(g, setting, by_load, ceiling)[0] is True
                     for g in GOALS.get(replicas, ()))
        return passed, statistics.mean(r[setting]["hit_rate"] for r in by_load.values())
    return max(settings, key=merit) if settings else None


def report(replicas: int, by_load: dict[float, dict[str, Result]], ceiling: Result,
           load_name: str) -> list[str]:
    """The tables of one replica count, then its goal lines (also returned)."""
    for load, results in by_load.items():
        rr = results.get("round_robin")
        rows = []
        for setup, r in [*results.items(), (CEILING, ceiling)]:
            rows.append([setup, f"{r['hit_rate']:.3f}",
                         f"{_ratio(r['hit_rate'], ceiling['hit_rate']):.0%}",
                         f"{_ratio(r['hit_rate'], rr['hit_rate']):.2f}x" if rr else "-",
                         f"{r['ttft_p50'] * 1e3:.0f}", f"{r['ttft_p90'] * 1e3:.0f}",
                         f"{r['ttft_p99'] * 1e3:.0f}", f"{r['tok_s']:.1f}",
                         f"{r['failed']}/{r['requests']}"])
        print(f"\n{replicas} replicas, {load_name} {load:g} (the ceiling: {CEILING_CLIENTS} "
              f"clients back to back):")
        print(table(["setup", "hit rate", "vs ceiling", "vs round robin", "TTFT p50 ms",
                     "p90 ms", "p99 ms", "out tok/s", "failed"], rows))
    best = best_dynamo(replicas, by_load, ceiling["hit_rate"])
    if best is None:
        lines = [f"{replicas} replicas: no dynamo-* setup run: no goal checked"]
    elif replicas not in GOALS:
        lines = [f"{replicas} replicas: the goals are set for {' and '.join(map(str, GOALS))}"]
    else:
        lines = [f"{replicas} replicas, Dynamo's best setting: {best}"]
        for goal in GOALS[replicas]:
            passed, figures = check(goal, best, by_load, ceiling["hit_rate"])
            verdict = {True: "PASS", False: "FAIL", None: "N/A "}[passed]
            lines.append(f"{verdict} {replicas} replicas: {goal.text}: {figures}")
    print("\n" + "\n".join(lines), flush=True)
    return lines


def run_logged(setup: str, replicas: int, load: float, load_name: str, args: Any,
               trace: list[Request], redis: Optional[RedisServer]) -> Result:
    """run_setup, logging under --log-dir/<N>x/<load>/<setup>, then one line on how it went."""
    where = "ceiling" if setup == CEILING else f"{load_name}-{load:g}"
    t0 = time.perf_counter()
    r = run_setup(setup, replicas, load, args, trace, redis,
                  args.log_dir / f"{replicas}x" / where)
    print(f"{replicas} replicas, {where}, {setup}: {time.perf_counter() - t0:.0f} s (replay "
          f"{r['wall_s']:.0f} s), hit rate {r['hit_rate']:.3f}, TTFT p50/p90 "
          f"{r['ttft_p50'] * 1e3:.0f}/{r['ttft_p90'] * 1e3:.0f} ms, failed "
          f"{r['failed']}/{r['requests']}"
          + "".join(f"\n  {n} x {e}" for e, n in r["errors"].items()), flush=True)
    return r


def main() -> None:
    parser = bench_parser(__doc__, block=16)
    parser.add_argument("--trace", type=Path, required=True, help="mooncake-conversation.jsonl")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4],
                        help="replica counts, each a sitting of its own with its own ceiling")
    parser.add_argument("--arrivals", choices=("trace", "closed"), default="trace",
                        help="trace: open loop at the trace's arrival times divided by each "
                             "--speedup; closed: each --concurrency clients back to back")
    parser.add_argument("--speedup", type=float, nargs="+", default=[16.0, 32.0],
                        help="open loop: the loads, arrival times divided by each")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[4, 8],
                        help="closed loop: the loads, clients each")
    parser.add_argument("--setups", nargs="+", choices=SETUPS, default=list(DEFAULT_SETUPS))
    parser.add_argument("--dynamo-temperature", type=float, default=0.5,
                        help="router_temperature of the dynamo-*-temp setups")
    parser.add_argument("--tokens-per-id", type=int,
                        help="token ids per trace hash id (default: --block, one KV block)")
    parser.add_argument("--max-ids", type=int, default=48,
                        help="hash ids kept per prompt (its prefix), to fit --max-seq-len")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--kv-tokens", type=int, default=32768,
                        help="device pool per replica, tokens (small: the trace evicts)")
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--threads-per-replica", type=int, default=1)
    parser.add_argument("--redis-maxmemory", default="8gb",
                        help="round_robin+redis: the shared Redis tier's bound (it evicts LRU "
                             "past it): at least what the replicas' pools hold")
    parser.add_argument("--model", help="checkpoint (default: the small counting model with "
                                        "a byte-level tokenizer, FLEET_CHECKPOINT)")
    parser.add_argument("--model-size", choices=tuple(MODEL_SIZES), default="counts",
                        help="without --model: counts, the small counting model (2 layers, "
                             "hidden 64); prefill, 4 layers of hidden 256, whose prefill per "
                             "token costs ~10x more (lower --speedup with it)")
    parser.add_argument("--port", type=int, default=31000, help="router port; replicas above it")
    parser.add_argument("--connections", choices=("fresh", "kept"), default="fresh",
                        help="fresh: a connection per request (default); kept: kept-alive "
                             "connections, where Dynamo's frontend's first event waits on the "
                             "client's delayed ACK (it leaves Nagle's algorithm on)")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--time-limit", type=float, default=7200.0,
                        help="hard limit on every process the benchmark starts, seconds")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/rtpkv-bench-fleet"))
    parser.add_argument("--simulate", type=int, nargs="+", metavar="KV_TOKENS",
                        help="start no fleet: print an LRU simulation's hit rates (round robin, "
                             "prefix-aware, the ceiling) of --requests at these pool sizes per "
                             "replica, for each --replicas")
    args = parser.parse_args()
    for name in ("requests", "tokens_per_id", "max_ids", "max_new_tokens", "kv_tokens",
                 "threads_per_replica"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: at least 1")
    if min(args.replicas) < 1 or min(args.speedup) <= 0 or min(args.concurrency) < 1:
        parser.error("--replicas and --concurrency: at least 1 each; --speedup: above 0")
    if args.model is None:
        name, dims = MODEL_SIZES[args.model_size]
        args.model = str(cached_tiny_checkpoint(name, show_progress=False, **dims))
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    tokens_per_id = args.tokens_per_id or args.block
    trace = load_trace(args.trace, args.requests, tokens_per_id, args.max_ids,
                       args.max_new_tokens, vocab)
    if args.simulate:
        print(f"LRU simulation of {len(trace)} requests, {tokens_per_id} token ids per hash id, "
              f"at most {args.max_ids} ids a prompt, block {args.block}:")
        print(simulation_table(trace, args.replicas, args.simulate, args.block))
        return
    open_loop = args.arrivals == "trace"
    loads = args.speedup if open_loop else [float(c) for c in args.concurrency]
    load_name = "speedup" if open_loop else "concurrency"
    span = trace[-1].arrival - trace[0].arrival
    print(f"{len(trace)} requests of {args.trace.name}, {tokens_per_id} token ids per hash id, "
          f"at most {args.max_ids} ids a prompt, outputs <= {args.max_new_tokens} tokens; "
          f"{args.threads_per_replica} thread(s) and {args.kv_tokens} KV tokens per replica, "
          f"block {args.block}; "
          + (f"open loop at the trace's arrival times ({span:.0f} s) / "
             + ", ".join(f"{s:g} ({span / s:.0f} s)" for s in loads)
             if open_loop else "closed loop at concurrency "
             + ", ".join(map(str, args.concurrency)))
          + f"; {len(args.replicas) * (1 + len(loads) * len(args.setups))} runs", flush=True)
    goal_lines = []
    with (RedisServer(args=["--maxmemory", args.redis_maxmemory])
          if "round_robin+redis" in args.setups else contextlib.nullcontext()) as redis:
        for replicas in args.replicas:
            t0 = time.perf_counter()
            ceiling = run_logged(CEILING, replicas, 0, load_name, args, trace, redis)
            by_load = {load: {setup: run_logged(setup, replicas, load, load_name, args, trace,
                                                redis)
                              for setup in args.setups}
                       for load in loads}
            goal_lines += report(replicas, by_load, ceiling, load_name)
            print(f"{replicas} replicas: {time.perf_counter() - t0:.0f} s in all", flush=True)
    print("\nGoals:\n" + "\n".join(goal_lines))


if __name__ == "__main__":
    main()
