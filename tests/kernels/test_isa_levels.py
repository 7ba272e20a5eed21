"""RTPKV_ISA: the C kernels built for each vector ISA this CPU runs give the same bits (each
output's arithmetic is fixed, whatever the vector width), so the level changes speed only; a level
the CPU lacks is refused by name. Levels this host lacks are skipped, naming the flags."""

from __future__ import annotations

import pytest
import torch

from attention_batches import attention_batch
from conftest import load, needs_c_kernels, run
from rtpkv.errors import ConfigError
from rtpkv.kernels import cpu_build
from rtpkv.kernels.activation import silu_and_mul
from rtpkv.kernels.bf16_linear import Bf16Linear
from rtpkv.kernels.cpu_attention import CpuPagedAttention
from rtpkv.kernels.kv_quant import quantize_rows
from rtpkv.kernels.int8_linear import Int8Linear
from rtpkv.kernels.linear import InferenceLinear
from rtpkv.kernels.w8a8_linear import W8A8Linear

pytestmark = needs_c_kernels

LEVELS = [level for level in cpu_build.ISA_NEEDS]
SHAPES = [(64, 40, 1), (1000, 37, 2), (3000, 100, 3), (96, 130, 7), (2100, 64, 13)]


@pytest.fixture(autouse=True)
def restore_isa():
    yield
    cpu_build.select_isa("auto")


def _on_every_level(fn):
    """fn() at each ISA level this CPU runs (at least two, else the test is skipped)."""
    levels = cpu_build.available_isas()
    if len(levels) < 2:
        missing = sorted(set(cpu_build.ISA_NEEDS["avx512"]) - set(cpu_build.cpu_flags().split()))
        pytest.skip(f"one ISA level on this CPU: it lacks {', '.join(missing)}")
    results = []
    for level in levels:
        cpu_build.select_isa(level)
        results.append(fn())
    return results


@pytest.mark.parametrize("make", [lambda l: InferenceLinear(l, "avx2"), Bf16Linear, Int8Linear,
                                  W8A8Linear], ids=["fp32", "bf16", "int8", "w8a8"])
def test_every_level_gives_the_same_bits(make):
    g = torch.Generator().manual_seed(0)
    for k, n, m in SHAPES:
        layer = torch.nn.Linear(k, n)
        fast, x = make(layer), torch.randn(m, k, generator=g)
        with torch.inference_mode():
            first, *others = _on_every_level(lambda: fast(x))
        assert all(torch.equal(first, other) for other in others), (k, n, m)


# (query heads, KV heads, head dim): GQA groups of 2, 3, 1 and 4 (3 x 16 rows of a prefill tile,
# decodes in the head-dimension lanes), and head dims that are 4, 4.5, 2.5 and 16 vectors of 16
ATTENTION_SHAPES = [(8, 4, 64), (9, 3, 64), (4, 4, 72), (8, 2, 128), (4, 1, 40)]
# (first position, tokens this step): decodes, prefill chunks after a prefix, fresh prompts
ATTENTION_SEQS = [(37, 1), (5, 1), (0, 1), (20, 23), (0, 40), (70, 3), (3, 17)]


