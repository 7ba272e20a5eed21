"""The flash-attn backend: flash-attn 2's CUDA kernels over rtpkv's paged KV pool (fp16/bf16).

Two routes, chosen by the step's block size:
- paged: when SEQ_SIZE_PER_BLOCK is a multiple of the page size the installed flash-attn
  accepts (`page_multiple`: 256 from 2.5, whose `mha_fwd_kvcache` checks
  `page_block_size % 256`), `flash_attn_with_kvcache` reads K/V in place through a block table:
  one call for the step's decodes, one per prefill chunk.
- gathered: otherwise each sequence's blocks, from its window's first block, are gathered into
  one token-major K/V and `flash_attn_varlen_func` runs the whole batch in one call.

Both pass causal=True: flash-attn aligns the causal mask to the bottom right when a query is
shorter than its keys, so a prefill chunk after a cached prefix (reuse, a task prompt, the
second chunk of a chunked prefill) attends its prefix and itself; the attention window is
`window_size=(W - 1, 0)`; GQA is flash-attn's own (K/V with fewer heads). The pool layer is
head-major (kv_store) and flash-attn reads K/V through strides (only the last dimension must be
contiguous), so the paged route views a layer as (blocks, B, kv_heads, d) without a copy.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from types import ModuleType
from typing import Optional

import torch

from rtpkv.kernels.attention import AttentionBatch
from rtpkv.kernels.kv_store import write_kv

log = logging.getLogger("rtpkv")

CUDA_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


def load_flash_attn() -> Optional[ModuleType]:
    """The `flash_attn` module, or None where it does not import (not installed, or built for
    another torch)."""
    try:
        return importlib.import_module("flash_attn")
    except ImportError:
        return None


def page_multiple(version: str) -> Optional[int]:
    """Block sizes flash_attn_with_kvcache accepts with a block table are multiples of this, for
    flash-attn `version`; None where that version has no paged KV (before 2.5) or is unknown."""
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return None
    return 256 if (major, minor) >= (2, 5) and major == 2 else None


@dataclass
class FlashMetadata:
    write_rows: torch.Tensor                        # (kv_heads, T) pool rows of the new K/V
    block_size: int
    paged: bool                                     # the route (see the module docstring)
    window: tuple[int, int] = (-1, -1)              # flash-attn's window_size
    # paged route
    num_decodes: int = 0                            # the first rows are single-token sequences
    decode_tables: Optional[torch.Tensor] = None    # (num_decodes, max_blocks) int32
    decode_lens: Optional[torch.Tensor] = None      # (num_decodes,) int32 keys each attends
    chunks: list[tuple[int, int, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # gathered route: every row in one varlen call
    key_slots: Optional[torch.Tensor] = None        # (total_k,) pool slot of each gathered key
    cu_q: Optional[torch.Tensor] = None             # (num_seqs + 1,) int32
    cu_k: Optional[torch.Tensor] = None             # (num_seqs + 1,) int32
    max_q: int = 0
    max_k: int = 0


class FlashAttention:
    """flash-attn on the AttentionBatch seam; see the module docstring for the two routes."""

    name = "flash-attn"

    def __init__(self, head_dim: int, dtype: torch.dtype, device: torch.device):
        module = load_flash_attn()
        if module is None:
            raise RuntimeError("RTPKV_ATTENTION=flash-attn: the flash_attn package does not "
                               "import; install it on a CUDA machine (pip install -e '.[gpu]', "
                               "see the README) or choose RTPKV_ATTENTION=auto or torch")
        if device.type == "cuda" and dtype not in CUDA_DTYPES:
            raise ValueError(f"RTPKV_ATTENTION=flash-attn runs float16 and bfloat16 models, not "
                             f"{str(dtype).removeprefix('torch.')}: set DTYPE=bfloat16 or float16, "
                             "or RTPKV_ATTENTION=torch")
        if head_dim % 8 or head_dim > MAX_HEAD_DIM:
            raise ValueError(f"RTPKV_ATTENTION=flash-attn needs a head size that is a multiple "
                             f"of 8 up to {MAX_HEAD_DIM}, not {head_dim}")
        self.fa = module
        self.version = str(getattr(module, "__version__", "unknown"))
        self.page_multiple = page_multiple(self.version)
        self._logged_block: Optional[int] = None   # the block size whose route was logged
        self._probe(head_dim, dtype, device)

    def paged(self, block_size: int) -> bool:
        """Whether blocks of `block_size` tokens go through the paged route."""
        return self.page_multiple is not None and block_size % self.page_multiple == 0

    def _log_route(self, block_size: int) -> None:
        """Say once which route a block size takes (the first step's log)."""
        if self._logged_block == block_size:
            return
        self._logged_block = block_size
        if self.paged(block_size):
            log.info("flash-attn %s: paged route (flash_attn_with_kvcache), SEQ_SIZE_PER_BLOCK=%d",
                     self.version, block_size)
        else:
            why = (f"not a multiple of {self.page_multiple}" if self.page_multiple
                   else "no paged KV in this version")
            log.info("flash-attn %s: gathered route (flash_attn_varlen_func), "
                     "SEQ_SIZE_PER_BLOCK=%d is %s", self.version, block_size, why)

    def _probe(self, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        """One tiny call at start-up, so a package that cannot run this dtype on this device (a
        pre-Ampere GPU, a CPU tensor, a build for another torch) fails here, not mid-request."""
        q = torch.zeros(1, 1, head_dim, dtype=dtype, device=device)
        cu = torch.tensor([0, 1], dtype=torch.int32, device=device)
        try:
            self.fa.flash_attn_varlen_func(q, q, q, cu, cu, 1, 1, causal=True)
        except Exception as exc:
            raise RuntimeError(f"RTPKV_ATTENTION=flash-attn: flash_attn {self.version} cannot run "
                               f"{str(dtype).removeprefix('torch.')} on {device}: {exc}") from exc

    def build(self, batch: AttentionBatch) -> FlashMetadata:
        self._log_route(batch.block_size)
        meta = FlashMetadata(write_rows=batch.write_rows(), block_size=batch.block_size,
                             paged=self.paged(batch.block_size))
        if batch.window is not None:
            meta.window = (batch.window - 1, 0)
        if meta.paged:
            self._build_paged(batch, meta)
        else:
            self._build_gathered(batch, meta)
        return meta

    @staticmethod
    def _build_paged(batch: AttentionBatch, meta: FlashMetadata) -> None:
        """Tables as int32 with released entries (-1, older than the window) pointed at block 0:
        flash-attn may read a page its mask then drops, and must not read outside the pool."""
        decodes = [i for i, n in enumerate(batch.query_len) if n == 1]
        if decodes != list(range(len(decodes))):
            raise ValueError("FlashAttention needs the single-token sequences first in the batch")
        tables = batch.block_tables_tensor.clamp(min=0).to(torch.int32)
        lens = torch.tensor(batch.context_len, dtype=torch.int32, device=tables.device)
        n = meta.num_decodes = len(decodes)
        if n:
            meta.decode_tables, meta.decode_lens = tables[:n].contiguous(), lens[:n]
        for i in range(n, len(batch.query_len)):
            start, width = batch.query_start[i], -(-batch.context_len[i] // batch.block_size)
            meta.chunks.append((start, start + batch.query_len[i],
                                tables[i:i + 1, :width].contiguous(), lens[i:i + 1]))

    @staticmethod
    def _build_gathered(batch: AttentionBatch, meta: FlashMetadata) -> None:
        """The slots of each sequence's keys, from its window's first block (whole blocks before
        it may be released) to its last position, concatenated in batch order."""
        B, device = batch.block_size, batch.device
        offsets = torch.arange(B, device=device)
        slots, q_lens, k_lens = [], [], []
        for i, (n, ctx) in enumerate(zip(batch.query_len, batch.context_len)):
            first = batch.first_key(ctx - n) // B
            blocks = batch.block_tables_tensor[i, first: -(-ctx // B)]   # on the device: no sync
            k_len = ctx - first * B
            slots.append((blocks[:, None] * B + offsets).flatten()[:k_len])
            q_lens.append(n)
            k_lens.append(k_len)
        meta.key_slots = torch.cat(slots)
        meta.cu_q = _cumulative(q_lens, device)
        meta.cu_k = _cumulative(k_lens, device)
        meta.max_q, meta.max_k = max(q_lens), max(k_lens)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: FlashMetadata, scale: float) -> torch.Tensor:
        write_kv(k_cache, v_cache, k, v, meta.write_rows)
        kv_heads, d = k.shape[1], k.shape[2]
        if not meta.paged:
            keys = k_cache.view(kv_heads, -1, d).index_select(1, meta.key_slots).transpose(0, 1)
            values = v_cache.view(kv_heads, -1, d).index_select(1, meta.key_slots).transpose(0, 1)
            return self.fa.flash_attn_varlen_func(
                q, keys, values, meta.cu_q, meta.cu_k, meta.max_q, meta.max_k,
                softmax_scale=scale, causal=True, window_size=meta.window)
        pages_k, pages_v = (c.view(kv_heads, -1, meta.block_size, d).permute(1, 2, 0, 3)
                            for c in (k_cache, v_cache))    # (blocks, B, kv_heads, d) views
        out = torch.empty_like(q)
        n = meta.num_decodes
        if n:
            out[:n] = self.fa.flash_attn_with_kvcache(
                q[:n].unsqueeze(1), pages_k, pages_v, cache_seqlens=meta.decode_lens,
                block_table=meta.decode_tables, softmax_scale=scale, causal=True,
                window_size=meta.window).squeeze(1)
        for start, end, table, length in meta.chunks:
            out[start:end] = self.fa.flash_attn_with_kvcache(
                q[start:end].unsqueeze(0), pages_k, pages_v, cache_seqlens=length,
                block_table=table, softmax_scale=scale, causal=True, window_size=meta.window)[0]
        return out


def _cumulative(lengths: list[int], device: torch.device) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)
