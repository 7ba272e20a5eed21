"""Two checkouts' single-stream decode step, alternated: the way to see an effect of 5-20% on a
host whose speed drifts by more than that between invocations.

    python benchmarks/step_ab.py --python-a BEFORE/venv/bin/python --python-b AFTER/venv/bin/python
                                 [--weight-type auto] [--pairs 6]

Each interpreter imports its own install of rtpkv (a virtual environment with the checkout
installed editable). A measurement is one fresh process: the bench model (benchmarks/common.py),
block 32, three decodes of 128 tokens after a 512-token prompt, the median step of each decode,
then the median of the three. Pairs alternate which checkout goes first. The table has every
pair and the median of the per-pair ratios b / a.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT, NEW, DECODES = 512, 128, 3


def measure(weight_type: str) -> float:
    """The median decode step (ms) in this process."""
    from common import pipeline, random_ids, setup_threads

    setup_threads(2)
    with pipeline(seq_size_per_block=32, weight_type=weight_type) as pipe:
        engine, steps = pipe.engine, []
        step = engine.step

        def timed() -> bool:
            t0 = time.perf_counter()
            result = step()
            steps.append(time.perf_counter() - t0)
            return result

        engine.step = timed
        medians = []
        for seed in range(DECODES):
            steps.clear()
            list(pipe(random_ids(PROMPT, seed=seed), top_k=1, ignore_eos=True, max_new_tokens=NEW))
            medians.append(statistics.median(steps[2:]))   # past the prefill
        return 1e3 * statistics.median(medians)


def run(python: str, weight_type: str) -> tuple[float, str]:
    """One measurement in a fresh process of `python`: its own rtpkv, this checkout's workload
    (benchmarks/common.py), so both sides run the same model and prompts. It runs in the
    temporary directory: `python -c` puts its working directory first on the path, and in a
    checkout that would import the checkout's rtpkv on both sides. Returns the median step (ms)
    and the rtpkv package the process imported."""
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"import step_ab, rtpkv; print('STEP', step_ab.measure({weight_type!r}), "
            f"rtpkv.__path__[0])")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True,
                         cwd=tempfile.gettempdir()).stdout
    _, ms, package = next(line for line in out.splitlines() if line.startswith("STEP")).split()
    return float(ms), package


def main() -> None:
    from common import table

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python-a", required=True)
    parser.add_argument("--python-b", required=True)
    parser.add_argument("--weight-type", default="auto")
    parser.add_argument("--pairs", type=int, default=6)
    args = parser.parse_args()
    rows, ratios, packages = [], [], {}
    for i in range(args.pairs):
        order = ("a", "b") if i % 2 == 0 else ("b", "a")
        got = {}
        for side in order:
            got[side], packages[side] = run(getattr(args, f"python_{side}"), args.weight_type)
        if packages["a"] == packages["b"]:
            raise SystemExit(f"both interpreters import rtpkv from {packages['a']}")
        ratios.append(got["b"] / got["a"])
        rows.append([i + 1, "-".join(order), f"{got['a']:.3f}", f"{got['b']:.3f}",
                     f"{ratios[-1]:.2f}"])
        print(rows[-1], flush=True)
    rows.append(["median", "", "", "", f"{statistics.median(ratios):.2f}"])
    print(f"weights {args.weight_type}; median decode step (ms) per measurement; a: rtpkv of "
          f"{packages['a']}, b: {packages['b']}")
    print(table(["pair", "order", "a", "b", "b / a"], rows))


if __name__ == "__main__":
    sys.exit(main())
