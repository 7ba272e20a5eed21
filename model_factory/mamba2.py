"""The Mamba2 mixer of the Mamba2 hybrids (IBM Granite 4.0-H: GraniteMoeHybridForCausalLM): its
dimensions (`Mamba2Spec`) and the layer (`Mamba2Mixer`), a recurrent layer of
model_factory/recurrent.py.

A mixer keeps no per-token KV: each sequence has a convolution state (the last kernel - 1
inputs of the x, B, C channels) and a recurrent state (heads x head_dim x state size), both
float32, overwritten at every token. Its forward is the in projection (the model's linear
layers), the sequential part of kernels/mamba2.py over the batch's sequences and their state
slots, then the out projection. Parameter names are the checkpoints' (`mamba.in_proj`,
`mamba.conv1d`, `mamba.dt_bias`, `mamba.A_log`, `mamba.D`, `mamba.norm`, `mamba.out_proj`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from rtpkv.kernels.mamba2 import Mamba2Shape, Mamba2Weights, mix
from rtpkv.model_factory.recurrent import RecurrentBatch, StateSpec


@dataclass(frozen=True)
class Mamba2Spec(Mamba2Shape):
    """A hybrid's Mamba2 layers' dimensions (Mamba2Shape) and options (model_factory/
    granite.py reads them from config.json)."""

    conv_bias: bool
    proj_bias: bool
    dt_min: float        # time_step_limit: softplus(dt + dt_bias) is clamped to it
    dt_max: float


class GatedNorm(nn.Module):
    """The mixer's gated RMSNorm: holds its weight; kernels/mamba2.py computes it."""

    def __init__(self, size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))


class Mamba2Mixer(nn.Module):
    def __init__(self, hidden_size: int, spec: Mamba2Spec, norm_eps: float):
        super().__init__()
        self.spec = spec
        self.norm_eps = norm_eps
        channels = spec.conv_channels
        self.in_proj = nn.Linear(hidden_size, spec.projection_size, bias=spec.proj_bias)
        self.conv1d = nn.Conv1d(channels, channels, spec.kernel, groups=channels,
                                padding=spec.kernel - 1, bias=spec.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(spec.heads))
        self.A_log = nn.Parameter(torch.zeros(spec.heads))
        self.D = nn.Parameter(torch.ones(spec.heads))
        self.norm = GatedNorm(spec.inner)
        self.out_proj = nn.Linear(spec.inner, hidden_size, bias=spec.proj_bias)
        self.weights: Optional[Mamba2Weights] = None

    def convert(self, convert: Callable[[nn.Linear], nn.Module]) -> None:
        """After loading: the projections through `convert` (the model's GEMM path or its
        quantization), the constants between them as float32 (A = -exp(A_log), in float32 as
        transformers computes it)."""
        self.in_proj = convert(self.in_proj)
        self.out_proj = convert(self.out_proj)
        s = self.spec

        def f32(t: torch.Tensor) -> torch.Tensor:
            return t.detach().float().contiguous()

        self.weights = Mamba2Weights(
            s.heads, s.head_dim, s.state, s.groups, s.kernel, f32(self.conv1d.weight[:, 0, :]),
            None if self.conv1d.bias is None else f32(self.conv1d.bias), f32(self.dt_bias),
            -torch.exp(f32(self.A_log)), f32(self.D), f32(self.norm.weight), self.norm_eps,
            s.dt_min, s.dt_max)

    def state_specs(self) -> tuple[StateSpec, ...]:
        """model_factory/recurrent.py's RecurrentLayer: the convolution's window, then the
        SSM state, float32."""
        return (StateSpec("conv", self.spec.conv_state_shape()),
                StateSpec("ssm", self.spec.ssm_state_shape()))

    def forward(self, x: torch.Tensor, batch: RecurrentBatch,
                states: Sequence[torch.Tensor]) -> torch.Tensor:
        """The mixer's output rows for `x` (rows, hidden) after the input norm; `states`: the
        pool's (conv, ssm) tensors of this layer, advanced in place, snapshots written."""
        if self.weights is None:
            raise RuntimeError("Mamba2Mixer.convert must run after the weights are loaded")
        conv_state, ssm_state = states
        mixed = mix(self.weights, self.in_proj(x), batch.query_start, batch.query_len,
                    batch.slots, conv_state, ssm_state,
                    [batch.snapshots_of(i) for i in range(len(batch.slots))])
        return self.out_proj(mixed.to(x.dtype))
