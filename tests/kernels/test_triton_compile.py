"""Every Triton kernel compiles for NVIDIA GPUs (Ampere sm_80, Hopper sm_90) on a machine
without one: Triton builds PTX and the ptxas bundled in its wheel assembles it, so a kernel that
only the interpreter accepts (a type its compiler refuses, a tile too small for tl.dot) fails
here on every CI run rather than on the first GPU."""

from __future__ import annotations

import pytest

TYPES = {"fp32": "ieee", "bf16": "tf32", "fp16": "tf32"}   # attention's dot precision


def _signatures(ops, attention, dtype: str) -> dict[str, tuple]:
    """kernel name -> (kernel, signature, constexprs) as the wrappers launch them."""
    t = f"*{dtype}"
    return {
        "store_kv": (ops._store_kv_kernel, dict(
            k_ptr=t, v_ptr=t, k_cache=t, v_cache=t, slots_ptr="*i64", k_row_stride="i32",
            k_head_stride="i32", v_row_stride="i32", v_head_stride="i32", num_slots="i32"),
            dict(HEAD_DIM=128, BLOCK_D=128)),
        "rms_norm": (ops._rms_norm_kernel, dict(
            x_ptr=t, residual_ptr=t, weight_ptr=t, out_ptr=t, dim="i32", eps="fp32"),
            dict(HAS_RESIDUAL=True, BLOCK=1024)),
        "rope": (ops._rope_kernel, dict(
            x_ptr=t, cos_ptr=t, sin_ptr=t, positions_ptr="*i64", row_stride="i32",
            head_stride="i32"), dict(HALF=64, BLOCK=64)),
        "silu_and_mul": (ops._gated_activation_kernel, dict(x_ptr=t, out_ptr=t, inter="i32"),
                         dict(GELU_TANH=False, BLOCK=ops.ACTIVATION_BLOCK)),
        "gelu_tanh_and_mul": (ops._gated_activation_kernel, dict(x_ptr=t, out_ptr=t, inter="i32"),
                              dict(GELU_TANH=True, BLOCK=ops.ACTIVATION_BLOCK)),
        "paged_attention": (attention._paged_attention_kernel, dict(
            q_ptr=t, k_cache=t, v_cache=t, out_ptr=t, positions_ptr="*i32", tables_ptr="*i32",
            tiles_ptr="*i32", q_row_stride="i32", q_head_stride="i32", out_row_stride="i32",
            table_stride="i32", num_slots="i32", block_size="i32", window="i32", scale="fp32"),
            dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, TILE=attention.TILE_ROWS,
                 CHUNK=attention.KEY_CHUNK, PRECISION=TYPES[dtype], DOT_FP32=False)),
    }


@pytest.mark.parametrize("arch, dtype", [(90, "bf16"), (90, "fp32"), (80, "fp16")])
def test_every_kernel_compiles_for_the_gpu(triton_compiled, arch, dtype):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ops, attention = triton_compiled
    for name, (kernel, signature, constexprs) in _signatures(ops, attention, dtype).items():
        signature.update({k: "constexpr" for k in constexprs})
        compiled = triton.compile(ASTSource(kernel, signature, constexprs),
                                  target=GPUTarget("cuda", arch, 32))
        assert compiled.asm["cubin"], f"{name}: no cubin for sm_{arch} {dtype}"
