"""Bindings of csrc/moe_experts.c: a mixture-of-experts layer (router, routing, chosen experts,
shared expert) in one C call (model_factory/moe.py), on the kernels the per-layer torch path
runs (the avx2, bf16-weight, int8 or w8a8 linear layers, SiLU-and-mul). A one-token decode step
then makes one call per sparse layer where the torch path makes a dozen ops for the routing and
grouping alone; the fused decoder (kernels/fused_decoder.py) calls the same C function, by the
address of this layer's table (`address`), so a decode step makes no Python call at all."""

from __future__ import annotations

import ctypes
from typing import Any, Optional

import torch

from rtpkv.kernels import fused_ops
from rtpkv.kernels.cpu_build import Signatures, bound_library
from rtpkv.kernels.fused_decoder import LINEAR_KINDS, LinearArgs, linear_args
from rtpkv.kernels.int8_linear import Int8Linear

_P = ctypes.c_void_p
_I = ctypes.c_int64


class _Expert(ctypes.Structure):
    _fields_ = [("gate_up", LinearArgs), ("down", LinearArgs)]


class _Layer(ctypes.Structure):
    _fields_ = [("num_experts", _I), ("top_k", _I), ("hidden", _I), ("inter", _I),
                ("linear_kind", _I), ("int8_group", _I), ("panel_rows", _I),
                ("experts", ctypes.POINTER(_Expert)), ("router", _P), ("normalize", _I),
                ("shared_inter", _I), ("shared", _Expert), ("shared_gate", LinearArgs),
                ("router_bias", _P), ("softmax_after_top_k", _I), ("activation", _I),
                ("alpha", ctypes.c_float), ("limit", ctypes.c_float)]

# the experts' activations (MLP.kind) the C call computes, as its `activation`
_ACTIVATIONS = {"silu": 0, "clamped_swiglu": 1}


_SIGNATURES: Signatures = {"rtpkv_moe_forward": ([_P, _P, _I, _P], None)}


def _library() -> Optional[ctypes.CDLL]:
    return bound_library("moe_experts", _SIGNATURES, "fused_ops", "fp32_linear", "int8_linear",
                         "w8a8_linear")


def _expert(mlp: Any) -> _Expert:
    return _Expert(linear_args(mlp.gate_up), linear_args(mlp.down_proj))


class ExpertKernel:
    """One sparse layer (model_factory/moe.py's SparseMoe, its linear layers converted) as one
    C call; holds its weights' addresses, so it lives as long as they do."""

    def __init__(self, moe: Any, lib: ctypes.CDLL):
        first = moe.experts[0].gate_up
        self.lib = lib
        self.hidden = first.in_features
        self.table = (_Expert * len(moe.experts))(*(_expert(e) for e in moe.experts))
        kind, panel_rows = LINEAR_KINDS[first.path]
        shared, gate = moe.shared_expert, moe.shared_expert_gate
        expert = moe.experts[0]
        clamped = expert.kind == "clamped_swiglu"
        self.layer = _Layer(
            len(moe.experts), moe.top_k, self.hidden, first.out_features // 2, kind,
            first.group_size if isinstance(first, Int8Linear) else 0, panel_rows, self.table,
            moe.gate.packed.data_ptr(), int(moe.normalize_top_k),
            0 if shared is None else shared.gate_up.out_features // 2,
            _Expert() if shared is None else _expert(shared),
            LinearArgs() if gate is None else linear_args(gate), fused_ops.ptr(moe.gate.bias),
            int(moe.softmax_after_top_k), _ACTIVATIONS[expert.kind],
            expert.alpha if clamped else 0.0, expert.limit if clamped else 0.0)
        self.address = ctypes.addressof(self.layer)

    @classmethod
    def build(cls, moe: Any) -> Optional["ExpertKernel"]:
        """The kernel of sparse layer `moe`, or None where the per-layer torch path must run it:
        a linear layer off the C kernels (oneDNN, native, bfloat16), experts on different ones,
        a router off the float32 C kernel, experts other than SwiGLU (MLP.kind "silu") or
        gpt-oss's clamped SwiGLU ones, a shared expert other than SwiGLU, a bias on the shared
        expert or its gate, or an intermediate size the C activations do not take, or no
        compiler. Routing either way (softmax then top-k, or gpt-oss's and Granite's top-k then
        softmax), router and expert biases (gpt-oss's) and an ungated shared expert (Granite's)
        are the C call's."""
        mlps = [*moe.experts, *([] if moe.shared_expert is None else [moe.shared_expert])]
        linears = [m for e in mlps for m in (e.gate_up, e.down_proj)]
        if moe.shared_expert_gate is not None:
            linears.append(moe.shared_expert_gate)
        first = linears[0]
        if (len({m.path for m in linears}) != 1 or first.path not in LINEAR_KINDS
                or getattr(moe.gate, "path", None) != "avx2"
                or len({getattr(e, "kind", None) for e in moe.experts}) != 1
                or getattr(moe.experts[0], "kind", None) not in _ACTIVATIONS
                or any(getattr(e, "kind", None) != "silu" for e in mlps[len(moe.experts):])
                or any(m.bias is not None for m in linears[2 * len(moe.experts):])
                or any((e.gate_up.out_features // 2) % fused_ops.ROW_MULTIPLE for e in mlps)):
            return None
        lib = _library()
        return None if lib is None else cls(moe, lib)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's output for x: (T, hidden) float32."""
        x = x.contiguous()
        out = torch.empty_like(x)
        self.lib.rtpkv_moe_forward(self.address, x.data_ptr(), x.shape[0], out.data_ptr())
        return out
