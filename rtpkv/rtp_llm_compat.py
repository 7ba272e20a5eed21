"""rtp-llm compatibility: the generate_config keys and ModelConfig fields rtp-llm defines that
rtpkv has no option of its own for, and what rtpkv does with each.

rtp-llm code and clients send these keys, often with their default values, so every key of
rtp-llm's `GenerateConfig` is accepted: a key rtpkv implements under another name is mapped
(`gen_length` is `max_new_tokens`), a key for a feature rtpkv lacks is accepted at the value that
leaves the feature off (`num_beams: 1`) and refused with any other value, naming both. Keys for
request bookkeeping that cannot change the generated tokens (trace ids, routing, frontend
settings) are accepted with any value. A key no one defines is refused by GenerateConfig.
"""

from __future__ import annotations

from typing import Any, Optional

from rtpkv.errors import ConfigError

ANY = None  # the key cannot change what is generated here: every value is accepted

# rtp-llm GenerateConfig key -> the values rtpkv supports (ANY: all of them). Keys rtpkv
# implements under the same name are GenerateConfig fields and are not listed here.
GENERATE_KEYS: dict[str, Optional[tuple[Any, ...]]] = {
    # decoding features rtpkv does not have: accepted while they stay off
    "num_beams": (1,),
    "variable_num_beams": ([],),
    "num_return_sequences": (0, 1),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "no_repeat_ngram_size": (None, 0),
    "top_p_decay": (None,),
    "top_p_min": (None,),
    "top_p_reset_ids": (None,),
    "bad_words_list": (None, []),
    "eos_token_id": (None,),
    "bos_token_id": (None,),
    "print_stop_words": (False,),
    "ttft_timeout_ms": (None, -1),
    "in_think_mode": (False,),
    "end_think_token_ids": ([],),
    "calculate_loss": (0,),
    "logits_index": (None,),
    "return_hidden_states": (False,),
    "return_all_hidden_states": (False,),
    "hidden_states_cut_dim": (0,),
    "normalized_hidden_states": (False,),
    "select_tokens_str": ([],),
    "select_tokens_id": ([],),
    "return_input_ids": (False,),
    "return_cum_log_probs": (False,),
    "return_all_probs": (False,),
    "return_softmax_probs": (False,),
    "sp_advice_prompt": ("",),
    "sp_advice_prompt_token_ids": ([],),
    "sp_edit": (False,),
    "force_sp_accept": (False,),
    "adapter_name": (None,),
    "resized_shape": (None,),
    "request_format": ("raw",),
    "enable_device_cache": (True,),
    "gen_timeline": (False,),
    # what rtpkv always does
    "return_output_ids": (False, True),   # Response.output_ids always carries them
    "is_streaming": (False, True),        # pipeline(...) always streams; keep the last response
    "using_hf_sampling": (False, True),   # the sampler follows transformers' processors
    "force_disable_sp_run": (False, True),  # there is no speculative decoding to disable
    # bookkeeping, routing and frontend settings: no effect on the tokens
    "max_input_tokens": ANY,
    "max_thinking_tokens": ANY,
    "chat_template_kwargs": ANY,
    "pad_token_id": ANY,
    "traffic_reject_priority": ANY,
    "chat_id": ANY,
    "md5_value": ANY,
    "custom_prop": ANY,
    "can_use_pd_separation": ANY,
    "profile_step": ANY,
    "out_prefix": ANY,
    "role_addrs": ANY,
    "trace_id": ANY,
    "inter_request_id": ANY,
    "global_request_id": ANY,
    "add_vision_id": ANY,
    "tool_call_message_extract_strategy": ANY,
    "sync_wait_write": ANY,
}

# rtp-llm keys that are rtpkv options under another name.
GENERATE_ALIASES = {"gen_length": "max_new_tokens", "enable_memory_block_cache": "enable_memory_cache"}

# rtp-llm's ModelConfig / ModelArgs fields that rtpkv ignores (with a warning): the checkpoint
# path and type come from `ModelFactory.from_huggingface(path)`, weights load in `dtype` (or
# int8: `weight_type`, an option), and LoRA, p-tuning, speculative decoding and other
# quantisations are not implemented.
MODEL_CONFIG_IGNORED_FIELDS = frozenset({
    "model_type", "ckpt_path", "tokenizer_path", "act_type", "quantization",
    "gen_num_per_circle", "ptuning_path", "lora_infos", "ref_module", "ref_dict", "sp_type",
    "task_type", "extra_data_path", "local_extra_data_path", "mla_ops_type",
    "json_model_override_args", "phy2log_path", "enable_fp32_lm_head",
    "enable_output_vocab_pruning", "use_new_loader", "require_weight_update",
})


def _same(value: Any, accepted: Any) -> bool:
    return value == accepted and isinstance(value, bool) == isinstance(accepted, bool)


def from_rtp_llm(values: dict[str, Any]) -> dict[str, Any]:
    """generate_config values with rtp-llm's keys mapped or checked and dropped; rtpkv's own
    keys (and unknown ones, for GenerateConfig to refuse) pass through."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key in GENERATE_ALIASES:
            target = GENERATE_ALIASES[key]
            if target in values and values[target] != value:
                raise ConfigError(f"{key}: {value!r} and {target}: {values[target]!r} disagree; "
                                  f"{key} is rtp-llm's name for {target}, give one of them")
            out[target] = value
        elif key in GENERATE_KEYS:
            accepted = GENERATE_KEYS[key]
            if accepted is not ANY and not any(_same(value, a) for a in accepted):
                supported = " or ".join(repr(a) for a in accepted)
                raise ConfigError(f"{key}: {value!r} is not supported; {key}: {supported} is")
        else:
            out[key] = value
    return out
