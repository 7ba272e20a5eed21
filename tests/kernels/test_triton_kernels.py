"""The Triton kernels (kernels/triton_ops.py, kernels/triton_attention.py) against their torch
references, run by Triton's interpreter on CPU tensors (the `triton_interpreter` fixture sets
TRITON_INTERPRET=1): tiny shapes, float32 and bfloat16.

Tolerances: float32 within float32 rounding (the kernels sum in another order than torch).
bfloat16: the interpreter rounds float32 to bfloat16 by its own rule (round half up on the
dropped bits, where a GPU and torch round to nearest even), so a result may differ by one or
two bfloat16 steps (2**-7 relative each) from torch's; on a GPU (tests/gpu) it is the same
rounding as torch's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attention_batches import attention_batch
from rtpkv.kernels import TorchAttention, attention_backend
from rtpkv.kernels.kv_store import head_major_rows, write_kv
from rtpkv.kernels.norm import rms_norm_reference
from rtpkv.kernels.rope import _rotate_half, rope_table
from rtpkv.model_factory.spec import ModelSpec

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16]


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    if ref.dtype == torch.float32:
        torch.testing.assert_close(ours, ref, atol=2e-6, rtol=2e-6)
    else:
        torch.testing.assert_close(ours.float(), ref.float(), atol=2 ** -7, rtol=2 ** -6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_writes_head_major_rows_and_skips_slot_minus_one(triton_interpreter, dtype):
    ops, _ = triton_interpreter
    g = torch.Generator().manual_seed(0)
    kv_heads, d, num_slots = 2, 16, 24
    qkv = torch.randn(4, 3 * kv_heads * d, generator=g).to(dtype)   # K/V as strided views
    k = qkv[:, : kv_heads * d].view(4, kv_heads, d)
    v = qkv[:, kv_heads * d: 2 * kv_heads * d].view(4, kv_heads, d)
    slots = torch.tensor([5, -1, 23, 0])
    caches = [torch.full((kv_heads * num_slots, d), 7.0, dtype=dtype) for _ in range(4)]
    ops.store_kv(caches[0], caches[1], k, v, slots)
    keep = slots >= 0
    write_kv(caches[2], caches[3], k[keep], v[keep],
             head_major_rows(slots[keep], kv_heads, num_slots))
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert int((caches[0] != 7).any(-1).sum()) == 3 * kv_heads   # the -1 row wrote nothing


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_the_reference(triton_interpreter, dtype, residual):
    ops, _ = triton_interpreter
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 48, generator=g).to(dtype)
    weight = (1 + torch.randn(48, generator=g) / 4).to(dtype)
    res = torch.randn(5, 48, generator=g).to(dtype) if residual else None
    res_ref = None if res is None else res.clone()
    ours = ops.rms_norm(x, weight, 1e-6, res)
    ref = rms_norm_reference(x, weight, 1e-6, res_ref)
    _close(ours, ref)
    if residual:
        _close(res, res_ref)   # residual + x stored in place, as the reference does
        if dtype == torch.float32:
            assert torch.equal(res, res_ref)


ROPES = {"default": {}, "linear": {"rope_type": "linear", "factor": 2.0},
         "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}


@pytest.mark.parametrize("kind", list(ROPES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_matches_the_reference_for_each_kind(triton_interpreter, dtype, kind):
    ops, _ = triton_interpreter
    spec = ModelSpec.from_config({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "num_hidden_layers": 1,
        "vocab_size": 32, "rope_scaling": ROPES[kind] or None})
    cos, sin = rope_table(spec.inv_freq(), 256, dtype, CPU)
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(5, 4 * 16 + 2 * 2 * 16, generator=g).to(dtype)
    q, k = qkv[:, :64].view(5, 4, 16), qkv[:, 64:96].view(5, 2, 16)   # strided, as in a model
    positions = torch.tensor([0, 1, 63, 64, 255])
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    q_ref, k_ref = q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
    ops.apply_rope_(q, k, cos, sin, positions)
    _close(q, q_ref)
    _close(k, k_ref)


@pytest.mark.parametrize("kind", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_activations_match_torch(triton_interpreter, dtype, kind):
    ops, _ = triton_interpreter
    g = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(3, 2, 2 * 1100, generator=g) * 3).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)   # 1100: two programs per row, the second partial
    if kind == "silu":
        ours, ref = ops.silu_and_mul(gate_up), F.silu(gate) * up
    else:
        ours, ref = ops.gelu_tanh_and_mul(gate_up), F.gelu(gate, approximate="tanh") * up
    assert ours.shape == (3, 2, 1100)
    _close(ours, ref)


def _tables(seqs, block, num_blocks, window, seed):
    """Random distinct blocks per sequence; with a window, entries wholly before a sequence's
    first key released (-1), as the KV cache manager does."""
    free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = []
    for start, n in seqs:
        table = [free.pop() for _ in range(-(-(start + n) // block))]
        if window:
            for i in range(max(0, start - window + 1) // block):
                table[i] = -1
        tables.append(table)
    return tables


def _attend(backend, batch, q, k, v, k_cache, v_cache):
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    out = backend.forward(q, k, v, k_cache, v_cache, backend.build(batch), q.shape[-1] ** -0.5)
    return out, k_cache, v_cache


# (block size, [(first position, tokens this step)] per sequence, window, (heads, kv heads),
# head size): decodes first then prefill chunks, a chunk after a cached prefix, block sizes from
# 1 to 64, windows whose oldest blocks are released, GQA groups of 2 and 4 and plain MHA, a head
# size that is not a power of two.
CASES = [
    (16, [(70, 1), (5, 1), (0, 40), (50, 30)], None, (4, 2), 16),
    (1, [(7, 1), (0, 9)], None, (4, 1), 16),
    (64, [(100, 1), (0, 3), (70, 20)], 24, (4, 2), 16),
    (4, [(50, 1), (30, 17)], 9, (2, 2), 24),
]


@pytest.mark.parametrize("case, dtype", [(i, torch.float32) for i in range(len(CASES))]
                         + [(0, torch.bfloat16), (2, torch.bfloat16)])
def test_paged_attention_matches_the_torch_backend(triton_interpreter, case, dtype):
    _, attention = triton_interpreter
    block, seqs, window, (heads, kv_heads), d = CASES[case]
    num_blocks = 64
    batch = attention_batch(_tables(seqs, block, num_blocks, window, case), seqs, block,
                            num_blocks, kv_heads, window)
    g = torch.Generator().manual_seed(case)
    T = len(batch.positions)
    k_cache = torch.randn(kv_heads * num_blocks * block, d, generator=g).to(dtype)
    v_cache = torch.randn(kv_heads * num_blocks * block, d, generator=g).to(dtype)
    q, k, v = (torch.randn(T, n, d, generator=g).to(dtype) for n in (heads, kv_heads, kv_heads))
    # Released and free blocks hold NaN (a CUDA pool is not zeroed): never read. Block 0 too
    # where the torch reference does not pad its decode gathers with it (one decode).
    used = {b for t in batch.block_tables for b in t} | ({0} if window is None else set())
    for b in set(range(num_blocks)) - used:
        for h in range(kv_heads):
            first = (h * num_blocks + b) * block
            rows = slice(first, first + block)
            k_cache[rows] = v_cache[rows] = float("nan")
    ours = _attend(attention.TritonAttention(d, dtype, CPU), batch, q, k, v, k_cache, v_cache)
    ref = _attend(TorchAttention(d, dtype, CPU), batch, q, k, v, k_cache, v_cache)
    assert torch.equal(ours[1].nan_to_num(), ref[1].nan_to_num())   # the KV write
    assert torch.equal(ours[2].nan_to_num(), ref[2].nan_to_num())
    assert not ours[0].isnan().any()
    if dtype == torch.float32:
        torch.testing.assert_close(ours[0], ref[0], atol=1e-5, rtol=1e-5)
    else:   # probabilities rounded to bf16 before P @ V, as flash attention does
        torch.testing.assert_close(ours[0].float(), ref[0].float(), atol=0.03, rtol=0.03)


def test_paged_attention_rows_do_not_depend_on_their_batch(triton_interpreter):
    """A decode row alone and batched with a prefill, and a prefill chunk computed in one piece
    and as a cached prefix plus the rest: the same bits for each row (reuse on == off)."""
    _, attention = triton_interpreter
    kv_heads, heads, d, block, num_blocks = 2, 4, 16, 16, 16
    backend = attention.TritonAttention(d, torch.float32, CPU)
    g = torch.Generator().manual_seed(5)
    k_cache = torch.randn(kv_heads * num_blocks * block, d, generator=g)
    v_cache = torch.randn(kv_heads * num_blocks * block, d, generator=g)
    tables = [[3, 7, 1, 12, 5], [2, 9, 4, 0, 15]]
    q = torch.randn(71, heads, d, generator=g)
    k, v = torch.randn(71, kv_heads, d, generator=g), torch.randn(71, kv_heads, d, generator=g)

    def run(seqs, rows):
        batch = attention_batch([tables[i] for i in seqs], [seqs[i] for i in seqs], block,
                                num_blocks, kv_heads)
        return _attend(backend, batch, q[rows], k[rows], v[rows], k_cache, v_cache)

    # keys in two chunks of KEY_CHUNK (64): positions up to 69
    whole = run({0: (0, 70), 1: (66, 1)}, list(range(71)))    # prefill 0..69 then a decode
    decode_alone = run({1: (66, 1)}, [70])
    assert torch.equal(whole[0][70], decode_alone[0][0])
    full = _attend(backend, attention_batch([tables[0]], [(0, 70)], block, num_blocks, kv_heads),
                   q[:70], k[:70], v[:70], k_cache, v_cache)
    prefix = attention_batch([tables[0]], [(0, 41)], block, num_blocks, kv_heads)
    k2, v2 = k_cache.clone(), v_cache.clone()
    first = backend.forward(q[:41], k[:41], v[:41], k2, v2, backend.build(prefix), d ** -0.5)
    rest = attention_batch([tables[0]], [(41, 29)], block, num_blocks, kv_heads)
    second = backend.forward(q[41:70], k[41:70], v[41:70], k2, v2, backend.build(rest), d ** -0.5)
    assert torch.equal(torch.cat([first, second]), full[0])
    assert torch.equal(whole[0][:70], full[0])


def test_padding_rows_are_attended_but_never_written(triton_interpreter):
    _, attention = triton_interpreter
    backend = attention.TritonAttention(16, torch.float32, CPU)
    batch = attention_batch([[2], [0]], [(3, 1), (0, 1)], 4, 4, 1)
    batch.padding = 1
    meta = backend.build(batch)
    assert meta.slots.tolist() == [11, -1]
    k_cache, v_cache = torch.zeros(16, 16), torch.zeros(16, 16)
    q, k, v = torch.randn(2, 2, 16), torch.randn(2, 1, 16), torch.randn(2, 1, 16)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, 0.25)
    assert torch.equal(k_cache[11], k[0, 0]) and int((k_cache != 0).any(-1).sum()) == 1
    assert bool(out.isfinite().all())
    with pytest.raises(ValueError, match="padding rows"):
        TorchAttention(16, torch.float32, CPU).build(batch)


def test_the_backend_is_chosen_by_name_and_refuses_what_it_cannot_run(triton_interpreter):
    assert attention_backend(CPU, torch.float32, 16, "triton").name == "triton"
    with pytest.raises(ValueError, match="RTPKV_ATTENTION=triton does not read an int8 KV"):
        attention_backend(CPU, torch.float32, 16, "triton", kv_dtype=torch.int8)
    with pytest.raises(ValueError, match="even head size up to 256, not 300"):
        attention_backend(CPU, torch.float32, 300, "triton")
    with pytest.raises(ValueError, match="not int32"):
        attention_backend(CPU, torch.int32, 16, "triton")


def test_triton_on_a_cpu_without_the_interpreter_is_refused(monkeypatch):
    from rtpkv.kernels import triton_support

    if triton_support.import_error():
        pytest.skip(triton_support.import_error())
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="run on CUDA devices .* not on cpu"):
        attention_backend(CPU, torch.float32, 16, "triton")
