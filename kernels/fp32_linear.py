"""Bindings of csrc/fp32_linear.c, the float32 GEMM of RTPKV_LINEAR=avx2: weights packed once
into panels of 16 output channels; every output one FMA chain over its inputs in order (see the
C source), so any row count gives the same bits without padding or probing."""

from __future__ import annotations

import ctypes
from typing import Optional

import torch
import torch.nn.functional as F

from rtpkv.kernels.cpu_build import Signatures, bound_library, cpu_flags
from rtpkv.kernels.fused_ops import ptr

PANEL = 16   # output channels per packed panel

_P = ctypes.c_void_p
_I = ctypes.c_int64
_SIGNATURES: Signatures = {"rtpkv_fp32_linear": ([_P, _I, _I, _P, _I, _P, _P], None),
                           "rtpkv_bf16w_linear": ([_P, _I, _I, _P, _I, _P, _P], None)}


def library() -> Optional[ctypes.CDLL]:
    return bound_library("fp32_linear", _SIGNATURES)


def available() -> bool:
    """Whether this CPU runs the kernel (AVX2 and FMA) and it builds."""
    flags = cpu_flags().split()
    return "avx2" in flags and "fma" in flags and library() is not None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """(out, in) float32 -> (panels, in, PANEL): output channels zero-padded to whole panels."""
    out_features = weight.shape[0]
    panels = -(-out_features // PANEL)
    padded = F.pad(weight.detach().float(), (0, 0, 0, panels * PANEL - out_features))
    return padded.view(panels, PANEL, -1).transpose(1, 2).contiguous()


def pad_bias(bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The bias zero-padded to whole panels (the kernel reads a tile's full width)."""
    if bias is None:
        return None
    return F.pad(bias.detach().float(), (0, -bias.shape[0] % PANEL)).contiguous()


def fp32_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor],
                out_features: int) -> torch.Tensor:
    """y = x W^T + b for float32 `x` of shape (..., in) on the CPU; `packed` from `pack`, `bias`
    from `pad_bias`; the kernel must be `available()` (linear_path checks it)."""
    in_features = packed.shape[1]
    if x.dtype != torch.float32 or x.shape[-1] != in_features:
        # the kernel would read any other tensor as float32 rows of in_features values
        raise ValueError(f"the avx2 linear layer takes float32 inputs of {in_features} "
                         f"features, not {x.dtype} of {x.shape[-1]}")
    x = x.contiguous()
    y = torch.empty(*x.shape[:-1], out_features, dtype=torch.float32)
    library().rtpkv_fp32_linear(x.data_ptr(), x.numel() // in_features, in_features,
                               packed.data_ptr(), out_features, ptr(bias), y.data_ptr())
    return y
