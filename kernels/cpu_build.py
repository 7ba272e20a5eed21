"""Build and load the C kernels of kernels/csrc with the system C compiler, once per machine.

The library is plain C with OpenMP (no torch headers, so a build takes about a second), compiled
for the host CPU (-march=native; no FMA contraction, so the same expression gives the same bits
wherever it is inlined: the kernels write their FMAs out) into the user's cache directory, keyed
by the source and the headers of csrc/, the compiler, the CPU's flags and the ISA level.

ISA levels (RTPKV_ISA): "avx2" (AVX2 + FMA: 8 float lanes) and "avx512" (AVX-512 F/BW/DQ/VL:
16 lanes, with VNNI's int8 dot products where the CPU has them); "auto" takes the highest this
CPU runs. A level is a set of compiler flags over -march=native (the avx2 level turns AVX-512
and VNNI off), so every level builds the same sources, each kernel choosing its vectors with
`#if defined(__AVX512F__)`. Every kernel gives the same bits at every level (each output's
arithmetic is fixed, whatever the vector width), so the level changes speed only. The level is
process-wide, like the libraries: `select_isa` (the model factory's call) sets it. It links the same
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

from rtpkv.kernels.names import ISA_LEVELS
from rtpkv.user_cache import user_cache_dir

log = logging.getLogger("rtpkv")

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
# each ISA level: the CPU flags it needs, the compiler flags that hold the build to it
ISA_NEEDS = {"avx2": ("avx2", "fma"), "avx512": ("avx2", "fma", "avx512f", "avx512bw",
                                                  "avx512dq", "avx512vl")}
ISA_FLAGS = {"avx2": ["-mno-avx512f", "-mno-avxvnni"], "avx512": []}

_selected_isa = "auto"


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
def available_isas() -> tuple[str, ...]:
    """The ISA levels this CPU runs, lowest first (empty without AVX2 and FMA); read once, as
    every kernel call asks for the current level."""
    flags = set(cpu_flags().split())
    return tuple(level for level, needs in ISA_NEEDS.items() if flags.issuperset(needs))


def cpu_kind() -> str:
    """One line naming the CPU and the instructions the kernels care about: what a benchmark
    figure was measured on."""
    flags = set(cpu_flags().split())
    extras = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16",
                          "amx_tile", "amx_int8", "amx_bf16") if f in flags]
    model = _cpuinfo("model name").partition(":")[2].strip() or "unknown CPU"
    family = _cpuinfo("cpu family").partition(":")[2].strip()
    number = _cpuinfo("model").partition(":")[2].strip()
    if family:
        core = _amd_core(int(family), "avx512f" in flags) if "AMD" in model else None
        model += f" (family {family} model {number}{': ' + core if core else ''})"
    return f"{model}, {os.cpu_count()} CPUs, {' '.join(extras) or 'no AVX2'}"


def _amd_core(family: int, avx512: bool) -> str | None:
    """AMD's core generation from the CPU family: a cloud VM's model name is often only "AMD
    EPYC", and Zen 4 and Zen 5 differ in cache sizes and 512-bit datapath width."""
    if family == 25:
        return "Zen 4" if avx512 else "Zen 3"
    return {23: "Zen or Zen 2", 26: "Zen 5"}.get(family)


def select_isa(name: str) -> None:
    """Sets the ISA level later builds and loads use (RTPKV_ISA); refuses a level this CPU
    lacks, naming the flags it needs."""
    if name not in ISA_LEVELS:
        raise ValueError(f"RTPKV_ISA={name!r} is invalid: accepted values are "
                         f"{', '.join(ISA_LEVELS)}")
    if name != "auto" and name not in available_isas():
        missing = sorted(set(ISA_NEEDS[name]) - set(cpu_flags().split()))
        raise ValueError(f"RTPKV_ISA={name} needs a CPU with {', '.join(ISA_NEEDS[name])}; this "
                         f"one lacks {', '.join(missing)}")
    global _selected_isa
    _selected_isa = name


def isa() -> str:
    """The ISA level the kernels are built for now: the selected one, or the highest this CPU
    runs ("none" without AVX2: the builds then fail and callers fall back to torch)."""
    if _selected_isa != "auto":
        return _selected_isa
    levels = available_isas()
    return levels[-1] if levels else "none"


def load_library(name: str, *linked: str) -> Optional[ctypes.CDLL]:
    """csrc/<name>.c, with csrc/<linked>.c for each of `linked` compiled beside it (a driver
    calling other kernels), as a loaded shared library built for the current ISA level on first
    use; None if it cannot be built."""
    return _load_library(name, linked, isa())


@lru_cache(maxsize=None)
def _load_library(name: str, linked: tuple[str, ...], level: str) -> Optional[ctypes.CDLL]:
    requested = os.environ.get("CC")
    compiler = shutil.which(requested) if requested else shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found (CC=%s): the %s kernel falls back to pure torch",
                    requested or "unset", name)
        return None
    sources = [SOURCE_DIR / f"{n}.c" for n in (name, *linked)]
    headers = b"".join(h.read_bytes() for h in sorted(SOURCE_DIR.glob("*.h")))
    flags = FLAGS + ISA_FLAGS.get(level, [])
    key = hashlib.sha256(b"".join(s.read_bytes() for s in sources) + headers
                         + " ".join([compiler] + flags).encode()
                         + cpu_flags().encode()).hexdigest()[:16]
    target = cache_dir() / f"{name}-{level}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so")
        os.close(fd)
        cmd = [compiler, *flags, *map(str, sources), "-o", tmp, "-lm"]
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
