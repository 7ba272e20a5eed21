"""ModelConfig: options given in code; a field left as None falls back to the environment."""

from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import ValidationError

from rtpkv.config import CacheOptions, describe_validation_error
from rtpkv.errors import ConfigError


class ModelConfig(CacheOptions):
    """dtype, device, max_seq_len, seq_size_per_block, kv_cache_mem_mb, reuse_cache, scheduler
    policies, ... (see `rtpkv.config.CacheOptions`), plus `tasks`: task prompts given in code,
    as a list of {"task_id", "prompt"} entries."""

    tasks: Optional[list[dict[str, Union[int, str]]]] = None

    def __init__(self, **values: Any):
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise ConfigError(describe_validation_error(exc)) from None

    def options(self) -> dict[str, Any]:
        """The CacheOptions part, for merging with the environment."""
        return self.model_dump(exclude={"tasks"})
