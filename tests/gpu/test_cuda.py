"""The CUDA path on a real GPU: the model, KV pool, sampler and attention on the device, against
transformers on the same GPU; reuse on/off; the host tier's pinned, side-stream copies, and the
disk and Redis tiers with device blocks. Skipped, with the reason, where CUDA (or flash_attn, or
triton) is absent. The Triton backend runs its decode steps from CUDA graphs (the default).

Tolerances (logits are about 2-4 in magnitude on the tiny checkpoints): float16 within 1e-2,
bfloat16 within 6e-2 (four bf16 rounding steps at that magnitude): flash-attn and transformers'
SDPA accumulate in different orders. A generated token must be transformers' arg-max or within
that tolerance of it, teacher-forced on our tokens (a near tie may go either way).
"""

from __future__ import annotations

import logging

import pytest
import torch

from conftest import load, run
from rtpkv.kernels import triton_support
from rtpkv.kernels.flash_attention import load_flash_attn
from rtpkv.pipeline import Pipeline

NO_GPU = "needs a CUDA device (run on a GPU machine)"
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
needs_flash = pytest.mark.skipif(
    not torch.cuda.is_available() or load_flash_attn() is None,
    reason=NO_GPU if not torch.cuda.is_available()
    else "flash_attn is not installed (pip install -e '.[gpu]', see docs/USAGE.md)")
needs_triton = pytest.mark.skipif(
    not torch.cuda.is_available() or triton_support.import_error() is not None,
    reason=NO_GPU if not torch.cuda.is_available() else str(triton_support.import_error()))
DTYPES = {"float16": (torch.float16, 1e-2), "bfloat16": (torch.bfloat16, 6e-2)}
# Each attention backend that runs on CUDA: torch's reference always, flash-attn and Triton
# where they import.
ATTENTIONS = ["torch", pytest.param("flash-attn", marks=needs_flash),
              pytest.param("triton", marks=needs_triton)]


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (n,), generator=g).tolist()


def _pipeline(path, **options) -> Pipeline:
    options.setdefault("kv_cache_max_tokens", 16384)
    model = load(path, device="cuda", **options)
    return Pipeline(model, model.tokenizer)


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("block", [64, 256])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_matches_transformers_on_cuda(llama_path, dtype, block, attention):
    import transformers

    torch_dtype, atol = DTYPES[dtype]
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch_dtype).cuda()
    pipe = _pipeline(llama_path, dtype=dtype, seq_size_per_block=block,
                     max_num_batched_tokens=192, rtpkv_attention=attention)
    try:
        assert pipe.model.module.attention_name == attention
        assert pipe.engine.cache.memory.kv.is_cuda
        prompt = _ids(500, 1)
        res = run(pipe, prompt, max_new_tokens=16, return_logits=True)
        with torch.inference_mode():
            ref = hf(torch.tensor([prompt + res.output_ids[:-1]], device="cuda")).logits[0]
        ref = ref[len(prompt) - 1:].float()
        torch.testing.assert_close(res.logits.float().cuda(), ref, atol=atol, rtol=0)
        picked = ref.gather(1, torch.tensor(res.output_ids, device="cuda")[:, None])[:, 0]
        assert bool((picked >= ref.max(-1).values - atol).all())
        pipe.check_integrity()
    finally:
        pipe.stop()


def test_torch_attention_turns_cudnn_sdpa_off(llama_path, monkeypatch):
    """cuDNN's SDPA builds a plan per shape, and a decode's context grows every step: with it,
    a decode step took 41-44 ms on an H200, 7 without (kernels/attention.py). A pipeline on the
    torch backend turns it off for the process, so none of its SDPA calls runs with it."""
    import torch.nn.functional as F

    seen: list[bool] = []
    sdpa = F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        pipe = _pipeline(llama_path, dtype="bfloat16", rtpkv_attention="torch")
        try:
            monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
            run(pipe, _ids(300, 8), max_new_tokens=8)
        finally:
            pipe.stop()
        assert seen and not any(seen)
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("block", [64, 256])
def test_reuse_on_and_off_give_the_same_tokens_on_cuda(llama_path, block, attention):
    prompts = [_ids(600, 2), None]
    prompts[1] = prompts[0][:530] + _ids(40, 3)
    outs = []
    for reuse in (True, False):
        pipe = _pipeline(llama_path, dtype="bfloat16", seq_size_per_block=block,
                         reuse_cache=reuse, rtpkv_attention=attention)
        try:
            outs.append([run(pipe, p, max_new_tokens=16) for p in prompts])
            pipe.check_integrity()
        finally:
            pipe.stop()
    assert outs[0][1].aux_info["reuse_len"] == 512 and outs[1][1].aux_info["reuse_len"] == 0
    assert [r.output_ids for r in outs[0]] == [r.output_ids for r in outs[1]]


def test_host_tier_onboards_device_blocks_through_pinned_memory(llama_path):
    """A pool of one request: the second A is onboarded from the host tier (pinned buffer,
    side-stream offload) and gives the tokens of the first."""
    a, b = _ids(300, 4), _ids(300, 5)
    pipe = _pipeline(llama_path, dtype="bfloat16", reuse_cache=True, seq_size_per_block=64,
                     kv_cache_max_tokens=320, host_cache_size=64 << 20)   # 5 blocks: one request
    try:
        host = pipe.engine.cache.ladder.tiers[0]
        assert host.cuda and host.buffer.is_pinned()
        first = [run(pipe, ids, max_new_tokens=8) for ids in (a, b)]
        again = run(pipe, a, max_new_tokens=8)
        assert again.aux_info["memory_reuse_len"] == 256
        assert again.output_ids == first[0].output_ids
        pipe.check_integrity()
    finally:
        pipe.stop()


def test_disk_tier_round_trips_device_blocks(llama_path, tmp_path):
    ids = _ids(300, 6)
    outs = []
    for _ in range(2):
        pipe = _pipeline(llama_path, dtype="bfloat16", reuse_cache=True,
                         enable_memory_cache_disk=True, memory_cache_disk_paths=str(tmp_path),
                         write_cache_sync=True)
        try:
            outs.append(run(pipe, ids, max_new_tokens=8))
        finally:
            pipe.stop()
    assert outs[1].aux_info["disk_reuse_len"] == 256
    assert outs[1].output_ids == outs[0].output_ids


def test_redis_tier_round_trips_device_blocks(llama_path, redis_url):
    """A replica writes device blocks through to Redis; a second one loads them to its device."""
    ids = _ids(300, 7)
    outs = []
    for _ in range(2):
        pipe = _pipeline(llama_path, dtype="bfloat16", reuse_cache=True,
                         enable_remote_cache=True, remote_cache_url=redis_url)
        try:
            outs.append(run(pipe, ids, max_new_tokens=8))
        finally:
            pipe.stop()   # flushes the write-through queue
    assert outs[1].aux_info["remote_reuse_len"] == 256
    assert outs[1].output_ids == outs[0].output_ids


@needs_flash
def test_auto_picks_flash_attn_and_logs_it(llama_path, caplog):
    with caplog.at_level(logging.INFO, logger="rtpkv"):
        model = load(llama_path, device="cuda", dtype="bfloat16")
    assert model.module.attention_name == "flash-attn"
    assert "RTPKV_ATTENTION=auto: flash-attn (CUDA, bfloat16, flash_attn" in caplog.text


@needs_flash
def test_float32_with_flash_attn_is_refused(llama_path):
    with pytest.raises(ValueError, match="runs float16 and bfloat16 models, not float32"):
        load(llama_path, device="cuda", dtype="float32", rtpkv_attention="flash-attn")
