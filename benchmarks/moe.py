"""One stream's decode speed of a mixture of experts shaped like Qwen3-30B-A3B, scaled down to fit
a small machine, against a dense Qwen3 with as many active parameters per token (its MLP as wide
as the experts a token runs), and against llama.cpp on GGUF conversions of the same checkpoints,
in one sitting.

    python benchmarks/moe.py [--runs 3] [--weight-type auto] [--threads 2] [--tiny]
                             [--llama-cpp VENV/bin/python --llama-cpp-src LLAMA_CPP_DIR]

Qwen3-30B-A3B: hidden 2048, 48 layers, 32 query and 4 KV heads of 128, 128 experts of 768 of
which 8 run per token, vocabulary 151,936. Scaled: hidden 512, 8 layers, 8 query and 1 KV heads
of 64, 128 experts of 192, top 8 (the same sparsity: 1/16 of the expert weights read per
token), vocabulary 8,000; random weights, float32 safetensors (about 1.3 GB). The dense model
has the same attention, embeddings and LM head and an MLP of 8 x 192 = 1,536: the same
parameters per token but the router's (1.6%). `--tiny` runs both at a toy size to show the
script works (its figures mean nothing).

Workload: one 128-token prompt alone, 64 new tokens, greedy, EOS ignored; decode tok/s is the
tokens after the first over the time after the first (benchmarks/token_timing.py). Both rtpkv
models run as in service: each decode step one C call (kernels/fused_decoder.py; the mixture's
sparse layers through kernels/moe_experts.py). Every engine runs in a process of its own
(rtpkv's in benchmarks/rtpkv_worker.py, driven as peers.py drives its peers: two pipelines in
one process about halve each other's step). The checkpoints are built once into the user
cache (their paths are printed). With `--llama-cpp` (the interpreter of a venv with
llama-cpp-python) and `--llama-cpp-src` (a llama.cpp source tree: llama-cpp-python's sdist
vendors one), each checkpoint is converted once to a float32 GGUF beside it by that tree's
converter (benchmarks/gguf_convert.py; with `--weight-type int8` or `w8a8_int8` a Q8_0 GGUF:
int8 weights on both sides), and llama.cpp decodes the same prompt on it (2 threads, as
rtpkv); its greedy tokens are compared with rtpkv's, which shows the two run the same
weights. Runs alternate between the engines; figures are medians. Ratios: each row's decode
speed over rtpkv's dense Qwen3 (the 0.8x goal of the mixture) and, for llama.cpp's rows,
rtpkv's on the same checkpoint over llama.cpp's (the 1.5x goal).

The memory roof: each round also measures this host's read bandwidth with the same threads
(common.read_bandwidth, a 1 GiB sum); each model's weight bytes a token
(common.decode_bytes_per_token: attention, router, top-k experts, LM head, by part) times its
tok/s is the bandwidth its decode implies, shown as a share of that roof. A speed that would
need more than 100% cannot be reached by reading the weights once a token in that dtype.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from common import (WAIT_POLICY_VARIABLES, WEIGHT_BYTES, bench_parser, decode_bytes_per_token,
                    random_ids, read_bandwidth, setup_threads, table)
from peers import PeerWorker

PROMPT, NEW = 128, 64
MOE, DENSE = "rtpkv mixture Qwen3-MoE", "rtpkv dense Qwen3"

MOE_SHAPE = dict(architecture="Qwen3MoeForCausalLM", vocab_size=8000, hidden_size=512,
                 intermediate_size=1536, num_layers=8, num_heads=8, num_kv_heads=1,
                 max_position_embeddings=4096, tokenizer_vocab_size=2000,
                 moe=dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=192,
                          norm_topk_prob=True))
TINY_MOE_SHAPE = dict(MOE_SHAPE, vocab_size=1024, hidden_size=64, intermediate_size=64,
                      num_layers=2, num_heads=4, num_kv_heads=1, tokenizer_vocab_size=600,
                      moe=dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                               norm_topk_prob=True))


def dense_shape(moe_shape: dict[str, Any]) -> dict[str, Any]:
    """The dense Qwen3 with the mixture's parameters per token: its MLP as wide as the experts
    a token runs."""
    moe = moe_shape["moe"]
    shape = {k: v for k, v in moe_shape.items() if k != "moe"}
    return dict(shape, architecture="Qwen3ForCausalLM",
                intermediate_size=moe["num_experts_per_tok"] * moe["moe_intermediate_size"])


def shapes(moe_shape: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The checkpoints of a sitting, by engine label: the mixture and the dense Qwen3."""
    return {MOE: moe_shape, DENSE: dense_shape(moe_shape)}


