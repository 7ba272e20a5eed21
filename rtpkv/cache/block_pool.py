"""BlockPool: the paged KV memory the model reads, and each block's bookkeeping.

The K and V of every layer live in one tensor of shape
(2, num_layers, kv_heads, num_blocks * block_size, head_dim); block b holds token slots
[b * B, (b + 1) * B) of every head (the head-major layout of rtpkv.kernels.kv_store). A block is in exactly one state: free (in the free list), cached
(unreferenced but registered in the PrefixIndex, so still hittable; the EvictionPolicy orders
these), or in use (ref_count > 0; pinned task blocks hold a reference too).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    pin_count: int = 0
    key: bytes | None = None        # set while registered in the PrefixIndex
    parent_key: bytes = b""         # key of the previous block of the chain (root for the first)
    serial: int = 0                 # unique per filled content; 0 while not filled
    parent_serial: int = 0          # serial of the block this one was computed after
    tokens: tuple[int, ...] = ()    # the token ids whose K/V the block holds, once full
    extra: bytes = b""              # extra key material (cache salt on a first block)
    last_used: float = 0.0

    def clear(self) -> None:
        self.key, self.parent_key, self.serial, self.parent_serial = None, b"", 0, 0
        self.tokens, self.extra = (), b""


class BlockPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # zeros, not empty: padded slots read by batched decode are masked, and a NaN in
        # uninitialised memory would still poison the masked product.
        self.num_slots = num_blocks * block_size
        self.kv = torch.zeros((2, num_layers, kv_heads, self.num_slots, head_dim),
                              dtype=dtype, device=device)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def layer_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, K and V as (kv_heads * num_slots, head_dim) views."""
        d = self.kv.shape[-1]
        return [(self.kv[0, i].view(-1, d), self.kv[1, i].view(-1, d))
                for i in range(self.kv.shape[1])]

    def take_free(self) -> int:
        return self.free_ids.popleft()

    def put_free(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.clear()
        self.free_ids.append(block_id)
