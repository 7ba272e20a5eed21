"""Linear layers for inference: the GEMM path chosen once at load time, batch invariance measured.

Paths (`RTPKV_LINEAR` in the configuration, default "auto"):
  onednn        weights prepacked once for oneDNN (`torch.ops.mkldnn._linear_pointwise`), in the
                model's dtype: float32 everywhere, bfloat16 where the CPU has bf16 GEMM
                instructions (AVX512-BF16, AVX-NE-CONVERT, AMX).
  fp32-compute  a bfloat16 model on a CPU without them: weights widened once to float32 copies
                of their bf16 values and prepacked for oneDNN, activations widened, results
                rounded back to bf16 (the values of a bf16 GEMM accumulating in float32; bf16
                GEMMs there run through a reference loop at 1-2 GFLOPS).
  avx2          float32 through the project's own kernel (fp32_linear.py, csrc/fp32_linear.c):
                weights packed once into panels of 16 channels, every output one FMA chain in
                order, so it is batch-invariant by construction (min_rows 1, no probe).
  native        F.linear in the model's dtype (MKL for float32 on x86): the reference.
"auto" takes avx2 for float32 on every CPU with AVX2 and FMA (AVX-512 CPUs included: the kernel
is then built with 16-lane vectors, RTPKV_ISA, same bits), so the fused decoder runs there;
onednn elsewhere where torch has it (bfloat16 models; fp32-compute for bf16 on CPUs without bf16
GEMMs) and native on other devices. On the 2-core AVX2 EPYC of the benchmarks oneDNN runs
float32 GEMMs at about 73 GFLOPS against MKL's 20-31, and a one-row GEMV 3-7x faster than MKL's
padded call; the avx2 kernel gives oneDNN's bits there, as fast for many rows and without the
~30 us oneDNN spends setting up each call, a third of a 512x512 GEMV (docs/BENCHMARKS.md,
"Single-stream decode"). On AVX-512 CPUs oneDNN's float32 GEMMs take another reduction order,
so there the avx2 path's bits are its own (still batch-invariant), not oneDNN's.

Batch invariance: a GEMM library may pick another kernel, and so another reduction order, for
another row count (MKL does below 16 rows; oneDNN with weights packed for one row does). The
bf16 reuse guarantee needs a row's output not to depend on how many rows share its call, so
`min_rows` is measured for each GEMM shape when a model loads (`invariant_min_rows`): the fewest
rows a call must compute for every probed row count, at any offset, to give the same bits as
one large reference call. Calls with fewer rows are padded with zeros to `min_rows`. oneDNN
prepacked for 256 rows needs no padding on that EPYC (min_rows 1); MKL needs 16. The probe
runs on a shape's first call, with the thread count the model runs with, and costs about as
much as a prefill of 1,100 tokens through the shape, so its result is kept on disk per machine
(`gemm-invariance-<cpu>.json` beside the built kernels) and paid once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from rtpkv.kernels import fp32_linear
from rtpkv.kernels.cpu_build import cache_dir, cpu_identity
from rtpkv.kernels.names import LINEAR_PATHS

# oneDNN keeps a primitive per GEMM shape (each row count is a shape) in two caches, ideep's
# (LRU_CACHE_CAPACITY) and oneDNN's own (ONEDNN_PRIMITIVE_CACHE_CAPACITY), 1024 entries each by
# default: under load, with batches of ever new sizes, a server's memory grew by ~650 MB before
# they filled. 128 entries each bound that (a probe of 900 shapes levels off ~200 MB above start
# instead of growing ~100 MB per 150 shapes). Read at oneDNN's first primitive, so set here,
# before any; a value already in the environment wins.
PRIMITIVE_CACHE_CAPACITY = 128
for _variable in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
    os.environ.setdefault(_variable, str(PRIMITIVE_CACHE_CAPACITY))

log = logging.getLogger("rtpkv")

PACKED_ROWS = 256                     # the row count oneDNN weights are prepacked for
PADDING_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)
PROBE_ROWS = (*range(1, 18), 24, 31, 32, 33, 48, 64, 65, 96, 127, 129, 200)
REFERENCE_ROWS = 256

_min_rows_by_shape: dict[str, int] = {}


def bf16_gemm_supported() -> bool:
    """Whether oneDNN has native bf16 GEMMs on this CPU."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def linear_path(dtype: torch.dtype, device: torch.device, name: str = "auto") -> str:
    """The GEMM path for `dtype` on `device` (see the module docstring); `name` is RTPKV_LINEAR
    in the configuration."""
    if name not in LINEAR_PATHS:
        raise ValueError(f"RTPKV_LINEAR={name!r} is invalid: accepted values are "
                         f"{', '.join(LINEAR_PATHS)}")
    if device.type != "cpu":
        return "native"
    if name == "auto":
        if dtype == torch.float32 and fp32_linear.available():
            return "avx2"
        if not torch.backends.mkldnn.is_available() or dtype not in (torch.float32, torch.bfloat16):
            return "native"
        if dtype == torch.bfloat16 and not bf16_gemm_supported():
            return "fp32-compute"
        return "onednn"
    if name in ("onednn", "fp32-compute") and not torch.backends.mkldnn.is_available():
        raise ValueError(f"RTPKV_LINEAR={name} needs a torch build with oneDNN (mkldnn)")
    if name == "onednn" and dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"RTPKV_LINEAR=onednn supports float32 and bfloat16, not {dtype}")
    if name == "onednn" and dtype == torch.bfloat16 and not bf16_gemm_supported():
        raise ValueError("RTPKV_LINEAR=onednn with bfloat16 needs a CPU with AVX512-BF16, "
                         "AVX-NE-CONVERT or AMX; use fp32-compute or native")
    if name == "avx2" and dtype != torch.float32:
        raise ValueError(f"RTPKV_LINEAR=avx2 computes float32 models, not {dtype}")
    if name == "avx2" and not fp32_linear.available():
        raise ValueError("RTPKV_LINEAR=avx2 needs a CPU with AVX2 and FMA and a C compiler")
    if name == "fp32-compute" and dtype != torch.bfloat16:
        return "native"   # nothing to widen
    return name


