"""GatedDeltaNet: the linear-attention layer of Qwen3-Next and Qwen3.5, a recurrent layer
(model_factory/recurrent.py) whose state per sequence is its short convolution's last K - 1
inputs and one Dk x Dv matrix per value head.

The checkpoints name its projections differently: Qwen3-Next's `in_proj_qkvz` and `in_proj_ba`
interleave q, k, v, z (and b, a) per key head; Qwen3.5's `in_proj_qkv`, `in_proj_z`, `in_proj_b`
and `in_proj_a` are plain. After loading, `convert` puts both into one projection in Qwen3.5's
order (q, k, v, z, b, a: rows permuted, so each output is the one the checkpoint computes) and
the recurrence runs on kernels/gated_delta.py.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import nn

from rtpkv.kernels.gated_delta import DeltaShape, DeltaWeights, gated_delta
from rtpkv.model_factory.recurrent import RecurrentBatch, StateSpec

INTERLEAVED_ARCHITECTURES = ("Qwen3NextForCausalLM",)   # in_proj_qkvz / in_proj_ba


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden_size: int, shape: DeltaShape, eps: float, interleaved: bool):
        super().__init__()
        self.shape = shape
        Hk, Hv, Dk, Dv = shape.key_heads, shape.value_heads, shape.key_dim, shape.value_dim
        self.key_size, self.value_size = Hk * Dk, Hv * Dv
        self.interleaved = interleaved
        if interleaved:
            self.in_proj_qkvz = nn.Linear(hidden_size, 2 * self.key_size + 2 * self.value_size,
                                          bias=False)
            self.in_proj_ba = nn.Linear(hidden_size, 2 * Hv, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(hidden_size, shape.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden_size, self.value_size, bias=False)
            self.in_proj_b = nn.Linear(hidden_size, Hv, bias=False)
            self.in_proj_a = nn.Linear(hidden_size, Hv, bias=False)
        self.conv1d = nn.Conv1d(shape.conv_dim, shape.conv_dim, shape.conv_kernel, bias=False,
                                groups=shape.conv_dim, padding=shape.conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(Hv))
        self.A_log = nn.Parameter(torch.zeros(Hv))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(Dv))
        self.out_proj = nn.Linear(self.value_size, hidden_size, bias=False)
        self.eps = eps
        self.in_proj: Optional[nn.Module] = None
        self.weights: Optional[DeltaWeights] = None

    def state_specs(self) -> tuple[StateSpec, ...]:
        s = self.shape
        return (StateSpec("conv", (s.conv_dim, s.conv_kernel - 1)),
                StateSpec("recurrent", (s.value_heads, s.key_dim, s.value_dim)))

    def _plain_order(self) -> torch.Tensor:
        """Qwen3-Next's in_proj_qkvz and in_proj_ba rows (stacked) in the order q, k, v, z,
        b, a, each by head."""
        s = self.shape
        r = s.value_heads // s.key_heads
        per_head = 2 * s.key_dim + 2 * r * s.value_dim
        parts: list[list[torch.Tensor]] = [[], [], [], []]
        sizes = (s.key_dim, s.key_dim, r * s.value_dim, r * s.value_dim)
        for g in range(s.key_heads):
            start = g * per_head
            for part, size in zip(parts, sizes):
                part.append(torch.arange(start, start + size))
                start += size
        base = 2 * self.key_size + 2 * self.value_size
        ba = [base + g * 2 * r + torch.arange(0, r) for g in range(s.key_heads)]
        ba_a = [base + g * 2 * r + torch.arange(r, 2 * r) for g in range(s.key_heads)]
        return torch.cat([torch.cat(p) for p in parts] + [torch.cat(ba), torch.cat(ba_a)])

    def convert(self, convert: Callable[[nn.Linear], nn.Module]) -> None:
        """After loading: one input projection (q, k, v, z, b, a) and the output projection
        through `convert` (CausalLM.prepare's), the recurrence's weights in float32."""
        if self.interleaved:
            stacked = torch.cat([self.in_proj_qkvz.weight, self.in_proj_ba.weight])
            weight = stacked[self._plain_order()]
            del self.in_proj_qkvz, self.in_proj_ba
        else:
            weight = torch.cat([self.in_proj_qkv.weight, self.in_proj_z.weight,
                                self.in_proj_b.weight, self.in_proj_a.weight])
            del self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a
        fused = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device,
                          dtype=weight.dtype)
        fused.weight.data = weight.contiguous()
        self.in_proj = convert(fused)
        self.out_proj = convert(self.out_proj)
        self.weights = DeltaWeights(
            conv=self.conv1d.weight.detach().float().reshape(self.shape.conv_dim, -1).contiguous(),
            A_log=self.A_log.detach().float().contiguous(),
            dt_bias=self.dt_bias.detach().float().contiguous(),
            norm=self.norm.weight.detach().float().contiguous(), eps=self.eps)

    def forward(self, x: torch.Tensor, batch: RecurrentBatch,
                states: Sequence[torch.Tensor]) -> torch.Tensor:
        s = self.shape
        projected = self.in_proj(x).float()
        qkv, z, b, a = (part.contiguous() for part in projected.split(
            [s.conv_dim, self.value_size, s.value_heads, s.value_heads], dim=-1))
        conv, recurrent = states
        out = gated_delta(qkv, b, a, z, self.weights, s, batch.query_start, batch.query_len,
                          batch.slots, batch.snapshots, conv, recurrent)
        return self.out_proj(out.to(x.dtype))
