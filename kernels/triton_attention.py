"""The Triton attention backend: paged attention read in place from rtpkv's head-major KV pool
(kv_store), any block size, in one launch per layer for a whole mixed batch.

The batch is cut into tiles of up to TILE_ROWS consecutive query rows of one sequence, aligned
to positions (see `tiles`): a decode token is a tile of its own, a prefill chunk (after a
cached prefix or not) is cut into tiles. One program per (tile, query head) walks the keys from
its rows' oldest key to its newest in chunks of KEY_CHUNK positions, each chunk starting at a
multiple of KEY_CHUNK, each key's pool row looked up through the sequence's block table (so
SEQ_SIZE_PER_BLOCK may be any power of two), with an online softmax in float32. GQA maps query head h to KV head
h // (heads / kv_heads); the attention window masks keys older than W - 1 positions before each
query, and released table entries (-1, wholly before the window) are never read: a key chunk
may reach back past a row's window, and a never-written pool row (a CUDA pool is not zeroed)
could hold NaN, which a weight of 0 would not cancel.

Batch-invariant: a query row sees the same key chunks in the same order with the same tile
shapes wherever it is (alone, batched, in a chunk starting at 0 or after a reused prefix, as a
decode step): a chunk wholly masked for a row leaves its running max, sum and accumulator
bit-for-bit unchanged (its scores are -inf, its weights exactly 0, its rescale exactly 1), a
row sits at the same index of its tile (its position modulo TILE_ROWS) and a key at the same
index of its chunk, and a matrix product's row does not depend on the tile's other rows. So reuse on
and reuse off give the same tokens, as with the CPU paged kernel (cpu_attention).

The metadata is four device tensors whose shapes depend only on the batch's rows, sequences and
table width: a CUDA graph captured for a decode batch (rtpkv.engine.cuda_graphs) replays with
new values copied into them. A row with slot -1 (a graph's padding row) is attended but never
written to the pool. Float16, bfloat16 and float32 (IEEE products, not TF32) models; not the
int8 KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rtpkv.kernels import triton_support
from rtpkv.kernels.attention import AttentionBatch
from rtpkv.kernels.triton_ops import add, maximum, minimum, store_kv

TILE_ROWS = 16       # query rows a program attends (the smallest tl.dot tile)
KEY_CHUNK = 64       # keys per step of a program's loop, at multiples of KEY_CHUNK
MAX_HEAD_DIM = 256
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _paged_attention_kernel(q_ptr, k_cache, v_cache, out_ptr, positions_ptr, tables_ptr,
                            tiles_ptr, q_row_stride, q_head_stride, out_row_stride,
                            table_stride, num_slots,
                            block_size, window, scale,
                            GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                            TILE: tl.constexpr, CHUNK: tl.constexpr, PRECISION: tl.constexpr,
                            DOT_FP32: tl.constexpr):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    seq = tl.load(tiles_ptr + 4 * tile)
    first_row = tl.load(tiles_ptr + 4 * tile + 1)
    num_rows = tl.load(tiles_ptr + 4 * tile + 2)
    lead = tl.load(tiles_ptr + 4 * tile + 3)   # the tile's index of its first row

    offs_m = tl.arange(0, TILE)
    offs_n = tl.arange(0, CHUNK)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = (offs_m >= lead) & (offs_m < lead + num_rows)
    d_ok = offs_d < HEAD_DIM
    rows = tl.where(row_ok, first_row - lead + offs_m, first_row).to(tl.int64)
    pos = tl.load(positions_ptr + rows, mask=row_ok, other=0)
    if window > 0:
        oldest = tl.maximum(pos - window + 1, 0)      # each row's oldest key
    else:
        oldest = pos * 0
    newest = tl.reduce(tl.where(row_ok, pos, 0), 0, maximum)
    start = tl.reduce(tl.where(row_ok, oldest, newest), 0, minimum) // CHUNK * CHUNK

    q = tl.load(q_ptr + rows[:, None] * q_row_stride + head * q_head_stride + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    m_i = tl.full([TILE], -1.0e30, tl.float32)   # finite: a wholly masked chunk keeps it
    l_i = tl.full([TILE], 0.0, tl.float32)
    acc = tl.full([TILE, BLOCK_D], 0.0, tl.float32)
    table = tables_ptr + seq.to(tl.int64) * table_stride
    for key in range(start, newest + 1, CHUNK):
        kpos = key + offs_n
        block = tl.load(table + kpos // block_size, mask=kpos <= newest, other=-1)
        k_ok = (kpos <= newest) & (block >= 0)   # released entries (-1): not read, weight 0
        block = tl.maximum(block, 0)
        krow = (kv_head * num_slots + block * block_size + kpos % block_size).to(tl.int64)
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache + krow[:, None] * HEAD_DIM + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        seen = (kpos[None, :] <= pos[:, None]) & (kpos[None, :] >= oldest[:, None])
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, maximum))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, add)
        v = tl.load(v_cache + krow[:, None] * HEAD_DIM + offs_d[None, :], mask=kv_mask, other=0.0)
        p = p.to(v.dtype)   # rounded to the model's dtype, as flash attention does
        if DOT_FP32:
            p, v = p.to(tl.float32), v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(row_ok, l_i, 1.0)[:, None]   # rows past the tile's: never stored
    tl.store(out_ptr + rows[:, None] * out_row_stride + head * HEAD_DIM + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@dataclass
class TritonMetadata:
    """The kernel's inputs, on the model's device; shapes depend only on the batch's rows (T),
    sequences and table width, values are copied into a captured graph's (see the module)."""

    slots: torch.Tensor        # (T,) int64 pool slot of each row's new K/V; -1: not written
    positions: torch.Tensor    # (T,) int32
    tables: torch.Tensor       # (num_seqs, width) int32; released entries -1, never read
    tiles: torch.Tensor        # (num_tiles, 4) int32: sequence, first row, rows, lead
    block_size: int
    window: int                # keys each query attends, itself included; 0: all


