"""ModelConfig: options given in code; a field not given (or given as None) falls back to the
environment. rtp-llm's ModelConfig fields that rtpkv has no use for are accepted with a warning,
so rtp-llm code runs unchanged; any other unknown field is refused with the list of fields."""

from __future__ import annotations

import logging
from typing import Any, Optional, Union

from pydantic import ConfigDict, ValidationError

from rtpkv.config import RuntimeConfig, describe_validation_error
from rtpkv.errors import ConfigError

log = logging.getLogger("rtpkv")

# rtp-llm's ModelConfig / ModelArgs fields that rtpkv ignores: the checkpoint path and type come
# from `ModelFactory.from_huggingface(path)`, the weights load in `dtype`, and LoRA, p-tuning,
# speculative decoding and quantisation are not implemented.
RTP_LLM_IGNORED_FIELDS = frozenset({
    "model_type", "ckpt_path", "tokenizer_path", "weight_type", "act_type", "quantization",
    "gen_num_per_circle", "ptuning_path", "lora_infos", "ref_module", "ref_dict", "sp_type",
    "task_type", "extra_data_path", "local_extra_data_path", "mla_ops_type",
    "json_model_override_args", "phy2log_path", "enable_fp32_lm_head",
    "enable_output_vocab_pruning", "use_new_loader", "require_weight_update",
})


class ModelConfig(RuntimeConfig):
    """dtype, device, max_seq_len, seq_size_per_block, kv_cache_mem_mb, reuse_cache, scheduler
    policies, ... (see `rtpkv.config.RuntimeConfig`), plus `tasks`: task prompts given in code,
    as a list of {"task_id", "prompt"} entries."""

    model_config = ConfigDict(frozen=False, validate_assignment=True)

    tasks: Optional[list[dict[str, Union[int, str]]]] = None

    def __init__(self, **values: Any):
        unknown = sorted(set(values) - set(type(self).model_fields) - RTP_LLM_IGNORED_FIELDS)
        if unknown:
            raise ConfigError(f"unknown ModelConfig field(s) {unknown}; accepted: "
                              f"{sorted(type(self).model_fields)}")
        ignored = sorted(set(values) & RTP_LLM_IGNORED_FIELDS)
        if ignored:
            log.warning("ModelConfig: rtp-llm field(s) %s have no effect in rtpkv", ignored)
        given = {k: v for k, v in values.items() if v is not None and k not in ignored}
        try:
            super().__init__(**given)
        except ValidationError as exc:
            raise ConfigError(describe_validation_error(exc)) from None
