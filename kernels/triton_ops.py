"""The element-wise kernels of the GPU path in Triton: the paged KV write, RMSNorm (with the
residual add), RoPE, SiLU-and-mul and GeLU(tanh)-and-mul. One launch each where the torch
reference launches five or six (the decode step of a small model is launch-bound on a GPU).

Each computes what its torch reference (kv_store, norm, rope, activation) computes, rounding
to the tensor's dtype where the reference's separate torch ops do, so bfloat16 results agree
with the reference to its last bit or one rounding step. Each row is one program with a fixed
reduction order: a row's result never depends on the batch it is in. Import this module only
where triton_support says Triton runs (it imports triton).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

ACTIVATION_BLOCK = 1024   # elements of a row each activation program handles


# Reductions go through tl.reduce with triton.language's own combine functions (and fills
# through tl.full) rather than tl.sum, tl.max, tl.min, tl.zeros: those are kernels defined when
# triton is imported, which Triton's interpreter (TRITON_INTERPRET=1) can run only where it was
# on at that import; it recognises these combine functions and reduces with numpy.
add = tl.standard._sum_combine
maximum = tl.standard._elementwise_max
minimum = tl.standard._elementwise_min


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache, v_cache, slots_ptr, k_row_stride, k_head_stride,
                     v_row_stride, v_head_stride, num_slots,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + t)
    offs = tl.arange(0, BLOCK_D)
    mask = (offs < HEAD_DIM) & (offs * 0 + slot >= 0)   # slot broadcast to the row
    row = (h * num_slots + slot).to(tl.int64) * HEAD_DIM
    k = tl.load(k_ptr + t * k_row_stride + h * k_head_stride + offs, mask=mask)
    v = tl.load(v_ptr + t * v_row_stride + h * v_head_stride + offs, mask=mask)
    tl.store(k_cache + row + offs, k, mask=mask)
    tl.store(v_cache + row + offs, v, mask=mask)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor) -> None:
    """k, v: (T, kv_heads, d), rows of any stride with contiguous heads; slots: (T,) int64 pool
    slot of each token, -1 for a row not to write (a CUDA graph's padding row). Writes the
    head-major pool layers (kv_store) k_cache, v_cache: (kv_heads * num_slots, d)."""
    T, kv_heads, d = k.shape
    if T == 0:
        return
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("store_kv needs K/V rows whose last dimension is contiguous")
    _store_kv_kernel[(T, kv_heads)](
        k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.shape[0] // kv_heads, HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d))


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, dim, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * dim
    offs = tl.arange(0, BLOCK)
    mask = offs < dim
    x = tl.load(x_ptr + row + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:   # residual + x in the input dtype, stored back, as residual.add_(x)
        x = (tl.load(residual_ptr + row + offs, mask=mask, other=0.0).to(tl.float32)
             + x.to(tl.float32)).to(x.dtype)
        tl.store(residual_ptr + row + offs, x, mask=mask)
    h = x.to(tl.float32)
    variance = tl.reduce(h * h, 0, add) / dim
    normed = (h * (1.0 / tl.sqrt(variance + eps))).to(x.dtype)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row + offs, (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype),
             mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """norm.rms_norm_reference in one launch: weight * normalize(h), h = x or residual + x
    (stored into `residual`, which must be contiguous)."""
    dim = x.shape[-1]
    x = x.contiguous()
    out = torch.empty_like(x)
    if residual is not None and not residual.is_contiguous():
        raise ValueError("rms_norm's residual must be contiguous (it is updated in place)")
    rows = x.numel() // dim
    if rows:
        _rms_norm_kernel[(rows,)](x, x if residual is None else residual, weight, out, dim, eps,
                                  HAS_RESIDUAL=residual is not None,
                                  BLOCK=triton.next_power_of_2(dim))
    return out


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, positions_ptr, row_stride, head_stride,
                 HALF: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    base = x_ptr + t.to(tl.int64) * row_stride + h * head_stride
    x1 = tl.load(base + offs, mask=mask, other=0.0)
    x2 = tl.load(base + HALF + offs, mask=mask, other=0.0)
    dtype = x1.dtype
    table = pos * (2 * HALF)
    c1 = tl.load(cos_ptr + table + offs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + table + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + table + offs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + table + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    # x * cos + rotate_half(x) * sin, each product and the sum rounded as the reference's ops
    out1 = ((a1 * c1).to(dtype).to(tl.float32) + (-a2 * s1).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((a2 * c2).to(dtype).to(tl.float32) + (a1 * s2).to(dtype).to(tl.float32)).to(dtype)
    tl.store(base + offs, out1, mask=mask)
    tl.store(base + HALF + offs, out2, mask=mask)


def _rope_one(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              positions: torch.Tensor) -> None:
    T, heads, d = x.shape
    if T == 0:
        return
    if x.stride(2) != 1:
        raise ValueError("apply_rope_ needs heads whose last dimension is contiguous")
    _rope_kernel[(T, heads)](x, cos, sin, positions, x.stride(0), x.stride(1), HALF=d // 2,
                             BLOCK=triton.next_power_of_2(d // 2))


def apply_rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor) -> None:
    """rope.apply_rope_ in two launches: q (T, heads, d) and k (T, kv_heads, d) rotated in
    place (views into the fused qkv output are fine); cos/sin: contiguous (max_positions, d)
    tables of any rtpkv RoPE kind (default, linear, llama3: they differ only in the table),
    positions: (T,) below max_positions (the caller checks)."""
    cos, sin = cos.contiguous(), sin.contiguous()
    _rope_one(q, cos, sin, positions)
    _rope_one(k, cos, sin, positions)


@triton.jit
def _gated_activation_kernel(x_ptr, out_ptr, inter, GELU_TANH: tl.constexpr,
                             BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * 2 * inter + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * 2 * inter + inter + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    if GELU_TANH:   # 0.5 g (1 + tanh(u)), tanh(|u|) = (1 - e) / (1 + e), e = exp(-2|u|) <= 1
        u = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        e = tl.exp(-2.0 * tl.abs(u))
        tanh = (1.0 - e) / (1.0 + e)
        act = 0.5 * g * (1.0 + tl.where(u >= 0, tanh, -tanh))
    else:
        act = g / (1.0 + tl.exp(-g))
    out = (act.to(gate.dtype).to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + row * inter + offs, out, mask=mask)


def _gated(gate_up: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    gate_up = gate_up.contiguous()
    inter = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], inter)
    rows = gate_up.numel() // (2 * inter) if inter else 0
    if rows:
        _gated_activation_kernel[(rows, triton.cdiv(inter, ACTIVATION_BLOCK))](
            gate_up, out, inter, GELU_TANH=gelu_tanh, BLOCK=ACTIVATION_BLOCK)
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(..., 2 * inter) -> (..., inter): SiLU(gate) * up (Llama's MLP)."""
    return _gated(gate_up, gelu_tanh=False)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(..., 2 * inter) -> (..., inter): GeLU(gate, tanh approximation) * up (Gemma's MLP)."""
    return _gated(gate_up, gelu_tanh=True)
