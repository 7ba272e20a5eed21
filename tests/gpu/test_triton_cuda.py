"""The Triton kernels compiled for a real GPU, and decode from CUDA graphs: each kernel against
its torch reference on the device (bfloat16 rounds as torch does there: one rounding step at
most), the paged attention batch-invariant on the device, and a pipeline on the Triton backend
giving the same tokens with graphs (the default) and with ENFORCE_EAGER=1, and with reuse on and
off (logits within a bf16 step: the attention is batch-invariant, cuBLAS may not be).
Skipped, with the reason, where CUDA or triton is absent."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from attention_batches import attention_batch
from conftest import load, run
from rtpkv.kernels import TorchAttention, auto_attention, triton_support
from rtpkv.kernels.flash_attention import load_flash_attn
from rtpkv.kernels.norm import rms_norm_reference
from rtpkv.kernels.rope import _rotate_half, rope_table
from rtpkv.pipeline import Pipeline

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or triton_support.import_error() is not None,
    reason="needs a CUDA device (run on a GPU machine)" if not torch.cuda.is_available()
    else str(triton_support.import_error()))
CUDA = torch.device("cuda")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _ops():
    from rtpkv.kernels import triton_ops

    return triton_ops


def _close(ours, ref):
    tol = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[ref.dtype]
    torch.testing.assert_close(ours.float(), ref.float(), atol=tol, rtol=2 * tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_element_wise_kernels_match_their_references(dtype):
    ops = _ops()
    g = torch.Generator(device=CUDA).manual_seed(0)
    x = torch.randn(37, 256, device=CUDA, generator=g).to(dtype)
    w = (1 + torch.randn(256, device=CUDA, generator=g) / 4).to(dtype)
    res, res_ref = (torch.randn(37, 256, device=CUDA, generator=g).to(dtype) for _ in range(2))
    res_ref.copy_(res)
    _close(ops.rms_norm(x, w, 1e-6, res), rms_norm_reference(x, w, 1e-6, res_ref))
    assert torch.equal(res, res_ref)
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    cos, sin = rope_table(inv, 512, dtype, CUDA)
    qkv = torch.randn(37, 12 * 64, device=CUDA, generator=g).to(dtype)
    q, k = qkv[:, :512].view(37, 8, 64), qkv[:, 512:640].view(37, 2, 64)
    positions = torch.randint(0, 512, (37,), device=CUDA, generator=g)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    q_ref, k_ref = q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
    ops.apply_rope_(q, k, cos, sin, positions)
    _close(q, q_ref)
    _close(k, k_ref)
    gate_up = torch.randn(37, 2 * 1408, device=CUDA, generator=g).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    _close(ops.silu_and_mul(gate_up), F.silu(gate) * up)
    _close(ops.gelu_tanh_and_mul(gate_up), F.gelu(gate, approximate="tanh") * up)


@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("block", [16, 64, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_matches_torch_and_is_batch_invariant(dtype, block, window):
    from rtpkv.kernels.triton_attention import TritonAttention

    seqs = [(599, 1), (39, 1), (280, 20), (0, 130)]
    num_blocks = 128   # 69 blocks of 16 tokens in use
    free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    tables = []
    for start, n in seqs:
        first = 0 if window is None else max(0, start - window + 1) // block
        table = [free.pop() for _ in range(-(-(start + n) // block))]
        tables.append([-1] * first + table[first:])
    batch = attention_batch(tables, seqs, block, num_blocks, 2, window)
    batch.device = CUDA
    T, d = len(batch.positions), 128
    g = torch.Generator(device=CUDA).manual_seed(1)
    q, k, v = (torch.randn(T, h, d, device=CUDA, generator=g).to(dtype) for h in (8, 2, 2))
    caches = [torch.randn(2 * num_blocks * block, d, device=CUDA, generator=g).to(dtype)
              for _ in "kv"]
    outs = []
    for backend in (TritonAttention(d, dtype, CUDA), TorchAttention(d, dtype, CUDA)):
        kc, vc = (c.clone() for c in caches)
        outs.append(backend.forward(q, k, v, kc, vc, backend.build(batch), d ** -0.5))
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 3e-3}[dtype]
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=tol, rtol=tol)
    alone = attention_batch(tables[:1], seqs[:1], block, num_blocks, 2, window)
    alone.device = CUDA
    backend = TritonAttention(d, dtype, CUDA)
    kc, vc = (c.clone() for c in caches)
    one = backend.forward(q[:1], k[:1], v[:1], kc, vc, backend.build(alone), d ** -0.5)
    assert torch.equal(one[0], outs[0][0])   # the decode row alone = in the batch


def _pipeline(path, **options) -> Pipeline:
    options.setdefault("kv_cache_max_tokens", 16384)
    model = load(path, device="cuda", rtpkv_attention="triton", **options)
    return Pipeline(model, model.tokenizer)


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (n,), generator=g).tolist()


def test_decode_graphs_give_the_eager_tokens(llama_path, caplog):
    prompts = [_ids(300, 1), _ids(40, 2), _ids(170, 3)]
    outs = []
    for eager in (False, True):
        with caplog.at_level(logging.INFO, logger="rtpkv"):
            pipe = _pipeline(llama_path, dtype="bfloat16", enforce_eager=eager)
        try:
            assert (pipe.engine.runner.graphs is None) == eager
            streams = [pipe(p, top_k=1, ignore_eos=True, max_new_tokens=n, return_logits=True)
                       for p, n in zip(prompts, (24, 16, 20))]
            outs.append([list(s)[-1] for s in streams])
            if not eager:
                assert 4 in pipe.engine.runner.graphs.graphs
            pipe.check_integrity()
        finally:
            pipe.stop()
    assert "ENFORCE_EAGER=1: decode steps run eagerly" in caplog.text
    for graphed, eager in zip(*outs):
        assert graphed.output_ids == eager.output_ids
        torch.testing.assert_close(graphed.logits, eager.logits, atol=2e-2, rtol=0)


@pytest.mark.parametrize("block", [16, 64])
def test_reuse_on_and_off_give_the_same_tokens_and_logits(llama_path, block):
    prompts = [_ids(600, 4), None]
    prompts[1] = prompts[0][:530] + _ids(40, 5)
    outs = []
    for reuse in (True, False):
        pipe = _pipeline(llama_path, dtype="bfloat16", seq_size_per_block=block,
                         reuse_cache=reuse)
        try:
            outs.append([run(pipe, p, max_new_tokens=16, return_logits=True) for p in prompts])
        finally:
            pipe.stop()
    assert outs[0][1].aux_info["reuse_len"] > 0 and outs[1][1].aux_info["reuse_len"] == 0
    for on, off in zip(*outs):   # attention is batch-invariant; cuBLAS may split by shape
        assert on.output_ids == off.output_ids
        torch.testing.assert_close(on.logits, off.logits, atol=2e-2, rtol=0)


@pytest.mark.skipif(load_flash_attn() is not None, reason="flash_attn imports: auto picks it")
def test_auto_picks_triton_without_flash_attn():
    assert auto_attention(CUDA, torch.bfloat16, 64)[0] == "triton"
