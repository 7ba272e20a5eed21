"""Keep torch's CPU parallelism in the engine thread, sized to the CPUs the process is given.

With libgomp, once the main thread has run a parallel region with N > 1 threads, its idle team
stays alive, and every other thread's team loses the spin-wait (the runtime sees more threads
than cores): small matmuls in the engine thread then run ~40% slower. Set-up work done in the
caller's thread (loading weights, zeroing the KV pool) therefore runs single-threaded, and the
engine thread sets its own thread count when it starts.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Iterator, Optional

import torch


@contextlib.contextmanager
def serial_torch() -> Iterator[None]:
    """Run the block with one intra-op thread, then restore the caller's setting."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _cgroup_paths(controller: str) -> list[Path]:
    """Where this process's cgroup keeps `controller`'s files: v2's unified tree ("0::/path"),
    v1's per-controller one; the root too, as a cgroup namespace shows its own cgroup there."""
    root = Path("/sys/fs/cgroup")
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    paths = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "" or controller in controllers.split(","):
            base = root if controllers == "" else root / controllers
            paths += [base / path.lstrip("/"), base]
    return paths


def cgroup_cpu_quota() -> Optional[float]:
    """CPUs the cgroup's quota allows this process (v2 `cpu.max`, v1 `cpu.cfs_quota_us` over
    `cpu.cfs_period_us`); None without a quota."""
    for base in _cgroup_paths("cpu"):
        try:
            if (base / "cpu.max").exists():
                quota, period = (base / "cpu.max").read_text().split()[:2]
                return None if quota == "max" else int(quota) / int(period)
            if (base / "cpu.cfs_quota_us").exists():
                quota = int((base / "cpu.cfs_quota_us").read_text())
                period = int((base / "cpu.cfs_period_us").read_text())
                return None if quota <= 0 else quota / period
        except (OSError, ValueError):
            continue
    return None


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by its cgroup's CPU quota (a
    container given 1.5 CPUs of 16 visible cores gets 2), at least 1. More OpenMP threads than
    this spin on CPU time the process is not given: each parallel region then waits for a thread
    the kernel has descheduled."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)


def engine_threads() -> int:
    """The intra-op threads the engine runs with: torch's setting (OMP_NUM_THREADS, or the
    cores it found), capped by `usable_cpus`."""
    return min(torch.get_num_threads(), usable_cpus())