def invariant_min_rows(gemm: Callable[[torch.Tensor], torch.Tensor], in_features: int,
                       dtype: torch.dtype, device: torch.device) -> int:
    """The fewest rows `gemm` must compute so that each row's output is the same bits for every
    row count in PROBE_ROWS (at an offset into the batch) as in one REFERENCE_ROWS call."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(REFERENCE_ROWS, in_features, generator=g).to(dtype=dtype, device=device)
    reference = gemm(x)
    for pad in PADDING_CANDIDATES:
        if all(torch.equal(gemm(F.pad(x[o:o + m], (0, 0, 0, max(0, pad - m))))[:m],
                           reference[o:o + m])
               for m in PROBE_ROWS for o in (min(m % 7, REFERENCE_ROWS - m),)):
            return pad
    log.warning("no padding up to %d rows makes this GEMM batch-invariant: outputs may differ "
                "in the last bits between batch sizes", PADDING_CANDIDATES[-1])
    return PADDING_CANDIDATES[-1]


def _probe_file():
    machine = hashlib.sha256(cpu_identity().encode()).hexdigest()[:16]
    return cache_dir() / f"gemm-invariance-{machine}.json"


def _known_min_rows(key: str) -> int | None:
    if key not in _min_rows_by_shape:
        try:
            saved = json.loads(_probe_file().read_text())
        except (OSError, ValueError):
            saved = None
        if isinstance(saved, dict):
            _min_rows_by_shape.update(saved)
    value = _min_rows_by_shape.get(key)
    return value if value in PADDING_CANDIDATES else None


def _remember_min_rows(key: str, rows: int) -> None:
    """Keeps a probe's result for later processes (best effort: a read-only cache only costs
    the probe again)."""
    _min_rows_by_shape[key] = rows
    path = _probe_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(_min_rows_by_shape, indent=0, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass


class InferenceLinear(nn.Module):
    """y = x W^T + b through `path`, at least `min_rows` rows per GEMM. `min_rows` is measured on
    the first call, in the thread that runs the model and with its thread count (a GEMM library
    may split the work differently for another count), or read from the probe cache."""

    def __init__(self, linear: nn.Linear, path: str):
        super().__init__()
        self.path = path
        self.out_dtype = linear.weight.dtype
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        bias = None if linear.bias is None else linear.bias.detach()
        if path == "fp32-compute":
            weight = weight.float()
            bias = None if bias is None else bias.float()
        self.bias = bias
        self.device = weight.device
        self.weight: torch.Tensor | None = None
        self.min_rows: int | None = None
        if path in ("onednn", "fp32-compute"):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_ROWS)
        elif path == "avx2":
            self.packed = fp32_linear.pack(weight)
            self.bias = fp32_linear.pad_bias(bias)
            self.min_rows = 1   # batch-invariant by construction
        else:
            self.weight = weight   # only the native path reads it: no second copy of the weights

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, path={self.path}, min_rows={self.min_rows}"

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        if self.path == "avx2":
            return fp32_linear.fp32_linear(x, self.packed, self.bias, self.out_features)
        if self.path == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.path == "fp32-compute":
            return torch.ops.mkldnn._linear_pointwise(x.float(), self.packed, self.bias, "none",
                                                      [], "").to(self.out_dtype)
        return F.linear(x, self.weight, self.bias)

    def measure_min_rows(self) -> int:
        key = (f"{self.path} {self.out_dtype} {self.device} {self.in_features}x{self.out_features}"
               f" bias={self.bias is not None} threads={torch.get_num_threads()}"
               f" torch={torch.__version__}")
        rows = _known_min_rows(key)
        if rows is None:
            with torch.inference_mode():
                rows = invariant_min_rows(self._gemm, self.in_features, self.out_dtype, self.device)
            _remember_min_rows(key, rows)
        self.min_rows = rows
        return rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        min_rows = self.min_rows or self.measure_min_rows()
        rows = x.shape[0]
        if rows >= min_rows:
            return self._gemm(x)
        return self._gemm(F.pad(x, (0, 0, 0, min_rows - rows)))[:rows]
