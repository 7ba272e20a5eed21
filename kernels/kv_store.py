"""The KV write: new keys and values go to their slots in the paged pool.

A pool layer is a tensor of shape (num_blocks * block_size, kv_heads, head_dim); the slot of
token position p of a sequence is `block_table[p // B] * B + p % B`.
"""

import torch


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)
