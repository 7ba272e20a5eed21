"""Int8 weights and int8 activations (WEIGHT_TYPE=W8A8_INT8), computed by csrc/w8a8_linear.c on
the AVX2 integer multiply-adds, as llama.cpp computes its Q8_0 weights against Q8_0 activations.

Weights are quantized at load exactly as for WEIGHT_TYPE=INT8 (`int8_linear.quantize`: symmetric,
a scale per output channel and group of GROUP_SIZE inputs); each call quantizes its input the
same way, a scale per row and group (`quantize_activations`). The products are then integers, and
their sum per group is exact, so `reference` (a float32 matmul of the int8 values, exact below
2^24, then the groups added in order) gives the kernel's bits: it is both the tests' reference
and the fallback where no compiler is found. Each output depends on its own row only, so the
layer is batch-invariant for any row count.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from rtpkv.kernels.cpu_build import Signatures, bound_library
from rtpkv.kernels.fused_ops import ptr
from rtpkv.kernels.int8_linear import QuantizedLinear, padded_groups, quantize

GROUP_SIZE = 32        # inputs per scale, fixed by the kernel (GROUP in csrc/w8a8_linear.c)
LANES = 8              # output channels per packed block
STEP = 4               # inputs per vector step of the kernel
TILE_BLOCKS = 4        # blocks interleaved in one weight stream (a GEMV tile: 32 channels)
CHANNEL_MULTIPLE = TILE_BLOCKS * LANES   # channels are zero-padded to whole tiles
MANY_ROWS_FROM = 4     # calls with at least this many rows sweep rows over a tile (prefill)

_P = ctypes.c_void_p
_I = ctypes.c_int64

_SIGNATURES: Signatures = {
    "rtpkv_w8a8_linear": ([_P, _I, _I, _P, _P, _I, _P, _P, _I], None)}


def library() -> Optional[ctypes.CDLL]:
    return bound_library("w8a8_linear", _SIGNATURES)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qx, sx) of float32 rows (rows, in) by the weights' rule (`int8_linear.quantize`, the C
    kernel's bit for bit): qx int8 (rows, groups, GROUP_SIZE), zero-padded; sx float32
    (rows, groups)."""
    q, scale = quantize(x, GROUP_SIZE)
    return padded_groups(q, GROUP_SIZE), scale


def reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
              bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The kernel's result for x (..., in) and a weight quantized by `int8_linear.quantize`
    (q (out, in), scale (out, groups)): the same bits, in torch."""
    rows = x.reshape(-1, q.shape[1]).float()
    qx, sx = quantize_activations(rows)
    qw = padded_groups(q, GROUP_SIZE).float()
    acc = torch.zeros(rows.shape[0], q.shape[0])
    for g in range(qw.shape[1]):
        isum = qx[:, g].float() @ qw[:, g].T          # exact: integers below 2^24
        acc = acc + isum * (scale[:, g] * sx[:, g, None])
    if bias is not None:
        acc = acc + bias
    return acc.view(*x.shape[:-1], q.shape[0])


def pack(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's layout: channels zero-padded to whole tiles of TILE_BLOCKS blocks of LANES,
    inputs zero-padded to whole groups; q as (tiles, in / STEP, TILE_BLOCKS, LANES, STEP), so a
    tile's weights are one stream in the order the kernel reads them, and scales as
    (blocks, groups, LANES)."""
    tiles = -(-q.shape[0] // CHANNEL_MULTIPLE)
    pad = tiles * CHANNEL_MULTIPLE - q.shape[0]
    padded = F.pad(padded_groups(q, GROUP_SIZE).reshape(q.shape[0], -1), (0, 0, 0, pad))
    q_tiles = padded.view(tiles, TILE_BLOCKS, LANES, -1, STEP).permute(0, 3, 1, 2, 4).contiguous()
    blocks = tiles * TILE_BLOCKS
    s_blocks = F.pad(scale, (0, 0, 0, pad)).view(blocks, LANES, -1).transpose(1, 2).contiguous()
    return q_tiles, s_blocks


def unpack(q_tiles: torch.Tensor, s_blocks: torch.Tensor, out_features: int,
           in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack`'s inverse: (q (out, in), scale (out, groups))."""
    q = q_tiles.permute(0, 2, 3, 1, 4).reshape(-1, q_tiles.shape[1] * STEP)
    scale = s_blocks.transpose(1, 2).reshape(-1, s_blocks.shape[1])
    return q[:out_features, :in_features], scale[:out_features]


class W8A8Linear(QuantizedLinear):
    """y = x W^T + b with W held as int8 with per-group scales and x quantized per row and group
    at each call. The C kernel where it builds, else `reference` (the same bits, slower)."""

    path = "w8a8"

    def __init__(self, linear: nn.Linear):
        super().__init__(linear, GROUP_SIZE, *pack(*quantize(linear.weight, GROUP_SIZE)))

    def quantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q (out, in) int8, scale (out, groups)): the weight as `int8_linear.quantize` gave it."""
        return unpack(self.q, self.scale, self.out_features, self.in_features)

    def _library(self) -> Optional[ctypes.CDLL]:
        return library()

    def _kernel(self, lib: ctypes.CDLL, x: torch.Tensor, rows: int, y: torch.Tensor) -> None:
        lib.rtpkv_w8a8_linear(x.data_ptr(), rows, self.in_features, self.q.data_ptr(),
                              self.scale.data_ptr(), self.out_features, ptr(self.bias),
                              y.data_ptr(), MANY_ROWS_FROM)

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        return reference(x, *self.quantized(), self.bias)
