"""Cohere2ForCausalLM's checkpoint read for rtpkv's RoPE. Cohere rotates interleaved pairs of a
head's dimensions ((0, 1), (2, 3), ...) where rtpkv's RoPE kernels rotate its halves (i with
i + head_dim / 2, Llama's rotate_half). Attention reads q and k only through their dot product,
which a permutation of the head's dimensions applied to both leaves unchanged; so q_proj's and
k_proj's rows (and biases) are permuted at load, each head's even dimensions first, then its odd
ones, and the half rotation of the permuted heads is the interleaved rotation of the published
ones (the cos/sin tables hold each frequency once per half, as Cohere's hold it once per pair).
The K/V cache holds the permuted keys; the layers without RoPE see the same scores."""

from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch

ARCHITECTURE = "Cohere2ForCausalLM"

_QK = re.compile(r"\.self_attn\.(q|k)_proj\.(weight|bias)$")


def half_rotation_tensors(tensors: Iterable[tuple[str, torch.Tensor]], head_dim: int
                          ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with q_proj's and k_proj's output rows permuted, head by head,
    to [0, 2, 4, ..., 1, 3, 5, ...]; every other tensor as it is."""
    order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    for name, tensor in tensors:
        if _QK.search(name):
            heads = tensor.shape[0] // head_dim
            rows = (torch.arange(heads)[:, None] * head_dim + order).flatten()
            tensor = tensor[rows]
        yield name, tensor
