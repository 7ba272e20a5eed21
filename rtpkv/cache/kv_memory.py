"""KVMemory: the paged KV tensor the model reads and writes.

The K and V of every layer live in one tensor of shape
(2, num_layers, kv_heads, num_blocks * block_size, row) (with KV cache groups, `num_layers` is
the layers a block holds, one group's: rtpkv/cache/groups.py); block b holds token slots
[b * B, (b + 1) * B) of every head (the head-major layout of rtpkv.kernels.kv_store). A row is
head_dim values of the model's dtype, or for the int8 cache head_dim int8 values and their
float32 scale (rtpkv.kernels.kv_quant): the scales live in the rows, so copying a block or a
token range copies its scales too. The bookkeeping of each block (references, keys,
priorities) is the BlockPool's.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Optional, Sequence

import torch

from rtpkv.kernels.kv_quant import row_width

_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 << 20


def _advise_huge_pages(t: torch.Tensor) -> None:
    """Asks Linux to back a large CPU tensor with 2 MiB pages before it is first touched: blocks
    are read scattered across the pool, and with 4 KiB pages every block costs TLB misses (about
    7% of a batched decode's attention on the benchmark EPYC). Best effort: a no-op elsewhere."""
    size = t.numel() * t.element_size()
    if t.device.type != "cpu" or not sys.platform.startswith("linux") or size < 2 * _HUGE_PAGE:
        return
    start = -(-t.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    length = (t.data_ptr() + size - start) // _HUGE_PAGE * _HUGE_PAGE
    try:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass


class KVMemory:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        """`dtype`: the model's dtype, or torch.int8 for the int8 cache."""
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        # zeroed, not left empty: padded slots read by batched decode are masked, and a NaN in
        # uninitialised memory would still poison the masked product.
        row = row_width(head_dim, dtype)
        self.kv = torch.empty((2, num_layers, kv_heads, self.num_slots, row), dtype=dtype,
                              device=device)
        _advise_huge_pages(self.kv)
        self.kv.zero_()

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return (2 * num_layers * block_size * kv_heads * row_width(head_dim, dtype)
                * torch.empty((), dtype=dtype).element_size())

    @property
    def int8(self) -> bool:
        """Whether this is the int8 cache (rows of int8 values and their scale)."""
        return self.kv.dtype == torch.int8

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def layer_caches(self, layer_slots: Optional[Sequence[int]] = None
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per model layer, K and V as (kv_heads * num_slots, row) views of its slot
        (`layer_slots`: with KV cache groups, layers of different groups share a slot, each
        through its own group's blocks; default: layer i in slot i)."""
        d = self.kv.shape[-1]
        slots = range(self.kv.shape[1]) if layer_slots is None else layer_slots
        return [(self.kv[0, i].view(-1, d), self.kv[1, i].view(-1, d)) for i in slots]

    def _slots(self, block_id: int) -> slice:
        return slice(block_id * self.block_size, (block_id + 1) * self.block_size)

    def read_block(self, block_id: int) -> torch.Tensor:
        """One block's K/V, shape (2, num_layers, kv_heads, block_size, row): a view of the
        memory on its device, which a tier copies before its `store` returns. With CUDA the host
        tier queues that copy into pinned memory on its side stream, and the engine's stream
        waits for it before it can write the block again; the disk, Redis and connector tiers
        copy it to the CPU at once."""
        return self.kv[:, :, :, self._slots(block_id)]

    def write_block(self, block_id: int, payload: torch.Tensor) -> None:
        """Fill one block from a payload of that shape (a tier hit); from the host tier's
        pinned slot on CUDA the copy is asynchronous on the engine's stream."""
        self.kv[:, :, :, self._slots(block_id)].copy_(payload, non_blocking=True)

    def copy_tokens(self, src: int, dst: int, num_tokens: int) -> None:
        """Copy the K/V of the first num_tokens slots of block `src` into block `dst` (a
        partial-block hit: `dst` is a fresh block the request owns, never a shared one)."""
        start, B = dst * self.block_size, self.block_size
        self.kv[:, :, :, start:start + num_tokens].copy_(
            self.kv[:, :, :, src * B:src * B + num_tokens])
