"""The weight types a user can ask for (WEIGHT_TYPE): one entry each, naming the layer class that
holds and computes the weights, the kernel kind the fused decoder calls, and what enters the
model's fingerprint. Adding a weight type is one entry here, its name in kernels/names.py, and its
C kernel's case in csrc/decoder.c.

Every weight type computes in float32 on a CPU: its layers take float32 activations, the model's
embeddings, norms, attention and KV cache stay float32 (`DEVICE`, `COMPUTE_DTYPE`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rtpkv.kernels import int8_linear, w8a8_linear
from rtpkv.kernels.bf16_linear import Bf16Linear
from rtpkv.kernels.int8_linear import Int8Linear, QuantizedLinear
from rtpkv.kernels.names import WEIGHT_TYPES
from rtpkv.kernels.w8a8_linear import W8A8Linear

DEVICE = "cpu"
COMPUTE_DTYPE = torch.float32


@dataclass(frozen=True)
class WeightType:
    """One WEIGHT_TYPE: `layer` replaces each nn.Linear at load; `kernel_kind` is its LINEAR_*
    in csrc/decoder.c and `panel_rows` the fewest rows of its prefill tiles there; `held_as`
    says in the load log what the weights become."""

    name: str
    layer: type[QuantizedLinear]
    kernel_kind: int
    panel_rows: int
    held_as: str

    def fingerprint(self, layer: QuantizedLinear) -> str:
        """What the model's fingerprint adds: blocks computed with other weights than the
        float ones must never be shared with another setting's."""
        return f"|{self.name}-g{layer.group_size}"


REGISTRY: dict[str, WeightType] = {t.name: t for t in (
    WeightType("int8", Int8Linear, 1, int8_linear.PANEL_MIN_ROWS,
               f"int8, one scale per output channel and {int8_linear.GROUP_SIZE} inputs"),
    WeightType("w8a8_int8", W8A8Linear, 2, w8a8_linear.MANY_ROWS_FROM,
               f"int8, one scale per output channel and {w8a8_linear.GROUP_SIZE} inputs, "
               "activations quantized per row and group at each call"),
    WeightType("bf16", Bf16Linear, 3, 0, "bfloat16, computed in float32"),
)}
assert set(REGISTRY) == set(WEIGHT_TYPES) - {"auto"}, "kernels/names.py lists every entry"
