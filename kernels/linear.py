"""Linear layers for inference, their GEMM path chosen once at load time.

Paths (`RTPKV_LINEAR`, default "auto"):
  native        F.linear in the model's dtype (MKL for float32 on x86).
  onednn        weights prepacked once for oneDNN (`torch.ops.mkldnn._linear_pointwise`); for
                bfloat16 this needs AVX512-BF16/AVX-NE-CONVERT or AMX.
  fp32-compute  a bfloat16 model on a CPU without bf16 GEMM instructions: weights kept as float32
                copies of their bf16 values, activations widened, results rounded back to bf16.
                bf16 GEMMs there run through a slow reference loop (~1-2 GFLOPS against ~27
                for float32 on the AMD EPYC of the benchmarks); the values are those of a bf16
                GEMM accumulating in float32, as oneDNN's.
"auto" takes onednn for bf16 where the CPU supports it, fp32-compute for bf16 elsewhere, and
native otherwise (on that EPYC, MKL and prepacked oneDNN float32 run at the same speed).

Batch invariance: MKL picks another kernel for very small row counts (below 8 rows, the
reduction order changes), so every call computes at least MIN_ROWS rows, padding with zeros. A
row's output then does not depend on how many rows share the call, which the bf16 reuse
guarantee needs (a decode alone and in a batch of 32 give the same bits).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

LINEAR_PATHS = ("auto", "native", "onednn", "fp32-compute")
MIN_ROWS = 16


def bf16_gemm_supported() -> bool:
    """Whether oneDNN has native bf16 GEMMs on this CPU."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def linear_path(dtype: torch.dtype, device: torch.device, name: str | None = None) -> str:
    """The GEMM path for `dtype` on `device` (see the module docstring)."""
    name = name or os.environ.get("RTPKV_LINEAR", "auto")
    if name not in LINEAR_PATHS:
        raise ValueError(f"RTPKV_LINEAR={name!r} is invalid: accepted values are "
                         f"{', '.join(LINEAR_PATHS)}")
    if device.type != "cpu":
        return "native"
    if name == "auto":
        if dtype == torch.bfloat16:
            return "onednn" if bf16_gemm_supported() else "fp32-compute"
        return "native"
    if name == "onednn" and dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"RTPKV_LINEAR=onednn supports float32 and bfloat16, not {dtype}")
    if name == "onednn" and dtype == torch.bfloat16 and not bf16_gemm_supported():
        raise ValueError("RTPKV_LINEAR=onednn with bfloat16 needs a CPU with AVX512-BF16, "
                         "AVX-NE-CONVERT or AMX; use fp32-compute or native")
    if name == "fp32-compute" and dtype != torch.bfloat16:
        return "native"   # nothing to widen
    return name


class InferenceLinear(nn.Module):
    """y = x W^T + b through `path`, at least MIN_ROWS rows per GEMM."""

    def __init__(self, linear: nn.Linear, path: str):
        super().__init__()
        self.path = path
        self.out_dtype = linear.weight.dtype
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        bias = None if linear.bias is None else linear.bias.detach()
        if path == "fp32-compute":
            weight = weight.float()
            bias = None if bias is None else bias.float()
        self.weight = weight
        self.bias = bias
        if path == "onednn":
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 256)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, path={self.path}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows < MIN_ROWS:
            x = F.pad(x, (0, 0, 0, MIN_ROWS - rows))
        if self.path == "onednn":
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        elif self.path == "fp32-compute":
            y = F.linear(x.float(), self.weight, self.bias).to(self.out_dtype)
        else:
            y = F.linear(x, self.weight, self.bias)
        return y[:rows] if rows < MIN_ROWS else y
