"""Disk tier: a long prompt served from disk after a restart against recomputed, and the cost
of writing every block through to disk when nothing is reused.

    python benchmarks/disk.py [--runs 3] [--block 64] [--dir DIR]

Workloads (the model of docs/BENCHMARKS.md):
  restart  workload a's 2,000-token prefix + a 64-token question on a pipeline with a disk tier
           (blocks written through on a writer thread); the pipeline stops (queued writes are
           flushed) and a new pipeline on the same directory re-indexes it: TTFT of the same
           prompt there (disk_reuse_len > 0) against a pipeline without the tier (recomputed).
           The files are read through the OS page cache: this measures the tier's own cost
           (read, checksum, decode, copy), not a cold disk.
  none     16 unrelated 512-token prompts, 16 new tokens each: total time with write-through
           (WRITE_CACHE_SYNC=0, the default) and without the disk tier, and tokens per second.
Every figure is the median of --runs runs, on and off interleaved, each on a fresh pipeline and
a fresh directory. Greedy outputs with the tier are checked equal to those without.
"""

from __future__ import annotations

import statistics
import tempfile
import time

from common import bench_parser, pipeline, random_ids, setup_threads, table, timed_request


def disk(directory: str | None) -> dict:
    if directory is None:
        return {}
    return dict(enable_memory_cache_disk=True, memory_cache_disk_paths=directory)


def restart(block: int, root: str | None):
    prompt = random_ids(2000, seed=1) + random_ids(64, seed=100)
    with tempfile.TemporaryDirectory(dir=root) as directory:
        with pipeline(reuse_cache=True, seq_size_per_block=block, **disk(directory)) as pipe:
            cold, _, first = timed_request(pipe, prompt, 16)
            t0 = time.perf_counter()
            pipe.stop()
            flush = time.perf_counter() - t0
            written = pipe.cache_stats()["disk_writes"]
        with pipeline(reuse_cache=True, seq_size_per_block=block, **disk(directory)) as pipe:
            warm, _, res = timed_request(pipe, prompt, 16)
        assert res.output_ids == first.output_ids, "the disk tier changed greedy outputs"
    with pipeline(reuse_cache=True, seq_size_per_block=block) as pipe:
        recompute, _, plain = timed_request(pipe, prompt, 16)
    assert plain.output_ids == res.output_ids
    return cold, warm, recompute, flush, written, res.aux_info


def none(tier: bool, block: int, root: str | None):
    with tempfile.TemporaryDirectory(dir=root) as directory:
        with pipeline(reuse_cache=True, seq_size_per_block=block,
                      **disk(directory if tier else None)) as pipe:
            t0 = time.perf_counter()
            outs = [timed_request(pipe, random_ids(512, seed=400 + i), 16)[2].output_ids
                    for i in range(16)]
            total = time.perf_counter() - t0
            stats = pipe.cache_stats()
    return total, outs, stats


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--dir", default=None, help="where the cache directories are made")
    args = parser.parse_args()
    setup_threads()

    runs = [restart(args.block, args.dir) for _ in range(args.runs)]
    cold, warm, recompute, flush = (statistics.median(r[i] for r in runs) for i in range(4))
    aux, written = runs[0][5], runs[0][4]
    print(f"Restart: 2,064-token prompt, served from disk by a new pipeline "
          f"(TTFT, seconds; SEQ_SIZE_PER_BLOCK={args.block})")
    print(table(["", "TTFT", "recompute / this"],
                [("first pipeline (cold, writes through)", cold, recompute / cold),
                 ("new pipeline, from disk", warm, recompute / warm),
                 ("no disk tier (recomputed)", recompute, 1.0)]))
    print(f"from disk: reuse_len={aux['reuse_len']} (disk {aux['disk_reuse_len']}); "
          f"{written} block files written; stop() flushed the queue in {flush:.3f} s")

    on, off = [], []
    for i in range(args.runs):
        for flag in ((True, False) if i % 2 == 0 else (False, True)):
            (on if flag else off).append(none(flag, args.block, args.dir))
    assert on[0][1] == off[0][1], "the disk tier changed greedy outputs"
    tot_on, tot_off = statistics.median(r[0] for r in on), statistics.median(r[0] for r in off)
    s = on[0][2]
    tokens = 16 * (512 + 16)
    print(f"\nNothing to reuse: 16 unrelated 512-token prompts, 16 new tokens; write-through on a "
          f"writer thread ({s['disk_writes']} files, {s['disk_write_bytes'] / 2**20:.1f} MiB, "
          f"{s['disk_writes_dropped']} dropped)")
    print(table(["", "disk tier on", "off", "on/off - 1"],
                [("total seconds", tot_on, tot_off, f"{(tot_on / tot_off - 1) * 100:+.1f}%"),
                 ("tokens/s (prompt + output)", tokens / tot_on, tokens / tot_off,
                  f"{(tot_off / tot_on - 1) * 100:+.1f}%")]))


if __name__ == "__main__":
    main()
