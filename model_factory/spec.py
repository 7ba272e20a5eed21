"""ModelSpec: the architecture facts rtpkv needs, read from a checkpoint's config.json.

Read from the raw JSON rather than through transformers' config classes so that both the
transformers 4 layout (`rope_theta`, `rope_scaling`) and the 5 layout (`rope_parameters`) work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from rtpkv.errors import ConfigError
from rtpkv.kernels.gated_delta import MAX_HEAD_DIM, DeltaShape
from rtpkv.model_factory import granite, qwen
from rtpkv.model_factory.granite import GraniteScales
from rtpkv.model_factory.mamba2 import Mamba2Spec
from rtpkv.model_factory.moe import MOE_ARCHITECTURES, MoeSpec

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "QWenLMHeadModel",
    "Cohere2ForCausalLM",
    *MOE_ARCHITECTURES,
    "Qwen3_5ForCausalLM",
    granite.ARCHITECTURE,
)

GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
GPT_OSS = "GptOssForCausalLM"
COHERE2 = "Cohere2ForCausalLM"
# their sliding layers alternate with full ones (the first slides) where layer_types is absent
_ALTERNATING = ("Gemma2ForCausalLM", GPT_OSS)
# their sliding_window_pattern's default, where layer_types is absent
_PATTERN_DEFAULTS = {"Gemma3ForCausalLM": 6, COHERE2: 4}
# their config sets the sliding layers' window (sliding_window, with this default) whatever
# use_sliding_window says
_WINDOW_DEFAULTS = {"Gemma2ForCausalLM": 4096, "Gemma3ForCausalLM": 4096, GPT_OSS: 128,
                    COHERE2: 4096}
# Gated DeltaNet hybrids: linear-attention layers among gated full-attention ones, (1 + w)
# RMSNorms, partial RoPE (model_factory/gated_delta.py)
LINEAR_ATTENTION_ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM")

# their sliding_window, when set, applies (to every layer) without use_sliding_window
_ALWAYS_WINDOWED = ("MistralForCausalLM", "MixtralForCausalLM")
# use_sliding_window puts the window on every layer, not on those of max_window_layers
_EVERY_LAYER_WINDOWED = _ALWAYS_WINDOWED + ("Qwen3MoeForCausalLM",)

# RoPE types as transformers names them. "dynamic" is the identity up to
# max_position_embeddings, which caps max_seq_len: past it transformers recomputes the
# frequencies from each forward's length, so a key's rotation would depend on the forward that
# computed it and a reused prefix could not equal recomputation. "longrope" (Phi-3) switches
# its factors on the forward's length the same way; no supported architecture uses it.
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")
_LAYER_TYPES = ("full_attention", "sliding_attention")
# a layer_types entry: a Gated DeltaNet layer, or Granite 4.0-H's Mamba2 layer (granite.MAMBA2)
LINEAR_ATTENTION = "linear_attention"
# MLP activations by their transformers names -> the plan's MLP kinds (model_factory/plan.py)
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    o_proj_bias: bool = False
    # gpt-oss: a learned logit per query head that joins each softmax's denominator
    attention_sinks: bool = False
    # Cohere2: its norms are LayerNorms without bias (layer_norm_eps), attention and MLP read
    # the same normalized input and add to the stream together, RoPE (interleaved pairs) on the
    # sliding layers only, and the logits are scaled by logit_scale
    cohere: bool = False
    logit_scale: Optional[float] = None
    rope: dict[str, Any] = field(default_factory=dict)
    # Gemma 3's sliding layers' own RoPE parameters (rope_local_base_freq); None: `rope`
    local_rope: Optional[dict[str, Any]] = None
    sliding_window: Optional[int] = None
    # each layer's kind, as transformers names it: "full_attention" or "sliding_attention"
    layer_types: tuple[str, ...] = ()
    hidden_activation: str = "silu"
    query_pre_attn_scalar: Optional[float] = None   # Gemma: softmax scale = its -1/2 power
    attn_logit_softcapping: Optional[float] = None
    final_logit_softcapping: Optional[float] = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: Optional[int] = None
    torch_dtype: Optional[str] = None
    moe: Optional[MoeSpec] = None        # mixtures of experts (model_factory/moe.py)
    # Gated DeltaNet hybrids (LINEAR_ATTENTION_ARCHITECTURES): the linear-attention layers'
    # shape, RoPE on the first `rotary_dim` of each head only, and the attention output gate
    linear_attention: Optional[DeltaShape] = None
    rotary_dim: Optional[int] = None     # None: the whole head
    attention_output_gate: bool = False
    # Mamba2 hybrids (Granite 4.0-H): the Mamba2 layers' shape (its linear_attention layers),
    # the four multipliers, and whether attention applies RoPE at all
    mamba: Optional[Mamba2Spec] = None
    granite_scales: Optional[GraniteScales] = None
    attention_rope: bool = True

    @classmethod
    def from_config(cls, cfg: dict[str, Any], source: str = "config.json") -> "ModelSpec":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ConfigError(
                f"{source}: architectures={archs!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if arch == qwen.ARCHITECTURE:
            cfg = qwen.qwen2_config(cfg, source)
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        layers = int(cfg["num_hidden_layers"])
        rope, local_rope = _rope_parameters(cfg, arch, source)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        sliding = _sliding_window(cfg, arch)
        linear = arch in LINEAR_ATTENTION_ARCHITECTURES
        is_granite = arch == granite.ARCHITECTURE
        types = tuple(_hybrid_layer_types(cfg, layers, source) if linear
                      else granite.layer_types(cfg, layers, source) if is_granite
                      else _layer_types(cfg, arch, layers, sliding, source))
        gemma = arch in GEMMA_ARCHITECTURES
        attention_bias = bool(cfg.get("attention_bias", arch == GPT_OSS))
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        if activation not in _ACTIVATIONS or (activation != "silu") != gemma:
            accepted = "gelu_pytorch_tanh" if gemma else "silu"
            raise ConfigError(f"{source}: hidden_activation={activation!r} is not supported for "
                              f"{arch} (supported: {accepted})")
        if cfg.get("use_bidirectional_attention"):
            raise ConfigError(f"{source}: use_bidirectional_attention=true is not supported "
                              "(a causal LM only)")
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            # Granite's dense MLP is its shared_mlp (its experts' size is intermediate_size)
            intermediate_size=int(cfg["shared_intermediate_size" if is_granite
                                      else "intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("layer_norm_eps", 1e-5) if arch == COHERE2
                               else cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma or arch == COHERE2)),
            qkv_bias=(arch in ("Qwen2ForCausalLM", qwen.ARCHITECTURE)
                      or attention_bias
                      or (arch == "Qwen2MoeForCausalLM" and bool(cfg.get("qkv_bias", True)))),
            # Qwen2's bias is q/k/v's only; attention_bias covers o_proj too elsewhere
            o_proj_bias=(arch not in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
                         and attention_bias),
            attention_sinks=arch == GPT_OSS,
            cohere=arch == COHERE2,
            logit_scale=float(cfg.get("logit_scale", 0.0625)) if arch == COHERE2 else None,
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM",
                             *LINEAR_ATTENTION_ARCHITECTURES),
            rope=rope,
            local_rope=local_rope,
            sliding_window=sliding if "sliding_attention" in types else None,
            layer_types=types,
            hidden_activation=_ACTIVATIONS[activation],
            query_pre_attn_scalar=(float(cfg.get("query_pre_attn_scalar", 256)) if gemma
                                   else None),
            attn_logit_softcapping=(_positive(cfg, "attn_logit_softcapping", source)
                                    if arch == "Gemma2ForCausalLM" else None),
            final_logit_softcapping=(_positive(cfg, "final_logit_softcapping", source)
                                     if gemma else None),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            moe=MoeSpec.from_config(arch, cfg, source),
            linear_attention=_delta_shape(cfg, source) if linear else None,
            rotary_dim=_rotary_dim(cfg, rope, head_dim, source) if linear else None,
            attention_output_gate=linear,
            mamba=granite.mamba2_spec(cfg, source) if is_granite else None,
            granite_scales=granite.GraniteScales.from_config(cfg, source) if is_granite else None,
            attention_rope=granite.uses_rope(cfg, source) if is_granite else True,
        )

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that attend (and so hold K/V), in order: every layer but the linear-
        attention ones."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind != LINEAR_ATTENTION)

    @property
    def num_kv_layers(self) -> int:
        """Layers whose K/V the pool holds."""
        return len(self.attention_layers)

    @property
    def layer_windows(self) -> tuple[Optional[int], ...]:
        """Each attending layer's window in tokens (itself included), in `attention_layers`
        order; None: full attention."""
        return tuple(self.sliding_window if self.layer_types[i] == "sliding_attention" else None
                     for i in self.attention_layers)

    @property
    def model_window(self) -> Optional[int]:
        """The window every layer shares (Mistral, Qwen2 sliding in every layer), which lets
        the cache release blocks behind it; None where some layer attends fully."""
        windows = set(self.layer_windows)
        return windows.pop() if len(windows) == 1 else None

    def inv_freq(self, rope: Optional[dict[str, Any]] = None) -> torch.Tensor:
        """RoPE inverse frequencies of `rope` (default: the model's global parameters),
        computed exactly as transformers does (float32)."""
        rope = self.rope if rope is None else rope
        dim = self.rotary_dim or self.head_dim
        base = float(rope["rope_theta"])
        inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        kind = rope["rope_type"]
        if kind == "linear":
            return inv / float(rope["factor"])
        if kind == "llama3":
            factor = float(rope["factor"])
            low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
            old_len = float(rope["original_max_position_embeddings"])
            low_wavelen, high_wavelen = old_len / low, old_len / high
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
            smooth = (old_len / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
            return torch.where(medium, smoothed, scaled)
        if kind == "yarn":
            return _yarn_inv_freq(rope, dim, base, self._yarn_factor(rope))
        return inv   # default, and dynamic up to max_position_embeddings (ROPE_TYPES)

    def rope_attention_factor(self, rope: Optional[dict[str, Any]] = None) -> float:
        """The factor transformers multiplies the cos and sin tables by: YaRN's
        `attention_factor` (given, or from `factor`, `mscale` and `mscale_all_dim`); 1.0 for
        every other type."""
        rope = self.rope if rope is None else rope
        if rope["rope_type"] != "yarn":
            return 1.0
        if rope.get("attention_factor") is not None:
            return float(rope["attention_factor"])
        factor = self._yarn_factor(rope)
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        return _yarn_mscale(factor)

    def _yarn_factor(self, rope: dict[str, Any]) -> float:
        factor = rope.get("factor")
        if factor is None:
            return self.max_position_embeddings / rope["original_max_position_embeddings"]
        return factor


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(rope: dict[str, Any], dim: int, base: float, factor: float) -> torch.Tensor:
    """YaRN's inverse frequencies, computed as transformers' _compute_yarn_parameters does:
    interpolated (divided by `factor`) below the slow rotations' dimension, extrapolated above
    the fast ones', a linear ramp between."""
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1
    original = rope["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001   # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    return ((1.0 / (factor * pos_freqs)) * (1 - extrapolation)
            + (1.0 / pos_freqs) * extrapolation)


def _checked_rope(rope: dict[str, Any], cfg: dict[str, Any], source: str, name: str,
                  partial: bool = False) -> dict[str, Any]:
    """`rope` with its type checked and, for llama3 and YaRN, the pretraining length filled in
    as transformers does (a top-level original_max_position_embeddings wins over the rope's for
    a model-wide rope; else max_position_embeddings). A partial_rotary_factor other than 1 only
    where `partial` (the Gated DeltaNet hybrids: `_rotary_dim` reads it)."""
    rope = dict(rope)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    factor = rope.get("partial_rotary_factor", 1.0)
    if not partial and factor is not None and float(factor) != 1.0:
        raise ConfigError(f"{source}: {name} partial_rotary_factor={factor} is not supported "
                          "(1.0: RoPE over the whole head; partial RoPE: "
                          f"{', '.join(LINEAR_ATTENTION_ARCHITECTURES)} only)")
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{source}: {name} type {rope_type!r} is not supported "
                          f"(supported: {', '.join(ROPE_TYPES)})")
    rope["rope_type"] = rope_type
    if rope_type in ("llama3", "yarn"):
        original = cfg.get("original_max_position_embeddings")
        if original is not None and name == "rope":
            rope["original_max_position_embeddings"] = original
        rope.setdefault("original_max_position_embeddings",
                        cfg.get("max_position_embeddings", 2048))
    return rope


