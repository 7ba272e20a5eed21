"""Bindings of csrc/moe_experts.c: a mixture-of-experts layer's experts in one C call, over the
(token, weight) pairs its router chose, grouped by expert (model_factory/moe.py). It runs the
kernels the per-layer torch path runs (the avx2, bf16-weight, int8 or w8a8 linear layers,
SiLU-and-mul), in the same order on the same rows, so the two give the same bits; a one-token
decode step then makes one call for its experts where it made about six torch calls per
expert."""

from __future__ import annotations

import ctypes
from typing import Optional, Sequence

import torch
from torch import nn

from rtpkv.kernels import fused_ops
from rtpkv.kernels.cpu_build import Signatures, bound_library
from rtpkv.kernels.fused_decoder import LINEAR_KINDS, LinearArgs, linear_args
from rtpkv.kernels.int8_linear import Int8Linear

_P = ctypes.c_void_p
_I = ctypes.c_int64


class _Expert(ctypes.Structure):
    _fields_ = [("gate_up", LinearArgs), ("down", LinearArgs)]


class _Experts(ctypes.Structure):
    _fields_ = [("num_experts", _I), ("hidden", _I), ("inter", _I), ("linear_kind", _I),
                ("int8_group", _I), ("panel_rows", _I), ("experts", ctypes.POINTER(_Expert))]


_SIGNATURES: Signatures = {
    "rtpkv_moe_experts": ([ctypes.POINTER(_Experts), _P, _P, _P, _P, _P, _P], None)}


def _library() -> Optional[ctypes.CDLL]:
    return bound_library("moe_experts", _SIGNATURES, "fused_ops", "fp32_linear", "int8_linear",
                         "w8a8_linear")


class ExpertKernel:
    """One layer's experts (gated MLPs whose `gate_up` and `down_proj` are already converted)
    as one C call; holds their weights' addresses, so it lives as long as they do."""

    def __init__(self, experts: Sequence[nn.Module], lib: ctypes.CDLL):
        first = experts[0].gate_up
        self.lib = lib
        self.hidden, self.inter = first.in_features, first.out_features // 2
        self.table = (_Expert * len(experts))(
            *(_Expert(linear_args(e.gate_up), linear_args(e.down_proj)) for e in experts))
        kind, panel_rows = LINEAR_KINDS[first.path]
        self.layer = _Experts(len(experts), self.hidden, self.inter, kind,
                              first.group_size if isinstance(first, Int8Linear) else 0,
                              panel_rows, self.table)

    @classmethod
    def build(cls, experts: Sequence[nn.Module]) -> Optional["ExpertKernel"]:
        """The kernel of `experts`, or None where the per-layer torch path must run them: a
        linear layer off the C kernels (oneDNN, native, bfloat16), an intermediate size the C
        SiLU-and-mul does not take, or no compiler."""
        linears = [m for e in experts for m in (e.gate_up, e.down_proj)]
        first = linears[0]
        if (len({m.path for m in linears}) != 1 or first.path not in LINEAR_KINDS
                or (first.out_features // 2) % fused_ops.ROW_MULTIPLE):
            return None
        lib = _library()
        return None if lib is None else cls(experts, lib)

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, tokens: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
        """x: (T, hidden) float32; counts: (num_experts,) int64 tokens per expert; tokens and
        weights: the pairs grouped by expert in ascending order (int64 rows of x, float32).
        Returns each row's experts' outputs, scaled and added in ascending expert order."""
        x = x.contiguous()
        counts = counts.to(torch.int64).contiguous()
        tokens = tokens.to(torch.int64).contiguous()
        weights = weights.to(torch.float32).contiguous()
        out = torch.zeros_like(x)
        widest = int(counts.max()) if counts.numel() else 0
        scratch = torch.empty(widest * (2 * self.hidden + 3 * self.inter), dtype=torch.float32)
        self.lib.rtpkv_moe_experts(ctypes.byref(self.layer), x.data_ptr(), counts.data_ptr(),
                                   tokens.data_ptr(), weights.data_ptr(), out.data_ptr(),
                                   scratch.data_ptr())
        return out
