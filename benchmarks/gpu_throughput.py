"""Engine speed on one CUDA GPU against transformers on the same GPU and checkpoint: prefill
tokens/s (one long prompt), decode tokens/s (one stream, and STREAMS concurrent streams), and
the time to first token of a prompt whose prefix is cached (reuse: only the chunk after the
cached prefix is computed). rtpkv runs with RTPKV_ATTENTION=--attention (auto: flash-attn when
it imports, else Triton when it imports, else torch; the table says which) and its decode steps
from CUDA graphs where the backend allows (triton) unless --eager (ENFORCE_EAGER=1);
transformers with its default (SDPA) attention. Method and figures: docs/BENCHMARKS.md.

    python benchmarks/gpu_throughput.py [--runs 3] [--block 256] [--dtype bfloat16] [--model PATH]
                                        [--attention auto|torch|flash-attn|triton] [--eager]
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from common import bench_checkpoint, bench_parser, random_ids, table, timed_request

PREFILL, DECODE_PROMPT, DECODE_NEW, STREAMS, REUSED = 2048, 64, 128, 32, 1984


def _synced(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def ours(path: Path, dtype: str, block: int, attention: str,
         eager: bool) -> tuple[str, list[float]]:
    from rtpkv.model_factory import ModelConfig, ModelFactory
    from rtpkv.pipeline import Pipeline

    model = ModelFactory.from_huggingface(path, ModelConfig(
        device="cuda", dtype=dtype, seq_size_per_block=block, reuse_cache=True,
        kv_cache_max_tokens=STREAMS * (DECODE_PROMPT + DECODE_NEW) + 4 * PREFILL,
        rtpkv_attention=attention, enforce_eager=eager, concurrency_limit=STREAMS),
        show_progress=False)
    with Pipeline(model, model.tokenizer) as pipe:
        graphs = "CUDA graphs" if pipe.engine.runner.graphs is not None else "eager"
        timed_request(pipe, random_ids(PREFILL, seed=0), 2)            # warm-up
        prefill = PREFILL / statistics.median(
            timed_request(pipe, random_ids(PREFILL, seed=1 + i), 1)[0] for i in range(5))
        ttft, total, _ = timed_request(pipe, random_ids(DECODE_PROMPT, seed=2), DECODE_NEW)
        decode = (DECODE_NEW - 1) / (total - ttft)
        prompts = [random_ids(DECODE_PROMPT, seed=10 + i) for i in range(STREAMS)]

        def batch():
            for stream in [pipe(p, top_k=1, ignore_eos=True, max_new_tokens=DECODE_NEW)
                           for p in prompts]:
                list(stream)

        batched = STREAMS * DECODE_NEW / _synced(batch)[0]
        cached = random_ids(PREFILL, seed=50)
        timed_request(pipe, cached, 1)
        reuse_ttft = timed_request(pipe, cached[:REUSED] + random_ids(64, seed=51), 1)[0]
        return (f"{model.module.attention_name}, {graphs}",
                [prefill, decode, batched, reuse_ttft * 1e3])


def theirs(path: Path, dtype: str) -> list[float]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, dtype)).cuda().eval()

    def timed(ids: list[list[int]], new: int) -> float:
        x = torch.tensor(ids, device="cuda")
        return _synced(lambda: model.generate(x, attention_mask=torch.ones_like(x),
                                              do_sample=False, max_new_tokens=new,
                                              min_new_tokens=new))[0]

    with torch.inference_mode():
        timed([random_ids(PREFILL, seed=0)], 2)
        prefill = PREFILL / statistics.median(
            timed([random_ids(PREFILL, seed=1 + i)], 1) for i in range(5))
        one = [random_ids(DECODE_PROMPT, seed=2)]
        decode = (DECODE_NEW - 1) / (timed(one, DECODE_NEW) - timed(one, 1))
        many = [random_ids(DECODE_PROMPT, seed=10 + i) for i in range(STREAMS)]
        batched = STREAMS * DECODE_NEW / timed(many, DECODE_NEW)
        cached = random_ids(PREFILL, seed=50)
        no_cache_ttft = timed([cached[:REUSED] + random_ids(64, seed=51)], 1)
    return [prefill, decode, batched, no_cache_ttft * 1e3]


def main() -> None:
    parser = bench_parser(__doc__, block=256)
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--model", type=Path, default=None,
                        help="a checkpoint directory (default: the BENCHMARKS.md random Llama)")
    parser.add_argument("--attention", choices=("auto", "torch", "flash-attn", "triton"),
                        default="auto", help="RTPKV_ATTENTION for rtpkv")
    parser.add_argument("--eager", action="store_true",
                        help="ENFORCE_EAGER=1: no CUDA graphs for decode")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_throughput.py needs a CUDA device")
    path = args.model or bench_checkpoint()
    runs = [ours(path, args.dtype, args.block, args.attention, args.eager)
            for _ in range(args.runs)]
    backend = runs[0][0]
    mine = [statistics.median(r[1][i] for r in runs) for i in range(4)]
    ref = [statistics.median(col) for col in zip(*(theirs(path, args.dtype) for _ in range(args.runs)))]
    rows = [[f"rtpkv ({backend})"] + mine, ["transformers (SDPA)"] + ref,
            ["rtpkv / transformers"] + [m / r for m, r in zip(mine[:3], ref[:3])] + [mine[3] / ref[3]]]
    print(f"{torch.cuda.get_device_name()}, {args.dtype}, SEQ_SIZE_PER_BLOCK={args.block}, "
          f"torch {torch.__version__}, medians of {args.runs} runs")
    print(table(["engine", f"prefill tok/s ({PREFILL} tokens)", "decode tok/s (1 stream)",
                 f"decode tok/s ({STREAMS} streams)",
                 f"TTFT ms, {PREFILL} tokens, {REUSED} cached (transformers: none)"], rows))


if __name__ == "__main__":
    main()
