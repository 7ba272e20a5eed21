"""IBM Granite 4.0-H (GraniteMoeHybridForCausalLM), the Mamba2 hybrid rtpkv runs: what its
config.json adds to a Llama-like decoder and how its tensors map onto rtpkv's modules.

Each layer is Llama's two-norm layer whose token mixer is a Mamba2 mixer
(model_factory/mamba2.py; `linear_attention`, formerly `mamba`, in layer_types) or attention
(`full_attention`, formerly `attention`), and whose MLP is a SwiGLU `shared_mlp`, with beside it,
where num_local_experts > 0, a mixture of SwiGLU experts routed by a softmax over the top-k
router logits (model_factory/moe.py). Four scalars: the embeddings times
`embedding_multiplier`, each mixer's and MLP's output times `residual_multiplier` before its
residual add, the softmax scale `attention_multiplier`, the logits divided by `logits_scaling`.
Attention has RoPE only where position_embedding_type is "rope" (Granite 4.0-H has none).

Names: `block_sparse_moe.router.layer` -> the mixture's `gate`; `block_sparse_moe.input_linear`
(experts, 2 x intermediate, hidden: gate then up) and `output_linear` (experts, hidden,
intermediate) -> each expert's gate/up/down_proj; `shared_mlp.input_linear` (gate then up) and
`output_linear` -> the shared expert's (or, without experts, the dense MLP's) projections.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

from rtpkv.errors import ConfigError
from rtpkv.model_factory.mamba2 import Mamba2Spec

ARCHITECTURE = "GraniteMoeHybridForCausalLM"
MAMBA2 = "linear_attention"   # a layer_types entry (spec.LINEAR_ATTENTION): a Mamba2 layer
MAX_CONV_KERNEL = 64
_LEGACY_TYPES = {"mamba": MAMBA2, "attention": "full_attention"}

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(block_sparse_moe|shared_mlp)\.(.+)\.weight$")


@dataclass(frozen=True)
class GraniteScales:
    embedding: float      # embedding_multiplier
    residual: float       # residual_multiplier
    attention: float      # attention_multiplier: the softmax scale
    logits: float         # logits_scaling: the logits' divisor

    @classmethod
    def from_config(cls, cfg: dict[str, Any], source: str = "config.json") -> "GraniteScales":
        values = {}
        for name in ("embedding_multiplier", "residual_multiplier", "attention_multiplier",
                     "logits_scaling"):
            value = float(cfg.get(name, 1.0))
            if not math.isfinite(value) or (name == "logits_scaling" and value == 0):
                raise ConfigError(f"{source}: {name}={cfg.get(name)!r} is invalid: a finite "
                                  "number" + (", not 0" if name == "logits_scaling" else ""))
            values[name] = value
        return cls(*values.values())


def layer_types(cfg: dict[str, Any], layers: int, source: str) -> list[str]:
    """Each layer's mixer: `layer_types` (or `layers_block_type`; the legacy names `mamba` and
    `attention` read as transformers reads them), every layer Mamba2 where absent."""
    types = cfg.get("layer_types") or cfg.get("layers_block_type") or [MAMBA2] * layers
    types = [_LEGACY_TYPES.get(t, t) for t in types]
    accepted = ("full_attention", MAMBA2)
    if len(types) != layers or any(t not in accepted for t in types):
        raise ConfigError(f"{source}: layer_types={types!r} is not supported: one entry per "
                          f"layer ({layers}), each one of {', '.join(accepted)}")
    return types


def mamba2_spec(cfg: dict[str, Any], source: str = "config.json") -> Mamba2Spec:
    """The mamba_* fields (GraniteMoeHybridConfig's defaults where absent), checked."""
    hidden = int(cfg["hidden_size"])
    inner = int(cfg.get("mamba_expand", 2)) * hidden
    heads = int(cfg.get("mamba_n_heads", 128))
    if heads < 1 or inner % heads:
        raise ConfigError(f"{source}: mamba_n_heads={heads} is invalid: it must divide "
                          f"mamba_expand * hidden_size ({inner})")
    head_dim = cfg.get("mamba_d_head", "auto")
    head_dim = inner // heads if head_dim == "auto" else int(head_dim)
    if head_dim * heads != inner:
        raise ConfigError(f"{source}: mamba_d_head={head_dim} is invalid: mamba_n_heads * "
                          f"mamba_d_head must be mamba_expand * hidden_size ({inner})")
    groups = int(cfg.get("mamba_n_groups", 1))
    if groups < 1 or heads % groups:
        raise ConfigError(f"{source}: mamba_n_groups={groups} is invalid: it must divide "
                          f"mamba_n_heads ({heads})")
    kernel = int(cfg.get("mamba_d_conv", 4))
    if not 1 <= kernel <= MAX_CONV_KERNEL:   # csrc/mamba2.c keeps a window on the stack
        raise ConfigError(f"{source}: mamba_d_conv={kernel} is invalid: accepted range is "
                          f"1..{MAX_CONV_KERNEL}")
    if int(cfg.get("mamba_d_state", 256)) < 1:
        raise ConfigError(f"{source}: mamba_d_state={cfg.get('mamba_d_state')} is invalid: "
                          "accepted values are 1 and above")
    dt_min, dt_max = _time_step_limit(cfg)
    if not 0 <= dt_min <= dt_max:
        raise ConfigError(f"{source}: time_step_limit={[dt_min, dt_max]} is invalid: two "
                          "bounds, 0 <= lower <= upper")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{source}: hidden_act={cfg.get('hidden_act')!r} is not supported "
                          f"for {ARCHITECTURE} (supported: silu)")
    return Mamba2Spec(heads, head_dim, int(cfg.get("mamba_d_state", 256)), groups,
                      kernel, bool(cfg.get("mamba_conv_bias", True)),
                      bool(cfg.get("mamba_proj_bias", False)), dt_min, dt_max)


