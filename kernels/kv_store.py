"""The KV layout and the KV write.

A pool layer is a tensor of shape (kv_heads * num_slots, head_dim), head-major: row
`h * num_slots + s` holds head h of slot s, and the slot of token position p of a sequence is
`block_table[p // B] * B + p % B`. Viewed as (kv_heads * num_blocks, B * head_dim), row
`h * num_blocks + b` is head h of block b: one `index_select` of whole blocks gathers a batch's
context straight into the contiguous (batch, kv_heads, length, head_dim) shape attention wants.
An int8 pool (kv_quant.py) has rows of head_dim int8 values and their scale, written quantized.
"""

import torch

from rtpkv.kernels.kv_quant import write_kv_int8


def head_major_rows(index: torch.Tensor, kv_heads: int, per_head: int) -> torch.Tensor:
    """Rows of slots (per_head = num_slots) or blocks (per_head = num_blocks) for every head:
    `index` of shape (..., n) gives rows of shape (..., kv_heads, n)."""
    heads = torch.arange(kv_heads, device=index.device) * per_head
    return index.unsqueeze(-2) + heads[:, None]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             rows: torch.Tensor) -> None:
    """k, v: (T, kv_heads, d) new tokens; rows: (kv_heads, T) their rows in the pool layer."""
    if k_cache.dtype == torch.int8:
        write_kv_int8(k_cache, v_cache, k, v, rows)
        return
    d = k.shape[-1]
    k_cache.index_copy_(0, rows.flatten(), k.transpose(0, 1).reshape(-1, d))
    v_cache.index_copy_(0, rows.flatten(), v.transpose(0, 1).reshape(-1, d))
