"""The flash-attn backend on CPU CI: the stand-in (tests/flash_attn_standin) injected as
`flash_attn`, the pipeline's reuse, task-prompt, window, chunked-prefill and batch scenarios run
with RTPKV_ATTENTION=flash-attn, and every token equal to the torch backend's.

Both routes run: SEQ_SIZE_PER_BLOCK=256 takes the paged one (flash_attn_with_kvcache with a
block table: 256 is flash-attn 2's page multiple), 64 the gathered one (flash_attn_varlen_func).
The stand-in refuses float32 as the real package does unless ALLOW_FP32 is set: the
`flash_attn_standin` fixture (conftest.py) sets it, so that float32 runs too (there the tokens must match the
torch backend's exactly; the real backend refuses float32 on CUDA, tested below).
"""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from attention_batches import attention_batch
from conftest import run
from rtpkv.kernels import TorchAttention, attention_backend, auto_attention
from rtpkv.kernels.flash_attention import FlashAttention, page_multiple

DTYPES = ["float32", "bfloat16"]
BLOCKS = [256, 64]     # paged route, gathered route
CPU = torch.device("cpu")


@pytest.fixture
def pair(make_pipeline, flash_attn_standin):
    """pair(**options) -> (flash-attn pipeline, torch pipeline) on the same checkpoint."""

    def make(**options):
        flash = make_pipeline(rtpkv_attention="flash-attn", **options)
        reference = make_pipeline(rtpkv_attention="torch", **options)
        backend = flash.engine.runner.module.attention
        assert isinstance(backend, FlashAttention)
        assert backend.paged(options["seq_size_per_block"]) == (options["seq_size_per_block"] == 256)
        return flash, reference

    return make


def _same(flash, reference, dtype):
    """Equal tokens, and logits within float32 rounding (float32) or one bf16 rounding step
    (measured: 0.0156 at logits of 2.5-2.8): tokens alone can hide an attention bug in a tiny
    random model whose arg-max rarely moves."""
    assert flash.output_ids == reference.output_ids
    atol = 1e-4 if dtype == "float32" else 0.02   # bf16: one rounding step of logits ~2-4
    torch.testing.assert_close(flash.logits, reference.logits, atol=atol, rtol=0)


def _ids(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (n,), generator=g).tolist()


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reuse_and_chunked_prefill_match_torch(pair, dtype, block, caplog):
    """A 600-token prompt prefilled in chunks of 160 (each chunk after the first is shorter than
    its keys), then one sharing 520 tokens with it: the second starts after a reused prefix."""
    flash, reference = pair(dtype=dtype, seq_size_per_block=block, reuse_cache=True,
                            max_num_batched_tokens=160)
    caplog.set_level(logging.INFO, logger="rtpkv")
    first = _ids(600, 1)
    second = first[:520] + _ids(70, 2)
    for pipe in (flash, reference):
        pipe.outputs = [run(pipe, p, max_new_tokens=12, return_logits=True)
                        for p in (first, second)]
    assert flash.outputs[1].aux_info["reuse_len"] == 512
    route = "paged route" if block == 256 else "gathered route"
    assert f"flash-attn 2.8.3: {route}" in caplog.text
    for ours, theirs in zip(flash.outputs, reference.outputs):
        _same(ours, theirs, dtype)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_task_prompts_match_torch(pair, dtype, block):
    """A pinned task prompt longer than a block: the request's prefill is a query shorter than
    its keys (rtp-llm's seed could not run this through flash attention)."""
    system = "You are a careful assistant who answers in short plain sentences. " * 40
    flash, reference = pair(dtype=dtype, seq_size_per_block=block,
                            tasks=[{"task_id": "t", "prompt": system}])
    outs = [run(p, "what is the river called?", task_id="t", max_new_tokens=12,
                return_logits=True) for p in (flash, reference)]
    assert outs[0].aux_info["reuse_len"] >= 256
    _same(*outs, dtype)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_window_matches_torch(pair, dtype, block):
    """MAX_ATTENTION_WINDOW=256 over a 700-token prompt in chunks of 200 and 40 decodes: blocks
    out of the window are released (-1 in the tables) while flash-attn's window_size masks."""
    flash, reference = pair(dtype=dtype, seq_size_per_block=block, max_attention_window=256,
                            max_num_batched_tokens=200, reuse_cache=True)
    prompt = _ids(700, 3)
    outs = [run(p, prompt, max_new_tokens=40, return_logits=True) for p in (flash, reference)]
    _same(*outs, dtype)
    again = [run(p, prompt[:650], max_new_tokens=8, return_logits=True)
             for p in (flash, reference)]
    assert again[0].aux_info["reuse_len"] > 0
    _same(*again, dtype)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_matches_torch(pair, dtype, block):
    """Three prompts of different lengths as one batch under a small token budget: steps mix
    decodes with prefill chunks."""
    flash, reference = pair(dtype=dtype, seq_size_per_block=block, max_num_batched_tokens=96)
    prompts = ["hello, what's your name", "tell me about the river and the hills " * 8,
               "the cat and the dog " * 20]
    outs = [list(p(prompts, top_k=1, ignore_eos=True, max_new_tokens=10))[-1]
            for p in (flash, reference)]
    assert outs[0].output_ids == outs[1].output_ids
    assert any(len(step) == 3 for step in flash.engine.step_log)


