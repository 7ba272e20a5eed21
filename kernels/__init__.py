"""Kernels: attention backends, linear layers, RoPE, RMSNorm, SiLU-and-mul, the KV write; the C
kernels of the CPU path live in csrc/ (see docs/DESIGN.md, "CPU fast path").
`attention_backend` is the one dispatch point that chooses the attention implementation."""

from __future__ import annotations

import logging

import torch

from rtpkv.kernels.attention import AttentionBackend, AttentionBatch, TorchAttention
from rtpkv.kernels.norm import rms_norm
from rtpkv.kernels.activation import silu_and_mul
from rtpkv.kernels.rope import apply_rope_, rope_table

log = logging.getLogger("rtpkv")

ATTENTION_BACKENDS = ("auto", "cpu-paged", "torch")


def attention_backend(device: torch.device, dtype: torch.dtype, head_dim: int,
                      name: str = "auto") -> AttentionBackend:
    """The attention implementation for `device` and `dtype`. `name` (RTPKV_ATTENTION in the
    configuration) picks one: "auto" takes the CPU paged kernel on a CPU when it builds and
    supports the dtype and head size, else the torch reference."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"RTPKV_ATTENTION={name!r} is invalid: accepted values are "
                         f"{', '.join(ATTENTION_BACKENDS)}")
    from rtpkv.kernels import cpu_attention

    wants_cpu = name == "cpu-paged" or (
        name == "auto" and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16))
    if wants_cpu:
        if device.type != "cpu":
            raise ValueError(f"RTPKV_ATTENTION=cpu-paged needs a CPU model, not {device}")
        if cpu_attention.available(head_dim):
            return cpu_attention.CpuPagedAttention(dtype)
        if name == "cpu-paged":
            raise RuntimeError("RTPKV_ATTENTION=cpu-paged: the kernel could not be built (see "
                               f"the warning above) or does not support head_dim {head_dim}")
        log.warning("CPU paged-attention kernel unavailable for head_dim %d: using the torch "
                    "reference backend", head_dim)
    return TorchAttention(head_dim, dtype, device)


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
