"""The vLLM side of benchmarks/peers.py, run by vLLM's own interpreter (it imports nothing from
rtpkv): one engine per process, workloads sent as JSON lines on stdin, results written as JSON
lines prefixed with RESULT on stdout (vLLM logs on the same stream).

    VENV/bin/python benchmarks/peers_vllm.py MODEL_DIR DTYPE BLOCK
"""

from __future__ import annotations

import json
import sys
import time

from token_timing import token_timing
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt


def _params(new: int) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, max_tokens=new)


def _request(llm: LLM, ids: list[int], new: int, rid: str) -> tuple[float, list[int]]:
    """(TTFT, output ids) of one request stepped through the engine, as a streaming client sees it."""
    engine = llm.llm_engine
    t0 = time.perf_counter()
    engine.add_request(rid, TokensPrompt(prompt_token_ids=ids), _params(new))
    ttft, out = None, []
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid:
                if ttft is None and o.outputs and o.outputs[0].token_ids:
                    ttft = time.perf_counter() - t0
                out = list(o.outputs[0].token_ids)
    return ttft, out


def workload_a(llm: LLM, prefix: list[int], questions: list[list[int]], new: int) -> dict:
    ttfts, outs = [], []
    for i, q in enumerate(questions):
        ttft, out = _request(llm, prefix + q, new, f"a{i}")
        ttfts.append(ttft)
        outs.append(out)
    return {"cold": ttfts[0], "warm": sum(ttfts[1:]) / (len(ttfts) - 1), "outputs": outs}


def workload_b(llm: LLM, first: list[int], additions: list[list[int]], new: int) -> dict:
    history, ttfts, outs = list(first), [], []
    for turn, added in enumerate([[]] + additions):
        history = history + (outs[-1] if outs else []) + added
        ttft, out = _request(llm, history, new, f"b{turn}")
        ttfts.append(ttft)
        outs.append(out)
    return {"turns": sum(ttfts[1:]) / (len(ttfts) - 1), "outputs": outs}


def workload_c(llm: LLM, prompts: list[list[int]], new: int) -> dict:
    t0 = time.perf_counter()
    results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], _params(new),
                           use_tqdm=False)
    wall = time.perf_counter() - t0
    produced = sum(len(r.outputs[0].token_ids) for r in results)
    return {"tok_s": produced / wall, "outputs": [list(r.outputs[0].token_ids) for r in results]}


def workload_d(llm: LLM, prompt: list[int], new: int) -> dict:
    """Each token's arrival, as token_timing.py reads it."""
    engine = llm.llm_engine
    t0 = time.perf_counter()
    engine.add_request("d", TokensPrompt(prompt_token_ids=prompt), _params(new))
    times, out = [], []
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.outputs and len(o.outputs[0].token_ids) > len(out):
                now = time.perf_counter() - t0
                times += [now] * (len(o.outputs[0].token_ids) - len(out))
                out = list(o.outputs[0].token_ids)
    return {**token_timing(times), "outputs": [out]}


def main() -> None:
    model, dtype, block = sys.argv[1], sys.argv[2], int(sys.argv[3])
    llm = LLM(model=model, dtype=dtype, block_size=block, enable_prefix_caching=True,
              max_model_len=4096, seed=0)
    print("RESULT " + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        llm.reset_prefix_cache()
        if job["workload"] == "a":
            result = workload_a(llm, job["prefix"], job["questions"], job["new"])
        elif job["workload"] == "b":
            result = workload_b(llm, job["first"], job["additions"], job["new"])
        elif job["workload"] == "d":
            result = workload_d(llm, job["prompt"], job["new"])
        else:
            result = workload_c(llm, job["prompts"], job["new"])
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
