"""Continuous batching throughput: 32 unrelated 512-token prompts submitted at once, 64 new
tokens each (workload c of docs/BENCHMARKS.md), against one batched `transformers.generate`.

    python benchmarks/batch.py [--runs 3] [--policy GUARANTEED_NO_EVICT] [--budget 2048]
"""

from __future__ import annotations

import statistics
import time

import torch

from common import bench_parser, bench_checkpoint, pipeline, random_ids, setup_threads, table

N, PROMPT, NEW = 32, 512, 64


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def rtpkv_run(policy: str, budget: int) -> tuple[float, list[float], list[list[int]]]:
    prompts = [random_ids(PROMPT, seed=500 + i) for i in range(N)]
    with pipeline(capacity_scheduler_policy=policy, max_num_batched_tokens=budget) as pipe:
        t0 = time.perf_counter()
        streams = [pipe(p, top_k=1, ignore_eos=True, max_new_tokens=NEW) for p in prompts]
        finals = [list(s)[-1] for s in streams]
        wall = time.perf_counter() - t0
    ttfts = [r.aux_info["first_token_cost_time"] / 1000 for r in finals]
    return N * NEW / wall, ttfts, [r.output_ids for r in finals]


def transformers_run() -> tuple[float, float, list[list[int]]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(bench_checkpoint(), dtype=torch.float32)
    ids = torch.tensor([random_ids(PROMPT, seed=500 + i) for i in range(N)])
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=1, min_new_tokens=1)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW,
                             min_new_tokens=NEW)
        wall = time.perf_counter() - t0
    return N * NEW / wall, ttft, out[:, PROMPT:].tolist()


def main() -> None:
    parser = bench_parser(__doc__, block=None)
    parser.add_argument("--policy", default="GUARANTEED_NO_EVICT")
    parser.add_argument("--budget", type=int, default=2048, help="MAX_NUM_BATCHED_TOKENS")
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()
    setup_threads()
    ours = [rtpkv_run(args.policy, args.budget) for _ in range(args.runs)]
    ttfts = ours[len(ours) // 2][1]
    rows = [("rtpkv", statistics.median(r[0] for r in ours), percentile(ttfts, 50),
             percentile(ttfts, 90), percentile(ttfts, 99))]
    if not args.skip_transformers:
        theirs = [transformers_run() for _ in range(args.runs)]
        hf_ttft = statistics.median(t[1] for t in theirs)
        rows.append(("transformers (one batched generate)", statistics.median(t[0] for t in theirs),
                     hf_ttft, hf_ttft, hf_ttft))
        same = sum(a == b for a, b in zip(ours[0][2], theirs[0][2]))
        print(f"greedy outputs equal to transformers: {same}/{N}")
    print(f"Workload c: {N} x {PROMPT}-token prompts at once, {NEW} new tokens each "
          f"({args.policy}, MAX_NUM_BATCHED_TOKENS={args.budget})")
    print(table(["engine", "output tok/s", "TTFT p50 (s)", "TTFT p90 (s)", "TTFT p99 (s)"], rows))


if __name__ == "__main__":
    main()
