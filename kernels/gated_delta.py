"""Gated DeltaNet's recurrence (Qwen3-Next, Qwen3.5): the short causal convolution, the gated
delta rule and the gated RMSNorm of its output, for a batch of sequences each advancing its own
state slot, token by token (csrc/gated_delta.c; `reference` is the torch fallback where the C
kernels do not build). Also the same models' gated attention output (`sigmoid_gate_`).

Both compute each sequence sequentially, with operations whose shapes do not depend on the
chunk or the batch, so a state computed in chunks has the bits of one computed in one pass, and
alone the bits of batched (model_factory/recurrent.py's contract). They agree with each other to
float32 rounding, not bit for bit (libm's exp against torch's vectorised one). transformers
computes a prefill in chunks of 64 tokens with a triangular solve: the same recurrence, within
float32 rounding of it.
"""

from __future__ import annotations

import ctypes
from array import array
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from rtpkv.kernels.cpu_build import Signatures, bound_library

_P = ctypes.c_void_p
_I = ctypes.c_int64
_SIGNATURES: Signatures = {
    "rtpkv_gated_delta": ([_P] * 8 + [ctypes.c_float, _I] + [_P] * 10 + [_I] * 5, ctypes.c_int),
    "rtpkv_sigmoid_gate": ([_P, _P] + [_I] * 5, None),
}
MAX_HEAD_DIM = 1024   # csrc/gated_delta.c's MAX_DK


def library() -> Optional[ctypes.CDLL]:
    return bound_library("gated_delta", _SIGNATURES)


@dataclass(frozen=True)
class DeltaShape:
    """A Gated DeltaNet layer's dimensions."""

    key_heads: int
    value_heads: int
    key_dim: int          # per head
    value_dim: int        # per head
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


@dataclass(frozen=True)
class DeltaWeights:
    """The layer's weights the recurrence reads (float32, contiguous)."""

    conv: torch.Tensor        # (conv_dim, K)
    A_log: torch.Tensor       # (Hv,)
    dt_bias: torch.Tensor     # (Hv,)
    norm: torch.Tensor        # (Dv,)
    eps: float


def gated_delta(qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, z: torch.Tensor,
                weights: DeltaWeights, shape: DeltaShape, starts: Sequence[int],
                lens: Sequence[int], slots: Sequence[int],
                snapshots: Sequence[Sequence[tuple[int, int]]],
                conv_states: torch.Tensor, recurrent_states: torch.Tensor) -> torch.Tensor:
    """The gated-normed output (T, Hv * Dv) of float32 rows `qkv` (T, conv_dim), `b`, `a`
    (T, Hv) and `z` (T, Hv * Dv); sequence i is rows starts[i].. of lens[i] and advances state
    slot slots[i] of `conv_states` (slots, conv_dim, K - 1) and `recurrent_states`
    (slots, Hv, Dk, Dv) in place, copying it after n of its rows into slot s for each (n, s)
    of snapshots[i]."""
    lib = library()
    args = (qkv, b, a, z, weights, shape, starts, lens, slots, snapshots, conv_states,
            recurrent_states)
    if (lib is None or qkv.device.type != "cpu" or max(shape.key_dim, shape.value_dim)
            > MAX_HEAD_DIM):
        return reference(*args)
    tensors = (qkv, b, a, z, conv_states, recurrent_states)
    if not all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors):
        raise ValueError("the Gated DeltaNet kernel takes contiguous float32 tensors")
    T = qkv.shape[0]
    mixed = torch.empty_like(qkv)
    out = torch.empty((T, shape.value_heads * shape.value_dim), dtype=torch.float32)
    n = len(starts)
    flat_tokens, flat_slots, bounds = [], [], [0]
    for i in range(n):
        for tokens, slot in (snapshots[i] if snapshots else ()):
            flat_tokens.append(tokens)
            flat_slots.append(slot)
        bounds.append(len(flat_tokens))
    ints = [array("q", values) for values in (starts, lens, slots, bounds, flat_tokens or [0],
                                                flat_slots or [0])]
    w = weights
    rc = lib.rtpkv_gated_delta(
        qkv.data_ptr(), b.data_ptr(), a.data_ptr(), z.data_ptr(), w.conv.data_ptr(),
        w.A_log.data_ptr(), w.dt_bias.data_ptr(), w.norm.data_ptr(), w.eps, n,
        *(arr.buffer_info()[0] for arr in ints), conv_states.data_ptr(),
        recurrent_states.data_ptr(), mixed.data_ptr(), out.data_ptr(), shape.conv_kernel,
        shape.key_heads, shape.value_heads, shape.key_dim, shape.value_dim)
    if rc:
        raise ValueError(f"Gated DeltaNet dimensions out of the kernel's range: {shape}")
    return out


