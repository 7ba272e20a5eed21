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
from rtpkv.model_factory.moe import MOE_ARCHITECTURES, MoeSpec

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    *MOE_ARCHITECTURES,
)

# their sliding_window, when set, applies (to every layer) without use_sliding_window
_ALWAYS_WINDOWED = ("MistralForCausalLM", "MixtralForCausalLM")
# use_sliding_window puts the window on every layer, not on those of max_window_layers
_EVERY_LAYER_WINDOWED = _ALWAYS_WINDOWED + ("Qwen3MoeForCausalLM",)


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
    rope: dict[str, Any] = field(default_factory=dict)
    sliding_window: Optional[int] = None
    mixed_sliding_layers: bool = False   # some layers attend fully (Qwen2 max_window_layers)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: Optional[int] = None
    torch_dtype: Optional[str] = None
    moe: Optional[MoeSpec] = None        # mixtures of experts (model_factory/moe.py)

    @classmethod
    def from_config(cls, cfg: dict[str, Any], source: str = "config.json") -> "ModelSpec":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ConfigError(
                f"{source}: architectures={archs!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3", "linear"):
            raise ConfigError(f"{source}: rope type {rope_type!r} is not supported "
                              "(supported: default, llama3, linear)")
        rope["rope_type"] = rope_type
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        sliding, mixed = None, False
        if arch in _ALWAYS_WINDOWED or cfg.get("use_sliding_window"):
            sliding = cfg.get("sliding_window")
            if sliding and arch not in _EVERY_LAYER_WINDOWED:
                layer_types = cfg.get("layer_types") or [
                    "sliding_attention" if i >= int(cfg.get("max_window_layers", 28))
                    else "full_attention" for i in range(int(cfg["num_hidden_layers"]))]
                if "sliding_attention" not in layer_types:
                    sliding = None   # transformers applies the window to no layer
                mixed = any(t != "sliding_attention" for t in layer_types)
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=(arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False))
                      or (arch == "Qwen2MoeForCausalLM" and bool(cfg.get("qkv_bias", True)))),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            rope=rope,
            sliding_window=int(sliding) if sliding else None,
            mixed_sliding_layers=mixed,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            moe=MoeSpec.from_config(arch, cfg, source),
        )

    def inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies, computed exactly as transformers does (float32)."""
        dim = self.head_dim
        base = float(self.rope["rope_theta"])
        inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        kind = self.rope["rope_type"]
        if kind == "linear":
            return inv / float(self.rope["factor"])
        if kind == "llama3":
            factor = float(self.rope["factor"])
            low, high = float(self.rope["low_freq_factor"]), float(self.rope["high_freq_factor"])
            old_len = float(self.rope["original_max_position_embeddings"])
            low_wavelen, high_wavelen = old_len / low, old_len / high
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
            smooth = (old_len / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
            return torch.where(medium, smoothed, scaled)
        return inv
