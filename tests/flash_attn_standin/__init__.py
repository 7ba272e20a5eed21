"""A pure-torch stand-in for flash-attn 2, so CPU CI runs rtpkv's flash-attn backend end to end.

Same function names, signatures and documented semantics as flash-attn 2.8's
`flash_attn_interface` for what rtpkv calls (`flash_attn_varlen_func`, `flash_attn_with_kvcache`):
- causal masks aligned to the bottom right: query i of sq attends keys j <= i + sk - sq;
- `window_size=(left, right)`: keys in [i + sk - sq - left, i + sk - sq + right], -1 unbounded
  (causal sets right to 0); a row with no key gives zeros;
- GQA: query head h reads K/V head h // (nheads / nheads_k);
- `softmax_scale` (default headdim ** -0.5) and `softcap` (scores -> softcap * tanh(s / softcap));
- paged K/V: a cache of (num_blocks, page_block_size, nheads_k, headdim), an int32 block table
  and int32 `cache_seqlens`, page_block_size a multiple of PAGE_MULTIPLE (256, as the real
  `mha_fwd_kvcache` checks); every table entry a sequence reaches must be a block of the cache
  (the real kernel would read outside it: here an IndexError);
- the real checks and their messages: dtypes, contiguous last dimensions, head size, head
  ratio, int32 metadata.

The one deliberate difference: ALLOW_FP32. The real package refuses float32 ("FlashAttention
only support fp16 and bf16 data type"); so does this one by default. CPU CI sets ALLOW_FP32 = True
(the `flash_attn_standin` fixture of test_flash_attn_backend.py) so that the backend's metadata
path also runs in float32, where its tokens must equal the torch backend's exactly.

Arithmetic is float32 with explicit masks, rounded to the input dtype once at the end, as the
real kernels accumulate in float32. What rtpkv does not call (dropout, rotary, ALiBi,
appending k/v to the cache, cache_batch_idx, left padding, a paged varlen call) raises
NotImplementedError rather than pretend.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

__version__ = "2.8.3"
ALLOW_FP32 = False
PAGE_MULTIPLE = 256
MAX_HEAD_DIM = 256


def _check_dtypes(q: torch.Tensor, *others: torch.Tensor) -> None:
    allowed = (torch.float16, torch.bfloat16) + ((torch.float32,) if ALLOW_FP32 else ())
    if q.dtype not in allowed:
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    for name, t in zip(("key", "value"), others):
        if t.dtype != q.dtype:
            raise RuntimeError(f"query and {name} must have the same dtype")


def _check_heads(nheads: int, nheads_k: int, head_dim: int) -> None:
    if head_dim > MAX_HEAD_DIM:
        raise RuntimeError("FlashAttention forward only supports head dimension at most 256")
    if nheads % nheads_k:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")


def _not_modelled(**given: object) -> None:
    used = [name for name, value in given.items() if value not in (None, False, 0, 0.0)]
    if used:
        raise NotImplementedError(f"flash_attn stand-in: {', '.join(used)} not modelled")


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
            window: tuple[int, int], softcap: float) -> torch.Tensor:
    """One sequence: q (sq, H, d), k/v (sk, KVH, d) -> (sq, H, d) in q's dtype."""
    sq, heads, _ = q.shape
    sk, kv_heads, _ = k.shape
    left, right = window
    if causal:
        right = 0
    group = heads // kv_heads
    kf = k.float().repeat_interleave(group, dim=1)         # head h reads kv head h // group
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    diagonal = torch.arange(sq)[:, None] + sk - sq        # each query's aligned key position
    j = torch.arange(sk)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        keep &= j >= diagonal - left
    if right >= 0:
        keep &= j <= diagonal + right
    scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no key: zeros
    return torch.einsum("hqk,khd->qhd", probs, vf).to(q.dtype)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """q: (total_q, nheads, d); k, v: (total_k, nheads_k, d); cu_seqlens_*: (batch + 1,) int32."""
    _not_modelled(dropout_p=dropout_p, alibi_slopes=alibi_slopes,
                  return_attn_probs=return_attn_probs, block_table=block_table)
    _check_dtypes(q, k, v)
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if t.dtype != torch.int32:
            raise RuntimeError(f"{name} must have dtype int32")
        if not t.is_contiguous():
            raise RuntimeError(f"{name} must be contiguous")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = (t.contiguous() for t in (q, k, v))   # the interface's maybe_contiguous
    _check_heads(q.shape[1], k.shape[1], q.shape[2])
    batch = cu_seqlens_q.numel() - 1
    if batch <= 0:
        raise RuntimeError("batch size must be positive")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out = torch.empty_like(q)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(batch):
        if cq[b + 1] - cq[b] > max_seqlen_q or ck[b + 1] - ck[b] > max_seqlen_k:
            raise RuntimeError("a sequence is longer than max_seqlen_q / max_seqlen_k")
        out[cq[b]:cq[b + 1]] = _attend(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]],
                                       scale, causal, tuple(window_size), softcap)
    return out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None,
                            cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
                            cache_batch_idx: Optional[torch.Tensor] = None,
                            cache_leftpad: Optional[torch.Tensor] = None,
                            block_table: Optional[torch.Tensor] = None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False):
    """q: (batch, seqlen_q, nheads, d); k_cache, v_cache: (batch, seqlen_cache, nheads_k, d), or
    (num_blocks, page_block_size, nheads_k, d) with block_table (batch, max_blocks) int32."""
    _not_modelled(k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                  cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                  alibi_slopes=alibi_slopes, return_softmax_lse=return_softmax_lse)
    assert k_cache.stride(-1) == 1, "k_cache must have contiguous last dimension"
    assert v_cache.stride(-1) == 1, "v_cache must have contiguous last dimension"
    _check_dtypes(q, k_cache, v_cache)
    batch, _, nheads, head_dim = q.shape
    _check_heads(nheads, k_cache.shape[2], head_dim)
    if batch <= 0:
        raise RuntimeError("batch size must be positive")
    if block_table is not None:
        if block_table.dtype != torch.int32:
            raise RuntimeError("block_table must have dtype torch.int32")
        if block_table.stride(-1) != 1:
            raise RuntimeError("block_table must have contiguous last dimension")
        page = k_cache.shape[1]
        if page % PAGE_MULTIPLE:
            raise RuntimeError("Paged KV cache block size must be divisible by 256")
        if tuple(block_table.shape[:1]) != (batch,):
            raise RuntimeError("block_table must have shape (batch_size, max_num_blocks_per_seq)")
        seqlen_k = block_table.shape[1] * page
    else:
        if k_cache.shape[0] < batch:
            raise RuntimeError("k_cache must have shape (batch_size_c, seqlen_k, ...)")
        seqlen_k = k_cache.shape[1]
    if cache_seqlens is None:
        lens = [seqlen_k] * batch
    elif isinstance(cache_seqlens, int):
        lens = [cache_seqlens] * batch
    else:
        if cache_seqlens.dtype != torch.int32:
            raise RuntimeError("seqlens_k must have dtype int32")
        lens = cache_seqlens.tolist()
    scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
    out = torch.empty_like(q)
    for b, length in enumerate(lens):
        if length > seqlen_k:
            raise RuntimeError("cache_seqlens is past the cache (or the block table)")
        if block_table is None:
            keys, values = k_cache[b, :length], v_cache[b, :length]
        else:
            pages = block_table[b, : -(-length // page)].long()
            if pages.numel() and (pages.min() < 0 or pages.max() >= k_cache.shape[0]):
                raise IndexError(f"block_table row {b} reaches blocks {pages.tolist()} outside "
                                 f"the cache's {k_cache.shape[0]}")
            keys = k_cache[pages].flatten(0, 1)[:length]
            values = v_cache[pages].flatten(0, 1)[:length]
        out[b] = _attend(q[b], keys, values, scale, causal, tuple(window_size), softcap)
    return out
