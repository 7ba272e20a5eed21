"""RMSNorm, computed in float32 as transformers does, cast back to the input dtype; optionally
fused with the residual add before it (vLLM's fused_add_rms_norm). On CUDA the Triton kernel
(triton_ops) where triton imports; on a CPU the C kernel; else the torch reference. Cohere's
LayerNorm without bias in torch."""

from __future__ import annotations

from typing import Optional

import torch

from rtpkv.kernels import fused_ops, triton_support


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """weight * normalize(h) with h = x, or h = residual + x stored into `residual` (in place).
    The C kernel when it takes the tensors (x made contiguous first: q/k heads of a qk-norm model
    are strided views, and one row at a time must be computed as in a batch), else
    rms_norm_reference."""
    triton_ops = triton_support.ops_for(x)
    if triton_ops is not None:
        return triton_ops.rms_norm(x, weight, eps, residual)
    dim = x.shape[-1]
    if not (fused_ops.usable(x, weight, *(() if residual is None else (residual,)))
            and weight.is_contiguous() and weight.numel() == dim
            and (residual is None or residual.is_contiguous())):
        return rms_norm_reference(x, weight, eps, residual)
    x = x.contiguous()
    out = torch.empty_like(x)
    fused_ops.library().rtpkv_rms_norm(x.data_ptr(), fused_ops.ptr(residual), weight.data_ptr(),
                                       out.data_ptr(), x.numel() // dim, dim, eps,
                                       int(x.dtype == torch.bfloat16))
    return out


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    if residual is not None:
        residual.add_(x)
        x = residual
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rms_norm_float_weight(x: torch.Tensor, weight: torch.Tensor, eps: float,
                          residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Gemma's order: the normalized input times a float32 `weight` in float32, then one
    rounding to x's dtype. For float32 x that is rms_norm's product (the rounding is none), so
    the C kernel computes it where it takes the tensors: the fused decoder calls the same kernel
    (kernels/fused_decoder.py), so the two paths share its bits. Otherwise transformers' torch
    ops."""
    if x.dtype == torch.float32:
        return rms_norm(x, weight, eps, residual)
    if residual is not None:
        residual.add_(x)
        x = residual
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def layer_norm_no_bias(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Cohere's LayerNorm (no bias) in transformers' arithmetic: in float32, the mean taken off,
    divided by the root of the variance plus eps, times the float32 weight, one rounding to x's
    dtype. With `residual`: normalizes residual + x, stored into `residual`."""
    if residual is not None:
        residual.add_(x)
        x = residual
    h = x.float()
    h = h - h.mean(-1, keepdim=True)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h).to(x.dtype)
