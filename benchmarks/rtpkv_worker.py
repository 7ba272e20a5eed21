"""rtpkv in a process of its own, driven by a benchmark as peers.py drives its peer engines
(PeerWorker): one pipeline per process, workloads sent as JSON lines on stdin, results written
as JSON lines prefixed with RESULT on stdout. A second pipeline in one process adds its engine
thread's OpenMP team to the first's (more threads than cores: libgomp stops spinning) and
about halves a decode step's speed, so a benchmark comparing rtpkv engines runs each here.

    python benchmarks/rtpkv_worker.py CHECKPOINT OPTIONS_JSON THREADS

OPTIONS_JSON: ModelConfig's fields (e.g. {"dtype": "float32", "reuse_cache": false}). The
first line says the worker is ready and how the model runs ("fused": the fused decoder's one C
call a step, or the layers one by one). Workload d: one prompt alone, greedy, EOS ignored,
`new` tokens; each token's arrival (a burst of several tokens arrives at once), as
token_timing.py reads it, and the tokens.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from common import setup_threads
from token_timing import token_timing


def workload_d(pipe: Any, prompt: list[int], new: int) -> dict[str, Any]:
    """Each token's arrival after submission, and the tokens."""
    t0 = time.perf_counter()
    times: list[float] = []
    tokens: list[int] = []
    for res in pipe(prompt, top_k=1, ignore_eos=True, max_new_tokens=new):
        while len(times) < len(res.output_ids):
            times.append(time.perf_counter() - t0)
        tokens = list(res.output_ids)
    return {**token_timing(times), "outputs": [tokens]}


def main() -> None:
    checkpoint, options, threads = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    setup_threads(threads)
    from rtpkv.model_factory import ModelConfig, ModelFactory
    from rtpkv.pipeline import Pipeline

    model = ModelFactory.from_huggingface(checkpoint, ModelConfig(**options),
                                          show_progress=False)
    with Pipeline(model, model.tokenizer) as pipe:
        print("RESULT " + json.dumps({"ready": True,
                                      "fused": model.module.fused is not None}), flush=True)
        for line in sys.stdin:
            job = json.loads(line)
            if job["workload"] != "d":
                raise SystemExit(f"workload {job['workload']} is not run by rtpkv_worker.py")
            print("RESULT " + json.dumps(workload_d(pipe, job["prompt"], job["new"])),
                  flush=True)


if __name__ == "__main__":
    main()