def _paged_attention(heads, kv_heads, dim, block, window, dtype, kv_int8, softcap=None):
    """The CPU paged-attention kernel over a mixed batch, at the current level (`softcap`:
    Gemma 2's soft-cap of the scores)."""
    blocks = [-(-(s + n) // block) for s, n in ATTENTION_SEQS]
    tables = [list(range(1 + sum(blocks[:i]), 1 + sum(blocks[:i + 1])))[::-1]
              for i in range(len(blocks))]
    num_blocks = sum(blocks) + 1
    batch = attention_batch(tables, ATTENTION_SEQS, block, num_blocks, kv_heads, window)
    g = torch.Generator().manual_seed(heads * dim + block)
    T = len(batch.positions)
    q, k, v = (torch.randn(T, h, dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
    rows = [torch.randn(kv_heads * num_blocks * block, dim, generator=g) for _ in range(2)]
    caches = [quantize_rows(r) if kv_int8 else r.to(dtype) for r in rows]
    backend = CpuPagedAttention(dtype)
    return backend.forward(q, k, v, caches[0], caches[1], backend.build(batch), dim ** -0.5,
                           softcap=softcap)


@pytest.mark.parametrize("dtype,kv_int8", [(torch.float32, False), (torch.bfloat16, False),
                                           (torch.float32, True)],
                         ids=["float32", "bfloat16", "int8-kv"])
@pytest.mark.parametrize("block", [4, 32])
def test_paged_attention_gives_the_same_bits_at_every_level(dtype, kv_int8, block):
    """Prefill tiles (query rows in the lanes) and decodes (the head dimension in the lanes), with
    and without a window, with and without a soft-cap (2: most scores are bent by it), give each
    level's kernel the same bits."""
    for shape in ATTENTION_SHAPES:
        for window, softcap in ((None, None), (13, None), (None, 2.0), (13, 2.0)):
            first, *others = _on_every_level(
                lambda: _paged_attention(*shape, block, window, dtype, kv_int8, softcap))
            assert all(torch.equal(first, other) for other in others), (shape, window, softcap)


def test_silu_and_mul_gives_the_same_bits_at_every_level():
    """Float32 SiLU-and-mul (16 lanes at avx512, the last 8 of a width that is not a multiple of
    16 at 8), over values that reach exp's clamps, infinities and NaN."""
    g = torch.Generator().manual_seed(0)
    for inter in (48, 40, 8):
        gate_up = torch.randn(5, 2 * inter, generator=g) * 40
        gate_up[0, :6] = torch.tensor([-100.0, 100.0, 87.5, -88.5, float("inf"), float("nan")])
        first, *others = _on_every_level(lambda: silu_and_mul(gate_up).view(torch.int32))
        assert all(torch.equal(first, other) for other in others), inter   # NaN's bits too


def test_bf16_weights_give_the_float32_kernels_bits_over_the_rounded_weights():
    g = torch.Generator().manual_seed(1)
    for k, n, m in SHAPES:
        layer = torch.nn.Linear(k, n)
        rounded = torch.nn.Linear(k, n)
        with torch.no_grad():
            rounded.weight.copy_(layer.weight.to(torch.bfloat16).float())
            rounded.bias.copy_(layer.bias)
        x = torch.randn(m, k, generator=g)
        with torch.inference_mode():
            ours = Bf16Linear(layer)
            assert torch.equal(ours(x), InferenceLinear(rounded, "avx2")(x)), (k, n, m)
            torch.testing.assert_close(ours(x), ours._torch(x), atol=1e-4, rtol=1e-4)
            assert torch.equal(ours.float_weight(), rounded.weight)
        padded = -(-n // 16) * 16   # whole panels of 16 channels
        assert ours.nbytes == 2 * k * padded + 4 * padded   # bf16 weights, float32 bias


def test_a_pipeline_decodes_the_same_tokens_at_every_level(llama_path, monkeypatch):
    monkeypatch.setenv("RTPKV_LINEAR", "avx2")
    prompt = list(range(5, 80))

    def tokens():
        model = load(llama_path, rtpkv_isa=cpu_build.isa())
        assert model.module.fused is not None
        from rtpkv.pipeline import Pipeline
        with Pipeline(model, model.tokenizer) as pipe:
            return run(pipe, prompt, max_new_tokens=12, return_logits=True).logits

    first, *others = _on_every_level(tokens)
    assert all(torch.equal(first, other) for other in others)


def test_bad_or_missing_levels_are_refused(llama_path, monkeypatch):
    with pytest.raises(ValueError, match="RTPKV_ISA='avx3' is invalid.*auto, avx2, avx512"):
        cpu_build.select_isa("avx3")
    monkeypatch.setattr(cpu_build, "available_isas", lambda: ("avx2",))
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: "fpu avx2 fma")
    with pytest.raises(ValueError, match="RTPKV_ISA=avx512 needs a CPU with .*avx512f.*lacks "
                                         "avx512bw, avx512dq, avx512f, avx512vl"):
        cpu_build.select_isa("avx512")
    with pytest.raises(ConfigError, match="RTPKV_ISA=avx512 needs"):
        load(llama_path, rtpkv_isa="avx512")
    monkeypatch.setenv("RTPKV_ISA", "sse")
    with pytest.raises(ConfigError, match="RTPKV_ISA"):
        load(llama_path)


def test_bf16_weights_run_fused_and_close_to_transformers(llama_path, hf, make_pipeline,
                                                         monkeypatch):
    """WEIGHT_TYPE=BF16 against transformers on the same weights rounded to bfloat16, alone and
    batched, reuse on == off."""
    import copy

    from conftest import hf_reference

    rounded = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in rounded.named_parameters():
            if name.endswith("proj.weight") or name == "lm_head.weight":
                p.copy_(p.to(torch.bfloat16).float())
    prompts = [list(range(3, 40)), list(range(50, 120))]
    pipe = make_pipeline(weight_type="BF16", reuse_cache=True)
    assert pipe.model.module.fused is not None and pipe.model.module.linear_path == "bf16"
    alone = [run(pipe, p, max_new_tokens=8, return_logits=True) for p in prompts]
    for p, res in zip(prompts, alone):
        tokens, logits = hf_reference(rounded, p, 8)
        assert res.output_ids == tokens
        torch.testing.assert_close(res.logits, logits, atol=2e-4, rtol=2e-4)
    again = run(pipe, prompts[1], max_new_tokens=8, return_logits=True)   # reused prefix
    assert again.aux_info["reuse_len"] > 0 and torch.equal(again.logits, alone[1].logits)
    streams = [pipe(p, generate_config={"top_k": 1, "ignore_eos": True, "max_new_tokens": 8,
                                        "return_logits": True}) for p in prompts]
    batched = [list(s)[-1] for s in streams]
    assert [b.output_ids for b in batched] == [a.output_ids for a in alone]


def test_the_cpu_kind_names_the_family_and_amds_core_generation(monkeypatch):
    info = {"model name": "model name\t: AMD EPYC", "cpu family": "cpu family\t: 26",
            "model": "model\t\t: 2"}
    monkeypatch.setattr(cpu_build, "_cpuinfo", lambda field: info.get(field, ""))
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: "avx2 fma avx512f")
    assert cpu_build.cpu_kind().startswith("AMD EPYC (family 26 model 2: Zen 5), ")
    info["cpu family"] = "cpu family\t: 25"
    assert "family 25 model 2: Zen 4)" in cpu_build.cpu_kind()
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: "avx2 fma")
    assert "family 25 model 2: Zen 3)" in cpu_build.cpu_kind()
    info["model name"] = "model name\t: Intel(R) Xeon(R) Platinum 8480+"
    assert cpu_build.cpu_kind().startswith("Intel(R) Xeon(R) Platinum 8480+ (family 25 model 2), ")
