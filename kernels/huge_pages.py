"""Large CPU buffers on 2 MiB pages: the KV pool, and the weights the C kernels stream.

A decode step reads every weight once, and a KV block wherever the pool put it; with 4 KiB pages
each 4 KiB of that is a TLB entry, and the step's reads far exceed what the TLB covers. Linux
backs an anonymous region with 2 MiB pages when asked (`madvise(MADV_HUGEPAGE)`) before the
region is first touched, where transparent huge pages are enabled (`always` or `madvise`).
Best effort: a no-op elsewhere.

`gather_weights` also lays the streamed weights out in one buffer in the order a forward reads
them (layer by layer: qkv, o, gate_up, down, then the LM head), so a step walks one region front
to back. Measured on the benchmark EPYC (docs/BENCHMARKS.md, "Single-stream decode"): a decode
step takes 0.90x the time of separate 4 KiB-page allocations with int8 weights and activations,
0.93x in float32.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
ALIGN = 4096   # each weight tensor starts on a page of its own (the kernels need 32 bytes)


def advise_huge_pages(t: torch.Tensor) -> None:
    """Asks Linux to back the whole 2 MiB pages of a CPU tensor with huge pages; call it before
    the tensor is first written."""
    size = t.numel() * t.element_size()
    if t.device.type != "cpu" or not sys.platform.startswith("linux") or size < 2 * HUGE_PAGE:
        return
    start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    length = (t.data_ptr() + size - start) // HUGE_PAGE * HUGE_PAGE
    try:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass


def gather_weights(fields: list[tuple[Any, str]]) -> torch.Tensor:
    """Moves each `getattr(owner, name)` tensor (CPU, contiguous) into one buffer on huge pages,
    in the order given, and sets the attribute to its view there; returns the buffer (the views
    keep it alive). Each original is dropped as soon as it is copied, so the process holds about
    one copy of the weights throughout (the buffer's pages are touched as they are filled). Run
    it single-threaded (`torch_threads.serial_torch`) in the caller's thread: the copies are
    torch ops."""
    sizes = [getattr(owner, name).numel() * getattr(owner, name).element_size()
             for owner, name in fields]
    spans = [-(-size // ALIGN) * ALIGN for size in sizes]
    buffer = torch.empty(sum(spans) + ALIGN, dtype=torch.uint8)
    advise_huge_pages(buffer)
    offset = -buffer.data_ptr() % ALIGN
    for (owner, name), size, span in zip(fields, sizes, spans):
        original = getattr(owner, name)
        view = buffer[offset:offset + size].view(original.dtype).view(original.shape)
        view.copy_(original)
        setattr(owner, name, view)
        offset += span
    return buffer
