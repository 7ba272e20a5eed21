"""A Mamba2 mixer's sequential part: the causal depthwise convolution with its state, the
selective state-space recurrence and the gated, grouped RMSNorm, for a batch of sequences whose
states live in pool slots (csrc/mamba2.c, and `mix_reference` in torch where the C kernels
cannot be built).

Both compute the recurrence token after token, each value by the same operations whatever the
chunking and the batch (the torch reference runs its operations on one token's tensors at a
time: torch's vectorized transcendental functions give other bits to the values a longer tensor
leaves to its scalar tail). So a state computed in chunks equals the state of one pass bit for
bit, and a sequence gives the same bits alone and batched: reuse from a saved state is exact.
The two paths agree with each other to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from rtpkv.kernels.cpu_build import Signatures, bound_library

_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float


class _Layer(ctypes.Structure):
    _fields_ = [("heads", _I), ("head_dim", _I), ("state", _I), ("groups", _I), ("kernel", _I),
                ("inner", _I), ("conv_weight", _P), ("conv_bias", _P), ("dt_bias", _P),
                ("A", _P), ("D", _P), ("norm_weight", _P), ("norm_eps", _F), ("dt_min", _F),
                ("dt_max", _F)]


_SIGNATURES: Signatures = {
    "rtpkv_mamba2_mix": ([ctypes.POINTER(_Layer), _I, _I] + [_P] * 11, None)}


def _library() -> Optional[ctypes.CDLL]:
    return bound_library("mamba2", _SIGNATURES)


@dataclass(frozen=True)
class Mamba2Shape:
    """A Mamba2 mixer's dimensions and what follows from them (the in projection's width, the
    per-sequence states' shapes): one definition for the layer (model_factory/mamba2.py's
    Mamba2Spec) and its constants here."""

    heads: int
    head_dim: int
    state: int
    groups: int
    kernel: int                          # the causal convolution's width

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        return self.inner + 2 * self.groups * self.state

    @property
    def projection_size(self) -> int:
        """The in projection's width: gate, x B C, dt."""
        return self.inner + self.conv_channels + self.heads

    def conv_state_shape(self) -> tuple[int, int]:
        """One sequence's convolution state: each channel's last kernel - 1 inputs."""
        return (self.conv_channels, self.kernel - 1)

    def ssm_state_shape(self) -> tuple[int, int, int]:
        return (self.heads, self.head_dim, self.state)


@dataclass(frozen=True)
class Mamba2Weights(Mamba2Shape):
    """A mixer's constants between its projections, float32 and contiguous."""

    conv_weight: torch.Tensor            # (conv channels, kernel)
    conv_bias: Optional[torch.Tensor]    # (conv channels,)
    dt_bias: torch.Tensor                # (heads,)
    A: torch.Tensor                      # (heads,): -exp(A_log), as transformers computes it
    D: torch.Tensor                      # (heads,)
    norm_weight: torch.Tensor            # (heads * head_dim,)
    norm_eps: float
    dt_min: float                        # softplus(dt + dt_bias) is clamped to [dt_min, dt_max]
    dt_max: float


Saves = Optional[Sequence[Sequence[tuple[int, int]]]]


def mix(weights: Mamba2Weights, proj: torch.Tensor, starts: Sequence[int], lens: Sequence[int],
        slots: Sequence[int], conv_state: torch.Tensor, ssm_state: torch.Tensor,
        saves: Saves = None) -> torch.Tensor:
    """The mixer between its projections: the (T, inner) input of the out projection, for
    sequences whose rows of `proj` (T, projection size; sequence s owns rows starts[s] ..
    starts[s] + lens[s]) continue the states in slot slots[s] of `conv_state` (slots, conv
    channels, kernel - 1) and `ssm_state` (slots, heads, head_dim, state), both float32 and
    advanced in place. `saves[s]`: (k, slot) pairs, k in 1 .. lens[s]: the states
    after the sequence's first k rows are copied into `slot` of both pools (model_factory/
    recurrent.py's snapshots). The C kernel where it builds, else `mix_reference`."""
    saves = _checked(weights, proj, starts, lens, slots, conv_state, ssm_state, saves)
    lib = _library() if proj.device.type == "cpu" else None
    if lib is None:
        return mix_reference(weights, proj, starts, lens, slots, conv_state, ssm_state, saves)
    T = proj.shape[0]
    save_starts = [0]
    for pairs in saves:
        save_starts.append(save_starts[-1] + len(pairs))
    proj = proj.float().contiguous()
    xbc = torch.empty(T, weights.conv_channels)
    out = torch.zeros(T, weights.inner)
    longs = [torch.tensor(list(values), dtype=torch.int64)
             for values in (starts, lens, slots, save_starts, [k for p in saves for k, _ in p],
                            [slot for p in saves for _, slot in p])]
    layer = _Layer(weights.heads, weights.head_dim, weights.state, weights.groups, weights.kernel,
                   weights.inner, weights.conv_weight.data_ptr(),
                   None if weights.conv_bias is None else weights.conv_bias.data_ptr(),
                   weights.dt_bias.data_ptr(), weights.A.data_ptr(), weights.D.data_ptr(),
                   weights.norm_weight.data_ptr(), weights.norm_eps, weights.dt_min,
                   weights.dt_max)
    lib.rtpkv_mamba2_mix(ctypes.byref(layer), T, len(slots), longs[0].data_ptr(),
                         longs[1].data_ptr(), longs[2].data_ptr(), proj.data_ptr(),
                         conv_state.data_ptr(), ssm_state.data_ptr(), xbc.data_ptr(),
                         out.data_ptr(), longs[3].data_ptr(), longs[4].data_ptr(),
                         longs[5].data_ptr())
    return out


