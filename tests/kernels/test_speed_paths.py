"""The speed paths agree with the reference ones: the CPU paged-attention kernel with the torch
backend, the oneDNN, fp32-compute and avx2 GEMM paths with F.linear; bad choices are refused."""

import json
import logging

import pytest
import torch
import torch.nn.functional as F
from attention_batches import attention_batch
from conftest import needs_c_kernels, run

from rtpkv.kernels import AttentionBatch, TorchAttention, attention_backend, cpu_attention
from rtpkv.kernels import cpu_build, fp32_linear
from rtpkv.kernels.linear import (PADDING_CANDIDATES, InferenceLinear, bf16_gemm_supported,
                                  invariant_min_rows, linear_path)

CPU = torch.device("cpu")
H, KVH, D, B, NUM_BLOCKS = 4, 2, 16, 4, 40


def _mixed_batch() -> AttentionBatch:
    """Two decodes (contexts 7 and 13), a prefill chunk of 5 after a 6-token prefix, and a
    fresh 9-token prompt: rows in the ModelRunner's order, decodes first."""
    tables = [[3, 9], [1, 4, 7, 8], [5, 2, 11], [6, 10, 12]]
    seqs = [(6, 1), (12, 1), (6, 5), (0, 9)]     # (first position, tokens this step)
    return attention_batch(tables, seqs, B, NUM_BLOCKS, KVH)


def _attend(backend, batch, q, k, v, dtype):
    g = torch.Generator().manual_seed(1)
    caches = [torch.randn(KVH * NUM_BLOCKS * B, D, generator=g).to(dtype) for _ in range(2)]
    return backend.forward(q, k, v, caches[0], caches[1], backend.build(batch), D ** -0.5)


@needs_c_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_kernel_matches_torch_backend(dtype):
    batch = _mixed_batch()
    T = len(batch.positions)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(T, h, D, generator=g).to(dtype) for h in (H, KVH, KVH))
    ours = _attend(attention_backend(CPU, dtype, D, "cpu-paged"), batch, q, k, v, dtype)
    ref = _attend(TorchAttention(D, dtype, CPU), batch, q, k, v, dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.float(), ref.float(), atol=tol, rtol=tol)


@needs_c_kernels
def test_paged_kernel_output_of_a_token_does_not_depend_on_its_batch():
    batch = _mixed_batch()
    T = len(batch.positions)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (H, KVH, KVH))
    kernel = attention_backend(CPU, torch.float32, D, "cpu-paged")
    together = _attend(kernel, batch, q, k, v, torch.float32)
    # the prefill chunk (rows 2..6) alone, its K/V written by the same call
    alone = AttentionBatch(
        positions=batch.positions[2:7], row_seq=[0] * 5,
        block_tables=batch.block_tables[2:3], query_start=[0], query_len=[5], context_len=[11],
        block_size=B, num_blocks=NUM_BLOCKS, kv_heads=KVH)
    assert torch.equal(_attend(kernel, alone, q[2:7], k[2:7], v[2:7], torch.float32),
                       together[2:7])


def _greedy(make_pipeline, **options):
    prompts = [list(range(5, 30)), list(range(5, 20)) + [77, 78, 79]]
    pipe = make_pipeline(seq_size_per_block=4, reuse_cache=True, max_num_batched_tokens=12,
                         **options)
    return [run(pipe, p, max_new_tokens=12, return_logits=True) for p in prompts]


@needs_c_kernels
def test_pipeline_tokens_with_kernel_and_with_torch_fallback(make_pipeline, monkeypatch):
    monkeypatch.setenv("RTPKV_ATTENTION", "cpu-paged")
    kernel = _greedy(make_pipeline)
    assert make_pipeline().engine.runner.module.attention_name == "cpu-paged"
    monkeypatch.setenv("RTPKV_ATTENTION", "torch")
    fallback = _greedy(make_pipeline)
    assert make_pipeline().engine.runner.module.attention_name == "torch"
    for a, b in zip(kernel, fallback):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(a.logits, b.logits, atol=1e-4, rtol=0)


