"""The gated MLP activations over the fused gate_up projection: SiLU(gate) * up (SwiGLU) and
GELU(gate) * up (GeGLU, tanh approximation): the Triton kernel on CUDA, the C kernel on a CPU
(the fused decoder, kernels/fused_decoder.py, calls the same one, so the two paths share its
bits), else torch; gpt-oss's clamped SwiGLU (the C kernel on a CPU, else torch). And the tanh
soft-cap of Gemma 2's logits, on the same terms."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from rtpkv.kernels import fused_ops, triton_support


def _c_kernel(gate_up: torch.Tensor, name: str) -> Optional[torch.Tensor]:
    """(..., 2 * inter) -> (..., inter) by fused_ops.c's `name`, or None where it does not take
    the tensor."""
    inter = gate_up.shape[-1] // 2
    if not (gate_up.is_contiguous() and inter % fused_ops.ROW_MULTIPLE == 0
            and fused_ops.usable(gate_up)):
        return None
    out = gate_up.new_empty(*gate_up.shape[:-1], inter)
    getattr(fused_ops.library(), name)(gate_up.data_ptr(), out.data_ptr(),
                                       gate_up.numel() // (2 * inter), inter,
                                       int(gate_up.dtype == torch.bfloat16))
    return out


def _gated(gate_up: torch.Tensor, kernel: str, act: Callable[[torch.Tensor], torch.Tensor]
           ) -> torch.Tensor:
    out = _c_kernel(gate_up, kernel)
    if out is not None:
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(..., 2 * inter) -> (..., inter): the Triton or C kernel when it takes the tensor, else
    torch."""
    triton_ops = triton_support.ops_for(gate_up)
    if triton_ops is not None:
        return triton_ops.silu_and_mul(gate_up)
    return _gated(gate_up, "rtpkv_silu_and_mul", F.silu)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(..., 2 * inter) -> (..., inter): GELU(gate, tanh approximation) * up, Gemma's GeGLU
    (transformers' gelu_pytorch_tanh): the Triton or C kernel when it takes the tensor, else
    torch."""
    triton_ops = triton_support.ops_for(gate_up)
    if triton_ops is not None:
        return triton_ops.gelu_tanh_and_mul(gate_up)
    return _gated(gate_up, "rtpkv_gelu_tanh_and_mul",
                  lambda gate: F.gelu(gate, approximate="tanh"))


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap): the C kernel on float32 CPU tensors (the fused decoder's), else
    transformers' torch ops (in x's dtype)."""
    if (x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous()
            and fused_ops.library() is not None):
        out = x.clone()
        fused_ops.library().rtpkv_softcap(out.data_ptr(), out.numel(), cap)
        return out
    return torch.tanh(x / cap) * cap


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float
                   ) -> torch.Tensor:
    """gpt-oss's expert activation in transformers' arithmetic: the gate clamped above at
    `limit`, up clamped to [-limit, limit], then (up + 1) * gate * sigmoid(gate * alpha)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def clamped_swiglu_and_mul(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """(..., 2 * inter), gate then up -> (..., inter): `clamped_swiglu`, by the C kernel where
    it takes the tensor. The C kernel computes each row alone; torch's sigmoid gives other bits
    in its vectorized loop's scalar tail, so there a row's values can depend on the rows that
    share the tensor."""
    inter = gate_up.shape[-1] // 2
    if not (gate_up.is_contiguous() and inter % fused_ops.ROW_MULTIPLE == 0
            and fused_ops.usable(gate_up)):
        gate, up = gate_up.chunk(2, dim=-1)
        return clamped_swiglu(gate, up, alpha, limit)
    out = gate_up.new_empty(*gate_up.shape[:-1], inter)
    fused_ops.library().rtpkv_clamped_swiglu(gate_up.data_ptr(), out.data_ptr(),
                                             gate_up.numel() // (2 * inter), inter, alpha, limit,
                                             int(gate_up.dtype == torch.bfloat16))
    return out
