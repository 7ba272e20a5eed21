"""The int8 KV cache's kernels: the quantized write gives the bits of the torch formula, the paged
kernel reading int8 blocks gives the bits of the same kernel reading a float32 cache that holds
the dequantized values (so everything proven of the float32 kernel holds), and the torch
reference backend agrees within float32 rounding (1e-5: another summation order)."""

import pytest
import torch
from attention_batches import attention_batch

from rtpkv.kernels import attention_backend, fused_ops
from rtpkv.kernels.kv_quant import (QMAX, SCALE_BYTES, dequantize_rows, quantize_rows, row_width,
                                    write_kv_int8)

from conftest import needs_c_kernels

pytestmark = needs_c_kernels  # these tests ask for the C kernels by name

CPU = torch.device("cpu")
H, KVH, B, NUM_BLOCKS = 4, 2, 8, 24
TABLES = [[7, 3, 11, 0, 19, 5, 2, 16], [4, 6, 8, 9, 1], [12, 13, 14, 15]]


def _randn(*shape, seed, dtype=torch.float32, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def test_the_int8_row_is_the_values_then_their_float32_scale():
    x = torch.tensor([[0.5, -2.54, 0.0, 1.0]])
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (1, 4 + SCALE_BYTES)
    assert rows[0, :4].tolist() == [25, -127, 0, 50]
    assert rows[0, 4:].view(torch.float32).item() == pytest.approx(2.54 / QMAX)
    assert row_width(64, torch.int8) == 68 and row_width(64, torch.bfloat16) == 64
    assert torch.equal(quantize_rows(torch.zeros(2, 8)), torch.zeros(2, 12, dtype=torch.int8))


def test_dequantized_values_are_within_half_a_step():
    x = _randn(50, 64, seed=1)
    back = dequantize_rows(quantize_rows(x))
    step = x.abs().amax(-1, keepdim=True) / QMAX
    assert ((back - x).abs() <= step / 2 * (1 + 1e-5)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_the_c_write_gives_the_torch_formula_bit_for_bit(dtype, qk_norm):
    """K and V as the model hands them: strided views of the fused qkv output (or contiguous
    after a q/k norm), with an all-zero row, scattered to random pool rows."""
    assert fused_ops.library() is not None
    T, D = 37, 64
    qkv = _randn(T, 3 * KVH * D, seed=2, dtype=dtype)
    qkv[5, KVH * D:KVH * D + D] = 0
    k = qkv[:, KVH * D:2 * KVH * D].view(T, KVH, D)
    v = qkv[:, 2 * KVH * D:].view(T, KVH, D)
    if qk_norm:
        k = k.contiguous()
    rows = torch.randperm(KVH * 64, generator=torch.Generator().manual_seed(3))[:KVH * T]
    rows = rows.view(KVH, T)
    caches = [torch.zeros(KVH * 64, D + SCALE_BYTES, dtype=torch.int8) for _ in range(2)]
    write_kv_int8(*caches, k, v, rows)
    for cache, x in zip(caches, (k, v)):
        want = torch.zeros_like(cache)
        want[rows.flatten()] = quantize_rows(x.transpose(0, 1)).reshape(-1, D + SCALE_BYTES)
        assert torch.equal(cache, want)


def test_without_the_library_the_torch_write_runs(monkeypatch):
    k, v = _randn(9, KVH, 16, seed=4), _randn(9, KVH, 16, seed=5)
    rows = torch.arange(KVH * 9).view(KVH, 9)
    fast = [torch.zeros(KVH * 9, 20, dtype=torch.int8) for _ in range(2)]
    write_kv_int8(*fast, k, v, rows)
    monkeypatch.setattr(fused_ops, "library", lambda: None)
    slow = [torch.zeros(KVH * 9, 20, dtype=torch.int8) for _ in range(2)]
    write_kv_int8(*slow, k, v, rows)
    assert all(torch.equal(a, b) for a, b in zip(fast, slow))


def test_a_step_with_no_tokens_writes_nothing():
    """As the float32 write (an empty index_copy_) does, on either path."""
    cache = [torch.ones(KVH * 9, 20, dtype=torch.int8) for _ in range(2)]
    empty = torch.empty(0, KVH, 16)
    write_kv_int8(*cache, empty, empty, torch.empty(KVH, 0, dtype=torch.int64))
    assert all(torch.equal(c, torch.ones_like(c)) for c in cache)


def _step(window=None):
    """Two decodes and a 21-token chunk after a 10-token prefix (tiles of 16 and 5 tokens)."""
    return attention_batch(TABLES, [(25, 1), (33, 1), (10, 21)], B, NUM_BLOCKS, KVH, window)


def _inputs(dtype, head_dim):
    T = 23
    q, k, v = (_randn(T, h, head_dim, seed=s, dtype=dtype) for h, s in ((H, 6), (KVH, 7), (KVH, 8)))
    caches = [quantize_rows(_randn(KVH * NUM_BLOCKS * B, head_dim, seed=s)) for s in (9, 10)]
    return q, k, v, caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 13])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_the_kernel_on_int8_blocks_is_the_kernel_on_their_float32_values(dtype, window, head_dim):
    q, k, v, caches = _inputs(dtype, head_dim)
    scale = head_dim ** -0.5
    int8 = attention_backend(CPU, dtype, head_dim, "cpu-paged", torch.int8)
    out = int8.forward(q, k, v, *caches, int8.build(_step(window)), scale)
    # the float32 kernel on the dequantized cache, new K/V written as stored
    floats = [dequantize_rows(c) for c in caches]
    f32 = attention_backend(CPU, torch.float32, head_dim, "cpu-paged")
    want = f32.forward(q.float(), dequantize_rows(quantize_rows(k)),
                       dequantize_rows(quantize_rows(v)), *floats, f32.build(_step(window)), scale)
    assert torch.equal(out, want.to(dtype))
    assert all(torch.equal(dequantize_rows(c), f) for c, f in zip(caches, floats))


