"""Whether Triton can run rtpkv's GPU kernels here (triton_ops.py, triton_attention.py), and why
not: Triton is an optional dependency (the `gpu` extra), so the kernels' modules are imported
only once this says yes. Triton compiles for CUDA devices; its interpreter (TRITON_INTERPRET=1,
read when a kernel module is imported) runs the same kernels on CPU tensors through numpy,
which is how the CPU-only CI checks them."""

from __future__ import annotations

import importlib
import os
from functools import lru_cache
from types import ModuleType
from typing import Optional

import torch


@lru_cache(maxsize=1)
def import_error() -> Optional[str]:
    """None when `triton` imports, else why it does not (the package's own message)."""
    try:
        importlib.import_module("triton")
        importlib.import_module("triton.language")
    except ImportError as exc:
        return f"the triton package does not import ({exc})"
    return None


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET=1): on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def unusable(device: torch.device) -> Optional[str]:
    """None when Triton kernels can run on `device` tensors, else why not."""
    error = import_error()
    if error:
        return error
    if device.type == "cuda" or (device.type == "cpu" and interpreting()):
        return None
    return (f"Triton kernels run on CUDA devices (or on CPU tensors under TRITON_INTERPRET=1, "
            f"its interpreter, for testing), not on {device.type}")


def ops_for(x: torch.Tensor) -> Optional[ModuleType]:
    """The Triton element-wise ops (triton_ops) for a CUDA tensor where Triton imports; None
    otherwise (the CPU path keeps its C kernels and the torch reference)."""
    if not x.is_cuda or import_error():
        return None
    return importlib.import_module("rtpkv.kernels.triton_ops")
