"""Kernels: paged attention, RoPE, RMSNorm, the KV write; `attention_backend` is the one
dispatch point that chooses the attention implementation for a device."""

from __future__ import annotations

from typing import Callable

import torch

from rtpkv.kernels.attention import AttentionMetadata, PrefillChunk, torch_paged_attention
from rtpkv.kernels.norm import rms_norm
from rtpkv.kernels.rope import apply_rope, rope_table

AttentionFn = Callable[..., torch.Tensor]


def attention_backend(device: torch.device) -> tuple[str, AttentionFn]:
    """The attention implementation for `device`: today the torch reference everywhere."""
    return "torch", torch_paged_attention


__all__ = [
    "AttentionMetadata",
    "PrefillChunk",
    "apply_rope",
    "attention_backend",
    "rms_norm",
    "rope_table",
    "torch_paged_attention",
]
