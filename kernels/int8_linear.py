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


def quantize(weight: torch.Tensor,
             group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) of a (out, in) weight: q int8 (out, in), scale float32 (out, groups), the last
    group of a row possibly shorter. An all-zero group gets scale 0."""
    w = weight.detach().float()
    out_features, in_features = w.shape
    groups = -(-in_features // group_size)
    padded = F.pad(w, (0, groups * group_size - in_features)).view(out_features, groups, group_size)
    scale = padded.abs().amax(dim=-1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(padded / safe.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q.view(out_features, -1)[:, :in_features].contiguous(), scale


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


class Int8Linear(nn.Module):
    """y = x W^T + b with W held as int8 and per-group scales; float32 activations. The C kernel
    where it builds, else a torch reference over the dequantized weight (correct, slower, and
    not batch-invariant in the last bits)."""

    path = "int8"

    def __init__(self, linear: nn.Linear, group_size: int = GROUP_SIZE):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group_size = group_size
        q, scale = quantize(linear.weight, group_size)
        self.q, self.scale = pack(q, scale)
        self.bias = None if linear.bias is None else linear.bias.detach().float().contiguous()

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, path=int8, group={self.group_size}"

    @property
    def nbytes(self) -> int:
        """Bytes the layer holds: int8 weights, scales and bias."""
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.bias)
                   if t is not None)

    def dequantized(self) -> torch.Tensor:
        """The (out, in) float32 weight this layer computes with."""
        q = self.q.transpose(1, 2).reshape(-1, self.in_features)[:self.out_features]
        scale = self.scale.transpose(1, 2).reshape(-1, self.scale.shape[1])[:self.out_features]
        return dequantize(q, scale, self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lib = library()
        if lib is None or x.device.type != "cpu" or x.dtype != torch.float32:
            return F.linear(x.float(), self.dequantized(), self.bias)
        x = x.contiguous()
        rows = x.numel() // self.in_features
        y = torch.empty(*x.shape[:-1], self.out_features, dtype=torch.float32)
        lib.rtpkv_int8_linear(x.data_ptr(), rows, self.in_features, self.q.data_ptr(),
                              self.scale.data_ptr(), self.out_features, self.group_size,
                              ptr(self.bias), y.data_ptr(), PANEL_MIN_ROWS)
        return y
