"""Paged attention, torch reference backend.

One forward carries a mixed batch laid out as [decode tokens..., prefill chunk 1, chunk 2, ...].
Decode tokens are attended in one batched call over their block tables (padded, masked);
each prefill chunk attends causally to its cached prefix plus its own new tokens.
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
    ctx_slots: Optional[torch.Tensor] = None   # slots of prefix + chunk, when a prefix exists
    mask: Optional[torch.Tensor] = None        # (1, 1, chunk, ctx) causal mask over them


@dataclass
class AttentionMetadata:
    """Built once per engine step, shared by every layer."""

    slot_mapping: torch.Tensor               # (T,) where each new token's K/V is written
    num_decodes: int = 0                     # the first rows of the batch are decode tokens
    decode_slots: Optional[torch.Tensor] = None   # (num_decodes, max_ctx)
    decode_mask: Optional[torch.Tensor] = None    # (num_decodes, 1, 1, max_ctx), None if all equal
    prefills: list[PrefillChunk] = field(default_factory=list)


def torch_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: (T, H, d); k, v: (T, KVH, d) for the new tokens. Returns (T, H, d)."""
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    n = meta.num_decodes
    if n:
        qd = q[:n].unsqueeze(2)                                  # (n, H, 1, d)
        shape = (*meta.decode_slots.shape, *k_cache.shape[1:])   # (n, L, KVH, d)
        flat = meta.decode_slots.flatten()
        kd = k_cache.index_select(0, flat).view(shape).transpose(1, 2)   # (n, KVH, L, d)
        vd = v_cache.index_select(0, flat).view(shape).transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask,
                                            scale=scale, enable_gqa=True)
        out[:n] = od.squeeze(2)
    for chunk in meta.prefills:
        qs = q[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)   # (1, H, c, d)
        if chunk.ctx_slots is None:
            ks = k[chunk.start:chunk.end]
            vs = v[chunk.start:chunk.end]
        else:  # index_select: several times faster than advanced indexing on CPU
            ks = k_cache.index_select(0, chunk.ctx_slots)
            vs = v_cache.index_select(0, chunk.ctx_slots)
        ks = ks.transpose(0, 1).unsqueeze(0)
        vs = vs.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=chunk.mask,
                                           is_causal=chunk.mask is None, scale=scale,
                                           enable_gqa=True)
        out[chunk.start:chunk.end] = o[0].transpose(0, 1)
    return out