def test_pipeline_tokens_with_onednn_on_and_off(make_pipeline, monkeypatch):
    monkeypatch.setenv("RTPKV_LINEAR", "native")
    native = _greedy(make_pipeline)
    monkeypatch.setenv("RTPKV_LINEAR", "onednn")
    pipe = make_pipeline()
    assert pipe.engine.runner.module.linear_path == "onednn"
    onednn = _greedy(make_pipeline)
    for a, b in zip(native, onednn):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(a.logits, b.logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("path", ["native", "onednn", "fp32-compute",
                                  pytest.param("avx2", marks=needs_c_kernels)])
def test_inference_linear_matches_f_linear_and_is_row_invariant(path):
    dtype = torch.bfloat16 if path == "fp32-compute" else torch.float32
    g = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(64, 96, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(96, 64, generator=g) * 0.1)
    layer = layer.to(dtype)
    fast = InferenceLinear(layer, path)
    x = torch.randn(40, 64, generator=g).to(dtype)
    full = fast(x)
    ref = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    torch.testing.assert_close(full.float(), ref, atol=1e-4 if dtype == torch.float32 else 5e-2,
                               rtol=1e-2)
    assert fast.min_rows in PADDING_CANDIDATES
    for rows in (1, 3, 15, 16, 33):
        assert torch.equal(fast(x[:rows]), full[:rows])
        assert torch.equal(fast(x[7:7 + rows]), full[7:7 + rows])


def test_min_rows_is_measured_from_the_gemm():
    """A GEMM that changes its reduction order below 8 rows is padded to 8; one that is
    invariant is not padded; one that never is gets the largest padding and a warning."""
    w = torch.randn(24, 32, generator=torch.Generator().manual_seed(0))

    def row_by_row(x):
        return torch.stack([w @ row for row in x])

    def small_m_kernel(x):
        y = row_by_row(x)
        return y * (1 + 2 ** -20) if x.shape[0] < 8 else y

    assert invariant_min_rows(small_m_kernel, 32, torch.float32, CPU) == 8
    assert invariant_min_rows(row_by_row, 32, torch.float32, CPU) == 1

    def batch_dependent(x):
        return row_by_row(x) + x.shape[0] * 1e-3

    assert invariant_min_rows(batch_dependent, 32, torch.float32, CPU) == PADDING_CANDIDATES[-1]


def test_the_measured_padding_is_kept_on_disk_and_read_back(monkeypatch, tmp_path):
    from rtpkv.kernels import linear

    monkeypatch.setenv("RTPKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(linear, "_min_rows_by_shape", {})
    layer = torch.nn.Linear(40, 24)
    fast = InferenceLinear(layer, "native")
    assert fast.min_rows is None          # measured on the first call, in the model's thread
    fast(torch.ones(2, 40))
    probed = fast.min_rows
    (saved,) = tmp_path.glob("kernels/gemm-invariance-*.json")
    entries = json.loads(saved.read_text())
    assert list(entries.values()) == [probed]
    saved.write_text(json.dumps({k: 32 for k in entries}))   # another process's finding
    monkeypatch.setattr(linear, "_min_rows_by_shape", {})
    assert InferenceLinear(layer, "native").measure_min_rows() == 32
    saved.write_text("null")                                  # a damaged cache: probe again
    monkeypatch.setattr(linear, "_min_rows_by_shape", {})
    assert InferenceLinear(layer, "native").measure_min_rows() == probed
    assert torch.equal(InferenceLinear(layer, "native")(torch.ones(3, 40)),
                       F.linear(F.pad(torch.ones(3, 40), (0, 0, 0, 29)), layer.weight, layer.bias)[:3])


def test_bf16_defaults_to_a_fast_gemm_path():
    expected = "onednn" if bf16_gemm_supported() else "fp32-compute"
    assert linear_path(torch.bfloat16, CPU, "auto") == expected
    # float32 takes the project's kernel wherever it runs (AVX2 and FMA, AVX-512 CPUs included)
    expected = "avx2" if fp32_linear.available() else "onednn"
    assert linear_path(torch.float32, CPU, "auto") == expected


def test_bad_kernel_choices_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="RTPKV_ATTENTION='flash'.*auto, cpu-paged, flash-attn, torch"):
        attention_backend(CPU, torch.float32, D, "flash")
    with pytest.raises(ValueError, match="RTPKV_LINEAR='mkl'.*native, onednn, fp32-compute, avx2"):
        linear_path(torch.float32, CPU, "mkl")
    with pytest.raises(ValueError, match="RTPKV_LINEAR=avx2 computes float32 models"):
        linear_path(torch.bfloat16, CPU, "avx2")
    with pytest.raises(ValueError, match="supports float32 and bfloat16"):
        linear_path(torch.float16, CPU, "onednn")
    if not bf16_gemm_supported():
        with pytest.raises(ValueError, match="AVX512-BF16"):
            linear_path(torch.bfloat16, CPU, "onednn")
    with pytest.raises(ValueError, match="float32 and bfloat16, not torch.float16"):
        cpu_attention.CpuPagedAttention(torch.float16)


def test_without_a_compiler_attention_falls_back_to_torch(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("RTPKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    cpu_build._load_library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="rtpkv"):
            backend = attention_backend(CPU, torch.float32, D)
        assert isinstance(backend, TorchAttention)
        assert "falls back to pure torch" in caplog.text or "failed" in caplog.text
        with pytest.raises(RuntimeError, match="could not be built"):
            attention_backend(CPU, torch.float32, D, "cpu-paged")
    finally:
        cpu_build._load_library.cache_clear()


def test_auto_dtype_on_cpu_is_the_fastest_exact_one(tmp_path, llama_path):
    from conftest import load

    from rtpkv.model_factory.tiny import build_tiny_checkpoint

    bf16_checkpoint = build_tiny_checkpoint(tmp_path / "bf16", dtype="bfloat16")
    expected = torch.bfloat16 if bf16_gemm_supported() else torch.float32
    assert load(bf16_checkpoint).dtype == expected
    assert load(llama_path).dtype == torch.float32
    assert load(bf16_checkpoint, dtype="bfloat16").dtype == torch.bfloat16
