"""Fleet: N `rtpkv serve` replicas and one existing cache-aware router on one machine.

Each replica is its own process on its own port, publishing its KV events on its own PUB and
replay sockets (loopback unless told otherwise), optionally pointed at one shared Redis. The
router is vLLM's (`vllm-router`: round_robin, cache_aware, kv_aware fed by the events) or
SGLang's (`sglang-router`: round_robin, cache_aware over the text it routes), run unmodified
from their pip packages. What each policy needs from the replicas:

- vllm-router kv_aware: one `--kv-event-source URL=tcp://...` (and replay source) per replica
  and `--kv-event-block-size` equal to the replicas' SEQ_SIZE_PER_BLOCK. It gets a request's
  token ids from the replica's `/v1/completions/render` (so no tokenizer on the router side)
  and hashes them by block with SHA-256, as it hashes the `token_ids` of each BlockStored
  event: no hash seed to share.
- cache_aware (both routers) and round_robin: only the worker URLs.
- session keys: vllm-router's consistent_hash routes by a key from the request's headers
  (X-Session-ID, X-User-ID, X-Tenant-ID, ...) or body (`session_params.session_id`, `user`);
  sglang-router's manual policy by its `x-smg-routing-key` header. Neither reads OpenAI's
  `prompt_cache_key`: a client sends its key in one of those too (docs/USAGE.md).

- Dynamo (`--router dynamo`): the replicas are `rtpkv dynamo-worker`s (each also serving rtpkv's
  HTTP routes on its replica port), and the router is Dynamo's frontend with its KV router
  (`--router-mode kv`), all finding each other through one discovery directory (file backend,
  DYN_FILE_KV) and every socket on loopback (the DYN_*_HOST variables). The router's knobs are
  the default cost function's parameters (`dynamo_policy`: overlap_score_credit,
  router_temperature, ...), written to the `--router-policy-config` YAML that Dynamo 1.6 reads
  and 1.7 keeps (the single flags are deprecated there).

`stop()` ends the router, then the replicas (SIGTERM: in-flight requests finish; SIGKILL after
the grace period); every process also carries a hard time limit when one is given.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

ROUTERS = {"vllm": ("round_robin", "cache_aware", "kv_aware", "consistent_hash"),
           "sglang": ("round_robin", "cache_aware", "manual"),
           "dynamo": ("kv", "round-robin", "random", "least-loaded")}
DEFAULT_POLICIES = {"vllm": "kv_aware", "sglang": "cache_aware", "dynamo": "kv"}
# The parameters of Dynamo's default worker-selection cost function (its policy YAML).
DYNAMO_POLICY_PARAMETERS = ("overlap_score_credit", "overlap_score_credit_decay",
                            "prefill_load_scale", "decode_active_request_weight",
                            "host_cache_hit_weight", "disk_cache_hit_weight",
                            "shared_cache_multiplier", "router_temperature")
# Dynamo's own sockets, each told to stay on the fleet's host.
DYNAMO_HOST_VARIABLES = ("DYN_TCP_RPC_HOST", "DYN_EVENT_PLANE_HOST",
                         "DYN_TCP_RESPONSE_STREAM_HOST", "DYN_SYSTEM_HOST")


@dataclass
class Replica:
    index: int
    url: str
    events_endpoint: str
    replay_endpoint: str
    process: subprocess.Popen
    log: Path


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as res:
            return res.status == 200
    except OSError:
        return False


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the process's whole group: the command and, under `timeout`, its child."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _terminate(processes: Sequence[subprocess.Popen], grace: float) -> None:
    """SIGTERM to each (`timeout` passes it on to the command), all at once so that they
    drain side by side, then each group's SIGKILL once `grace` seconds have passed."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        _kill_group(process)


