"""The Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5): the recurrence's kernel (csrc/gated_delta.c
and its torch fallback) gives a state computed in chunks the bits of one pass and a sequence
batched the bits of alone, snapshots inside a chunk included; every recurrent hybrid (these and
Granite 4.0-H's Mamba2 ones) matches transformers (float32) on greedy tokens and logits, prompts
shorter and longer than a prefill chunk, alone and batched; what is not supported is refused by
name; no state slot outlives its request."""

import pytest
import torch
import transformers

from conftest import c_kernels_missing, hf_reference, random_prompt, run, run_together
from rtpkv.errors import ConfigError
from rtpkv.kernels import gated_delta as gd
from rtpkv.model_factory.spec import ModelSpec

SHAPE = gd.DeltaShape(key_heads=2, value_heads=4, key_dim=16, value_dim=8, conv_kernel=4)
HYBRIDS = ["qwen3_next", "qwen3_5"]
# every recurrent hybrid: the Gated DeltaNet ones, and Granite 4.0-H's Mamba2 ones (a mixture with
# RoPE and every multiplier away from 1; dense without RoPE)
RECURRENT = HYBRIDS + ["granite_hybrid", "granite_hybrid_dense"]
CHUNK = 32   # MAX_NUM_BATCHED_TOKENS: prompts of 20 and 75 tokens, one chunk and three

KERNELS = {"c": gd.gated_delta, "torch": gd.reference}


def _kernel(name):
    if name == "c" and c_kernels_missing():
        pytest.skip(c_kernels_missing())
    return KERNELS[name]


def _inputs(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(T, n, generator=g) for n in (SHAPE.conv_dim, 4, 4, 32)]
    weights = gd.DeltaWeights(conv=torch.randn(SHAPE.conv_dim, 4, generator=g) * 0.5,
                              A_log=torch.rand(4, generator=g).log(), dt_bias=torch.ones(4),
                              norm=torch.rand(8, generator=g) + 0.5, eps=1e-6)
    return rows, weights


def _states(slots):
    return (torch.zeros(slots, SHAPE.conv_dim, 3), torch.zeros(slots, 4, 16, 8))


def _in_chunks(kernel, rows, weights, splits, slot=0, states=None, snapshots=()):
    """One sequence through `kernel` in chunks of `splits` tokens; snapshots: (token, slot)
    over the whole sequence."""
    conv, rec = states or _states(4)
    outs, start = [], 0
    for n in splits:
        chunk = [r[start:start + n].contiguous() for r in rows]
        snaps = [(t - start, s) for t, s in snapshots if start < t <= start + n]
        outs.append(kernel(*chunk, weights, SHAPE, [0], [n], [slot], [snaps], conv, rec))
        start += n
    return torch.cat(outs), conv, rec


@pytest.mark.parametrize("name", KERNELS)
def test_state_in_chunks_has_the_bits_of_one_pass(name):
    kernel = _kernel(name)
    rows, weights = _inputs(41)
    one, conv1, rec1 = _in_chunks(kernel, rows, weights, [41], snapshots=[(16, 1), (32, 2)])
    many, conv2, rec2 = _in_chunks(kernel, rows, weights, [5, 1, 1, 13, 4, 17],
                                   snapshots=[(16, 1), (32, 2)])
    assert torch.equal(one, many) and torch.equal(conv1, conv2) and torch.equal(rec1, rec2)
    # a snapshot inside a chunk is the state after exactly that many tokens
    _, conv16, rec16 = _in_chunks(kernel, rows, weights, [16])
    assert torch.equal(conv1[1], conv16[0]) and torch.equal(rec1[1], rec16[0])
    assert not torch.equal(rec1[1], rec1[2])


@pytest.mark.parametrize("name", KERNELS)
def test_a_sequence_batched_has_the_bits_of_alone(name):
    kernel = _kernel(name)
    (qkv_a, b_a, a_a, z_a), weights = _inputs(9, seed=1)
    (qkv_b, b_b, a_b, z_b), _ = _inputs(23, seed=2)
    alone_a, _, rec_a = _in_chunks(kernel, [qkv_a, b_a, a_a, z_a], weights, [9])
    alone_b, _, rec_b = _in_chunks(kernel, [qkv_b, b_b, a_b, z_b], weights, [23], slot=3)
    conv, rec = _states(4)
    out = kernel(torch.cat([qkv_a, qkv_b]), torch.cat([b_a, b_b]), torch.cat([a_a, a_b]),
                 torch.cat([z_a, z_b]), weights, SHAPE, [0, 9], [9, 23], [0, 3], [[], []],
                 conv, rec)
    assert torch.equal(out[:9], alone_a) and torch.equal(out[9:], alone_b)
    assert torch.equal(rec[0], rec_a[0]) and torch.equal(rec[3], rec_b[3])