def _rope_parameters(cfg: dict[str, Any], arch: str, source: str
                     ) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
    """The global RoPE parameters and, for Gemma 3, the sliding layers' own: transformers 5's
    `rope_parameters` (per layer type for Gemma 3) or 4's `rope_theta`, `rope_scaling` and
    `rope_local_base_freq`."""
    params = cfg.get("rope_parameters") or {}
    if arch == "Gemma3ForCausalLM":
        if "full_attention" in params or "sliding_attention" in params:
            full = dict(params.get("full_attention") or {})
            local = dict(params.get("sliding_attention") or {})
        else:
            full = dict(params or cfg.get("rope_scaling") or {})
            local = {}
        full.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
        local.setdefault("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
        return (_checked_rope(full, cfg, source, "rope_parameters.full_attention"),
                _checked_rope(local, cfg, source, "rope_parameters.sliding_attention"))
    rope = dict(params or cfg.get("rope_scaling") or _DEFAULT_ROPES.get(arch, {}))
    rope.setdefault("rope_theta", cfg.get("rope_theta", _DEFAULT_THETAS.get(arch, 10000.0)))
    return _checked_rope(rope, cfg, source, "rope",
                         partial=arch in LINEAR_ATTENTION_ARCHITECTURES), None


# the RoPE parameters transformers' config class gives a config that has none
_DEFAULT_ROPES = {GPT_OSS: {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "truncate": False,
                            "original_max_position_embeddings": 4096}}
_DEFAULT_THETAS = {GPT_OSS: 150000.0}


def _sliding_window(cfg: dict[str, Any], arch: str) -> Optional[int]:
    """The window of the sliding layers, where the architecture (or use_sliding_window) turns
    sliding attention on; None otherwise."""
    if arch in _WINDOW_DEFAULTS:
        sliding = cfg.get("sliding_window", _WINDOW_DEFAULTS[arch])
    elif arch in _ALWAYS_WINDOWED or cfg.get("use_sliding_window"):
        sliding = cfg.get("sliding_window")
    else:
        sliding = None
    return int(sliding) if sliding else None


def _layer_types(cfg: dict[str, Any], arch: str, layers: int, sliding: Optional[int],
                 source: str) -> list[str]:
    """Each layer's attention kind as transformers decides it: `layer_types` when the config
    has it, else the architecture's pattern."""
    if sliding is None and arch not in _WINDOW_DEFAULTS:
        return ["full_attention"] * layers
    if arch in _EVERY_LAYER_WINDOWED:
        return ["sliding_attention"] * layers
    types = cfg.get("layer_types")
    if not types:
        if arch in _ALTERNATING:
            types = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                     for i in range(layers)]
        elif arch in _PATTERN_DEFAULTS:   # one full layer every `pattern`, the last of each
            pattern = int(cfg.get("sliding_window_pattern", _PATTERN_DEFAULTS[arch]))
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                     for i in range(layers)]
        else:   # Qwen2/3: the first max_window_layers attend fully
            types = ["sliding_attention" if i >= int(cfg.get("max_window_layers", 28))
                     else "full_attention" for i in range(layers)]
    if len(types) != layers or any(t not in _LAYER_TYPES for t in types):
        raise ConfigError(f"{source}: layer_types={types!r} is not supported: one entry per "
                          f"layer ({layers}), each one of {', '.join(_LAYER_TYPES)}")
    return list(types)