def tiles(query_start: list[int], query_len: list[int],
          first_position: list[int]) -> list[tuple[int, int, int, int]]:
    """(sequence, first row, rows, lead) of each tile: a tile holds the step's rows of one
    sequence at positions [k * TILE_ROWS, (k + 1) * TILE_ROWS), the row at position p at index
    p % TILE_ROWS (its `lead` for the first): a row's index in its tile, and so the arithmetic
    that computes it, is the same however the sequence's tokens are cut into steps."""
    out = []
    for seq, (row, n, position) in enumerate(zip(query_start, query_len, first_position)):
        end = row + n
        while row < end:
            lead = position % TILE_ROWS
            rows = min(TILE_ROWS - lead, end - row)
            out.append((seq, row, rows, lead))
            row, position = row + rows, position + rows
    return out


class TritonAttention:
    """Paged attention in Triton on the AttentionBatch seam; see the module docstring."""

    name = "triton"
    graph_safe = True   # forward reads only metadata tensors: a CUDA graph may capture it

    def __init__(self, head_dim: int, dtype: torch.dtype, device: torch.device):
        if dtype not in DTYPES:
            raise ValueError(f"RTPKV_ATTENTION=triton runs float16, bfloat16 and float32 models, "
                             f"not {str(dtype).removeprefix('torch.')}")
        if head_dim % 2 or head_dim > MAX_HEAD_DIM:
            raise ValueError(f"RTPKV_ATTENTION=triton needs an even head size up to "
                             f"{MAX_HEAD_DIM}, not {head_dim}")
        # Triton's interpreter multiplies 16-bit floats' bit patterns in tl.dot: there the
        # products run on the float32 values (exact for bf16/fp16 inputs, sums in float32 as
        # on the GPU's tensor cores).
        self.dot_fp32 = triton_support.interpreting() and dtype != torch.float32
        # float32 models: IEEE products, not TF32
        self.precision = "ieee" if dtype == torch.float32 or self.dot_fp32 else "tf32"

    def build(self, batch: AttentionBatch) -> TritonMetadata:
        device = batch.device
        slots = batch.slots()
        if batch.padding:
            slots[len(slots) - batch.padding:] = -1
        return TritonMetadata(
            slots=slots,
            positions=torch.tensor(batch.positions, dtype=torch.int32, device=device),
            tables=batch.block_tables_tensor.to(torch.int32),
            tiles=torch.tensor(tiles(batch.query_start, batch.query_len,
                                     [c - n for c, n in zip(batch.context_len, batch.query_len)]),
                               dtype=torch.int32, device=device).view(-1, 4),
            block_size=batch.block_size, window=batch.window or 0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: TritonMetadata, scale: float) -> torch.Tensor:
        if k_cache.dtype == torch.int8:
            raise ValueError("RTPKV_ATTENTION=triton does not read an int8 KV cache")
        store_kv(k_cache, v_cache, k, v, meta.slots)
        T, heads, d = q.shape
        kv_heads = k.shape[1]
        out = torch.empty((T, heads, d), dtype=q.dtype, device=q.device)
        if T == 0:
            return out
        if q.stride(2) != 1:
            q = q.contiguous()
        _paged_attention_kernel[(meta.tiles.shape[0], heads)](
            q, k_cache, v_cache, out, meta.positions, meta.tables, meta.tiles,
            q.stride(0), q.stride(1), out.stride(0), meta.tables.stride(0),
            k_cache.shape[0] // kv_heads,
            meta.block_size, meta.window, scale,
            GROUP=heads // kv_heads, HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
            TILE=TILE_ROWS, CHUNK=KEY_CHUNK, PRECISION=self.precision, DOT_FP32=self.dot_fp32)
        return out
