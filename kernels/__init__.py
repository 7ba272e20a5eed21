"""Kernels: attention backends, linear layers, RoPE, RMSNorm, SiLU-and-mul, the KV write; the C
kernels of the CPU path live in csrc/ (see docs/DESIGN.md, "CPU fast path"), flash-attn and the
Triton kernels serve CUDA (flash_attention.py, triton_attention.py, triton_ops.py, "GPU path").
`attention_backend` is the one dispatch point that chooses the attention implementation."""

from __future__ import annotations

import logging
from typing import Optional

import torch

from rtpkv.kernels.attention import AttentionBackend, AttentionBatch, TorchAttention
from rtpkv.kernels.norm import rms_norm
from rtpkv.kernels.activation import silu_and_mul
from rtpkv.kernels.names import ATTENTION_BACKENDS
from rtpkv.kernels.rope import apply_rope_, rope_table

log = logging.getLogger("rtpkv")


def auto_attention(device: torch.device, dtype: torch.dtype, head_dim: int,
                   softcap: bool = False, sinks: bool = False) -> tuple[str, str]:
    """What RTPKV_ATTENTION=auto picks for `device` and `dtype`, and why (the start-up log):
    on CUDA flash-attn for float16/bfloat16 when the package imports, else the Triton kernels
    when triton imports (any of the three float dtypes), else the torch reference; on a CPU the
    paged C kernel when it builds and supports the dtype and head size, else the torch
    reference. A model that soft-caps attention logits (`softcap`: Gemma 2) gets one of the
    two backends that do: the paged C kernel on a CPU where it runs, else the torch reference;
    one with attention sinks (`sinks`: gpt-oss) the paged C kernel or the torch reference, the
    two that add them."""
    from rtpkv.kernels import cpu_attention, flash_attention, triton_support

    if softcap and device.type != "cpu":
        return "torch", ("the model soft-caps attention logits, which only the torch and the "
                         "cpu-paged backends do")
    dtype_name = str(dtype).removeprefix("torch.")
    if sinks and device.type != "cpu":
        return "torch", "the model has attention sinks, which flash-attn and Triton do not add"
    if device.type == "cuda":
        module = flash_attention.load_flash_attn()
        if dtype in flash_attention.CUDA_DTYPES and module is not None:
            return ("flash-attn",
                    f"CUDA, {dtype_name}, flash_attn {getattr(module, '__version__', '?')}")
        flash_why = ("the flash_attn package does not import" if module is None
                     else f"flash-attn runs float16/bfloat16, the model is {dtype_name}")
        triton_why = triton_support.import_error()
        if triton_why is None:
            return "triton", f"CUDA, {dtype_name}, {flash_why}"
        return "torch", f"{flash_why}; {triton_why}"
    if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
        if cpu_attention.available(head_dim):
            return "cpu-paged", f"CPU, {dtype_name}"
        return "torch", f"the CPU paged-attention kernel is unavailable for head_dim {head_dim}"
    return "torch", f"no faster backend for {dtype_name} on {device.type}"


def attention_backend(device: torch.device, dtype: torch.dtype, head_dim: int,
                      name: str = "auto",
                      kv_dtype: Optional[torch.dtype] = None,
                      softcap: bool = False, sinks: bool = False) -> AttentionBackend:
    """The attention implementation for `device` and `dtype`. `name` (RTPKV_ATTENTION in the
    configuration) picks one; "auto" is `auto_attention`'s choice, logged with its reason, and
    falls back to Triton (or the torch reference where triton does not import) where flash-attn
    imports but cannot run. `kv_dtype` is the pool's (torch.int8 for the int8 cache, which
    neither flash-attn nor Triton reads); the model's by default. `softcap`: the model
    soft-caps attention logits (only the torch and cpu-paged backends do); `sinks`: it has
    attention sinks (the torch and cpu-paged backends add them)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"RTPKV_ATTENTION={name!r} is invalid: accepted values are "
                         f"{', '.join(ATTENTION_BACKENDS)}")
    if softcap and name not in ("auto", "torch", "cpu-paged"):
        raise ValueError(f"RTPKV_ATTENTION={name} does not soft-cap attention logits "
                         "(attn_logit_softcapping, Gemma 2): use cpu-paged, torch or auto")
    if sinks and name in ("flash-attn", "triton"):
        raise ValueError(f"RTPKV_ATTENTION={name} does not add attention sinks (gpt-oss's "
                         "per-head softmax logits): use cpu-paged, torch or auto")
    if kv_dtype == torch.int8 and name == "flash-attn":
        raise ValueError("RTPKV_ATTENTION=flash-attn does not read an int8 KV cache "
                         "(KV_CACHE_DTYPE=int8 / INT8_KV_CACHE=1): use cpu-paged or torch")
    asked = name
    if name == "auto":
        name, why = auto_attention(device, dtype, head_dim, softcap, sinks)
        (log.warning if name == "torch" else log.info)("RTPKV_ATTENTION=auto: %s (%s)", name, why)
    if name == "flash-attn":
        from rtpkv.kernels.flash_attention import FlashAttention

        try:
            return FlashAttention(head_dim, dtype, device)
        except RuntimeError as exc:   # its start-up probe failed (e.g. a pre-Ampere GPU)
            if asked != "auto":
                raise
            from rtpkv.kernels import triton_support

            name = "torch" if triton_support.unusable(device) else "triton"
            log.warning("RTPKV_ATTENTION=auto: %s; using the %s backend", exc,
                        "torch reference" if name == "torch" else name)
    if name == "triton":
        from rtpkv.kernels import triton_support

        if kv_dtype == torch.int8:
            raise ValueError("RTPKV_ATTENTION=triton does not read an int8 KV cache "
                             "(KV_CACHE_DTYPE=int8 / INT8_KV_CACHE=1): use cpu-paged or torch")
        why = triton_support.unusable(device)
        if why:
            raise RuntimeError(f"RTPKV_ATTENTION=triton: {why}; choose RTPKV_ATTENTION=auto or "
                               "torch (Triton installs with pip install -e '.[gpu]')")
        from rtpkv.kernels.triton_attention import TritonAttention

        return TritonAttention(head_dim, dtype, device)
    if name == "cpu-paged":
        from rtpkv.kernels import cpu_attention

        if device.type != "cpu":
            raise ValueError(f"RTPKV_ATTENTION=cpu-paged needs a CPU model, not {device}")
        if not cpu_attention.available(head_dim):
            raise RuntimeError("RTPKV_ATTENTION=cpu-paged: the kernel could not be built (see "
                               f"the warning above) or does not support head_dim {head_dim}")
        return cpu_attention.CpuPagedAttention(dtype)
    return TorchAttention(head_dim, dtype, device, kv_dtype)


__all__ = [
    "AttentionBackend",
    "AttentionBatch",
    "TorchAttention",
    "apply_rope_",
    "attention_backend",
    "rms_norm",
    "rope_table",
    "silu_and_mul",
]