def gguf(checkpoint: Path, llama_cpp_src: str, outtype: str) -> Path:
    """The checkpoint's GGUF in `outtype` (f32 or q8_0), converted once beside it by llama.cpp's
    converter."""
    out = checkpoint / f"model-{outtype}.gguf"
    if not out.exists():
        tmp = checkpoint / f"model-{outtype}.gguf.part"
        subprocess.run([sys.executable, str(Path(__file__).with_name("gguf_convert.py")),
                        llama_cpp_src, str(checkpoint), str(tmp), "--outtype", outtype],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        tmp.replace(out)
    return out


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy answers share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def parameters(spec) -> tuple[int, int]:
    """(total, active per token) parameters of a model: a token runs top-k of the experts."""
    hidden, layers = spec.hidden_size, spec.num_layers
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    attention = hidden * (2 * q + 2 * kv) + 2 * spec.head_dim + 2 * hidden
    embeddings = spec.vocab_size * hidden * (1 if spec.tie_word_embeddings else 2) + hidden
    if spec.moe is None:
        mlp = 3 * hidden * spec.intermediate_size
        return (embeddings + layers * (attention + mlp),) * 2
    expert = 3 * hidden * spec.moe.expert_intermediate_size
    router = spec.moe.num_experts * hidden
    total = embeddings + layers * (attention + router + spec.moe.num_experts * expert)
    active = embeddings + layers * (attention + router + spec.moe.experts_per_token * expert)
    return total, active


def roof_line(label: str, bytes_per_token: float, bandwidth: float) -> str:
    """What a model reads a token and the fastest decode the measured bandwidth allows it."""
    return (f"{label}: {bytes_per_token / 1e6:.1f} MB of weights a token, at most "
            f"{bandwidth / bytes_per_token:.0f} tok/s at the measured read bandwidth")


def main() -> None:
    parser = bench_parser(__doc__, block=None)
    parser.add_argument("--weight-type", default="auto", help="WEIGHT_TYPE: auto, int8 or "
                                                              "w8a8_int8 (float32 weights: auto)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="toy shapes: proves the script runs")
    parser.add_argument("--llama-cpp", help="python of a venv with llama-cpp-python installed")
    parser.add_argument("--llama-cpp-src", help="a llama.cpp source tree (its converter)")
    args = parser.parse_args()
    if bool(args.llama_cpp) != bool(args.llama_cpp_src):
        parser.error("--llama-cpp and --llama-cpp-src go together")
    setup_threads(args.threads)

    from rtpkv.model_factory.spec import ModelSpec
    from rtpkv.model_factory.tiny import cached_tiny_checkpoint

    sitting = shapes(TINY_MOE_SHAPE if args.tiny else MOE_SHAPE)
    paths = {name: cached_tiny_checkpoint("moe-bench", show_progress=False, **shape)
             for name, shape in sitting.items()}
    specs = {name: ModelSpec.from_config(json.loads((path / "config.json").read_text()))
             for name, path in paths.items()}
    options: dict[str, Any] = dict(dtype="float32", kv_cache_mem_mb=512, reuse_cache=False)
    weights = "float32"
    if args.weight_type != "auto":
        options["weight_type"] = args.weight_type.upper()
        weights = args.weight_type.lower()
    env = {"OMP_NUM_THREADS": str(args.threads),
           **{k: os.environ[k] for k in WAIT_POLICY_VARIABLES if k in os.environ}}
    engines: dict[str, PeerWorker] = {}
    rows_info: dict[str, tuple[int, int, float]] = {}   # parameters, active, bytes a token
    for name, path in paths.items():
        engines[name] = PeerWorker(sys.executable, "rtpkv_worker.py",
                                   [str(path), json.dumps(options), str(args.threads)], env,
                                   ("d",))
        rows_info[name] = (*parameters(specs[name]),
                           sum(decode_bytes_per_token(specs[name], WEIGHT_BYTES[weights]).values()))
        print(f"{name} checkpoint: {path}")
    spec = specs[MOE]
    print(f"shape (Qwen3-30B-A3B scaled down): {spec.num_layers} layers, hidden "
          f"{spec.hidden_size}, {spec.num_heads} query and {spec.num_kv_heads} KV heads of "
          f"{spec.head_dim}, {spec.moe.num_experts} experts of "
          f"{spec.moe.expert_intermediate_size}, top {spec.moe.experts_per_token}, vocabulary "
          f"{spec.vocab_size}; dense: MLP {sitting[DENSE]['intermediate_size']}; "
          f"{weights} weights, {args.threads} threads; each engine in a process of its own")
    same_weights: dict[str, str] = {}   # a llama.cpp row -> the rtpkv row of its checkpoint
    peer_type = "float32" if weights == "float32" else "q8_0"   # int8 on both sides
    if args.llama_cpp:
        for name, path in paths.items():
            label = name.replace("rtpkv", "llama.cpp")
            file = gguf(path, args.llama_cpp_src, "f32" if peer_type == "float32" else "q8_0")
            print(f"{label}: {file}")
            engines[label] = PeerWorker(args.llama_cpp, "peers_llamacpp.py",
                                        [str(file), str(args.threads)],
                                        {"OMP_NUM_THREADS": str(args.threads)}, ("d",))
            rows_info[label] = (*rows_info[name][:2],
                                sum(decode_bytes_per_token(specs[name],
                                                           WEIGHT_BYTES[peer_type]).values()))
            same_weights[label] = name
    paths_run = {label: ("one C call a step" if worker.ready()["fused"] else "layers one by one")
                 if label in paths else f"llama.cpp, {peer_type} GGUF"
                 for label, worker in engines.items()}
    prompt = random_ids(PROMPT, seed=11, vocab=spec.vocab_size)
    for worker in engines.values():   # warm-up: kernels built, first-call allocations
        worker.run("d", {"prompt": prompt[:16], "new": 8})
    results: dict[str, list[dict[str, Any]]] = {label: [] for label in engines}
    bandwidths: list[float] = []
    labels = list(results)
    for run in range(args.runs):
        bandwidths.append(read_bandwidth(args.threads, runs=3))
        for label in (labels if run % 2 == 0 else labels[::-1]):
            results[label].append(engines[label].run("d", {"prompt": prompt, "new": NEW}))
    for worker in engines.values():
        worker.close()
    roof = statistics.median(bandwidths)
    print(f"measured read bandwidth ({args.threads} threads, a 1 GiB sum; median of "
          f"{len(bandwidths)} rounds): {roof / 1e9:.1f} GB/s")
    for name in paths:
        parts = decode_bytes_per_token(specs[name], WEIGHT_BYTES[weights])
        print(roof_line(name, sum(parts.values()), roof) + " ("
              + ", ".join(f"{part} {n / 1e6:.1f}" for part, n in parts.items()) + " MB)")
    for label, name in same_weights.items():
        if peer_type != weights:
            print(roof_line(label, rows_info[label][2], roof))
    speeds = {label: statistics.median(r["decode_tok_s"] for r in runs)
              for label, runs in results.items()}
    rows = []
    for label, runs in results.items():
        total, active, per_token = rows_info[label]
        rtpkv = same_weights.get(label)
        rows.append([label, paths_run[label], f"{total / 1e6:.1f}M", f"{active / 1e6:.1f}M",
                     speeds[label], 1e3 / speeds[label],
                     statistics.median(r["itl_p50"] for r in runs),
                     per_token * speeds[label] / 1e9,
                     f"{per_token * speeds[label] / roof * 100:.0f}%",
                     speeds[label] / speeds[DENSE],
                     speeds[rtpkv] / speeds[label] if rtpkv else "",
                     f"{agreeing_prefix(runs[0]['outputs'][0], results[rtpkv][0]['outputs'][0])}"
                     f"/{NEW}" if rtpkv else ""])
    print(table(["engine", "path", "parameters", "active", "decode tok/s", "ms/token",
                 "ITL p50 ms", "GB/s implied", "% of roof", "x rtpkv dense", "rtpkv x this",
                 "greedy = rtpkv's"], rows))
    for label, rtpkv in same_weights.items():
        print(f"1.5x {label} would be {1.5 * speeds[label]:.0f} tok/s: "
              f"{1.5 * speeds[label] * rows_info[rtpkv][2] / roof * 100:.0f}% of the roof for "
              f"{rtpkv}'s weights")


if __name__ == "__main__":
    main()