def _time_step_limit(cfg: dict[str, Any]) -> tuple[float, float]:
    """time_step_limit as saved (JSON's Infinity, or transformers' {"__float__": "Infinity"})."""
    limit = cfg.get("time_step_limit") or (0.0, math.inf)

    def number(v: Any) -> float:
        return float(v["__float__"]) if isinstance(v, dict) else float(v)

    return number(limit[0]), number(limit[1])


def uses_rope(cfg: dict[str, Any], source: str = "config.json") -> bool:
    kind = cfg.get("position_embedding_type")
    if kind not in (None, "rope", "nope"):
        raise ConfigError(f"{source}: position_embedding_type={kind!r} is not supported "
                          "(supported: rope, or null for none)")
    return kind == "rope"


def granite_tensors(tensors: Iterable[tuple[str, torch.Tensor]], has_experts: bool
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """A Granite 4.0-H checkpoint's tensors under the module's names (the experts' stacked
    tensors split per expert); other names pass unchanged (the loader reports what is
    missing)."""
    for name, tensor in tensors:
        match = _LAYER.match(name)
        if match is None:
            yield name, tensor
            continue
        prefix, block, rest = f"model.layers.{match[1]}.mlp.", match[2], match[3]
        if block == "shared_mlp":
            own = prefix + ("shared_expert." if has_experts else "")
            if rest == "input_linear":
                gate, up = tensor.chunk(2, dim=0)
                yield own + "gate_proj.weight", gate
                yield own + "up_proj.weight", up
            elif rest == "output_linear":
                yield own + "down_proj.weight", tensor
            else:
                yield name, tensor
        elif rest == "router.layer":
            yield prefix + "gate.weight", tensor
        elif rest == "input_linear":
            for e, stacked in enumerate(tensor.unbind(0)):
                gate, up = stacked.chunk(2, dim=0)
                yield f"{prefix}experts.{e}.gate_proj.weight", gate
                yield f"{prefix}experts.{e}.up_proj.weight", up
        elif rest == "output_linear":
            for e, down in enumerate(tensor.unbind(0)):
                yield f"{prefix}experts.{e}.down_proj.weight", down
        else:
            yield name, tensor
