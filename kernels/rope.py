"""Rotary position embedding (Llama's rotate_half form) with a cos/sin table precomputed once
per model, applied in place: the Triton kernel on CUDA (triton_ops), the C kernel on a CPU,
else the torch reference."""

import torch

from rtpkv.kernels import fused_ops, triton_support


def rope_table(inv_freq: torch.Tensor, max_positions: int, dtype: torch.dtype,
               device: torch.device, attention_factor: float = 1.0
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (max_positions, head_dim), float32 maths as in transformers, each
    times `attention_factor` (YaRN's; 1.0, exact, for the other RoPE types)."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq.float())
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * attention_factor, emb.sin() * attention_factor
    return cos.to(dtype=dtype, device=device), sin.to(dtype=dtype, device=device)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor) -> None:
    """Rotates q: (T, heads, d) and k: (T, kv_heads, d) in place; cos/sin: (max_positions, d)
    tables, positions: (T,) int64, each below max_positions (the caller checks, once a step:
    the C kernel does not). The C kernel takes rows of any stride with contiguous heads
    (views into the fused qkv output); otherwise the torch reference."""
    triton_ops = triton_support.ops_for(q)
    if triton_ops is not None and q.stride(2) == 1 and k.stride(2) == 1:
        triton_ops.apply_rope_(q, k, cos, sin, positions)
        return
    if (q.stride(1) == q.shape[2] and q.stride(2) == 1 and k.stride(1) == k.shape[2]
            and k.stride(2) == 1 and cos.is_contiguous() and sin.is_contiguous()
            and positions.dtype == torch.int64 and positions.is_contiguous()
            and fused_ops.usable(q, k, cos, sin, multiple=fused_ops.ROPE_MULTIPLE)):
        fused_ops.library().rtpkv_rope(q.data_ptr(), k.data_ptr(), q.shape[0], q.shape[1],
                                       k.shape[1], q.stride(0), k.stride(0), q.shape[2],
                                       cos.data_ptr(), sin.data_ptr(), positions.data_ptr(),
                                       int(q.dtype == torch.bfloat16))
        return
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    q.copy_(q * c + _rotate_half(q) * s)
    k.copy_(k * c + _rotate_half(k) * s)
