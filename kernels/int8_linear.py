"""Weight-only int8 linear layers (WEIGHT_TYPE=INT8): weights quantized once at load, computed by
csrc/int8_linear.c, which widens them to float32 in registers and accumulates in float32.

Quantization is symmetric, one float32 scale per output channel and group of GROUP_SIZE input
values (llama.cpp's Q8_0 granularity): scale = max|w| / 127 over the group, q = round(w / scale).
The weight a layer computes with is exactly `dequantize(q, scale)` = float32(q) * scale, so a
torch model holding those values is its reference. Every output is one FMA chain over the inputs
in order (see the C source): batch-invariant for any row count without padding.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from rtpkv.kernels.cpu_build import Signatures, bound_library
from rtpkv.kernels.fused_ops import ptr

GROUP_SIZE = 32        # input values per scale: the measured choice (docs/BENCHMARKS.md)
LANES = 8              # output channels per packed block (one AVX2 register of float32)
CHANNEL_MULTIPLE = 64  # channels are zero-padded to this: the kernel's tiles are whole
PANEL_MIN_ROWS = 4     # calls with at least this many rows widen weight panels once (prefill)

_P = ctypes.c_void_p
_I = ctypes.c_int64


_SIGNATURES: Signatures = {
    "rtpkv_int8_linear": ([_P, _I, _I, _P, _P, _I, _I, _P, _P, _I], None)}


def library() -> Optional[ctypes.CDLL]:
    return bound_library("int8_linear", _SIGNATURES)


def padded_groups(t: torch.Tensor, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """(rows, groups, group_size) view of `t` (rows, in), zero-padded to whole groups."""
    rows, width = t.shape
    groups = -(-width // group_size)
    return F.pad(t, (0, groups * group_size - width)).view(rows, groups, group_size)


def quantize(weight: torch.Tensor,
             group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) of a (out, in) weight: q int8 (out, in), scale float32 (out, groups), the last
    group of a row possibly shorter. scale = max|w| / 127, q = round-half-even(w / scale)
    clamped to +-127; an all-zero group gets scale 0, a group holding a NaN or an infinity gets
    scale NaN (q 0), so what it multiplies becomes NaN, as in float32."""
    w = weight.detach().float()
    padded = padded_groups(w, group_size)
    scale = padded.abs().amax(dim=-1) / 127.0
    scale = torch.where(torch.isfinite(scale), scale, torch.full_like(scale, float("nan")))
    usable = (scale > 0).unsqueeze(-1)
    safe = torch.where(usable, scale.unsqueeze(-1), torch.ones_like(padded))
    q = torch.where(usable, torch.round(padded / safe), torch.zeros_like(padded))
    q = q.clamp_(-127, 127).to(torch.int8).view(w.shape[0], padded.shape[1] * padded.shape[2])[:, :w.shape[1]]
    return q.contiguous(), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """The float32 weight the int8 layer computes with: float32(q) * its group's scale."""
    columns = torch.arange(q.shape[1]) // group_size
    return q.float() * scale[:, columns]


def pack(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's layout: channels in blocks of LANES (zero-padded to CHANNEL_MULTIPLE), q as
    (blocks, in, LANES) and scales as (blocks, groups, LANES)."""
    blocks = -(-q.shape[0] // CHANNEL_MULTIPLE) * CHANNEL_MULTIPLE // LANES
    pad = blocks * LANES - q.shape[0]
    q_blocks = F.pad(q, (0, 0, 0, pad)).view(blocks, LANES, -1).transpose(1, 2).contiguous()
    s_blocks = F.pad(scale, (0, 0, 0, pad)).view(blocks, LANES, -1).transpose(1, 2).contiguous()
    return q_blocks, s_blocks


class QuantizedLinear(nn.Module):
    """What the converted layers share (kernels/weight_types.py): the weight converted at load
    and held packed for a kernel as `q` and `scale`, a float32 bias, and the call: the kernel
    (`_kernel`) on contiguous float32 rows on the CPU, else the layer's torch path (`_torch`):
    by default the float32 weight it computes with (`float_weight`) through the float GEMM path
    `auto` picks, which is batch-invariant (kernels/linear.py), so reuse stays exact on a host
    without the C kernels; `path` names the kind."""

    path = ""

    def __init__(self, linear: nn.Linear, group_size: int, q: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group_size = group_size
        self.q, self.scale = q, scale
        self.bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        self._fallback: Optional[nn.Module] = None

    def extra_repr(self) -> str:
        return (f"{self.in_features}, {self.out_features}, path={self.path}, "
                f"group={self.group_size}")

    @property
    def nbytes(self) -> int:
        """Bytes the layer holds: weights, scales and bias."""
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.bias)
                   if t is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lib = self._library()
        if lib is None or x.device.type != "cpu" or x.dtype != torch.float32:
            return self._torch(x)
        x = x.contiguous()
        y = torch.empty(*x.shape[:-1], self.out_features, dtype=torch.float32)
        self._kernel(lib, x, x.numel() // self.in_features, y)
        return y

    def _library(self) -> Optional[ctypes.CDLL]:
        raise NotImplementedError

    def _kernel(self, lib: ctypes.CDLL, x: torch.Tensor, rows: int, y: torch.Tensor) -> None:
        raise NotImplementedError

    def float_weight(self) -> torch.Tensor:
        """The (out, in) float32 weight this layer computes with."""
        raise NotImplementedError

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        if self._fallback is None:   # built on first use: only a host without the kernel pays
            from rtpkv.kernels.linear import InferenceLinear, linear_path

            weight = self.float_weight()
            layer = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                              device="meta")
            layer.weight = nn.Parameter(weight, requires_grad=False)
            if self.bias is not None:
                layer.bias = nn.Parameter(self.bias[:self.out_features], requires_grad=False)
            self._fallback = InferenceLinear(layer, linear_path(torch.float32, weight.device))
        return self._fallback(x.float())


class Int8Linear(QuantizedLinear):
    """y = x W^T + b with W held as int8 and per-group scales; float32 activations. The C kernel
    where it builds, else the float GEMM over the dequantized weight (the same values, other
    bits, batch-invariant too)."""

    path = "int8"

    def __init__(self, linear: nn.Linear, group_size: int = GROUP_SIZE):
        super().__init__(linear, group_size, *pack(*quantize(linear.weight, group_size)))

    def float_weight(self) -> torch.Tensor:
        """The (out, in) float32 weight this layer computes with."""
        q = self.q.transpose(1, 2).reshape(-1, self.in_features)[:self.out_features]
        scale = self.scale.transpose(1, 2).reshape(-1, self.scale.shape[1])[:self.out_features]
        return dequantize(q, scale, self.group_size)

    def _library(self) -> Optional[ctypes.CDLL]:
        return library()

    def _kernel(self, lib: ctypes.CDLL, x: torch.Tensor, rows: int, y: torch.Tensor) -> None:
        lib.rtpkv_int8_linear(x.data_ptr(), rows, self.in_features, self.q.data_ptr(),
                              self.scale.data_ptr(), self.out_features, self.group_size,
                              ptr(self.bias), y.data_ptr(), PANEL_MIN_ROWS)

