"""Giving freed heap memory back to the OS: `malloc_trim(0)` from the engine thread.

Why: under a load of ever new batch sizes a server's RSS grew by hundreds of MiB while its live
allocations (glibc's `mallinfo2().uordblks`), Python's objects and the KV pool stayed flat: the
growth was free memory kept inside glibc's arenas, mostly the engine thread's. Activations of
a new size are served from an arena (glibc's dynamic mmap threshold moves up to each large
block freed, up to 32 MiB), and an arena returns memory only from its top, so freed buffers of
other sizes stay resident. `malloc_trim(0)` releases every whole free page of every arena. It
runs at most every `RTPKV_MALLOC_TRIM_S` seconds and only after the engine has stepped since
the last trim; a no-op where the C library has no `malloc_trim` (musl, macOS). The fused
decoder's forward scratch is not the arenas' (kernels/fused_decoder.py keeps it).
"""

from __future__ import annotations

import ctypes
import logging
import time
from typing import Callable, Optional

log = logging.getLogger("rtpkv")


def libc_malloc_trim() -> Optional[Callable[[], None]]:
    """glibc's `malloc_trim(0)`, or None where the process's C library has none."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


class HeapTrimmer:
    """Calls `trim` when `interval_s` has passed since the last call and the engine has stepped
    since; `interval_s` 0 (or no `trim`) turns it off."""

    def __init__(self, interval_s: float, trim: Optional[Callable[[], None]],
                 clock: Callable[[], float] = time.monotonic):
        self.interval_s = interval_s
        self._trim = trim if interval_s > 0 else None
        self._clock = clock
        self._last = clock()
        self._stepped = False
        self.trims = 0

    def stepped(self) -> None:
        """The engine ran a step (and so allocated and freed activations)."""
        self._stepped = True
        self.maybe_trim()

    def maybe_trim(self) -> None:
        """Trim if due: called after each step and on each idle wake-up of the engine loop."""
        if self._trim is None or not self._stepped:
            return
        now = self._clock()
        if now - self._last < self.interval_s:
            return
        self._trim()
        self._last, self._stepped = self._clock(), False
        self.trims += 1
        log.debug("malloc_trim: %.1f ms", (self._last - now) * 1000)
