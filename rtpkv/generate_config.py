"""GenerateConfig: the per-request options of `pipeline(prompt, generate_config=...)`.

Names follow rtp-llm's generate_config where it has one; every other key rtp-llm defines is
accepted as `rtpkv.rtp_llm_compat` says (mapped, or checked that it leaves a missing feature
off). Keys no one defines are refused by name.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from rtpkv.cache.retention import KvCacheRetentionConfig
from rtpkv.config import describe_validation_error
from rtpkv.errors import ConfigError
from rtpkv.rtp_llm_compat import from_rtp_llm


class GenerateConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_new_tokens: Optional[int] = Field(None, ge=1)  # None: up to 256, within max_seq_len
    min_new_tokens: int = Field(0, ge=0)
    top_k: int = Field(0, ge=0)              # 0: no top-k filter; 1: greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False)  # 0: greedy
    do_sample: bool = True                   # False: greedy, whatever top_k/top_p/temperature say
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False)
    random_seed: Optional[int] = Field(None, ge=-2**63, le=2**64 - 1)  # what torch accepts
    stop_words_str: list[str] = Field(default_factory=list)
    stop_words_list: list[list[int]] = Field(default_factory=list)
    ignore_eos: bool = False
    task_id: Optional[Union[str, int]] = None
    reuse_cache: bool = True
    cache_salt: Optional[str] = Field(None, max_length=256)
    return_incremental: bool = False
    return_logits: bool = False              # each response carries the logits of its tokens
    # each response carries every generated token's log-probability (the model's, before any
    # sampling processor, as vLLM reports them) and this many most likely alternatives
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    timeout_ms: Optional[int] = Field(None, ge=1)  # -1 (rtp-llm's default): no timeout
    skip_special_tokens: bool = True         # in the response text
    kv_cache_retention_config: Optional[KvCacheRetentionConfig] = None  # object or plain dict
    enable_memory_cache: bool = True         # rtp-llm's per-request tier switches
    enable_disk_cache: bool = True
    enable_remote_cache: bool = True

    @field_validator("timeout_ms", mode="before")
    @classmethod
    def _no_timeout(cls, value: Any) -> Any:
        return None if value == -1 else value

    @field_validator("task_id")
    @classmethod
    def _task_id_as_text(cls, value: Any) -> Optional[str]:
        return None if value is None else str(value)

    @field_validator("stop_words_str")
    @classmethod
    def _no_empty_stop(cls, value: list[str]) -> list[str]:
        if any(not s for s in value):
            raise ValueError("stop words must be non-empty strings")
        return value

    @field_validator("stop_words_list")
    @classmethod
    def _no_empty_stop_ids(cls, value: list[list[int]]) -> list[list[int]]:
        if any(not s for s in value):
            raise ValueError("stop word id lists must be non-empty")
        return value

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.top_k == 1 or self.temperature == 0.0

    @classmethod
    def build(cls, base: "dict[str, Any] | GenerateConfig | None",
              overrides: dict[str, Any]) -> "GenerateConfig":
        """generate_config (a dict or a GenerateConfig) merged with keyword arguments; errors
        name the key and the rule."""
        if isinstance(base, GenerateConfig):
            base = base.model_dump(exclude_unset=True)
        values = dict(base or {})
        values.update(overrides)
        values = from_rtp_llm(values)
        unknown = sorted(set(values) - set(cls.model_fields))
        if unknown:
            raise ConfigError(f"unknown generate_config key(s) {unknown}; "
                              f"accepted: {sorted(cls.model_fields)} and rtp-llm's GenerateConfig keys")
        try:
            return cls(**values)
        except ValidationError as exc:
            raise ConfigError(describe_validation_error(
                exc, lambda key: f"generate_config[{key!r}]")) from None
