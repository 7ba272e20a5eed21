"""The int8 KV cache's rows (KV_CACHE_DTYPE=int8, INT8_KV_CACHE=1): quantize and dequantize.

A quantized row is one token's K (or V) of one head: `head_dim` int8 values, then their float32
scale in the next 4 bytes, so a pool row is `head_dim + 4` bytes and every path that moves rows
(block reads and writes, tiers, partial-block copies) moves the scales with them.

Symmetric, one scale per token and head: scale = max|x| / 127, q = round-half-even(x / scale),
clamped to [-127, 127] (all zeros where the scale is 0); the value read back is float(q) * scale.
Per token rather than per block because blocks fill token by token during decode: a block scale
would have to requantize the block as it fills, and a token's stored bits would depend on the
tokens after it, so reuse would no longer be exact. The C write of csrc/fused_ops.c computes the
same bits as `quantize_rows` (the tests check it).
"""

from __future__ import annotations

import ctypes

import torch

from rtpkv.kernels import fused_ops

SCALE_BYTES = 4
QMAX = 127


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one pool row: head_dim, or head_dim + the scale's bytes for int8."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """(..., D) float -> (..., D + 4) int8 rows: the torch reference of the quantized write."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / QMAX
    q = torch.where(scale > 0, x / scale, torch.zeros_like(x)).round().clamp_(-QMAX, QMAX)
    return torch.cat([q.to(torch.int8), scale.view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(..., D + 4) int8 rows -> (..., D) values float(q) * scale, in `dtype`."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)
    return (rows[..., :d].float() * scale).to(dtype)


def write_kv_int8(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  rows: torch.Tensor) -> None:
    """Quantize the new tokens' K/V (T, kv_heads, d) into their pool rows ((kv_heads, T)): the
    C kernel where it builds and takes the tensors (CPU, float32/bfloat16), else torch."""
    T, kvh, d = k.shape
    if not T:
        return   # nothing to write (quantize_rows cannot view an empty scale column as bytes)
    if fused_ops.usable(k, v) and k.stride(1) == d and v.stride(1) == d \
            and k.stride(2) == 1 and v.stride(2) == 1:
        index = rows.to(torch.int64).contiguous()
        fused_ops.library().rtpkv_write_kv_int8(
            k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            index.data_ptr(), T, kvh, d, k.stride(0), v.stride(0),
            ctypes.c_int(k.dtype == torch.bfloat16))
        return
    flat = rows.flatten()
    k_cache.index_copy_(0, flat, quantize_rows(k.transpose(0, 1)).reshape(-1, d + SCALE_BYTES))
    v_cache.index_copy_(0, flat, quantize_rows(v.transpose(0, 1)).reshape(-1, d + SCALE_BYTES))
