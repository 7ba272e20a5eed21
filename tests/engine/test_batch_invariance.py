"""Batch invariance: a token's K/V and logits do not depend on how many other tokens share its
forward, nor on where its prefill chunk starts. So prefix reuse, chunked prefill and batching
give bit-identical greedy tokens and logits, in bfloat16 as in float32, with int8 weights
(WEIGHT_TYPE=INT8 and W8A8_INT8) and with the int8 KV cache (KV_CACHE_DTYPE=int8) in both, for
Llama, for Qwen3 (whose q/k norm runs on strided views of the fused qkv output) and for the
mixtures of experts (Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss: tokens grouped by expert, each
token's experts added in a fixed order; where the experts run on the C linear kernels, in one C
call per layer)."""

import pytest
import torch
from conftest import run

MODES = {"bfloat16": dict(dtype="bfloat16"), "float32": dict(dtype="float32"),
         "int8": dict(weight_type="INT8"), "w8a8": dict(weight_type="W8A8_INT8"),
         "int8-kv": dict(dtype="float32", kv_cache_dtype="int8"),
         "bf16-int8-kv": dict(dtype="bfloat16", int8_kv_cache=True)}
ARCHS = ["llama", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral"]
# and gpt-oss (biased router, softmax after the top-k, clamped SwiGLU experts, sinks) in the
# modes whose experts run in the C call: float32 and the int8 weights
CASES = [(mode, arch) for arch in ARCHS for mode in MODES] + [
    (mode, "gpt_oss") for mode in ("float32", "int8", "w8a8")]


def _prompts(n=4, length=21, seed=5):
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 1000, (12,), generator=g).tolist()
    return [shared + torch.randint(3, 1000, (length - 12,), generator=g).tolist() for _ in range(n)]


def _one_by_one(pipe, prompts, new=10):
    return [run(pipe, p, max_new_tokens=new, return_logits=True) for p in prompts]


def _all_at_once(pipe, prompts, new=10):
    streams = [pipe(p, top_k=1, ignore_eos=True, max_new_tokens=new, return_logits=True)
               for p in prompts]
    return [list(s)[-1] for s in streams]


def _conversation(pipe, turns=4):
    g = torch.Generator().manual_seed(3)
    history, outs = [], []
    for _ in range(turns):
        history += torch.randint(3, 1000, (13,), generator=g).tolist()
        res = run(pipe, history, max_new_tokens=6, return_logits=True)
        outs.append(res)
        history += res.output_ids
    return outs


def _assert_identical(a, b):
    for x, y in zip(a, b, strict=True):
        assert x.output_ids == y.output_ids
        assert torch.equal(x.logits, y.logits)


@pytest.mark.parametrize("mode,arch", CASES)
def test_reuse_on_and_off_give_identical_tokens_and_logits(make_pipeline, checkpoints, mode, arch):
    path = checkpoints(arch)
    plain = _conversation(make_pipeline(path, **MODES[mode], seq_size_per_block=4))
    reused = _conversation(make_pipeline(path, **MODES[mode], seq_size_per_block=4,
                                         reuse_cache=True))
    assert all(r.aux_info["reuse_len"] > 0 for r in reused[1:])
    _assert_identical(plain, reused)


@pytest.mark.parametrize("mode,arch", CASES)
def test_chunked_and_unchunked_prefill_are_identical(make_pipeline, checkpoints, mode, arch):
    path = checkpoints(arch)
    prompts = _prompts()
    whole = _one_by_one(make_pipeline(path, **MODES[mode], seq_size_per_block=4), prompts)
    chunked = _one_by_one(make_pipeline(path, **MODES[mode], seq_size_per_block=4,
                                        max_num_batched_tokens=5), prompts)
    _assert_identical(whole, chunked)


@pytest.mark.parametrize("mode,arch", CASES)
def test_alone_and_in_a_batch_are_identical(make_pipeline, checkpoints, mode, arch):
    path = checkpoints(arch)
    prompts = _prompts(n=6)
    alone = _one_by_one(make_pipeline(path, **MODES[mode], seq_size_per_block=4), prompts)
    pipe = make_pipeline(path, **MODES[mode], seq_size_per_block=4, reuse_cache=True)
    batched = _all_at_once(pipe, prompts)
    assert any(len(step) > 1 for step in pipe.engine.step_log)
    _assert_identical(alone, batched)
