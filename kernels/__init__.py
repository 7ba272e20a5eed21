"""Kernels: attention backends, linear layers, RoPE, RMSNorm, SiLU-and-mul, the KV write; the C
kernels of the CPU path live in csrc/ (see docs/DESIGN.md, "CPU fast path"), flash-attn serves
CUDA (flash_attention.py, "GPU path"). `attention_backend` is the one dispatch point that
chooses the attention implementation."""

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
                   softcap: bool = False) -> tuple[str, str]:
    """What RTPKV_ATTENTION=auto picks for `device` and `dtype`, and why (the start-up log):
    flash-attn on CUDA for float16/bfloat16 when the package imports, the CPU paged kernel on a
    CPU when it builds and supports the dtype and head size, else the torch reference (the
    only backend that soft-caps attention logits, `softcap`: Gemma 2)."""
    from rtpkv.kernels import cpu_attention, flash_attention

    if softcap:
        return "torch", "the model soft-caps attention logits, which only the torch backend does"
    dtype_name = str(dtype).removeprefix("torch.")
    if device.type == "cuda":
        if dtype not in flash_attention.CUDA_DTYPES:
            return "torch", f"flash-attn runs float16/bfloat16, the model is {dtype_name}"
        module = flash_attention.load_flash_attn()
        if module is None:
            return "torch", "the flash_attn package does not import"
        return "flash-attn", f"CUDA, {dtype_name}, flash_attn {getattr(module, '__version__', '?')}"
    if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
        if cpu_attention.available(head_dim):
            return "cpu-paged", f"CPU, {dtype_name}"
        return "torch", f"the CPU paged-attention kernel is unavailable for head_dim {head_dim}"
    return "torch", f"no faster backend for {dtype_name} on {device.type}"


def attention_backend(device: torch.device, dtype: torch.dtype, head_dim: int,
                      name: str = "auto",
                      kv_dtype: Optional[torch.dtype] = None,
                      softcap: bool = False) -> AttentionBackend:
    """The attention implementation for `device` and `dtype`. `name` (RTPKV_ATTENTION in the
    configuration) picks one; "auto" is `auto_attention`'s choice, logged with its reason, and
    falls back to the torch reference where flash-attn imports but cannot run. `kv_dtype` is the
    pool's (torch.int8 for the int8 cache, which flash-attn does not read); the model's by
    default. `softcap`: the model soft-caps attention logits (only the torch backend does)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"RTPKV_ATTENTION={name!r} is invalid: accepted values are "
                         f"{', '.join(ATTENTION_BACKENDS)}")
    if softcap and name not in ("auto", "torch"):
        raise ValueError(f"RTPKV_ATTENTION={name} does not soft-cap attention logits "
                         "(attn_logit_softcapping, Gemma 2): use torch or auto")
    if kv_dtype == torch.int8 and name == "flash-attn":
        raise ValueError("RTPKV_ATTENTION=flash-attn does not read an int8 KV cache "
                         "(KV_CACHE_DTYPE=int8 / INT8_KV_CACHE=1): use cpu-paged or torch")
    asked = name
    if name == "auto":
        name, why = auto_attention(device, dtype, head_dim, softcap)
        (log.warning if name == "torch" else log.info)("RTPKV_ATTENTION=auto: %s (%s)", name, why)
    if name == "flash-attn":
        from rtpkv.kernels.flash_attention import FlashAttention

        try:
            return FlashAttention(head_dim, dtype, device)
        except RuntimeError as exc:   # its start-up probe failed (e.g. a pre-Ampere GPU)
            if asked != "auto":
                raise
            log.warning("RTPKV_ATTENTION=auto: %s; using the torch reference backend", exc)
            name = "torch"
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
