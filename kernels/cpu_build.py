"""Build and load the C kernels of kernels/csrc with the system C compiler, once per machine.

The library is plain C with OpenMP (no torch headers, so a build takes about a second), compiled
for the host CPU (-march=native; no FMA contraction, so the same expression gives the same bits
wherever it is inlined: the kernels write their FMAs out) into the user's cache directory, keyed
by the source and the headers of csrc/, the compiler and the CPU's flags. It links the same
`libgomp.so.1` torch loads, so it runs on torch's own OpenMP thread pool: one pool, sized by
`torch.set_num_threads`. When no compiler is found or the build fails, `load_library` returns
None and callers use their pure-torch fallback; `bound_library` is how the bindings ask for a
library, its functions' C signatures set.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

from rtpkv.user_cache import user_cache_dir

log = logging.getLogger("rtpkv")

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]


def cache_dir() -> Path:
    return user_cache_dir() / "kernels"


def _cpuinfo(field: str) -> str:
    """The first `field` line of /proc/cpuinfo ("" where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line
    except OSError:
        pass
    return ""


def cpu_flags() -> str:
    return _cpuinfo("flags")


def cpu_identity() -> str:
    """Model, core count and flags: what a measurement made on this CPU is valid for."""
    return f"{_cpuinfo('model name')} {os.cpu_count()} {cpu_flags()}"


@lru_cache(maxsize=None)
def load_library(name: str, *linked: str) -> Optional[ctypes.CDLL]:
    """csrc/<name>.c, with csrc/<linked>.c for each of `linked` compiled beside it (a driver
    calling other kernels), as a loaded shared library, built on first use; None if it cannot
    be built."""
    requested = os.environ.get("CC")
    compiler = shutil.which(requested) if requested else shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found (CC=%s): the %s kernel falls back to pure torch",
                    requested or "unset", name)
        return None
    sources = [SOURCE_DIR / f"{n}.c" for n in (name, *linked)]
    headers = b"".join(h.read_bytes() for h in sorted(SOURCE_DIR.glob("*.h")))
    key = hashlib.sha256(b"".join(s.read_bytes() for s in sources) + headers
                         + " ".join([compiler] + FLAGS).encode()
                         + cpu_flags().encode()).hexdigest()[:16]
    target = cache_dir() / f"{name}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so")
        os.close(fd)
        cmd = [compiler, *FLAGS, *map(str, sources), "-o", tmp, "-lm"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            os.unlink(tmp)
            log.warning("building the %s kernel failed, falling back to pure torch:\n%s",
                        name, result.stderr[-2000:])
            return None
        os.replace(tmp, target)  # another process may have built the same file: same bytes
    return ctypes.CDLL(str(target))


# function name -> (argtypes, restype) of a library's C functions
Signatures = dict[str, tuple[Optional[list[Any]], Any]]


def bound_library(name: str, signatures: Signatures, *linked: str) -> Optional[ctypes.CDLL]:
    """`load_library` with the C signatures of its functions set on first use. Every kernel call
    asks for its library this way, so after the first it is a cache lookup and a flag."""
    lib = load_library(name, *linked)
    if lib is not None and not getattr(lib, "_rtpkv_bound", False):
        for function, (argtypes, restype) in signatures.items():
            getattr(lib, function).argtypes = argtypes
            getattr(lib, function).restype = restype
        lib._rtpkv_bound = True
    return lib
