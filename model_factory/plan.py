"""The layer plan: what each decoder layer computes, as data.

A `ModelPlan` is per-layer specs (the token mixer: attention, Gated DeltaNet or Mamba2; norms
and where they sit, attention window, softmax scale, logit soft-cap, which RoPE table if any, q/k
norm, output gate, MLP kind, residual scale) plus the model-wide constants (embedding scale,
final soft-cap, logits divisor). `CausalLM` builds its modules from it and its forward executes
it; the fused C decoder (kernels/fused_decoder.py) runs a plan only where every layer is one it
computes, and refuses the model otherwise. A new architecture is a new plan, read from its
config by `model_plan`, not a new walk over the modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from rtpkv.model_factory.spec import (GEMMA_ARCHITECTURES, LINEAR_ATTENTION,
                                      LINEAR_ATTENTION_ARCHITECTURES, ModelSpec)

GLOBAL_ROPE = "global"
LOCAL_ROPE = "local"   # Gemma 3's sliding layers (rope_local_base_freq)

ATTENTION = "attention"        # a layer's token mixer: paged attention over the KV pool
GATED_DELTA = "gated_delta"    # Gated DeltaNet, a recurrent layer (model_factory/gated_delta.py)
MAMBA2 = "mamba2"              # a Mamba2 mixer, a recurrent layer (model_factory/mamba2.py)


@dataclass(frozen=True)
class NormPlan:
    eps: float
    # Gemma's RMSNorm: the weight is applied as (1 + w), in float32 before the one rounding to
    # the model's dtype; otherwise Llama's: w times the normalized input in the model's dtype
    offset: bool = False
    # Cohere's LayerNorm without bias: the mean taken off before the RMS, in float32
    centered: bool = False


@dataclass(frozen=True)
class AttentionPlan:
    window: Optional[int]      # tokens each query attends to, itself included; None: all
    scale: float               # the softmax scale
    softcap: Optional[float]   # scores become cap * tanh(score / cap) before the mask (Gemma 2)
    rope: Optional[str]        # which RoPE table: GLOBAL_ROPE or LOCAL_ROPE; None: no RoPE
    qk_norm: bool              # an RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3)
    # a learned logit per query head in each softmax's denominator, which takes weight from
    # every key without a value of its own (gpt-oss's attention sinks)
    sinks: bool = False
    # the output times sigmoid(a gate q_proj computes beside each query head) (Qwen3-Next)
    output_gate: bool = False


@dataclass(frozen=True)
class LayerPlan:
    attention: AttentionPlan   # a recurrent layer's is unused
    mlp: str                   # "silu" (SwiGLU) or "gelu_tanh" (GeGLU, gelu_pytorch_tanh)
    norm: NormPlan
    # Gemma 2/3's four norms: the attention output and the MLP output are normalized before
    # their residual adds, and the MLP input by a norm of its own; otherwise Llama's two
    sandwich: bool
    # Cohere's parallel block: attention and MLP both read the input norm's output, and their
    # sum is the layer's output (one norm per layer)
    parallel: bool = False
    mixer: str = ATTENTION     # ATTENTION, GATED_DELTA or MAMBA2
    # the mixer's and the MLP's outputs times this before their residual adds (Granite)
    residual_scale: Optional[float] = None

    @property
    def recurrent(self) -> bool:
        return self.mixer != ATTENTION


@dataclass(frozen=True)
class ModelPlan:
    layers: tuple[LayerPlan, ...]
    ropes: dict[str, dict[str, Any]]     # RoPE table name -> its parameters
    embedding_scale: Optional[float]     # embeddings times this, in the model's dtype (Gemma)
    final_softcap: Optional[float]       # logits become cap * tanh(logit / cap) (Gemma)
    final_norm: NormPlan
    logit_scale: Optional[float] = None  # logits times this, in the model's dtype (Cohere)
    logits_divisor: Optional[float] = None   # logits divided by this (Granite's logits_scaling)

    @property
    def softcapped_attention(self) -> bool:
        return any(layer.attention.softcap is not None for layer in self.layers)

    @property
    def attention_sinks(self) -> bool:
        return any(layer.attention.sinks for layer in self.layers)


def capped_window(layer: Optional[int], limit: Optional[int]) -> Optional[int]:
    """A layer's window under the engine's (MAX_ATTENTION_WINDOW, or the window every layer
    shares): the smaller of the two; None where neither is set."""
    if layer is None or limit is None:
        return layer if limit is None else limit
    return min(layer, limit)


def model_plan(spec: ModelSpec) -> ModelPlan:
    """The plan of a checkpoint of `spec`'s architecture."""
    gemma = spec.architecture in GEMMA_ARCHITECTURES
    offset = gemma or spec.architecture in LINEAR_ATTENTION_ARCHITECTURES
    norm = NormPlan(spec.rms_norm_eps, offset=offset, centered=spec.cohere)
    scale = (spec.query_pre_attn_scalar if gemma else spec.head_dim) ** -0.5
    granite = spec.granite_scales
    if granite is not None:
        scale = granite.attention
    recurrent = MAMBA2 if spec.mamba is not None else GATED_DELTA
    ropes = {GLOBAL_ROPE: spec.rope}
    if spec.local_rope is not None:
        ropes[LOCAL_ROPE] = spec.local_rope
    windows = dict(zip(spec.attention_layers, spec.layer_windows))
    layers = tuple(
        LayerPlan(
            attention=AttentionPlan(
                window=windows.get(i), scale=scale, softcap=spec.attn_logit_softcapping,
                rope=_layer_rope(spec, kind, windows.get(i), ropes),
                qk_norm=spec.qk_norm, sinks=spec.attention_sinks,
                output_gate=spec.attention_output_gate),
            mlp=spec.hidden_activation, norm=norm, sandwich=gemma, parallel=spec.cohere,
            mixer=recurrent if kind == LINEAR_ATTENTION else ATTENTION,
            residual_scale=granite.residual if granite is not None else None)
        for i, kind in enumerate(spec.layer_types))
    embedding_scale = (spec.hidden_size ** 0.5 if gemma
                       else granite.embedding if granite is not None else None)
    return ModelPlan(layers=layers, ropes=ropes, embedding_scale=embedding_scale,
                     final_softcap=spec.final_logit_softcapping, final_norm=norm,
                     logit_scale=spec.logit_scale,
                     logits_divisor=granite.logits if granite is not None else None)


def _layer_rope(spec: ModelSpec, kind: str, window: Optional[int],
                ropes: dict[str, Any]) -> Optional[str]:
    """The RoPE table of a layer of `kind`, or None for a layer without positional encoding:
    Granite 4.0-H's attention where its config says so; Cohere2's full layers (its sliding
    layers, those with a window: transformers' condition, rotate). Gemma 3's sliding layers
    have their own table; every other layer takes the global one."""
    if not spec.attention_rope:
        return None
    if spec.cohere:
        return GLOBAL_ROPE if kind == "sliding_attention" and window is not None else None
    return LOCAL_ROPE if kind == "sliding_attention" and LOCAL_ROPE in ropes else GLOBAL_ROPE
