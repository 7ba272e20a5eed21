"""Weights moved into one anonymous mapping that Linux may back with 2 MiB pages
(madvise(MADV_HUGEPAGE); transparent huge pages set to `madvise` or `always`): the C kernels'
weights of every model on the CPU (model_factory/llama.py), a mixture's per layer
(model_factory/moe.py), each moved before a C table takes their addresses.

Why: a mixture's decode step reads 8 of 128 experts a layer, so from one step to the next it
touches a different few MiB of a weight set far larger than the caches, in 4 KiB pages whose
page-table entries (8 bytes a page: 2.5 MB for the MoE bench's 1.3 GB) are mostly cold; every
new page then costs a page walk that misses too, on top of the hardware prefetcher stopping at
the page's end. With 2 MiB pages an expert's weights are one or two TLB entries. Measured on
the experts of the MoE bench shape (a C loop over their float32 GEMVs, 8 layers x top 8 of
128): 1.035 ms a step against 1.121 in 4 KiB pages, interleaved in one process; a dense step's
GEMVs (the bench shape's dense Qwen3: attention, MLP, LM head) 0.91x. The values and their
order are unchanged (a copy), so every output keeps its bits.
"""

from __future__ import annotations

import mmap
from typing import Any, Sequence

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64   # each tensor starts on a cache line, as the allocator's do


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """`nbytes` of zeroed memory (uint8) starting on a 2 MiB boundary, in a private anonymous
    mapping advised for huge pages; the tensor keeps the mapping alive. Needs
    mmap.MADV_HUGEPAGE (Linux)."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)   # holds the mapping
    start = -whole.data_ptr() % HUGE_PAGE
    region.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    return whole[start:start + nbytes]


def into_huge_pages(holders: Sequence[tuple[Any, str]]) -> bool:
    """Moves tensor `getattr(obj, name)` of each (obj, name) into one mapping advised for huge
    pages, replacing the attribute with a view of the same dtype, shape and values; one tensor
    at a time, so the old one is freed (where nothing else holds it) before the next is copied
    and memory grows by one tensor at most. Returns False, moving nothing, where there is no
    such advice (not Linux) or a tensor is not a contiguous CPU one."""
    tensors = [getattr(obj, name) for obj, name in holders]
    if not hasattr(mmap, "MADV_HUGEPAGE") or not tensors or any(
            not isinstance(t, torch.Tensor) or t.device.type != "cpu"
            or t.layout != torch.strided or not t.is_contiguous() for t in tensors):
        return False
    sizes = [-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in tensors]
    del tensors
    buffer = huge_page_buffer(sum(sizes))
    offset = 0
    for (obj, name), size in zip(holders, sizes):
        old = getattr(obj, name)
        nbytes = old.numel() * old.element_size()
        new = buffer[offset:offset + nbytes].view(old.dtype).view(old.shape)
        new.copy_(old)
        setattr(obj, name, new)
        offset += size
    return True
