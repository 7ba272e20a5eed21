"""bfloat16 weights, float32 arithmetic (WEIGHT_TYPE=BF16): the linear layers' weights rounded to
bfloat16 once at load (exact for a bfloat16 checkpoint) and held at half the bytes of float32,
computed by csrc/fp32_linear.c's `rtpkv_bf16w_linear`, which widens them in registers and runs the
float32 kernel's FMA chains. So a layer's output is, bit for bit, the avx2 path's over float32
weights equal to the bf16 ones (its reference), batch-invariant for any row count; activations,
norms, attention and the KV cache stay float32, and the fused decoder runs it.

Why not AVX512-BF16's `vdpbf16ps`: it rounds the activations to bfloat16 too (another model than
the float32 reference, on AVX512-BF16 CPUs only), where a decode step is bound by the weights'
bytes, which widening halves as well, on every AVX2 CPU.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch
from torch import nn

from rtpkv.kernels import fp32_linear
from rtpkv.kernels.fused_ops import ptr
from rtpkv.kernels.int8_linear import QuantizedLinear


class Bf16Linear(QuantizedLinear):
    """y = x W^T + b with W held as bfloat16 panels (`fp32_linear.pack`'s layout) and float32
    activations. The C kernel where it builds, else the float GEMM over the widened weight (the
    same values, other bits, batch-invariant too)."""

    path = "bf16"

    def __init__(self, linear: nn.Linear):
        packed = fp32_linear.pack(linear.weight.detach().to(torch.bfloat16).float())
        super().__init__(linear, 0, packed.to(torch.bfloat16), None)
        self.bias = fp32_linear.pad_bias(linear.bias)   # the kernel reads whole panels

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, path={self.path}"

    def float_weight(self) -> torch.Tensor:
        """The (out, in) float32 weight this layer computes with."""
        panels = self.q.float().transpose(1, 2).reshape(-1, self.in_features)
        return panels[:self.out_features]

    def _library(self) -> Optional[ctypes.CDLL]:
        return fp32_linear.library()

    def _kernel(self, lib: ctypes.CDLL, x: torch.Tensor, rows: int, y: torch.Tensor) -> None:
        lib.rtpkv_bf16w_linear(x.data_ptr(), rows, self.in_features, self.q.data_ptr(),
                               self.out_features, ptr(self.bias), y.data_ptr())
