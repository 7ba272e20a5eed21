"""Paged attention, torch reference backend.

One forward carries a mixed batch laid out as [decode tokens..., prefill chunk 1, chunk 2, ...].
Decode tokens are attended in one batched call over their gathered contexts (padded, masked);
each prefill chunk attends causally to its cached prefix plus its own new tokens. Contexts are
gathered a whole block at a time with one `index_select` over head-major block rows (see
kv_store), which lands them contiguous; key positions past a sequence's end are masked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from rtpkv.kernels.kv_store import write_kv


@dataclass
class PrefillChunk:
    start: int                      # first row of the chunk in the flat batch
    end: int                        # one past its last row
    ctx_blocks: Optional[torch.Tensor] = None  # (kv_heads, blocks) rows of prefix + chunk
    mask: Optional[torch.Tensor] = None        # (1, 1, chunk, prefix + chunk) causal mask


@dataclass
class AttentionMetadata:
    """Built once per engine step, shared by every layer."""

    write_rows: torch.Tensor                 # (kv_heads, T) slot rows of each new token's K/V
    block_size: int = 1
    num_decodes: int = 0                     # the first rows of the batch are decode tokens
    decode_blocks: Optional[torch.Tensor] = None  # (num_decodes, kv_heads, max_blocks)
    decode_len: int = 0                           # longest decode context, in tokens
    decode_mask: Optional[torch.Tensor] = None    # (num_decodes, 1, 1, decode_len); None if all equal
    prefills: list[PrefillChunk] = field(default_factory=list)
    # Reused gather buffers (flat, big enough for the largest gather of the step): a fresh
    # multi-MB tensor per gather costs page faults that can exceed the copy itself.
    k_buffer: Optional[torch.Tensor] = None
    v_buffer: Optional[torch.Tensor] = None

    def gather_numel(self, head_dim: int) -> int:
        """Elements the largest single gather of this step needs."""
        sizes = [c.ctx_blocks.numel() for c in self.prefills if c.ctx_blocks is not None]
        if self.decode_blocks is not None:
            sizes.append(self.decode_blocks.numel())
        return max(sizes, default=0) * self.block_size * head_dim


def _gather(cache: torch.Tensor, blocks: torch.Tensor, block_size: int,
            buffer: Optional[torch.Tensor], length: int) -> torch.Tensor:
    """(..., kv_heads, n) block rows -> (..., kv_heads, length, d): whole blocks copied into
    `buffer`, then viewed up to `length` tokens (each head's rows stay contiguous)."""
    d = cache.shape[-1]
    width = block_size * d
    out = None if buffer is None else buffer[: blocks.numel() * width].view(-1, width)
    rows = torch.index_select(cache.view(-1, width), 0, blocks.flatten(), out=out)
    return rows.view(*blocks.shape[:-1], blocks.shape[-1] * block_size, d)[..., :length, :]


def torch_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: (T, H, d); k, v: (T, KVH, d) for the new tokens. Returns (T, H, d)."""
    write_kv(k_cache, v_cache, k, v, meta.write_rows)
    out = torch.empty_like(q)
    n, B = meta.num_decodes, meta.block_size
    if n:
        od = F.scaled_dot_product_attention(
            q[:n].unsqueeze(2),
            _gather(k_cache, meta.decode_blocks, B, meta.k_buffer, meta.decode_len),
            _gather(v_cache, meta.decode_blocks, B, meta.v_buffer, meta.decode_len),
            attn_mask=meta.decode_mask, scale=scale, enable_gqa=True)   # (n, H, 1, d)
        out[:n] = od.squeeze(2)
    for chunk in meta.prefills:
        qs = q[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)   # (1, H, c, d)
        if chunk.ctx_blocks is None:
            ks = k[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)
            vs = v[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)
        else:
            ctx = chunk.mask.shape[-1]
            ks = _gather(k_cache, chunk.ctx_blocks, B, meta.k_buffer, ctx).unsqueeze(0)
            vs = _gather(v_cache, chunk.ctx_blocks, B, meta.v_buffer, ctx).unsqueeze(0)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=chunk.mask,
                                           is_causal=chunk.mask is None, scale=scale,
                                           enable_gqa=True)
        out[chunk.start:chunk.end] = o[0].transpose(0, 1)
    return out