class Fleet:
    def __init__(self, model: str, replicas: int = 2, *, host: str = "127.0.0.1",
                 replica_port: int = 8100, events_port: int = 5557, router_port: int = 30000,
                 block_size: int = 64, threads_per_replica: int = 1,
                 redis_url: Optional[str] = None, env: Optional[dict[str, str]] = None,
                 log_dir: Optional[str] = None, time_limit_s: Optional[float] = None,
                 served_model_name: Optional[str] = None, dynamo: bool = False):
        if replicas < 1:
            raise ValueError(f"replicas={replicas}: at least 1")
        if threads_per_replica < 1:
            raise ValueError(f"threads_per_replica={threads_per_replica}: at least 1")
        self.model = str(model)
        self.served_model_name = served_model_name or Path(self.model.rstrip("/")).name
        self.num_replicas = replicas
        self.host = host
        self.replica_port = replica_port
        self.events_port = events_port
        self.router_port = router_port
        self.block_size = block_size
        self.threads = threads_per_replica
        self.redis_url = redis_url
        self.env = dict(env or {})
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="rtpkv-fleet-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.time_limit_s = time_limit_s
        self.replicas: list[Replica] = []
        self.router: Optional[subprocess.Popen] = None
        self.router_url = f"http://{host}:{router_port}"
        self.dynamo = dynamo   # replicas are Dynamo workers; the router is Dynamo's frontend
        self.discovery_dir = self.log_dir / "discovery"

    # ------------------------------------------------------------------ processes
    def _command(self, argv: list[str]) -> list[str]:
        """`argv` under coreutils' `timeout` when a time limit is set: nothing outlives it."""
        if self.time_limit_s is None:
            return argv
        return ["timeout", "-k", "10", str(int(self.time_limit_s)), *argv]

    def _spawn(self, argv: list[str], log: Path, env: Optional[dict[str, str]] = None
               ) -> subprocess.Popen:
        """Start `argv` as the leader of its own process group (stopped as a group)."""
        with open(log, "ab") as out:
            return subprocess.Popen(self._command(argv), stdout=out, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True)

    def dynamo_env(self) -> dict[str, str]:
        """What Dynamo's processes need to find each other on this machine only."""
        return {"DYN_FILE_KV": str(self.discovery_dir), "DYN_DISCOVERY_BACKEND": "file",
                "DYN_EVENT_PLANE": "zmq", "DYN_REQUEST_PLANE": "tcp",
                **{name: self.host for name in DYNAMO_HOST_VARIABLES}}

    def replica_env(self, index: int) -> dict[str, str]:
        events = f"tcp://{self.host}:{self.events_port + 2 * index}"
        replay = f"tcp://{self.host}:{self.events_port + 2 * index + 1}"
        env = {**os.environ, "REUSE_CACHE": "1", "SEQ_SIZE_PER_BLOCK": str(self.block_size),
               "KV_EVENTS_ENDPOINT": events, "KV_EVENTS_REPLAY_ENDPOINT": replay,
               # the routers started here read tagged maps only (an `env` entry still wins)
               "KV_EVENTS_LAYOUT": "map",
               "OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads)}
        if self.redis_url:
            env.update(ENABLE_REMOTE_CACHE="1", REMOTE_CACHE_URL=self.redis_url)
        if self.dynamo:
            env.update(self.dynamo_env())
        env.update(self.env)
        return env

    def start_replicas(self, timeout: float = 180.0) -> None:
        """Start every replica and wait until each answers /health (a replica that exits or
        stays unhealthy past `timeout` stops the fleet and raises, with its log's tail)."""
        for i in range(self.num_replicas):
            port = self.replica_port + i
            env = self.replica_env(i)
            log = self.log_dir / f"replica-{i}.log"
            argv = self.replica_command(port)
            self.replicas.append(Replica(i, f"http://{self.host}:{port}",
                                         env["KV_EVENTS_ENDPOINT"],
                                         env["KV_EVENTS_REPLAY_ENDPOINT"],
                                         self._spawn(argv, log, env), log))
        deadline = time.monotonic() + timeout
        for replica in self.replicas:
            while not _healthy(replica.url + "/health"):
                if replica.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    tail = replica.log.read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"replica {replica.index} ({replica.url}) did not come "
                                       f"up; its log ends with:\n{tail}")
                time.sleep(0.2)

    def replica_command(self, port: int) -> list[str]:
        """`rtpkv serve` on `port`, or with `dynamo` a Dynamo worker serving rtpkv's routes
        there too."""
        if self.dynamo:
            return [sys.executable, "-m", "rtpkv", "dynamo-worker", "--model", self.model,
                    "--served-model-name", self.served_model_name, "--host", self.host,
                    "--port", str(port)]
        return [sys.executable, "-m", "rtpkv", "serve", "--model", self.model,
                "--host", self.host, "--port", str(port), "--shutdown-timeout", "10",
                "--served-model-name", self.served_model_name]

    def dynamo_policy_file(self, parameters: dict[str, float]) -> Path:
        """Dynamo's router policy YAML: its default cost function under a name of ours, with
        `parameters` (names checked here, values by Dynamo) for every aggregated worker."""
        unknown = sorted(set(parameters) - set(DYNAMO_POLICY_PARAMETERS))
        if unknown:
            raise ValueError(f"dynamo_policy: unknown parameter(s) {', '.join(unknown)}; "
                             f"accepted: {', '.join(DYNAMO_POLICY_PARAMETERS)}")
        lines = ["worker_selection:", "  instances:", "    - name: rtpkv-fleet",
                 "      type: dynamo-default-cost-fn", "      parameters:"]
        lines += [f"        {name}: {float(value)!r}" for name, value in parameters.items()]
        lines += ["  aggregated: rtpkv-fleet"]
        path = self.log_dir / "dynamo-policy.yaml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def router_command(self, router: str, policy: str,
                       replicas: Optional[Sequence[Replica]] = None,
                       router_args: Sequence[str] = (),
                       dynamo_policy: Optional[dict[str, float]] = None) -> list[str]:
        """The router's command line; `router_args` are appended unchanged (the router's own
        options, e.g. vllm-router's `--kv-aware-session-affinity-ttl-secs 600`);
        `dynamo_policy`: the knobs of Dynamo's KV router (DYNAMO_POLICY_PARAMETERS)."""
        if policy not in ROUTERS.get(router, ()):
            raise ValueError(f"router={router!r} policy={policy!r}: accepted: "
                             + "; ".join(f"{r}: {', '.join(p)}" for r, p in ROUTERS.items()))
        replicas = self.replicas if replicas is None else replicas
        urls = [r.url for r in replicas]
        if router == "dynamo":
            if not self.dynamo:
                raise ValueError("router='dynamo' needs Dynamo workers: Fleet(..., dynamo=True)")
            argv = [sys.executable, "-m", "dynamo.frontend", "--http-host", self.host,
                    "--http-port", str(self.router_port), "--router-mode", policy,
                    "--discovery-backend", "file", "--event-plane", "zmq",
                    "--request-plane", "tcp", "--kv-cache-block-size", str(self.block_size)]
            if dynamo_policy:
                argv += ["--router-policy-config", str(self.dynamo_policy_file(dynamo_policy))]
            return argv + list(router_args)
        if dynamo_policy:
            raise ValueError(f"dynamo_policy is Dynamo's router's; router={router!r} has none")
        if router == "sglang":
            return [sys.executable, "-m", "sglang_router.launch_router", "--host", self.host,
                    "--port", str(self.router_port), "--policy", policy,
                    "--prometheus-host", self.host, "--prometheus-port", str(self.router_port + 1),
                    "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                    "--worker-urls", *urls, *router_args]
        argv = [sys.executable, "-m", "vllm_router.launch_router", "--host", self.host,
                "--port", str(self.router_port), "--policy", policy,
                "--prometheus-host", self.host, "--prometheus-port", str(self.router_port + 1),
                "--worker-startup-check-interval", "1", "--health-check-interval-secs", "1",
                "--health-failure-threshold", "1", "--worker-urls", *urls]
        if policy == "kv_aware":
            for r in replicas:
                argv += ["--kv-event-source", f"{r.url}={r.events_endpoint}",
                         "--kv-event-replay-source", f"{r.url}={r.replay_endpoint}"]
            argv += ["--kv-event-block-size", str(self.block_size),
                     "--kv-event-model", self.served_model_name]
        return argv + list(router_args)

    def start_router(self, router: str = "vllm", policy: str = "kv_aware",
                     timeout: float = 60.0, router_args: Sequence[str] = (),
                     dynamo_policy: Optional[dict[str, float]] = None) -> None:
        """Start the router in front of the replicas; wait until it answers /health (Dynamo's
        frontend: until it lists the model with every live worker behind it)."""
        self.stop_router()
        log = self.log_dir / f"router-{router}-{policy}.log"
        argv = self.router_command(router, policy, router_args=router_args,
                                   dynamo_policy=dynamo_policy)
        self.router = self._spawn(argv, log, {**os.environ, **self.dynamo_env()}
                                  if router == "dynamo" else None)
        deadline = time.monotonic() + timeout
        ready = self._frontend_ready if router == "dynamo" else (
            lambda: _healthy(self.router_url + "/health"))
        while not ready():
            if self.router.poll() is not None or time.monotonic() > deadline:
                self.stop_router()
                raise RuntimeError(f"the {router} router did not come up; its log ends with:\n"
                                   + log.read_text(errors="replace")[-2000:])
            time.sleep(0.2)

    def _frontend_ready(self) -> bool:
        """Dynamo's frontend serves the model and routes to as many workers as are alive."""
        try:
            with urllib.request.urlopen(self.router_url + "/health", timeout=2) as res:
                health = json.load(res)
            with urllib.request.urlopen(self.router_url + "/v1/models", timeout=2) as res:
                models = [m.get("id") for m in json.load(res).get("data", [])]
        except (OSError, ValueError):
            return False
        if self.served_model_name not in models:
            return False
        alive = sum(r.process.poll() is None for r in self.replicas)
        endpoints = [i for i in health.get("instances", [])
                     if i.get("endpoint") == "generate"]
        return health.get("status") == "healthy" and len(endpoints) >= alive

    def stop_router(self) -> None:
        if self.router is not None:
            _terminate([self.router], 10)
            self.router = None

    def kill_replica(self, index: int) -> None:
        """SIGKILL one replica (what a crash looks like to the router)."""
        _kill_group(self.replicas[index].process)

    def stop(self) -> None:
        self.stop_router()
        _terminate([replica.process for replica in self.replicas], 20)
        self.replicas = []

    def describe(self, router: str, policy: str) -> str:
        """Where everything listens, and the model name requests must give."""
        lines = [f"replica {r.index}: {r.url}  events {r.events_endpoint}  "
                 f"replay {r.replay_endpoint}" for r in self.replicas]
        lines.append(f"router ({router}, {policy}): {self.router_url}  logs: {self.log_dir}")
        lines.append(f"model: {self.served_model_name}  (the \"model\" of every request)")
        return "\n".join(lines)

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def fleet_from_args(args: argparse.Namespace) -> Fleet:
    """The Fleet `rtpkv fleet` runs (nothing started yet)."""
    from rtpkv.model_factory.tiny import model_or_demo

    return Fleet(model_or_demo(args.model), args.replicas, host=args.host,
                 replica_port=args.replica_port, events_port=args.events_port,
                 router_port=args.port, block_size=args.block_size,
                 threads_per_replica=args.threads_per_replica, redis_url=args.redis,
                 log_dir=args.log_dir,
                 served_model_name=args.served_model_name or (None if args.model else "demo"),
                 dynamo=args.router == "dynamo")


def main(args: argparse.Namespace) -> None:
    """`rtpkv fleet`: start the replicas and the router, print where they are, run until
    SIGINT/SIGTERM (or --duration seconds), then stop everything."""
    from rtpkv.errors import ConfigError

    if args.router != "dynamo" and (args.overlap_score_credit is not None
                                    or args.router_temperature is not None):
        raise ConfigError(f"--overlap-score-credit and --router-temperature are Dynamo's "
                          f"router's knobs; --router {args.router} has none")
    fleet = fleet_from_args(args)
    policy = args.policy or DEFAULT_POLICIES[args.router]
    knobs = {name: value for name, value in (
        ("overlap_score_credit", args.overlap_score_credit),
        ("router_temperature", args.router_temperature)) if value is not None}
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(True))
    try:
        fleet.start_replicas()
        fleet.start_router(args.router, policy, router_args=shlex.split(args.router_args),
                           dynamo_policy=knobs or None)
        print(fleet.describe(args.router, policy), flush=True)
        deadline = time.monotonic() + args.duration if args.duration else None
        while not stop and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.2)
    finally:
        fleet.stop()