def _mixed_batch(B: int, window):
    """Decodes at contexts 600 and 40, a 20-token chunk after a 280-token prefix, a fresh
    30-token prompt: the ModelRunner's row order, distinct shuffled blocks, and with a window
    the entries wholly before each sequence's first query's window released (-1)."""
    seqs = [(599, 1), (39, 1), (280, 20), (0, 30)]     # (first position, tokens this step)
    order = torch.randperm(64, generator=torch.Generator().manual_seed(0)).tolist()
    tables = []
    for start, n in seqs:
        first = 0 if window is None else max(0, start - window + 1) // B
        table = [order.pop() for _ in range(-(-(start + n) // B))]
        tables.append([-1] * first + table[first:])
    return attention_batch(tables, seqs, B, 64, 2, window)


@pytest.mark.parametrize("window", [None, 256])
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_backend_output_matches_torch_backend(flash_attn_standin, dtype, block, window):
    """Attention outputs themselves (more sensitive than a tiny model's logits): both routes,
    GQA 4:2, a non-default scale, released table entries under a window; float16 too (a CUDA
    dtype that the CPU pipeline does not run)."""
    batch = _mixed_batch(block, window)
    T, D = len(batch.positions), 16
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(T, h, D, generator=g).to(dtype) for h in (4, 2, 2))
    outs = []
    for backend in (FlashAttention(D, dtype, CPU), TorchAttention(D, dtype, CPU)):
        caches = [torch.randn(2 * 64 * block, D, generator=torch.Generator().manual_seed(s))
                  .to(dtype) for s in (2, 3)]
        outs.append(backend.forward(q, k, v, *caches, backend.build(batch), 0.3))
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}[dtype]
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=tol, rtol=tol)


def test_page_multiple_follows_the_version():
    assert page_multiple("2.8.3") == page_multiple("2.5.0") == 256
    assert page_multiple("2.4.2") is None and page_multiple("3.0.0b1") is None
    assert page_multiple("unknown") is None


def test_flash_attn_refuses_float32_on_cuda(flash_attn_standin):
    with pytest.raises(ValueError, match=r"RTPKV_ATTENTION=flash-attn runs float16 and bfloat16 "
                                         r"models, not float32: set DTYPE=bfloat16"):
        FlashAttention(64, torch.float32, torch.device("cuda"))


def test_a_package_that_cannot_run_fails_at_start(flash_attn_standin, monkeypatch):
    """The start-up probe: the real package refuses float32 (the stand-in without ALLOW_FP32)."""
    monkeypatch.setattr(flash_attn_standin, "ALLOW_FP32", False)
    with pytest.raises(RuntimeError, match="flash_attn 2.8.3 cannot run float32 on cpu: "
                                           "FlashAttention only support fp16 and bf16"):
        attention_backend(CPU, torch.float32, 16, "flash-attn")
    with pytest.raises(ValueError, match="multiple of 8 up to 256, not 12"):
        FlashAttention(12, torch.bfloat16, CPU)


def test_auto_falls_back_when_flash_attn_cannot_run(flash_attn_standin, monkeypatch,
                                                    caplog):
    """auto's choice made, the probe fails (a GPU flash-attn does not support): the torch
    reference, with a warning; RTPKV_ATTENTION=flash-attn named explicitly raises instead."""
    import rtpkv.kernels as kernels

    monkeypatch.setattr(flash_attn_standin, "ALLOW_FP32", False)
    monkeypatch.setattr(kernels, "auto_attention", lambda *args: ("flash-attn", "test"))
    with caplog.at_level(logging.WARNING, logger="rtpkv"):
        assert isinstance(attention_backend(CPU, torch.float32, 16), TorchAttention)
    assert "cannot run float32 on cpu" in caplog.text and "torch reference backend" in caplog.text


def test_missing_package_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)   # import raises ImportError
    with pytest.raises(RuntimeError, match=r"the flash_attn package does not import.*"
                                           r"RTPKV_ATTENTION=auto or torch"):
        attention_backend(CPU, torch.bfloat16, 16, "flash-attn")
    from rtpkv.kernels import triton_support

    if triton_support.import_error() is None:   # then Triton's kernels serve CUDA
        assert auto_attention(torch.device("cuda"), torch.bfloat16, 16) == (
            "triton", "CUDA, bfloat16, the flash_attn package does not import")
    monkeypatch.setattr(triton_support, "import_error", lambda: "no triton here")
    assert auto_attention(torch.device("cuda"), torch.bfloat16, 16) == (
        "torch", "the flash_attn package does not import; no triton here")


def test_auto_picks_flash_attn_on_cuda_and_says_so(flash_attn_standin, caplog):
    """The choice itself (building it needs CUDA tensors): flash-attn for 16-bit models on CUDA
    when the package imports; for float32 the Triton kernels where triton imports, else the
    torch reference."""
    from rtpkv.kernels import triton_support

    assert auto_attention(torch.device("cuda"), torch.bfloat16, 64) == (
        "flash-attn", "CUDA, bfloat16, flash_attn 2.8.3")
    assert auto_attention(torch.device("cuda"), torch.float16, 64)[0] == "flash-attn"
    float32 = "torch" if triton_support.import_error() else "triton"
    assert auto_attention(torch.device("cuda"), torch.float32, 64)[0] == float32
    assert auto_attention(CPU, torch.float32, 64)[0] in ("cpu-paged", "torch")
    with caplog.at_level(logging.INFO, logger="rtpkv"):
        attention_backend(CPU, torch.float32, 64)
    assert "RTPKV_ATTENTION=auto: " in caplog.text