def _hybrid_layer_types(cfg: dict[str, Any], layers: int, source: str) -> list[str]:
    """A Gated DeltaNet hybrid's layer kinds: `layer_types`, else transformers' default (every
    `full_attention_interval`-th layer attends, 4 by default; the others are linear)."""
    types = cfg.get("layer_types")
    if not types:
        interval = int(cfg.get("full_attention_interval") or 4)
        types = [LINEAR_ATTENTION if (i + 1) % interval else "full_attention"
                 for i in range(layers)]
    accepted = ("full_attention", LINEAR_ATTENTION)
    if len(types) != layers or any(t not in accepted for t in types):
        raise ConfigError(f"{source}: layer_types={types!r} is not supported: one entry per "
                          f"layer ({layers}), each one of {', '.join(accepted)}")
    return list(types)


def _delta_shape(cfg: dict[str, Any], source: str) -> DeltaShape:
    """The linear-attention layers' dimensions, checked against what the kernel computes."""
    shape = DeltaShape(key_heads=int(cfg.get("linear_num_key_heads", 16)),
                       value_heads=int(cfg.get("linear_num_value_heads", 32)),
                       key_dim=int(cfg.get("linear_key_head_dim", 128)),
                       value_dim=int(cfg.get("linear_value_head_dim", 128)),
                       conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)))
    if shape.key_heads < 1 or shape.value_heads % shape.key_heads:
        raise ConfigError(f"{source}: linear_num_value_heads={shape.value_heads} is invalid: a "
                          f"multiple of linear_num_key_heads ({shape.key_heads}, at least 1)")
    for name, value in (("linear_key_head_dim", shape.key_dim),
                        ("linear_value_head_dim", shape.value_dim)):
        if not 1 <= value <= MAX_HEAD_DIM:
            raise ConfigError(f"{source}: {name}={value} is invalid: accepted range is "
                              f"1..{MAX_HEAD_DIM}")
    if not 1 <= shape.conv_kernel <= 64:
        raise ConfigError(f"{source}: linear_conv_kernel_dim={shape.conv_kernel} is invalid: "
                          "accepted range is 1..64")
    return shape


def _rotary_dim(cfg: dict[str, Any], rope: dict[str, Any], head_dim: int, source: str) -> int:
    """The rotated part of each head: partial_rotary_factor (in the RoPE parameters or at the
    top level; transformers' default for these models is 0.25) times head_dim, an even count."""
    factor = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    dim = int(head_dim * factor)
    if not 0 < factor <= 1 or dim < 2 or dim % 2:
        raise ConfigError(f"{source}: partial_rotary_factor={factor} is invalid: the rotated "
                          f"dimensions (head_dim {head_dim} times it) must be an even count of "
                          "at least 2, at most head_dim")
    return dim


def _positive(cfg: dict[str, Any], name: str, source: str) -> Optional[float]:
    value = cfg.get(name)
    if value is None:
        return None
    if not float(value) > 0:
        raise ConfigError(f"{source}: {name}={value!r} is invalid: a positive number or null")
    return float(value)
