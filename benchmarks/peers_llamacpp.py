"""The llama.cpp side of benchmarks/peers.py (workload d), run by an interpreter with
llama-cpp-python installed (it imports nothing from rtpkv): one model per process, workloads
sent as JSON lines on stdin, results written as JSON lines prefixed with RESULT on stdout.

    VENV/bin/python benchmarks/peers_llamacpp.py MODEL.gguf THREADS

The GGUF is the benchmark checkpoint converted by llama.cpp's own `convert_hf_to_gguf.py`
(`--outtype f32` or `q8_0`; docs/BENCHMARKS.md, "Running a peer engine").
"""

from __future__ import annotations

import json
import sys
import time

from llama_cpp import Llama
from token_timing import token_timing


def workload_d(llm: Llama, prompt: list[int], new: int) -> dict:
    """Each token's arrival, as token_timing.py reads it; greedy."""
    llm.reset()
    t0 = time.perf_counter()
    times, out = [], []
    for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0,
                              reset=True):
        times.append(time.perf_counter() - t0)
        out.append(int(token))
        if len(out) == new:
            break
    return {**token_timing(times), "outputs": [out]}


def main() -> None:
    model, threads = sys.argv[1], int(sys.argv[2])
    llm = Llama(model_path=model, n_ctx=4096, n_batch=512, n_threads=threads,
                n_threads_batch=threads, seed=0, verbose=False)
    print("RESULT " + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        if job["workload"] != "d":
            raise SystemExit(f"workload {job['workload']} is not run on llama.cpp")
        print("RESULT " + json.dumps(workload_d(llm, job["prompt"], job["new"])), flush=True)


if __name__ == "__main__":
    main()
