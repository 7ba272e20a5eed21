"""Shared benchmark helpers: the BENCHMARKS.md model, token workloads, timing, tables."""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

# The model of docs/BENCHMARKS.md: random Llama, vocab 8000, hidden 512, intermediate 1408,
# 8 layers, 8 heads, 4 KV heads, float32 safetensors (31.8M parameters).
BENCH_CHECKPOINT = dict(architecture="LlamaForCausalLM", vocab_size=8000, hidden_size=512,
                        intermediate_size=1408, num_layers=8, num_heads=8, num_kv_heads=4,
                        max_position_embeddings=4096, tokenizer_vocab_size=2000)


# For benchmarks that count (hit rates, evictions) rather than time: what a cache does with a
# request does not depend on the model, so a much smaller one answers in a fraction of the time.
COUNTS_CHECKPOINT = dict(BENCH_CHECKPOINT, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=2, num_kv_heads=1)


def bench_parser(doc: str, *, block: int | None = 64) -> argparse.ArgumentParser:
    """The options every benchmark takes: `--runs` (medians over that many) and, for the cache
    benchmarks, `--block` (SEQ_SIZE_PER_BLOCK)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    if block is not None:
        parser.add_argument("--block", type=int, default=block, help="SEQ_SIZE_PER_BLOCK")
    return parser


# libgomp's spin-or-sleep settings: a benchmark passes them to rtpkv (in process) only; peers in
# their own processes get the default unless a benchmark gives them these explicitly
WAIT_POLICY_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def setup_threads(threads: int = 2) -> None:
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))


def wait_policy() -> str:
    """libgomp's wait policy as this process started with it (read when torch loads libgomp,
    so only the environment the process was started with counts)."""
    given = [f"{k}={os.environ[k]}" for k in WAIT_POLICY_VARIABLES if k in os.environ]
    return " ".join(given) or "libgomp's default"


def kernel_paths(module) -> str:
    """What a figure measured: the CPU kind, the kernels' ISA level, each layer's linear path,
    the attention backend (the paged kernel's query rows per vector), whether the fused
    decoder ran, and the OpenMP wait policy."""
    from rtpkv.kernels.cpu_attention import vector_lanes
    from rtpkv.kernels.cpu_build import cpu_kind, isa

    layer = module.model.layers[0]
    mlp = layer.mlp.experts[0] if hasattr(layer.mlp, "experts") else layer.mlp   # a mixture's
    paths = sorted({getattr(m, "path", type(m).__name__) for m in
                    (layer.self_attn.qkv, layer.self_attn.o_proj, mlp.gate_up, mlp.down_proj)})
    attention = module.attention_name
    if attention == "cpu-paged":
        attention += f" ({isa()}, {vector_lanes()} query rows a vector)"
    return (f"CPU: {cpu_kind()}; kernels built for {isa()}; linear layers: {', '.join(paths)}; "
            f"attention: {attention}; fused decoder: "
            f"{'on' if module.fused is not None else 'off'}; OpenMP wait: {wait_policy()}")


def read_bandwidth(threads: int, gib: float = 1.0, runs: int = 5) -> float:
    """This host's memory read bandwidth (bytes/s) with `threads` threads, measured by
    `read_bandwidth_here` in a child process: a multi-threaded torch op on this process's
    thread would start a second OpenMP team beside a pipeline's engine thread's, and with more
    team threads than cores libgomp stops spinning between parallel regions, which halved an
    in-process decode afterwards (418 -> 188 tok/s on the bench model)."""
    code = (f"from common import read_bandwidth_here; "
            f"print(read_bandwidth_here({threads}, {gib}, {runs}))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, cwd=Path(__file__).parent).stdout
    return float(out.split()[-1])


def read_bandwidth_here(threads: int, gib: float, runs: int) -> float:
    """The median of `runs` timed sums of a float32 buffer of `gib` GiB (far larger than any
    L3, so every pass reads memory), torch's vectorised reduction being one sequential read
    per thread, in 2 MiB pages where Linux gives them (kernels/huge_pages.py, as a model's
    weights are), so no page walk slows the read. A decode step that reads its weights once
    can go no faster than its bytes over this (the roof)."""
    import mmap

    from rtpkv.kernels.huge_pages import huge_page_buffer

    torch.set_num_threads(threads)
    nbytes = int(gib * 2**30) // 4 * 4
    buffer = (huge_page_buffer(nbytes) if hasattr(mmap, "MADV_HUGEPAGE")
              else torch.empty(nbytes, dtype=torch.uint8)).view(torch.float32)
    buffer.fill_(1.0)   # first touch and the team's start off the clock
    seconds = []
    for _ in range(runs):
        t0 = time.perf_counter()
        buffer.sum()
        seconds.append(time.perf_counter() - t0)
    return nbytes / statistics.median(seconds)


# bytes a weight takes per weight type: rtpkv's int8 types keep a float32 scale per 32 inputs,
# llama.cpp's Q8_0 a float16 one
WEIGHT_BYTES = {"float32": 4.0, "bfloat16": 2.0, "int8": 1 + 4 / 32, "w8a8_int8": 1 + 4 / 32,
                "q8_0": 34 / 32}


def decode_bytes_per_token(spec: Any, weight_bytes: float = 4.0,
                           router_bytes: float = 4.0) -> dict[str, float]:
    """The weight bytes one decoded token reads from memory, by part, for a model's ModelSpec
    whose weights take `weight_bytes` each (WEIGHT_BYTES) and a mixture's router
    `router_bytes` (float32 by default: rtpkv keeps the router on the float path under the int8
    weight types, so the experts chosen are the float weights', and llama.cpp's converter keeps
    it F32 in a quantized GGUF). Counted: every layer's q, k, v and o projections; its MLP: a
    dense one's gate, up and down projections, or a mixture's router (whole), its top-k experts'
    gate, up and down projections and its shared expert with that expert's gate; the LM head
    (the embedding table where tied) and one embedding row. Not
    counted: norms and biases (under 0.1%), the KV cache (2 x layers x KV heads x head_dim x
    its dtype's bytes per token of context: 0.4 MiB at 100 tokens of the MoE bench's float32
    cache), activations. Other layer kinds (linear attention, Mamba) are refused by name."""
    if spec.linear_attention is not None or spec.mamba is not None:
        raise ValueError(f"decode_bytes_per_token counts attention and MLP layers only, not "
                         f"{spec.architecture}'s linear-attention or Mamba layers")
    hidden, layers = spec.hidden_size, spec.num_layers
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    parts = {"attention": layers * hidden * (2 * q + 2 * kv)}
    moe = spec.moe
    sparse = len(moe.sparse_layers) if moe is not None else 0
    parts["dense MLP"] = (layers - sparse) * 3 * hidden * spec.intermediate_size
    if moe is not None:
        parts["router"] = sparse * moe.num_experts * hidden * router_bytes / weight_bytes
        parts["top-k experts"] = (sparse * moe.experts_per_token * 3 * hidden
                                  * moe.expert_intermediate_size)
        shared = moe.shared_expert_intermediate_size
        parts["shared expert"] = sparse * (3 * hidden * shared
                                           + (hidden if shared and moe.gated_shared_expert else 0))
    parts["LM head and embedding row"] = (spec.vocab_size + 1) * hidden
    return {part: n * weight_bytes for part, n in parts.items() if n}


def bench_checkpoint(counts: bool = False) -> Path:
    """The BENCHMARKS.md model, or with `counts` the small one for counting benchmarks."""
    from rtpkv.model_factory.tiny import cached_tiny_checkpoint

    if counts:
        return cached_tiny_checkpoint("counts", show_progress=False, **COUNTS_CHECKPOINT)
    return cached_tiny_checkpoint("bench", show_progress=False, **BENCH_CHECKPOINT)


def random_ids(n: int, seed: int, vocab: int = 8000) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def pipeline(counts: bool = False, checkpoint: Optional[Path] = None, **options: Any):
    """A pipeline on `checkpoint`, by default the BENCHMARKS.md model (`counts`: the small one)."""
    from rtpkv.model_factory import ModelConfig, ModelFactory
    from rtpkv.pipeline import Pipeline

    options.setdefault("kv_cache_mem_mb", 2048)
    model = ModelFactory.from_huggingface(checkpoint or bench_checkpoint(counts),
                                          ModelConfig(**options), show_progress=False)
    return Pipeline(model, model.tokenizer)


def prefix_workload(prefixes: int, requests: int, block: int, **options: Any) -> dict:
    """`prefixes` shared prefixes of 4 blocks, asked for `requests` times in a seeded random
    order, each with a unique 8-token question and 8 new tokens, on the counting model with
    reuse on and the pipeline `options` (the pool); returns the cache's stats."""
    heads = [random_ids(4 * block, seed=1000 + i) for i in range(prefixes)]
    order = random.Random(7)
    with pipeline(counts=True, reuse_cache=True, seq_size_per_block=block, **options) as pipe:
        for r in range(requests):
            prompt = heads[order.randrange(prefixes)] + random_ids(8, seed=5000 + r)
            for _ in pipe(prompt, top_k=1, ignore_eos=True, max_new_tokens=8):
                pass
        return pipe.cache_stats()


def timed_request(pipe, ids: Sequence[int], max_new_tokens: int, **cfg: Any) -> tuple[float, float, Any]:
    """(TTFT seconds, total seconds, last response) measured by the caller's clock."""
    t0 = time.perf_counter()
    ttft = None
    res = None
    for res in pipe(list(ids), top_k=1, ignore_eos=True, max_new_tokens=max_new_tokens, **cfg):
        if ttft is None:
            ttft = time.perf_counter() - t0
    return ttft, time.perf_counter() - t0, res


def time_calls(objs_and_names: Sequence[tuple[Any, str]]) -> list[float]:
    """Wrap methods so the seconds spent inside them add up in the returned cell."""
    spent = [0.0]
    for obj, name in objs_and_names:
        method = getattr(obj, name)

        def timed(*args, _method=method, **kwargs):
            t0 = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t0

        setattr(obj, name, timed)
    return spent


def interleaved(fn, runs: int) -> tuple[list, list]:
    """fn(True) and fn(False) `runs` times each, alternating which goes first, so that drift
    in the machine's speed falls on both sides alike."""
    on, off = [], []
    for i in range(runs):
        for flag in ((True, False) if i % 2 == 0 else (False, True)):
            (on if flag else off).append(fn(flag))
    return on, off


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if value < 100 else f"{value:.0f}"
    return str(value)
