"""Bindings of csrc/fused_ops.c: RMSNorm (with the residual add), SiLU-and-mul, gpt-oss's
clamped SwiGLU, GELU-and-mul and RoPE as one pass each over memory on the CPU, the int8 KV
cache's quantized write, the greedy pick and the logit soft-cap. `library()` is None where the
C kernels cannot be built; the callers in norm.py, activation.py, rope.py and kv_quant.py then
run their torch reference, `argmax` torch's."""

from __future__ import annotations

import ctypes
from array import array
from typing import Optional

import torch

from rtpkv.kernels.cpu_build import Signatures, bound_library

_P = ctypes.c_void_p
_I = ctypes.c_int64
_DTYPES = (torch.float32, torch.bfloat16)
_SIGNATURES: Signatures = {
    "rtpkv_rms_norm": ([_P, _P, _P, _P, _I, _I, ctypes.c_float, ctypes.c_int], None),
    "rtpkv_silu_and_mul": ([_P, _P, _I, _I, ctypes.c_int], None),
    "rtpkv_clamped_swiglu": ([_P, _P, _I, _I, ctypes.c_float, ctypes.c_float, ctypes.c_int],
                             None),
    "rtpkv_gelu_tanh_and_mul": ([_P, _P, _I, _I, ctypes.c_int], None),
    "rtpkv_rope": ([_P, _P, _I, _I, _I, _I, _I, _I, _P, _P, _P, ctypes.c_int], None),
    "rtpkv_write_kv_int8": ([_P, _P, _P, _P, _P, _I, _I, _I, _I, _I, ctypes.c_int], None),
    "rtpkv_argmax": ([_P, _I, _I, _P], None),
    "rtpkv_softcap": ([_P, _I, ctypes.c_float], None),
}


def library() -> Optional[ctypes.CDLL]:
    return bound_library("fused_ops", _SIGNATURES)


ROW_MULTIPLE = 8    # the fused ops' rows: whole vectors of 8 floats (RMSNorm, the gated MLPs)
ROPE_MULTIPLE = 16  # RoPE's head dim: two halves of whole vectors


def usable(*tensors: torch.Tensor, multiple: int = ROW_MULTIPLE) -> bool:
    """Whether the C kernels take these tensors: CPU, float32 or bfloat16 alike, the last
    dimension a multiple of `multiple`, and the library built."""
    first = tensors[0]
    dtype, device = first.dtype, first.device
    if device.type != "cpu" or dtype not in _DTYPES or first.shape[-1] % multiple:
        return False
    for t in tensors:
        if t.dtype != dtype or t.device != device:
            return False
    return library() is not None


def ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def argmax(logits: torch.Tensor) -> list[int]:
    """Each row's arg-max of (n, vocab) logits, as torch.argmax gives it (a NaN wins). On the
    CPU in C: after a decode step's C forward, a torch op pays for the caches the weights
    evicted (kernels/fused_decoder.py)."""
    lib = library()
    if (lib is None or logits.device.type != "cpu" or logits.dtype != torch.float32
            or logits.dim() != 2 or not logits.is_contiguous() or not logits.shape[1]):
        return logits.argmax(dim=-1).tolist()
    out = array("q", bytes(8 * logits.shape[0]))
    lib.rtpkv_argmax(logits.data_ptr(), logits.shape[0], logits.shape[1], out.buffer_info()[0])
    return out.tolist()
