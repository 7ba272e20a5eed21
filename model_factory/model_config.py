"""ModelConfig: options given in code; a field not given (or given as None) falls back to the
environment. rtp-llm's ModelConfig fields that rtpkv has no use for are accepted with a warning,
so rtp-llm code runs unchanged; any other unknown field is refused with the list of fields."""

from __future__ import annotations

import logging
from typing import Any, Optional, Union

from pydantic import ConfigDict, ValidationError

from rtpkv.config import RuntimeConfig, describe_validation_error
from rtpkv.errors import ConfigError
from rtpkv.rtp_llm_compat import MODEL_CONFIG_IGNORED_FIELDS

log = logging.getLogger("rtpkv")


class ModelConfig(RuntimeConfig):
    """dtype, device, max_seq_len, seq_size_per_block, kv_cache_mem_mb, reuse_cache, scheduler
    policies, ... (see `rtpkv.config.RuntimeConfig`), plus `tasks`: task prompts given in code,
    as a list of {"task_id", "prompt"} entries."""

    model_config = ConfigDict(frozen=False, validate_assignment=True)

    tasks: Optional[list[dict[str, Union[int, str]]]] = None

    def __init__(self, **values: Any):
        unknown = sorted(set(values) - set(type(self).model_fields) - MODEL_CONFIG_IGNORED_FIELDS)
        if unknown:
            raise ConfigError(f"unknown ModelConfig field(s) {unknown}; accepted: "
                              f"{sorted(type(self).model_fields)}")
        ignored = sorted(set(values) & MODEL_CONFIG_IGNORED_FIELDS)
        if ignored:
            log.warning("ModelConfig: rtp-llm field(s) %s have no effect in rtpkv", ignored)
        given = {k: v for k, v in values.items() if v is not None and k not in ignored}
        try:
            super().__init__(**given)
        except ValidationError as exc:
            raise ConfigError(describe_validation_error(exc)) from None