def reference(qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, z: torch.Tensor,
              weights: DeltaWeights, shape: DeltaShape, starts: Sequence[int],
              lens: Sequence[int], slots: Sequence[int],
              snapshots: Sequence[Sequence[tuple[int, int]]],
              conv_states: torch.Tensor, recurrent_states: torch.Tensor) -> torch.Tensor:
    """`gated_delta` in torch, one token of one sequence at a time (every op's shape is the
    same for every token, so its bits do not depend on the chunk or the batch)."""
    Hk, Hv, Dk, Dv, K = (shape.key_heads, shape.value_heads, shape.key_dim, shape.value_dim,
                         shape.conv_kernel)
    key_dim = Hk * Dk
    w = weights
    out = torch.empty((qkv.shape[0], Hv * Dv), dtype=torch.float32, device=qkv.device)
    A = w.A_log.exp()
    scale = Dk ** -0.5
    for i, (start, n, slot) in enumerate(zip(starts, lens, slots)):
        conv, S = conv_states[slot], recurrent_states[slot]
        for t in range(n):
            row = start + t
            window = torch.cat((conv, qkv[row, :, None]), dim=1)
            acc = window[:, 0] * w.conv[:, 0]
            for j in range(1, K):
                acc = acc + window[:, j] * w.conv[:, j]
            conv.copy_(window[:, 1:])
            m = F.silu(acc)
            q = _l2norm(m[:key_dim].view(Hk, Dk)).repeat_interleave(Hv // Hk, 0) * scale
            k = _l2norm(m[key_dim:2 * key_dim].view(Hk, Dk)).repeat_interleave(Hv // Hk, 0)
            v = m[2 * key_dim:].view(Hv, Dv)
            beta = torch.sigmoid(b[row])
            decay = torch.exp(-A * F.softplus(a[row] + w.dt_bias))
            S.mul_(decay[:, None, None])
            delta = (v - (S * k[:, :, None]).sum(1)) * beta[:, None]
            S.add_(k[:, :, None] * delta[:, None, :])
            o = (S * q[:, :, None]).sum(1)
            y = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + w.eps)
            out[row] = ((w.norm * y) * F.silu(z[row].view(Hv, Dv))).flatten()
            for tokens, dst in (snapshots[i] if snapshots else ()):
                if tokens == t + 1:
                    conv_states[dst].copy_(conv)
                    recurrent_states[dst].copy_(S)
    return out


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def sigmoid_gate_(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) times sigmoid(gate) (T, H, D; a strided view into q_proj's rows), in place:
    in C value by value on a CPU in float32 (torch's vectorised sigmoid would give a row other
    bits as the row count changes), else torch's ops (transformers')."""
    lib = library()
    if (lib is None or x.device.type != "cpu" or x.dtype != torch.float32
            or gate.dtype != torch.float32 or not x.is_contiguous() or gate.stride(2) != 1):
        return x.mul_(torch.sigmoid(gate))
    T, H, D = x.shape
    lib.rtpkv_sigmoid_gate(x.data_ptr(), gate.data_ptr(), T, H, D, gate.stride(0),
                           gate.stride(1))
    return x
