"""The attention window in force: how many tokens each query attends to (itself included), and
where that number came from.

TensorRT-LLM's `max_attention_window`: only the KV of the last W positions is attended (and
kept). Unset, it is the model's own `sliding_window` where every layer slides (Mistral, Qwen2
with use_sliding_window in every layer), else off (every query sees its whole sequence). When
both are set the smaller wins: a model trained with a window never attends further than it. A
model that mixes sliding and full layers (Gemma 2/3) has no model-wide window: each sliding
layer attends its own (model_factory/plan.py), under MAX_ATTENTION_WINDOW where it is set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rtpkv.config import RuntimeConfig
from rtpkv.errors import ConfigError
from rtpkv.model_factory.spec import ModelSpec


@dataclass(frozen=True)
class AttentionWindow:
    tokens: Optional[int]   # None: full attention
    source: str             # what set it, for the start-up log and cache_stats()

    def describe(self) -> str:
        return "off (full attention)" if self.tokens is None else f"{self.tokens} tokens ({self.source})"


def attention_window(config: RuntimeConfig, spec: ModelSpec) -> AttentionWindow:
    """The window for `config` on a model of `spec`; a bad MAX_ATTENTION_WINDOW raises
    ConfigError naming it and the accepted range."""
    asked = config.max_attention_window
    B, limit = config.seq_size_per_block, config.max_seq_len
    if asked is not None and not B <= asked <= max(limit, B):
        raise ConfigError(
            f"MAX_ATTENTION_WINDOW={asked} is invalid: must be from one KV block "
            f"(SEQ_SIZE_PER_BLOCK={B} tokens) to max_seq_len ({limit} tokens)")
    model = spec.model_window
    if asked is not None and (model is None or asked <= model):
        return AttentionWindow(asked, "MAX_ATTENTION_WINDOW")
    if model is not None:
        return AttentionWindow(max(model, 1), "the model's sliding_window")
    return AttentionWindow(None, "off")