def add_parser(sub: "argparse._SubParsersAction", parents: list) -> None:
    p = sub.add_parser("fleet", parents=parents,
                       help="N `rtpkv serve` replicas behind vllm-router or sglang-router, or "
                            "N Dynamo workers behind Dynamo's frontend")
    p.add_argument("--model", help="checkpoint directory every replica serves "
                                   "(default: the demo one)")
    p.add_argument("--served-model-name",
                   help="the model name the replicas serve (default: the model directory's "
                        "name; demo for the demo model)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--router", choices=sorted(ROUTERS), default="vllm")
    p.add_argument("--policy",
                   help="vllm: round_robin, cache_aware, kv_aware (default), consistent_hash; "
                        "sglang: round_robin, cache_aware (default), manual (consistent_hash "
                        "and manual: by a session key the client sends); dynamo: kv (default), "
                        "round-robin, random, least-loaded")
    p.add_argument("--overlap-score-credit", type=float,
                   help="dynamo: how much a cached prefix block counts against a worker's "
                        "prefill load (0: cache ignored, 1: Dynamo's default, >1: favoured)")
    p.add_argument("--router-temperature", type=float,
                   help="dynamo: softmax temperature of the worker choice (0: always the "
                        "cheapest worker; higher spreads load at some cost in reuse)")
    p.add_argument("--router-args", default="",
                   help="more options for the router, passed as they are (one string), e.g. "
                        "'--kv-aware-session-affinity-ttl-secs 600'")
    p.add_argument("--redis", help="redis:// URL every replica shares as its remote KV tier")
    p.add_argument("--host", default="127.0.0.1", help="address everything listens on")
    p.add_argument("--port", type=int, default=30000, help="the router's port (+1: its metrics)")
    p.add_argument("--replica-port", type=int, default=8100, help="first replica's port")
    p.add_argument("--events-port", type=int, default=5557,
                   help="first replica's KV event port; replica i uses 2i and 2i+1 above it")
    p.add_argument("--block-size", type=int, default=64, help="SEQ_SIZE_PER_BLOCK of every replica")
    p.add_argument("--threads-per-replica", type=int, default=1,
                   help="torch threads per replica (replicas x threads <= cores)")
    p.add_argument("--log-dir", help="where each process logs (default: a new temp directory)")
    p.add_argument("--duration", type=float, help="stop after this many seconds")
    p.set_defaults(func=main)
