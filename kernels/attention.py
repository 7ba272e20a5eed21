"""Paged attention, torch reference backend.

One forward carries a mixed batch laid out as [decode tokens..., prefill chunk 1, chunk 2, ...].
Decode tokens are attended in one batched call over their gathered contexts (padded, masked);
each prefill chunk attends causally to its cached prefix plus its own new tokens. Contexts are
gathered with one `index_select` over head-major rows (see kv_store), which lands them
contiguous: several times faster on CPU than advanced indexing plus a transpose.
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
    ctx_rows: Optional[torch.Tensor] = None    # (kv_heads, ctx) rows of prefix + chunk
    mask: Optional[torch.Tensor] = None        # (1, 1, chunk, ctx) causal mask over them


@dataclass
class AttentionMetadata:
    """Built once per engine step, shared by every layer."""

    write_rows: torch.Tensor                 # (kv_heads, T) where each new token's K/V goes
    num_decodes: int = 0                     # the first rows of the batch are decode tokens
    decode_rows: Optional[torch.Tensor] = None    # (num_decodes, kv_heads, max_ctx)
    decode_mask: Optional[torch.Tensor] = None    # (num_decodes, 1, 1, max_ctx), None if all equal
    prefills: list[PrefillChunk] = field(default_factory=list)


def _gather(cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return cache.index_select(0, rows.flatten()).view(*rows.shape, cache.shape[-1])


def torch_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: (T, H, d); k, v: (T, KVH, d) for the new tokens. Returns (T, H, d)."""
    write_kv(k_cache, v_cache, k, v, meta.write_rows)
    out = torch.empty_like(q)
    n = meta.num_decodes
    if n:
        od = F.scaled_dot_product_attention(
            q[:n].unsqueeze(2), _gather(k_cache, meta.decode_rows), _gather(v_cache, meta.decode_rows),
            attn_mask=meta.decode_mask, scale=scale, enable_gqa=True)   # (n, H, 1, d)
        out[:n] = od.squeeze(2)
    for chunk in meta.prefills:
        qs = q[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)   # (1, H, c, d)
        if chunk.ctx_rows is None:
            ks = k[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)
            vs = v[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)
        else:
            ks = _gather(k_cache, chunk.ctx_rows).unsqueeze(0)
            vs = _gather(v_cache, chunk.ctx_rows).unsqueeze(0)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=chunk.mask,
                                           is_causal=chunk.mask is None, scale=scale,
                                           enable_gqa=True)
        out[chunk.start:chunk.end] = o[0].transpose(0, 1)
    return out