def test_the_c_kernel_agrees_with_the_torch_fallback():
    kernel = _kernel("c")
    rows, weights = _inputs(30, seed=4)
    out_c, conv_c, rec_c = _in_chunks(kernel, rows, weights, [30])
    out_t, conv_t, rec_t = _in_chunks(gd.reference, rows, weights, [30])
    torch.testing.assert_close(out_c, out_t, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rec_c, rec_t, atol=1e-5, rtol=1e-5)
    assert torch.equal(conv_c, conv_t)


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("reuse", [False, True])
@pytest.mark.parametrize("arch", RECURRENT)
def test_greedy_tokens_and_logits_match_transformers(checkpoints, make_pipeline, arch, reuse):
    """Prompts shorter and longer than a prefill chunk, alone and then all at once: the tokens
    and logits of transformers; batched, the bits of alone."""
    path = checkpoints(arch)
    hf = _hf(path)
    pipe = make_pipeline(path, max_num_batched_tokens=CHUNK, seq_size_per_block=8,
                         reuse_cache=reuse)
    prompts = [random_prompt(20, 1), random_prompt(75, 2), random_prompt(75, 2)[:50] + random_prompt(9, 3)]
    alone = [run(pipe, p, max_new_tokens=8, return_logits=True) for p in prompts]
    for prompt, res in zip(prompts, alone):
        tokens, logits = hf_reference(hf, prompt, 8)
        assert res.output_ids == tokens
        torch.testing.assert_close(res.logits, logits, atol=1e-4, rtol=0)
    for res, together in zip(alone, run_together(pipe, prompts, max_new_tokens=8,
                                                 return_logits=True)):
        assert together.output_ids == res.output_ids
        assert torch.equal(together.logits, res.logits)
    states = pipe.engine.cache.state_group.states
    assert states.num_free == states.num_slots - pipe.engine.cache.state_group.pool.num_blocks


@pytest.mark.parametrize("arch,state_bytes", [
    # three Gated DeltaNet layers: a conv window of 3 over 2 x 32 + 64 channels, 4 x 16 x 16 state
    ("qwen3_5", 3 * (4 * (2 * 32 + 64) * 3 + 4 * 4 * 16 * 16)),
    # two Mamba2 layers: a conv window of 3 over 128 + 2 x 8 channels, 8 x 16 x 8 SSM state
    ("granite_hybrid_dense", 2 * 4 * (3 * 144 + 8 * 16 * 8))])
def test_no_state_slot_outlives_its_request(checkpoints, make_pipeline, arch, state_bytes):
    pipe = make_pipeline(checkpoints(arch), concurrency_limit=2)
    stream = pipe(random_prompt(30, 5), top_k=1, ignore_eos=True, max_new_tokens=200)
    next(iter(stream))
    stream.close()   # cancelled mid-decode
    run(pipe, random_prompt(12, 6), max_new_tokens=3)
    group = pipe.engine.cache.state_group
    assert group.live_slots == 2 and group.states.num_free == 2
    assert group.states.bytes_per_slot == state_bytes


BASE = {"architectures": ["Qwen3_5ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4}


@pytest.mark.parametrize("field,value,message", [
    ("linear_num_value_heads", 3, r"linear_num_value_heads=3 is invalid: a multiple of "
                                  r"linear_num_key_heads \(2"),
    ("linear_key_head_dim", 2048, r"linear_key_head_dim=2048 is invalid: accepted range is "
                                  r"1\.\.1024"),
    ("linear_conv_kernel_dim", 0, r"linear_conv_kernel_dim=0 is invalid"),
    ("hidden_act", "gelu", r"'gelu' is not supported for Qwen3_5ForCausalLM \(supported: silu"),
    ("layer_types", ["linear_attention", "sliding_attention", "linear_attention",
                     "full_attention"], r"layer_types=.* is not supported"),
    ("partial_rotary_factor", 0.01, r"partial_rotary_factor=0.01 is invalid"),
    ("architectures", ["Qwen3_5ForConditionalGeneration"],
     r"architectures=\['Qwen3_5ForConditionalGeneration'\] is not supported"),
])
def test_unsupported_configurations_are_refused_by_name(field, value, message):
    with pytest.raises(ConfigError, match=message):
        ModelSpec.from_config({**BASE, field: value})


def test_a_config_without_layer_types_attends_every_fourth_layer():
    spec = ModelSpec.from_config({**BASE, "num_hidden_layers": 8})
    assert spec.attention_layers == (3, 7) and spec.num_kv_layers == 2
    assert spec.rotary_dim == 4   # transformers' default partial_rotary_factor, 0.25
