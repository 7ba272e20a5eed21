"""One decode step of a mixture-of-experts layer shaped like gpt-oss-20b's: the layer as one C call
(kernels/moe_experts.py) against the per-layer torch loop over the same weights, interleaved in
one process.

    python benchmarks/moe_layer.py [--runs 5] [--steps 20] [--weight-type float32] [--threads 2]
                                   [--hidden 2880] [--inter 2880] [--experts 32] [--top-k 4]
                                   [--tiny]

gpt-oss-20b's sparse layer: hidden 2880, 32 experts of intermediate 2880, top 4, a biased
router, biased experts, the clamped SwiGLU (alpha 1.702, limit 7); random weights (float32:
about 3.2 GB for the layer; `--weight-type int8` or `w8a8_int8` a quarter of that). A step is
one token through the layer (SparseMoe.forward), a fresh random token each step, the same
tokens for both paths; each run times `--steps` steps of one path then of the other, the order
alternating between runs. Figures: each path's median step time over the runs' medians, and
the torch loop's over the C call's. `--tiny` runs a toy size to show the script works (its
figures mean nothing).
"""

from __future__ import annotations

import statistics
import time
from functools import partial

import torch

from common import bench_parser, setup_threads, table
from rtpkv.kernels import weight_types
from rtpkv.kernels.linear import InferenceLinear
from rtpkv.model_factory.llama import MLP
from rtpkv.model_factory.moe import SparseMoe
from rtpkv.model_factory.spec import ModelSpec


def gpt_oss_layer(hidden: int, inter: int, experts: int, top_k: int,
                  weight_type: str) -> SparseMoe:
    """A gpt-oss sparse layer of random weights, converted as CausalLM.prepare converts it."""
    spec = ModelSpec.from_config({
        "architectures": ["GptOssForCausalLM"], "vocab_size": 64, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": 8,
        "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": experts,
        "num_experts_per_tok": top_k})
    g = torch.Generator().manual_seed(0)
    layer = SparseMoe(hidden, spec.moe, partial(MLP, spec, kind=spec.moe.activation,
                                                bias=spec.moe.expert_bias))
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * param.shape[-1] ** -0.5)
    kind = None if weight_type == "float32" else weight_types.REGISTRY[weight_type]
    layer.convert(lambda linear: kind.layer(linear) if kind else InferenceLinear(linear, "avx2"),
                  lambda router: InferenceLinear(router, "avx2"))
    return layer


def step_times(layer: SparseMoe, tokens: torch.Tensor, c_call: bool) -> float:
    """The median time of one token through `layer`, over `tokens` (one a step)."""
    kernel, layer.kernel = layer.kernel, (layer.kernel if c_call else None)
    times = []
    try:
        with torch.inference_mode():
            for token in tokens:
                start = time.perf_counter()
                layer(token[None])
                times.append(time.perf_counter() - start)
    finally:
        layer.kernel = kernel
    return statistics.median(times)


def main() -> None:
    parser = bench_parser(__doc__, block=None)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--weight-type", default="float32", help="float32, int8 or w8a8_int8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=2880)
    parser.add_argument("--inter", type=int, default=2880)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--tiny", action="store_true", help="toy shapes: proves the script runs")
    args = parser.parse_args()
    setup_threads(args.threads)
    if args.tiny:
        args.hidden, args.inter, args.experts, args.top_k = 64, 64, 8, 2
    layer = gpt_oss_layer(args.hidden, args.inter, args.experts, args.top_k, args.weight_type)
    if layer.kernel is None:
        raise SystemExit("the C expert call does not take this layer here (no AVX2/FMA or no "
                         "C compiler): nothing to compare")
    g = torch.Generator().manual_seed(1)
    medians: dict[bool, list[float]] = {True: [], False: []}
    for run in range(args.runs):
        tokens = torch.randn(args.steps, args.hidden, generator=g)
        for c_call in ((True, False) if run % 2 == 0 else (False, True)):
            medians[c_call].append(step_times(layer, tokens, c_call))
    c_ms, loop_ms = (1e3 * statistics.median(medians[k]) for k in (True, False))
    print("per run (ms), C call:", [round(1e3 * t, 2) for t in medians[True]],
          "torch loop:", [round(1e3 * t, 2) for t in medians[False]])
    print(f"gpt-oss-shaped sparse layer: hidden {args.hidden}, {args.experts} experts of "
          f"{args.inter}, top {args.top_k}, {args.weight_type}, {args.threads} threads; "
          f"{args.runs} runs of {args.steps} one-token steps")
    print(table(["path", "ms / step", "torch loop / this"],
                [["C call (kernels/moe_experts.py)", c_ms, loop_ms / c_ms],
                 ["torch loop (SparseMoe._experts)", loop_ms, 1.0]]))


if __name__ == "__main__":
    main()
