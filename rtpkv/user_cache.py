"""The directory where rtpkv keeps what it computes once per machine: built kernels, GEMM
probes, weight digests, the demo checkpoint."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir() -> Path:
    """`RTPKV_CACHE_DIR`, else `$XDG_CACHE_HOME/rtpkv`, else `~/.cache/rtpkv`."""
    root = os.environ.get("RTPKV_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rtpkv"