def mix_reference(weights: Mamba2Weights, proj: torch.Tensor, starts: Sequence[int],
                  lens: Sequence[int], slots: Sequence[int], conv_state: torch.Tensor,
                  ssm_state: torch.Tensor, saves: Saves = None) -> torch.Tensor:
    """`mix` in torch, one token's tensors at a time (what keeps it exact under chunking and
    batching; slow: the fallback where the C kernels cannot be built)."""
    saves = _checked(weights, proj, starts, lens, slots, conv_state, ssm_state, saves)
    H, P, N, G = weights.heads, weights.head_dim, weights.state, weights.groups
    I, CD, K = weights.inner, weights.conv_channels, weights.kernel
    proj = proj.float()
    out = torch.zeros(proj.shape[0], I, device=proj.device)
    per_group = H // G
    bias = (weights.conv_bias if weights.conv_bias is not None
            else torch.zeros(CD, device=proj.device))
    for s, slot in enumerate(slots):
        window = [column.clone() for column in conv_state[slot].unbind(1)]   # oldest first
        state = ssm_state[slot].clone()
        pending = list(saves[s])
        for k, t in enumerate(range(starts[s], starts[s] + lens[s]), start=1):
            z, xbc_in, dt = proj[t].split([I, CD, H])
            window.append(xbc_in)
            acc = bias
            for j in range(K):
                acc = acc + weights.conv_weight[:, j] * window[j]
            window.pop(0)
            x, B, C = F.silu(acc).split([I, G * N, G * N])
            dt = torch.clamp(F.softplus(dt + weights.dt_bias), weights.dt_min, weights.dt_max)
            decay = torch.exp(dt * weights.A)
            x = x.view(H, P)
            B = B.view(G, 1, N).expand(G, per_group, N).reshape(H, 1, N)
            C = C.view(G, 1, N).expand(G, per_group, N).reshape(H, 1, N)
            state = state * decay[:, None, None] + B * (x * dt[:, None])[:, :, None]
            y = (state * C).sum(-1) + weights.D[:, None] * x
            gated = (y.reshape(I) * F.silu(z)).view(G, I // G)
            normed = gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + weights.norm_eps)
            out[t] = weights.norm_weight * normed.reshape(I)
            while pending and pending[0][0] == k:
                target = pending.pop(0)[1]
                for j, column in enumerate(window):
                    conv_state[target, :, j] = column
                ssm_state[target] = state
        for j, column in enumerate(window):
            conv_state[slot, :, j] = column
        ssm_state[slot] = state
    return out


def _checked(weights: Mamba2Weights, proj: torch.Tensor, starts: Sequence[int],
             lens: Sequence[int], slots: Sequence[int], conv_state: torch.Tensor,
             ssm_state: torch.Tensor, saves: Saves) -> Sequence[Sequence[tuple[int, int]]]:
    """What the C kernel reads unchecked (shapes, row ranges, slots, saves) checked; `saves`,
    one list per sequence."""
    if proj.dim() != 2 or proj.shape[1] != weights.projection_size:
        raise ValueError(f"proj has shape {tuple(proj.shape)}: expected (rows, "
                         f"{weights.projection_size})")
    T = proj.shape[0]
    if not len(starts) == len(lens) == len(slots):
        raise ValueError(f"{len(slots)} state slots but {len(starts)} row starts and "
                         f"{len(lens)} row counts")
    spans = sorted(zip(starts, lens))
    if any(start < 0 or n < 0 or start + n > T for start, n in spans) or any(
            a + n > b for (a, n), (b, _) in zip(spans, spans[1:])):
        raise ValueError(f"rows starts {list(starts)} with counts {list(lens)} are not "
                         f"disjoint ranges of the {T} rows")
    for name, pool, shape in (("conv_state", conv_state, weights.conv_state_shape()),
                              ("ssm_state", ssm_state, weights.ssm_state_shape())):
        if (tuple(pool.shape[1:]) != shape or pool.dtype != torch.float32
                or not pool.is_contiguous()):
            raise ValueError(f"{name} is {pool.dtype} {tuple(pool.shape)}: expected contiguous "
                             f"float32 (slots, {', '.join(map(str, shape))})")
    saves = [sorted(pairs) for pairs in saves] if saves else [[]] * len(slots)
    if len(saves) != len(slots):
        raise ValueError(f"{len(saves)} save lists for {len(slots)} sequences")
    targets = [slot for pairs in saves for _, slot in pairs]
    used = list(slots) + targets
    limit = min(conv_state.shape[0], ssm_state.shape[0])
    if used and not 0 <= min(used) <= max(used) < limit:
        raise IndexError(f"state slots {min(used)}..{max(used)} are outside the pools "
                         f"({limit} slots)")
    if len(set(used)) != len(used):
        raise ValueError(f"state slots {list(slots)} (live) and {targets} (saves) repeat: each "
                         "sequence and each save needs its own")
    for s, pairs in enumerate(saves):
        rows = lens[s]
        offsets = [k for k, _ in pairs]
        if any(not 1 <= k <= rows for k in offsets):
            raise ValueError(f"sequence {s}: save offsets {offsets} must each be in 1..{rows} "
                             "(its rows)")
    return saves
