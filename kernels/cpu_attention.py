"""The CPU paged-attention backend: the C kernel of csrc/paged_attention.c, reading K/V blocks
in place (no gathered copy of the context), on torch's OpenMP pool.

Each query token's arithmetic depends only on the token, its position and the K/V it reads, so
a token's attention output is bit-identical whether it is computed alone or in a batch, in a
prefill chunk starting at 0 or at a reused prefix, or as a decode step: with batch-invariant
GEMMs (see linear.py) this makes prefix reuse exact in bf16 too, and with the int8 KV cache
(kv_quant.py), whose blocks the kernel dequantizes as it reads them.
"""

from __future__ import annotations

import ctypes
from array import array
from dataclasses import dataclass, field
from functools import cached_property
from typing import Optional

import torch

from rtpkv.kernels.attention import AttentionBatch
from rtpkv.kernels.cpu_build import Signatures, bound_library
from rtpkv.kernels.kv_store import write_kv

_P = ctypes.c_void_p
_I = ctypes.c_int64


class _Args(ctypes.Structure):
    _fields_ = [("q", _P), ("k_cache", _P), ("v_cache", _P), ("out", _P), ("q_seq", _P),
                ("q_pos", _P), ("tables", _P), ("max_blocks", _I), ("T", _I), ("H", _I),
                ("KVH", _I), ("D", _I), ("B", _I), ("S", _I), ("scale", ctypes.c_float),
                ("bf16", ctypes.c_int), ("window", _I), ("kv_int8", ctypes.c_int),
                ("sinks", _P), ("softcap", ctypes.c_float)]


_SIGNATURES: Signatures = {"rtpkv_paged_attention": ([ctypes.POINTER(_Args), _P, _I], None),
                           "rtpkv_tile_limit": (None, _I), "rtpkv_head_dim_multiple": (None, _I),
                           "rtpkv_attention_lanes": (None, _I)}


def _library() -> Optional[ctypes.CDLL]:
    return bound_library("paged_attention", _SIGNATURES)


def vector_lanes() -> Optional[int]:
    """Query rows per vector of the kernel built for the current ISA level (16 at avx512, 8 at
    avx2); None where it cannot be built. Benchmarks print it beside their figures."""
    lib = _library()
    return None if lib is None else int(lib.rtpkv_attention_lanes())


def available(head_dim: int) -> bool:
    """Whether the kernel builds and handles heads of `head_dim` (a multiple of 8)."""
    lib = _library()
    return lib is not None and head_dim % lib.rtpkv_head_dim_multiple() == 0


@dataclass
class CpuMetadata:
    """The kernel's arrays in two Python arrays, passed by address: no torch op builds them (a
    decode step's metadata is a few dozen numbers, and each torch op there costs more than the
    arithmetic). The per-layer path takes `write_rows` as a tensor over the same memory."""

    ints: array                  # int32: row_seq (T,), positions (T,), tables (num_seqs, width)
    longs: array                 # int64: write_rows (kv_heads, T), tile_start (num_tiles + 1,)
    T: int
    kv_heads: int
    width: int                   # entries per block table
    num_tiles: int               # tiles of consecutive rows of one sequence
    num_slots: int
    block_size: int
    window: int = 0              # tokens attended per query; 0: no window
    table_lengths: list[int] = field(default_factory=list)   # entries of each table, unpadded

    # Where each array starts, read from the arrays at each use (they never change size once
    # built, so their buffers stay put while the metadata lives).
    @property
    def row_seq_at(self) -> int:
        return self.ints.buffer_info()[0]

    @property
    def positions_at(self) -> int:
        return self.ints.buffer_info()[0] + 4 * self.T

    @property
    def tables_at(self) -> int:
        return self.ints.buffer_info()[0] + 8 * self.T

    @property
    def write_rows_at(self) -> int:
        return self.longs.buffer_info()[0]

    @property
    def tile_start_at(self) -> int:
        return self.longs.buffer_info()[0] + 8 * self.kv_heads * self.T

    @cached_property
    def write_rows(self) -> torch.Tensor:
        """(kv_heads, T) int64 pool rows of the new K/V, over `longs`."""
        return torch.frombuffer(self.longs, dtype=torch.int64,
                                count=self.kv_heads * self.T).view(self.kv_heads, self.T)


def kernel_args(meta: CpuMetadata, T: int, H: int, KVH: int, D: int, scale: float,
                bf16: bool, kv_int8: bool, softcap: Optional[float] = None) -> _Args:
    """The kernel's arguments for this step's batch (`kv_int8`: the int8 KV cache's rows;
    `softcap`: Gemma 2's attention soft-cap); q, the caches, out and the sinks (none by
    default) are left to set."""
    return _Args(None, None, None, None, meta.row_seq_at, meta.positions_at, meta.tables_at,
                 meta.width, T, H, KVH, D, meta.block_size,
                 meta.num_slots, scale, int(bf16), meta.window, int(kv_int8), None,
                 softcap or 0.0)


class CpuPagedAttention:
    name = "cpu-paged"

    def __init__(self, dtype: torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the CPU paged-attention kernel supports float32 and bfloat16, not {dtype}")
        self.lib = _library()
        if self.lib is None:
            raise RuntimeError("the CPU paged-attention kernel could not be built")
        self.tile = int(self.lib.rtpkv_tile_limit())
        self.dtype = dtype

    def build(self, batch: AttentionBatch) -> CpuMetadata:
        """The kernel's arrays, computed on Python ints (see CpuMetadata)."""
        positions, row_seq, tables = batch.positions, batch.row_seq, batch.block_tables
        T, B, S = len(positions), batch.block_size, batch.num_slots
        width = max(map(len, tables))
        ints = array("i", row_seq)
        ints.extend(positions)
        for t in tables:
            ints.extend(t)
            ints.extend([0] * (width - len(t)))
        slots = [tables[s][p // B] * B + p % B for s, p in zip(row_seq, positions)]
        longs = array("q", [h * S + slot for h in range(batch.kv_heads) for slot in slots])
        starts = [s for row, n in zip(batch.query_start, batch.query_len)
                  for s in range(row, row + n, self.tile)]
        longs.extend(starts)
        longs.append(T)
        return CpuMetadata(ints, longs, T, batch.kv_heads, width, len(starts), S, B,
                           batch.window or 0, [len(t) for t in tables])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: CpuMetadata, scale: float,
                softcap: Optional[float] = None,
                sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`softcap`: scores become softcap * tanh(score / softcap) before the mask (Gemma 2).
        `sinks`: (H,) logits, one per query head, that join each softmax's denominator
        (gpt-oss's attention sinks)."""
        write_kv(k_cache, v_cache, k, v, meta.write_rows)
        q = q.contiguous()
        T, H, D = q.shape
        out = torch.empty((T, H, D), dtype=torch.float32)
        args = kernel_args(meta, T, H, k.shape[1], D, scale, q.dtype == torch.bfloat16,
                           k_cache.dtype == torch.int8, softcap)
        args.q, args.k_cache, args.v_cache = q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr()
        args.out = out.data_ptr()
        if sinks is not None:
            sinks = sinks.detach().to(torch.float32).contiguous()
            args.sinks = sinks.data_ptr()
        self.lib.rtpkv_paged_attention(ctypes.byref(args), meta.tile_start_at, meta.num_tiles)
        return out if q.dtype == torch.float32 else out.to(q.dtype)
