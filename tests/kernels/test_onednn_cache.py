"""oneDNN's primitive caches are bounded: GEMMs of ever new row counts (a server's varying
batches) level off in memory instead of growing until 1024 primitives per cache."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

PROBE = textwrap.dedent("""
    import ctypes
    import os
    import torch
    import rtpkv.kernels.linear  # sets the cache bounds before oneDNN's first primitive

    torch.set_num_threads(1)

    def rss_mb():
        # freed heap the allocator keeps would otherwise blur the cache's own growth
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(512, 256), 256)
    at = {}
    for rows in range(1, 901):
        torch.ops.mkldnn._linear_pointwise(torch.randn(rows, 256), packed, None, "none", [], "")
        if rows in (600, 900):
            at[rows] = rss_mb()
    print(os.environ["LRU_CACHE_CAPACITY"], os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"],
          at[900] - at[600])
""")


def _probe(env: dict[str, str]) -> tuple[str, str, float]:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    lru, onednn, growth = done.stdout.split()
    return lru, onednn, float(growth)


def test_memory_levels_off_after_the_cache_fills():
    env = {k: v for k, v in os.environ.items()
           if k not in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")}
    lru, onednn, growth = _probe(env)
    assert (lru, onednn) == ("128", "128")
    # unbounded (1024 entries), these 300 new shapes add ~85 MB; bounded, ~0
    assert growth < 40, f"RSS grew {growth:.0f} MB over shapes 600..900"


def test_a_capacity_set_by_the_user_wins():
    env = {**os.environ, "LRU_CACHE_CAPACITY": "32", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "48"}
    lru, onednn, _ = _probe(env)
    assert (lru, onednn) == ("32", "48")
