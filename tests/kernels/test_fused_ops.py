"""The C kernels of the CPU fast path agree with their torch references: the fused RMSNorm
(Gemma's (1 + w) one in float32 too: the same kernel), SiLU-and-mul, GELU-and-mul and RoPE, the
greedy arg-max, and the attention kernel's two vectorisations (query rows in the lanes for
prefill tiles, the head dimension in the lanes for decodes), which must give the same bits for
a token."""

import pytest
import torch
import torch.nn.functional as F

from rtpkv.kernels import AttentionBatch, attention_backend, fused_ops
from rtpkv.kernels.activation import gelu_tanh_and_mul, silu_and_mul, soft_cap
from rtpkv.kernels.norm import rms_norm, rms_norm_float_weight, rms_norm_reference
from rtpkv.kernels.rope import apply_rope_, rope_table

from conftest import needs_c_kernels

pytestmark = needs_c_kernels  # these tests ask for the C kernels by name

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16]


def _randn(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_the_fused_library_builds_here():
    assert fused_ops.library() is not None


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_and_without_residual_matches_the_reference(dtype):
    x, w = _randn(37, 64, dtype=dtype), _randn(64, dtype=dtype, seed=1)
    res = _randn(37, 64, dtype=dtype, seed=2)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6), **tol)
    ours_res, ref_res = res.clone(), res.clone()
    ours = rms_norm(x, w, 1e-6, ours_res)
    ref = rms_norm_reference(x, w, 1e-6, ref_res)
    assert torch.equal(ours_res, ref_res)          # the residual stream: x + residual, in place
    torch.testing.assert_close(ours, ref, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(dtype):
    gate_up = _randn(19, 2 * 48, dtype=dtype) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(silu_and_mul(gate_up), F.silu(gate) * up, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul_matches_torch(dtype):
    """Gates far in both tails included (exp saturating to 0 and to infinity)."""
    gate_up = _randn(19, 2 * 48, dtype=dtype) * 4
    gate_up[0, :8] = torch.tensor([-120.0, -60.0, -9.0, -1e-3, 0.0, 1e-3, 9.0, 120.0])
    gate, up = gate_up.chunk(2, dim=-1)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(gelu_tanh_and_mul(gate_up), F.gelu(gate, approximate="tanh") * up,
                               **tol)


def test_the_soft_cap_matches_torch():
    """Gemma 2's logit soft-cap on float32 (a length that leaves a tail of 5), saturating far
    out, exact at 0 and odd; other dtypes run transformers' torch ops."""
    x = _randn(3, 101, dtype=torch.float32) * 40
    x[0, :6] = torch.tensor([-1e4, -1e-6, 0.0, 1e-6, 1e4, 30.0])
    ours = soft_cap(x, 30.0)
    torch.testing.assert_close(ours, torch.tanh(x / 30.0) * 30.0, atol=1e-5, rtol=1e-6)
    assert ours[0, 2] == 0 and ours[0, 0] == -30.0 and ours[0, 4] == 30.0
    assert torch.equal(soft_cap(-x, 30.0), -ours)
    assert torch.equal(soft_cap(x[:, 3:40].contiguous(), 30.0), ours[:, 3:40])   # lane-free
    half = x.to(torch.bfloat16)
    assert torch.equal(soft_cap(half, 30.0), torch.tanh(half / 30.0) * 30.0)


def test_the_offset_norm_is_transformers_formula():
    """Gemma's (1 + w) RMSNorm on float32, the C kernel over the float32 1 + w: transformers'
    torch ops (normalize, multiply by 1 + w in float32) to float32 rounding, the residual add
    bit for bit."""
    x, w, res = (_randn(37, 64, dtype=torch.float32, seed=s) for s in (0, 1, 2))
    scale = 1.0 + w
    ours_res, ref_res = res.clone(), res.clone()
    ours = rms_norm_float_weight(x, scale, 1e-6, ours_res)
    ref_res.add_(x)
    ref = ref_res * torch.rsqrt(ref_res.pow(2).mean(-1, keepdim=True) + 1e-6) * scale
    assert torch.equal(ours_res, ref_res)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place_on_views_of_the_fused_qkv_is_the_torch_rotation_bit_for_bit(dtype):
    T, H, KVH, D = 9, 4, 2, 32
    cos, sin = rope_table(1.0 / (10000 ** (torch.arange(0, D, 2) / D)), 64, dtype, CPU)
    qkv = _randn(T, (H + 2 * KVH) * D, dtype=dtype)
    positions = torch.tensor([0, 1, 2, 40, 41, 5, 63, 7, 8])
    q, k, _ = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
    q, k = q.view(T, H, D), k.view(T, KVH, D)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

    def rotate_half(x):
        return torch.cat((-x[..., D // 2:], x[..., :D // 2]), dim=-1)

    want_q, want_k = q * c + rotate_half(q) * s, k * c + rotate_half(k) * s
    apply_rope_(q, k, cos, sin, positions)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


H, KVH, B, NUM_BLOCKS = 4, 2, 8, 24


def _one_sequence(positions: list[int], window=None) -> AttentionBatch:
    table = [[7, 3, 11, 0, 19, 5, 2, 16]]
    return AttentionBatch(
        positions=positions, row_seq=[0] * len(positions),
        block_tables=table, query_start=[0], query_len=[len(positions)],
        context_len=[positions[-1] + 1], block_size=B, num_blocks=NUM_BLOCKS, kv_heads=KVH,
        window=window)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,softcap", [(None, None), (13, None), (None, 0.5), (13, 0.5)])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_a_token_computed_in_a_prefill_tile_or_as_a_decode_gives_the_same_bits(
        dtype, window, softcap, head_dim):
    """A 20-token chunk after a 25-token prefix (tiles of 16 and 4 tokens, 32 and 8 query rows:
    query rows in the lanes, blocks read whole or masked) and each of its tokens alone as a decode
    (2 query rows: the head dimension in the lanes) read the same cache and give identical
    outputs; with Gemma 2's soft-cap (small, so that it bends the scores), close to the torch
    backend's."""
    kernel = attention_backend(CPU, dtype, head_dim, "cpu-paged")
    caches = [_randn(KVH * NUM_BLOCKS * B, head_dim, dtype=dtype, seed=s) for s in (3, 4)]
    T, start = 20, 25
    q, k, v = (_randn(T, h, head_dim, dtype=dtype, seed=s) for h, s in ((H, 5), (KVH, 6), (KVH, 7)))
    chunk = _one_sequence(list(range(start, start + T)), window)
    ref_caches = [c.clone() for c in caches]
    together = kernel.forward(q, k, v, *caches, kernel.build(chunk), head_dim ** -0.5, softcap)
    for i in range(T):
        alone = _one_sequence([start + i], window)
        out = kernel.forward(q[i:i + 1], k[i:i + 1], v[i:i + 1], *caches, kernel.build(alone),
                             head_dim ** -0.5, softcap)
        assert torch.equal(out, together[i:i + 1]), f"token {i}"
    if softcap is not None:
        torch_backend = attention_backend(CPU, dtype, head_dim, "torch")
        ref = torch_backend.forward(q, k, v, *ref_caches, torch_backend.build(chunk),
                                    head_dim ** -0.5, softcap=softcap)
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(together.to(dtype), ref, **tol)


@pytest.mark.parametrize("kv", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("heads,kv_heads", [(1, 1), (3, 1), (7, 1), (6, 2)])
@pytest.mark.parametrize("block,head_dim", [(3, 8), (5, 24), (13, 40)])
def test_decode_and_prefill_bits_agree_on_odd_shapes(kv, heads, kv_heads, block, head_dim):
    """The decode path's tiles of 4 keys and 1-2 query rows against the prefill tiles, where
    neither divides evenly: blocks of 3, 5 and 13 keys (a padded last group of keys), 1 to 7
    query heads per KV head (a last tile of one row), head dims that are not a multiple of 16,
    a window whose released blocks (-1) must not be read, bfloat16 and int8 K/V."""
    from rtpkv.kernels.kv_quant import quantize_rows
    dtype = torch.bfloat16 if kv == "bfloat16" else torch.float32
    kernel = attention_backend(CPU, dtype, head_dim, "cpu-paged",
                               torch.int8 if kv == "int8" else None)
    blocks, T, start, window = 16, 9, 23, 7
    table = [9, 2, 14, 5, 11, 0, 7, 12, 3, 15, 6, 1, 10][: -(-(start + T) // block)]
    table = [-1] * ((start - window + 1) // block) + table[(start - window + 1) // block:]
    caches = [_randn(kv_heads * blocks * block, head_dim, dtype=dtype, seed=s) for s in (3, 4)]
    if kv == "int8":
        caches = [quantize_rows(c.float()) for c in caches]
    q, k, v = (_randn(T, h, head_dim, dtype=dtype, seed=s)
               for h, s in ((heads, 5), (kv_heads, 6), (kv_heads, 7)))

    def one_sequence(positions):
        return AttentionBatch(
            positions=positions, row_seq=[0] * len(positions), block_tables=[table],
            query_start=[0], query_len=[len(positions)], context_len=[positions[-1] + 1],
            block_size=block, num_blocks=blocks, kv_heads=kv_heads, window=window)

    chunk = one_sequence(list(range(start, start + T)))
    together = kernel.forward(q, k, v, *caches, kernel.build(chunk), head_dim ** -0.5)
    for i in range(T):
        alone = kernel.forward(q[i:i + 1], k[i:i + 1], v[i:i + 1], *caches,
                               kernel.build(one_sequence([start + i])), head_dim ** -0.5)
        assert torch.equal(alone, together[i:i + 1]), f"token {i}"


def test_without_the_library_the_torch_references_run(monkeypatch):
    monkeypatch.setattr(fused_ops, "library", lambda: None)
    x, w, res = (_randn(5, 32, dtype=torch.float32, seed=s) for s in (0, 1, 2))
    ref_res = res.clone()
    assert torch.equal(rms_norm(x, w[0], 1e-6, res), rms_norm_reference(x, w[0], 1e-6, ref_res))
    assert torch.equal(res, ref_res)
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(silu_and_mul(x), F.silu(gate) * up)
    assert torch.equal(gelu_tanh_and_mul(x), F.gelu(gate, approximate="tanh") * up)


def test_the_argmax_is_torchs_nan_ties_and_infinities_included(monkeypatch):
    logits = _randn(7, 8003, dtype=torch.float32)
    logits[1, [77, 99]] = float("nan")        # the first NaN wins
    logits[2] = float("-inf")                 # all equal: the first index
    logits[3, [5, 9]] = 1e9                   # a tie: the first
    logits[4, 0] = float("nan")
    logits[5, [3, 8002]] = float("inf")
    logits[6, 8002] = 50.0                    # the last column
    want = logits.argmax(dim=-1).tolist()
    assert fused_ops.argmax(logits) == want == [want[0], 77, 0, 5, 0, 3, 8002]
    for cols in (1, 100):   # other row widths through the C path: contiguous copies
        narrow = logits[:, :cols].contiguous()
        assert fused_ops.argmax(narrow) == narrow.argmax(dim=-1).tolist()
    assert fused_ops.argmax(logits[:0]) == []
    monkeypatch.setattr(fused_ops, "library", lambda: None)   # the fallback runs and agrees
    assert fused_ops.argmax(logits) == want