@pytest.mark.parametrize("window", [None, 13])
def test_the_kernel_and_the_torch_backend_agree_on_an_int8_cache(window):
    q, k, v, caches = _inputs(torch.float32, 64)
    outs, written = [], []
    for name in ("cpu-paged", "torch"):
        backend = attention_backend(CPU, torch.float32, 64, name, torch.int8)
        mine = [c.clone() for c in caches]
        outs.append(backend.forward(q, k, v, *mine, backend.build(_step(window)), 0.125))
        written.append(mine)
    assert all(torch.equal(a, b) for a, b in zip(*written))
    # outputs reach |10| here; against float64 the kernel (each score 8 partial chains and a
    # tree) is within 6e-6, torch (one chain) within 3e-5
    torch.testing.assert_close(outs[0], outs[1], atol=4e-5, rtol=0)


def test_a_token_in_a_prefill_tile_or_alone_gives_the_same_bits_on_int8_blocks():
    q, k, v, caches = _inputs(torch.float32, 64)
    kernel = attention_backend(CPU, torch.float32, 64, "cpu-paged", torch.int8)
    chunk = attention_batch(TABLES[:1], [(25, 20)], B, NUM_BLOCKS, KVH)
    together = kernel.forward(q[:20], k[:20], v[:20], *caches, kernel.build(chunk), 0.125)
    for i in range(20):
        alone = attention_batch(TABLES[:1], [(25 + i, 1)], B, NUM_BLOCKS, KVH)
        out = kernel.forward(q[i:i + 1], k[i:i + 1], v[i:i + 1], *caches, kernel.build(alone),
                             0.125)
        assert torch.equal(out, together[i:i + 1]), f"token {i}"


def test_flash_attn_is_refused_for_an_int8_cache():
    with pytest.raises(ValueError, match="flash-attn does not read an int8 KV cache"):
        attention_backend(CPU, torch.float32, 64, "flash-attn", torch.int8)
