"""Attention backends: what the ModelRunner hands them, and the pure-torch reference.

The ModelRunner describes a step's batch once (`AttentionBatch`: token positions, each
sequence's rows, context length and block table); a backend's `build` turns that into whatever
metadata its kernel wants, and its `forward` runs one layer. A new kernel (flash-attn, a CPU
kernel) is a new backend, not a change to the ModelRunner.

`TorchAttention`, the reference, lays the batch out as [decode tokens..., prefill chunk 1,
chunk 2, ...] (the ModelRunner orders rows that way): decode tokens are attended in one batched
call over their gathered contexts (padded, masked); each prefill chunk attends causally to its
cached prefix plus its own new tokens. With an attention window, contexts are gathered from the
window's first block and masked to a band (keys within W positions of each query). Contexts are
gathered a whole block at a time with one `index_select` over head-major block rows (see
kv_store). With the int8 KV cache (kv_quant.py) the gathered rows are dequantized, and a chunk
without a cached prefix attends its own K/V as stored (quantized and back), as every later query
reads them. On CUDA its results depend on the batch's shape in the last bits, so there it does
not give the batch-invariance guarantee (see cpu_attention). On a CPU, where it is the fallback
of a host without the C kernels (no AVX2 or no compiler), each query row attends alone to exactly
its keys (`TorchMetadata.key_ranges`): one SDPA call of one shape per row, whatever shares its
step, so reuse on equals reuse off there too, at the cost of a call per row.

On CUDA it turns cuDNN's SDPA backend off (`torch.backends.cuda.enable_cudnn_sdp(False)`) when
it is made: cuDNN builds an execution plan for each new shape, and a decode's context grows by
one token a step, so every layer of every step paid for a new plan (on an H200: 4.4-5.2 ms a
call, 35-41 ms of a 41-44 ms decode step). The flag is torch's and process-wide: set once, and
logged, rather than flipped around each call, which another thread's SDPA could interleave with.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Optional, Protocol

import torch
import torch.nn.functional as F

from rtpkv.kernels.kv_quant import dequantize_rows, quantize_rows, row_width
from rtpkv.kernels.kv_store import head_major_rows, write_kv

log = logging.getLogger("rtpkv")


@dataclass
class AttentionBatch:
    """One step's batch as the ModelRunner sees it; rows are the flat token rows of the forward,
    sequences own consecutive rows. Held as Python ints, which the CPU backend reads as they
    are; the torch backends take the `*_tensor` views, made on first use."""

    positions: list[int]            # position of each row's token
    row_seq: list[int]              # index of each row's sequence
    block_tables: list[list[int]]   # per sequence: its block table (at least its context's)
    query_start: list[int]          # per sequence: its first row
    query_len: list[int]            # per sequence: its rows (tokens computed this step)
    context_len: list[int]          # per sequence: positions attended by its last row
    block_size: int
    num_blocks: int                 # blocks in the pool (head-major row arithmetic)
    kv_heads: int
    # Tokens each query attends to, itself included (flash-attn's window_size=(window - 1, 0));
    # None: the whole sequence. Table entries of blocks wholly before a query's window may be
    # released (see KVCacheManager): a backend must not read them.
    window: Optional[int] = None
    device: torch.device = torch.device("cpu")   # where the `*_tensor` views are made
    # The last `padding` sequences are one-token rows that fill a CUDA graph's batch size
    # (rtpkv.engine.cuda_graphs): attended, never written to the pool, their outputs dropped.
    # Only a backend with `graph_safe` honours it (the Triton one).
    padding: int = 0

    def first_key(self, position: int) -> int:
        """The oldest position a query at `position` attends to."""
        return 0 if self.window is None else max(0, position - self.window + 1)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @cached_property
    def positions_tensor(self) -> torch.Tensor:
        """(T,) int64."""
        return torch.tensor(self.positions, dtype=torch.int64, device=self.device)

    @cached_property
    def row_seq_tensor(self) -> torch.Tensor:
        """(T,) int64."""
        return torch.tensor(self.row_seq, dtype=torch.int64, device=self.device)

    @cached_property
    def block_tables_tensor(self) -> torch.Tensor:
        """(num_seqs, max_blocks) int64, padded with block 0."""
        width = max(map(len, self.block_tables))
        return torch.tensor([t + [0] * (width - len(t)) for t in self.block_tables],
                            dtype=torch.int64, device=self.device)

    def slots(self) -> torch.Tensor:
        """(T,) pool slot of each row's new token."""
        B, positions = self.block_size, self.positions_tensor
        return self.block_tables_tensor[self.row_seq_tensor, positions // B] * B + positions % B

    def write_rows(self) -> torch.Tensor:
        """(kv_heads, T) rows of each new token's K/V in a head-major pool layer."""
        if self.padding:
            raise ValueError("a batch with padding rows has no pool row for them: only a "
                             "graph-safe attention backend (triton) runs it")
        return head_major_rows(self.slots(), self.kv_heads, self.num_slots)


class AttentionBackend(Protocol):
    name: str

    def build(self, batch: AttentionBatch) -> Any:
        """Per-step metadata, built once and shared by every layer."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: Any, scale: float) -> torch.Tensor:
        """q: (T, H, d); k, v: (T, KVH, d) for the new tokens, written into the pool layer
        (k_cache, v_cache: (KVH * num_slots, d)) before attending. Returns (T, H, d)."""


@dataclass
class PrefillChunk:
    start: int                      # first row of the chunk in the flat batch
    end: int                        # one past its last row
    ctx_blocks: Optional[torch.Tensor] = None  # (kv_heads, blocks) rows of prefix + chunk
    mask: Optional[torch.Tensor] = None        # (1, 1, chunk, prefix + chunk) causal mask


@dataclass
class TorchMetadata:
    write_rows: torch.Tensor                 # (kv_heads, T) slot rows of each new token's K/V
    block_size: int = 1
    num_decodes: int = 0                     # the first rows of the batch are decode tokens
    decode_blocks: Optional[torch.Tensor] = None  # (num_decodes, kv_heads, max_blocks)
    decode_len: int = 0                           # longest decode context, in tokens
    decode_mask: Optional[torch.Tensor] = None    # (num_decodes, 1, 1, decode_len); None if all equal
    prefills: list[PrefillChunk] = field(default_factory=list)
    # per row, the keys it attends to within its sequence's gathered context: [lo, hi); set where
    # each row attends alone (on a CPU)
    key_ranges: Optional[list[tuple[int, int]]] = None
    # Gather buffers (flat, big enough for the largest gather of the step): a fresh multi-MB
    # tensor per gather costs page faults that can exceed the copy itself.
    k_buffer: Optional[torch.Tensor] = None
    v_buffer: Optional[torch.Tensor] = None

    def gather_numel(self, row: int) -> int:
        """Elements the largest single gather of this step needs (`row`: a pool row's)."""
        sizes = [c.ctx_blocks.numel() for c in self.prefills if c.ctx_blocks is not None]
        if self.decode_blocks is not None:
            sizes.append(self.decode_blocks.numel())
        return max(sizes, default=0) * self.block_size * row


def _gather(cache: torch.Tensor, blocks: torch.Tensor, block_size: int,
            buffer: Optional[torch.Tensor], length: int) -> torch.Tensor:
    """(..., kv_heads, n) block rows -> (..., kv_heads, length, d): whole blocks copied into
    `buffer`, then viewed up to `length` tokens (each head's rows stay contiguous)."""
    d = cache.shape[-1]
    width = block_size * d
    out = None if buffer is None else buffer[: blocks.numel() * width].view(-1, width)
    rows = torch.index_select(cache.view(-1, width), 0, blocks.flatten(), out=out)
    return rows.view(*blocks.shape[:-1], blocks.shape[-1] * block_size, d)[..., :length, :]


def _context(cache: torch.Tensor, blocks: torch.Tensor, block_size: int,
             buffer: Optional[torch.Tensor], length: int, dtype: torch.dtype) -> torch.Tensor:
    """The gathered K or V of `blocks` (see _gather) as values of `dtype`: int8 rows dequantized."""
    rows = _gather(cache, blocks, block_size, buffer, length)
    return dequantize_rows(rows, dtype) if cache.dtype == torch.int8 else rows


def _as_stored(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """New K or V as the pool holds them: through int8 and back for the int8 cache."""
    return dequantize_rows(quantize_rows(x), x.dtype) if cache.dtype == torch.int8 else x


class TorchAttention:
    """The pure-torch reference backend: gathers contexts, then scaled_dot_product_attention."""

    name = "torch"

    def __init__(self, head_dim: int, dtype: torch.dtype, device: torch.device,
                 kv_dtype: Optional[torch.dtype] = None):
        """`kv_dtype`: the pool's (torch.int8 for the int8 cache); the model's by default."""
        kv_dtype = kv_dtype or dtype
        self.row = row_width(head_dim, kv_dtype)
        self.per_row = device.type == "cpu"   # batch-invariant on the CPU (module docstring)
        self._k_buffer = torch.empty(0, dtype=kv_dtype, device=device)
        self._v_buffer = torch.empty(0, dtype=kv_dtype, device=device)
        if device.type == "cuda" and torch.backends.cuda.cudnn_sdp_enabled():
            torch.backends.cuda.enable_cudnn_sdp(False)   # see the module's docstring
            log.info("torch attention on CUDA: cuDNN's SDPA backend turned off for the process "
                     "(it plans each new shape, and decode shapes grow every step)")

    def _buffers(self, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather buffers kept across steps, grown (never shrunk) to `numel` elements."""
        if self._k_buffer.numel() < numel:
            self._k_buffer = self._k_buffer.new_empty(numel)
            self._v_buffer = self._v_buffer.new_empty(numel)
        return self._k_buffer, self._v_buffer

    def build(self, batch: AttentionBatch) -> TorchMetadata:
        B, device = batch.block_size, batch.device
        decodes = [i for i, n in enumerate(batch.query_len) if n == 1]
        if decodes != list(range(len(decodes))):
            raise ValueError("TorchAttention needs the single-token sequences first in the batch")
        meta = TorchMetadata(write_rows=batch.write_rows(), block_size=B, num_decodes=len(decodes))
        if decodes:
            self._build_decodes(batch, meta, len(decodes))
        for i in range(len(decodes), len(batch.query_len)):
            row, n, end = batch.query_start[i], batch.query_len[i], batch.context_len[i]
            chunk = PrefillChunk(row, row + n)
            first = batch.first_key(end - n) // B * B    # the chunk's oldest key, block-aligned
            if end > n:
                blocks = batch.block_tables_tensor[i, first // B: -(-end // B)]
                chunk.ctx_blocks = head_major_rows(blocks, batch.kv_heads, batch.num_blocks)
            if end > n or batch.first_key(end - 1) > 0:
                q_pos = torch.arange(end - n, end, device=device)[:, None]
                k_pos = torch.arange(first if end > n else 0, end, device=device)[None, :]
                band = (k_pos <= q_pos) & (k_pos > q_pos - (batch.window or end))
                chunk.mask = band[None, None]
            meta.prefills.append(chunk)
        meta.k_buffer, meta.v_buffer = self._buffers(meta.gather_numel(self.row))
        if self.per_row:
            meta.key_ranges = self._key_ranges(batch, len(decodes))
        return meta

    @staticmethod
    def _key_ranges(batch: AttentionBatch, n: int) -> list[tuple[int, int]]:
        """Each row's keys [lo, hi) within its gathered context: a decode's starts at its
        window's first block, a chunk's at its oldest key's block (0 without a cached prefix)."""
        B, ranges = batch.block_size, []
        for i, (rows, end) in enumerate(zip(batch.query_len, batch.context_len)):
            if i < n:
                base = batch.first_key(end - 1) // B * B
            else:
                base = batch.first_key(end - rows) // B * B if end > rows else 0
            ranges += [(batch.first_key(p) - base, p + 1 - base) for p in range(end - rows, end)]
        return ranges

    @staticmethod
    def _build_decodes(batch: AttentionBatch, meta: TorchMetadata, n: int) -> None:
        """Each decode gathers the blocks from its window's first one (padded with block 0 to
        the widest), masked outside [first key, its position]."""
        B, device = batch.block_size, batch.device
        ctx = batch.context_len[:n]
        first = [batch.first_key(c - 1) // B for c in ctx]
        width = max(-(-c // B) - f for c, f in zip(ctx, first))
        tables = batch.block_tables_tensor[:n]
        if any(first):
            index = torch.tensor(first, device=device)[:, None] + torch.arange(width, device=device)
            tables = torch.cat([tables, tables.new_zeros(n, width)], dim=1).gather(1, index)
        else:
            tables = tables[:, :width]
        meta.decode_blocks = head_major_rows(tables, batch.kv_heads, batch.num_blocks)
        meta.decode_len = max(c - f * B for c, f in zip(ctx, first))
        if batch.window is None and min(ctx) == max(ctx):
            return
        k_pos = (torch.tensor(first, device=device)[:, None] * B
                 + torch.arange(meta.decode_len, device=device)[None, :])
        q_pos = torch.tensor(ctx, device=device)[:, None] - 1
        window = batch.window or max(ctx)
        meta.decode_mask = ((k_pos <= q_pos) & (k_pos > q_pos - window))[:, None, None, :]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: TorchMetadata, scale: float,
                softcap: Optional[float] = None,
                sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`softcap`: scores become softcap * tanh(score / softcap) before the mask (Gemma 2).
        `sinks`: (H,) logits, one per query head, that join each softmax (gpt-oss)."""
        write_kv(k_cache, v_cache, k, v, meta.write_rows)
        extra = _Extras(softcap, sinks)
        if meta.key_ranges is not None:
            return self._per_row(q, k, v, k_cache, v_cache, meta, scale, extra)
        out = torch.empty_like(q)
        n, B = meta.num_decodes, meta.block_size
        if n:
            od = _attend(
                q[:n].unsqueeze(2),
                _context(k_cache, meta.decode_blocks, B, meta.k_buffer, meta.decode_len, q.dtype),
                _context(v_cache, meta.decode_blocks, B, meta.v_buffer, meta.decode_len, q.dtype),
                meta.decode_mask, scale, extra, causal=False)   # (n, H, 1, d)
            out[:n] = od.squeeze(2)
        for chunk in meta.prefills:
            qs = q[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)   # (1, H, c, d)
            if chunk.ctx_blocks is None:
                ks = _as_stored(k[chunk.start:chunk.end], k_cache).transpose(0, 1).unsqueeze(0)
                vs = _as_stored(v[chunk.start:chunk.end], v_cache).transpose(0, 1).unsqueeze(0)
            else:
                ctx = chunk.mask.shape[-1]
                ks = _context(k_cache, chunk.ctx_blocks, B, meta.k_buffer, ctx, q.dtype)
                vs = _context(v_cache, chunk.ctx_blocks, B, meta.v_buffer, ctx, q.dtype)
                ks, vs = ks.unsqueeze(0), vs.unsqueeze(0)
            o = _attend(qs, ks, vs, chunk.mask, scale, extra, causal=chunk.mask is None)
            out[chunk.start:chunk.end] = o[0].transpose(0, 1)
        return out

    def _per_row(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: TorchMetadata, scale: float,
                 extra: "_Extras") -> torch.Tensor:
        """Each row attends alone to its keys (`key_ranges`) of its sequence's gathered
        context: the same call, on the same values, whether the row decodes or sits in a
        chunk, and whatever else the step holds."""
        out = torch.empty_like(q)
        n, B = meta.num_decodes, meta.block_size

        def attend(row: int, keys: torch.Tensor, values: torch.Tensor) -> None:
            lo, hi = meta.key_ranges[row]
            o = _attend(q[row][None, :, None, :], keys[None, :, lo:hi].contiguous(),
                        values[None, :, lo:hi].contiguous(), None, scale, extra, causal=False)
            out[row] = o[0, :, 0, :]

        if n:
            ks = _context(k_cache, meta.decode_blocks, B, meta.k_buffer, meta.decode_len, q.dtype)
            vs = _context(v_cache, meta.decode_blocks, B, meta.v_buffer, meta.decode_len, q.dtype)
            for row in range(n):
                attend(row, ks[row], vs[row])
        for chunk in meta.prefills:
            if chunk.ctx_blocks is None:
                ks = _as_stored(k[chunk.start:chunk.end], k_cache).transpose(0, 1)
                vs = _as_stored(v[chunk.start:chunk.end], v_cache).transpose(0, 1)
            else:
                ctx = chunk.mask.shape[-1]
                ks = _context(k_cache, chunk.ctx_blocks, B, meta.k_buffer, ctx, q.dtype)
                vs = _context(v_cache, chunk.ctx_blocks, B, meta.v_buffer, ctx, q.dtype)
            for row in range(chunk.start, chunk.end):
                attend(row, ks, vs)
        return out


@dataclass(frozen=True)
class _Extras:
    """What some models add to the softmax: a soft-cap (Gemma 2), per-head sinks (gpt-oss)."""

    softcap: Optional[float] = None
    sinks: Optional[torch.Tensor] = None


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
            scale: float, extra: _Extras, causal: bool) -> torch.Tensor:
    """Attention of q (..., H, c, d) over k, v (..., KVH, n, d) under a boolean `mask`, or
    causal (`causal`, no mask, c == n), or over every key. Without a soft-cap or sinks, torch's
    SDPA; with either, transformers' eager arithmetic: scores, the cap, the mask, then a float32
    softmax, or with sinks each head's sink logit joining the row, the row's maximum taken off,
    the softmax in the scores' dtype and the sink's column dropped (gpt-oss's)."""
    if extra.softcap is None and extra.sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              scale=scale, enable_gqa=True)
    groups = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if extra.softcap is not None:
        scores = torch.tanh(scores / extra.softcap) * extra.softcap
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if extra.sinks is None:
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(weights, v)
    sinks = extra.sinks.to(scores.dtype).view(-1, 1, 1).expand(*scores.shape[:-1], 1)
    logits = torch.cat([scores, sinks], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    weights = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    return torch.matmul(weights.to(v.dtype), v)
