"""The engine's threads are sized from the CPUs the process may use: its affinity mask and its
cgroup's CPU quota (v2 cpu.max, v1 cpu.cfs_quota_us), not every visible core."""

from __future__ import annotations

import os

import pytest
import torch

from rtpkv import torch_threads


def _cgroup(tmp_path, monkeypatch, proc_line: str, files: dict[str, str]):
    root = tmp_path / "sys"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    proc = tmp_path / "proc_cgroup"
    proc.write_text(proc_line + "\n")
    real = torch_threads.Path

    def fake(path, *rest):
        path = str(path)
        if path == "/proc/self/cgroup":
            return real(proc)
        return real(path.replace("/sys/fs/cgroup", str(root)), *rest)

    monkeypatch.setattr(torch_threads, "Path", fake)


@pytest.mark.parametrize("proc_line,files,quota", [
    ("0::/pod/app", {"pod/app/cpu.max": "150000 100000\n"}, 1.5),
    ("0::/", {"cpu.max": "max 100000\n"}, None),
    ("4:cpu,cpuacct:/docker/x", {"cpu,cpuacct/docker/x/cpu.cfs_quota_us": "100000\n",
                                 "cpu,cpuacct/docker/x/cpu.cfs_period_us": "100000\n"}, 1.0),
    ("4:cpu,cpuacct:/docker/x", {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
                                 "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, None),
    ("0::/", {}, None),
], ids=["v2 quota", "v2 max", "v1 quota", "v1 unlimited", "none"])
def test_the_cgroup_quota_is_read(tmp_path, monkeypatch, proc_line, files, quota):
    _cgroup(tmp_path, monkeypatch, proc_line, files)
    assert torch_threads.cgroup_cpu_quota() == quota


def test_threads_are_capped_by_quota_and_affinity(tmp_path, monkeypatch):
    _cgroup(tmp_path, monkeypatch, "0::/", {"cpu.max": "50000 100000\n"})
    assert torch_threads.usable_cpus() == 1            # half a CPU rounds up to one
    _cgroup(tmp_path, monkeypatch, "0::/", {"cpu.max": "max 100000\n"})
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert torch_threads.usable_cpus() == 1
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    assert torch_threads.engine_threads() == 1


def test_an_engine_runs_on_the_usable_cpus(make_pipeline, monkeypatch):
    monkeypatch.setattr(torch_threads, "usable_cpus", lambda: 1)
    pipe = make_pipeline()
    assert pipe.engine._threads == 1
    assert len(list(pipe("hello", generate_config={"max_new_tokens": 2}))) == 2
