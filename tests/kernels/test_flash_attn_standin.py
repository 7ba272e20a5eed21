"""The flash-attn stand-in (tests/flash_attn_standin) against scaled_dot_product_attention with
explicit masks built from flash-attn's documented rules, and its refusals: what makes it a
faithful witness for the flash-attn backend's CPU tests."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flash_attn_standin as fa

H, KVH, D = 6, 2, 16


@pytest.fixture(autouse=True)
def fp32_allowed(monkeypatch):
    monkeypatch.setattr(fa, "ALLOW_FP32", True)


def _reference(q, k, v, scale, left=-1, right=-1, causal=False):
    """SDPA over one sequence with a mask written from the docstring: query i sits at key
    position i + sk - sq; keys in [that - left, that + right] (causal: right = 0)."""
    sq, sk = q.shape[0], k.shape[0]
    if causal:
        right = 0
    at = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    mask = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        mask &= j >= at - left
    if right >= 0:
        mask &= j <= at + right
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None],
                                         k.float().transpose(0, 1)[None],
                                         v.float().transpose(0, 1)[None],
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    out = out[0].transpose(0, 1)
    return torch.where(mask.any(-1)[:, None, None], out, torch.zeros_like(out)).to(q.dtype)


def _rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [(-1, -1), (5, 0), (40, 0)])
def test_varlen_matches_sdpa(dtype, window):
    """Three sequences, one query shorter than its keys (a chunk after a prefix), one a decode,
    one a whole prompt; GQA 6:2; a non-default scale."""
    q_lens, k_lens = [7, 1, 12], [30, 19, 12]
    q = _rand(sum(q_lens), H, D, dtype=dtype, seed=1)
    k = _rand(sum(k_lens), KVH, D, dtype=dtype, seed=2)
    v = _rand(sum(k_lens), KVH, D, dtype=dtype, seed=3)
    cu_q = torch.tensor([0, 7, 8, 20], dtype=torch.int32)
    cu_k = torch.tensor([0, 30, 49, 61], dtype=torch.int32)
    out = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 12, 30, softmax_scale=0.3, causal=True,
                                    window_size=window)
    for b in range(3):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        expected = _reference(q[qs], k[ks], v[ks], 0.3, *window, causal=True)
        torch.testing.assert_close(out[qs], expected, atol=1e-5 if dtype == torch.float32 else 1e-2,
                                   rtol=0)


def test_kvcache_paged_matches_sdpa():
    """A paged cache read through a scattered block table, per-sequence cache_seqlens, queries of
    4 tokens at the end of 300 and 600 keys, a window of 100."""
    page, blocks = 256, 6
    k_cache = _rand(blocks, page, KVH, D, seed=4)
    v_cache = _rand(blocks, page, KVH, D, seed=5)
    table = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32)
    lens = torch.tensor([300, 600], dtype=torch.int32)
    q = _rand(2, 4, H, D, seed=6)
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table,
                                     causal=True, window_size=(99, 0))
    for b in range(2):
        keys = k_cache[table[b].long()].flatten(0, 1)[:lens[b]]
        values = v_cache[table[b].long()].flatten(0, 1)[:lens[b]]
        expected = _reference(q[b], keys, values, D ** -0.5, 99, 0, causal=True)
        torch.testing.assert_close(out[b], expected, atol=1e-5, rtol=0)


def test_kvcache_query_longer_than_keys_gives_zero_rows():
    """seqlen_q 5 over 2 keys: the documented mask leaves the first 3 rows empty -> zeros."""
    k_cache, v_cache = _rand(1, 2, KVH, D, seed=7), _rand(1, 2, KVH, D, seed=8)
    q = _rand(1, 5, H, D, seed=9)
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, causal=True)
    assert out[0, :3].abs().max() == 0
    torch.testing.assert_close(out[0], _reference(q[0], k_cache[0], v_cache[0], D ** -0.5,
                                                  causal=True), atol=1e-5, rtol=0)


def test_softcap_caps_the_scores():
    q, k, v = _rand(3, H, D, seed=10) * 4, _rand(3, KVH, D, seed=11) * 4, _rand(3, KVH, D, seed=12)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    out = fa.flash_attn_varlen_func(q, k, v, cu, cu, 3, 3, softcap=2.0)
    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(H // KVH, 1)) * D ** -0.5
    probs = torch.softmax(2.0 * torch.tanh(scores / 2.0), -1)
    torch.testing.assert_close(out, torch.einsum("hqk,khd->qhd", probs,
                                                 v.repeat_interleave(H // KVH, 1)),
                               atol=1e-5, rtol=0)


def test_refusals_mirror_the_real_package(monkeypatch):
    cache = torch.zeros(2, 256, KVH, D, dtype=torch.bfloat16)
    q = torch.zeros(1, 1, H, D, dtype=torch.bfloat16)
    table = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="divisible by 256"):
        fa.flash_attn_with_kvcache(q, cache[:, :64], cache[:, :64], block_table=table)
    with pytest.raises(RuntimeError, match="block_table must have dtype torch.int32"):
        fa.flash_attn_with_kvcache(q, cache, cache, block_table=table.long())
    with pytest.raises(RuntimeError, match="seqlens_k must have dtype int32"):
        fa.flash_attn_with_kvcache(q, cache, cache, block_table=table,
                                   cache_seqlens=torch.ones(1, dtype=torch.int64))
    with pytest.raises(IndexError, match="outside the cache"):
        fa.flash_attn_with_kvcache(q, cache, cache, block_table=table - 1,
                                   cache_seqlens=torch.ones(1, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="must divide"):
        fa.flash_attn_with_kvcache(torch.zeros(1, 1, 3, D, dtype=torch.bfloat16), cache, cache)
    with pytest.raises(RuntimeError, match="query and key must have the same dtype"):
        fa.flash_attn_with_kvcache(q.half(), cache, cache)
    monkeypatch.setattr(fa, "ALLOW_FP32", False)
    cu = torch.tensor([0, 1], dtype=torch.int32)
    x = torch.zeros(1, 1, D)
    with pytest.raises(RuntimeError, match="only support fp16 and bf16"):
        fa.flash_attn_varlen_func(x, x, x, cu, cu, 1, 1)
    with pytest.raises(RuntimeError, match="cu_seqlens_q must have dtype int32"):
        fa.flash_attn_varlen_func(x.bfloat16(), x.bfloat16(), x.bfloat16(), cu.long(), cu, 1, 1)
