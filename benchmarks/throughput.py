"""Raw engine speed against transformers on the same checkpoint: prefill tokens/s (one long
prompt) and decode tokens/s (one stream, and 8 concurrent streams).

    python benchmarks/throughput.py [--runs 3]
"""

from __future__ import annotations

import statistics
import time

import torch

from common import bench_parser, bench_checkpoint, pipeline, random_ids, setup_threads, table, timed_request

PREFILL, DECODE_PROMPT, DECODE_NEW, STREAMS = 1024, 64, 128, 8


def ours() -> tuple[float, float, float]:
    with pipeline() as pipe:
        timed_request(pipe, random_ids(PREFILL, seed=0), 2)  # warm-up: same shapes, other tokens
        prefill = PREFILL / statistics.median(
            timed_request(pipe, random_ids(PREFILL, seed=1 + i), 1)[0] for i in range(5))
        ttft, total, _ = timed_request(pipe, random_ids(DECODE_PROMPT, seed=2), DECODE_NEW)
        decode = (DECODE_NEW - 1) / (total - ttft)
        prompts = [random_ids(DECODE_PROMPT, seed=10 + i) for i in range(STREAMS)]
        t0 = time.perf_counter()
        streams = [pipe(p, top_k=1, ignore_eos=True, max_new_tokens=DECODE_NEW) for p in prompts]
        for s in streams:
            list(s)
        batched = STREAMS * DECODE_NEW / (time.perf_counter() - t0)
    return prefill, decode, batched


def theirs() -> tuple[float, float, float]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(bench_checkpoint(), dtype=torch.float32)
    gen = dict(do_sample=False)

    def timed(ids: torch.Tensor, new: int) -> float:
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                       min_new_tokens=new, **gen)
        return time.perf_counter() - t0

    with torch.inference_mode():
        timed(torch.tensor([random_ids(PREFILL, seed=0)]), 2)  # warm-up, as for rtpkv
        prefill = PREFILL / statistics.median(
            timed(torch.tensor([random_ids(PREFILL, seed=1 + i)]), 1) for i in range(5))
        one = torch.tensor([random_ids(DECODE_PROMPT, seed=2)])
        decode = (DECODE_NEW - 1) / (timed(one, DECODE_NEW) - timed(one, 1))
        many = torch.tensor([random_ids(DECODE_PROMPT, seed=10 + i) for i in range(STREAMS)])
        batched = STREAMS * DECODE_NEW / timed(many, DECODE_NEW)
    return prefill, decode, batched


def main() -> None:
    parser = bench_parser(__doc__, block=None)
    args = parser.parse_args()
    setup_threads()
    rows = []
    for name, fn in (("rtpkv", ours), ("transformers", theirs)):
        results = [fn() for _ in range(args.runs)]
        rows.append([name] + [statistics.median(r[i] for r in results) for i in range(3)])
    rows.append(["rtpkv / transformers"] + [rows[0][i] / rows[1][i] for i in range(1, 4)])
    print(f"fp32, 2 threads, medians of {args.runs} runs")
    print(table(["engine", f"prefill tok/s ({PREFILL} tokens)", "decode tok/s (1 stream)",
                 f"decode tok/s ({STREAMS} streams, batched)"], rows))


if __name__ == "__main__":
    main()
