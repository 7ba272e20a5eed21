"""Where a prefill step's time goes, against peers.py's workloads a and b: a cold prefill of 2,064
new tokens in one step (a's first question, 4,096 tokens a step as in peers.py) and a warm one
of 160 new tokens after 1,984 cached (b's turns), on the bench model, float32, block 32.

    python benchmarks/prefill_step.py [--runs 7]

Per kind, medians over --runs requests, ms: the client's time to first token, the engine's
step, its model call (`forward_logits`), the fused decoder's linear layers, attention (with
the q/K/V copy and KV write) and elementwise kernels (csrc/decoder.c's SECONDS_*), the model
call's rest (Python, allocation), the step's rest (scheduler, metadata, sampling, bookkeeping),
the TTFT less the step (the submission and the client's wake-up; the token is handed over
before the step's end), and the process's minor page faults in the step. Each request
gets a prompt of its own (a new prefix for a cold one), so nothing but the warm prefix is
cached. Wall times: on a shared host run it when the CPUs are idle.
"""

from __future__ import annotations

import resource
import statistics
import time

import torch

from common import bench_parser, pipeline, random_ids, setup_threads, table, timed_request

COLD, CACHED, WARM_NEW = 2064, 1984, 160
PARTS = ("TTFT", "step", "model call", "linear", "attention", "elementwise", "call's rest",
         "step's rest", "TTFT - step", "page faults")


def main() -> None:
    args = bench_parser(__doc__, block=None).parse_args()
    setup_threads(2)
    rows = {"cold": [], "warm": []}
    with pipeline(dtype="float32", seq_size_per_block=32, reuse_cache=True,
                  max_num_batched_tokens=4096) as pipe:
        engine, module = pipe.engine, pipe.engine.runner.module
        if module.fused is None:
            raise SystemExit("the fused decoder does not run here: nothing to split")
        seconds = module.fused.seconds = torch.zeros(3, dtype=torch.float64)
        call: dict[str, float] = {}
        steps: list[tuple[float, float, list[float], int]] = []   # step, call, parts, faults
        forward, step = module.forward_logits, engine.step

        def timed_forward(*a, **k):
            seconds.zero_()
            t0 = time.perf_counter()
            try:
                return forward(*a, **k)
            finally:
                call["s"] = time.perf_counter() - t0

        def timed_step():
            call.clear()
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            result = step()
            steps.append((time.perf_counter() - t0, call.get("s", 0.0), seconds.tolist(),
                          resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults))
            return result

        module.forward_logits, engine.step = timed_forward, timed_step
        timed_request(pipe, random_ids(COLD, seed=999), 1)   # the first forward off the clock
        for r in range(args.runs):
            prefix = random_ids(COLD, seed=10 + r)
            for kind, ids in (("cold", prefix),
                              ("warm", prefix[:CACHED] + random_ids(WARM_NEW, seed=50 + r))):
                time.sleep(0.05)   # the last request's steps are over
                first = len(steps)
                ttft, _, _ = timed_request(pipe, ids, 1)
                while len(steps) == first:   # the step returns after the client has its token
                    time.sleep(0.001)
                whole, forward_s, (linear, attention, elementwise), faults = steps[first]
                rows[kind].append((ttft, whole, forward_s, linear, attention, elementwise,
                                   forward_s - linear - attention - elementwise,
                                   whole - forward_s, ttft - whole, faults))
    print(table(["kind"] + list(PARTS),
                [[kind] + [1e3 * statistics.median(v) for v in list(zip(*values))[:-1]]
                 + [round(statistics.median(v[-1] for v in values))]
                 for kind, values in rows.items()]))


if __name__ == "__main__":
    main()
