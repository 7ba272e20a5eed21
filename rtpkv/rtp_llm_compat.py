"""rtp-llm compatibility: the generate_config keys, environment variables and ModelConfig
fields rtp-llm defines that rtpkv has no option of its own for, and what rtpkv does with each.
This module is the one place that decides it.

rtp-llm code and clients send these keys, often with their default values, so every key of
rtp-llm's `GenerateConfig` is accepted: a key rtpkv implements under another name is mapped
(`gen_length` is `max_new_tokens`), a key for a feature rtpkv lacks is accepted at the value that
leaves the feature off (`num_beams: 1`) and refused with any other value, naming both. Keys for
request bookkeeping that cannot change the generated tokens (trace ids, routing, frontend
settings) are accepted with any value. A key no one defines is refused by GenerateConfig.

Environment variables (`ENV_VARIABLES`, read by rtpkv.env_check at start-up, and `env_options`
by Settings): one rtpkv implements under another name is mapped (`MAX_BATCH_TOKENS_SIZE` sets
MAX_NUM_BATCHED_TOKENS); one at a value that asks for nothing rtpkv lacks is accepted silently
(`ENABLE_3FS=0`); any other value is warned about by name when only how rtpkv runs would differ
from rtp-llm (a tier or a scheduler it does not have), and refused by name when what the user
gets would differ (`FP8_KV_CACHE=1`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from rtpkv.switches import parse_switch
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
    "return_all_probs": (False, 0),       # 0: rtp-llm's ReturnAllProbsMode.NONE
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
    "aux_info": (True,),                  # rtpkv always returns aux_info
    "return_prompt_logits": (False,),     # prompt scoring
    "combo_token_size": (0,),             # generative recommendation's combo bans
    "banned_combo_token_ids": ([],),
    "auto_parse_banned_combo": (False,),
    "enable_cross_sequence_ban": (False,),
    "thinking_mode": (None, False),       # rtpkv parses no reasoning out of the text
    "response_format": (None, "text", {"type": "text"}),   # no structured output
    "json_schema": (None,),
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
    "qos_priority": ANY,
    "unique_key": ANY,
    "force_batch": ANY,
    "batch_group_timeout": ANY,
    "profile_trace_name": ANY,
    # settings of features that are off (prompt scoring, combo bans) or of image inputs, which
    # rtpkv refuses: no effect on a text prompt's tokens
    "prompt_logits_top_k": ANY,
    "prompt_logits_start": ANY,
    "prompt_logits_end": ANY,
    "return_target_logprob": ANY,
    "cross_seq_diverge_start_combo": ANY,
    "max_pixels": ANY,
    "min_pixels": ANY,
    "fps": ANY,
    "min_frames": ANY,
    "max_frames": ANY,
    "crop_positions": ANY,
    "mm_timeout_ms": ANY,
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


# ---------------------------------------------------------------------- environment variables
def _any(value: str, environ: Mapping[str, str]) -> bool:
    return True


def _never(value: str, environ: Mapping[str, str]) -> bool:
    return False


def _switch(on: bool) -> Callable[[str, Mapping[str, str]], bool]:
    """Neutral when the switch reads as `on` (an unreadable value is not neutral)."""
    def neutral(value: str, environ: Mapping[str, str]) -> bool:
        try:
            return parse_switch(value) is on
        except ValueError:
            return False
    return neutral


def _one_of(*values: str) -> Callable[[str, Mapping[str, str]], bool]:
    return lambda value, environ: value.strip().lower() in values


def _pool_block_size(value: str, environ: Mapping[str, str]) -> bool:
    """KERNEL_SEQ_SIZE_PER_BLOCK: 0 (rtp-llm's "same as the pool") or the pool's own size."""
    return value.strip() in ("0", environ.get("SEQ_SIZE_PER_BLOCK", "64").strip())


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise ValueError
    return number


@dataclass(frozen=True)
class EnvRule:
    """What rtpkv does with one of rtp-llm's environment variables. A value `neutral` accepts
    asks for nothing rtpkv lacks: accepted silently. Any other value sets the rtpkv `option`
    (converted by `convert`) where there is one; else it is refused (`refuse`: what the user
    gets would differ) or warned about, with `why`."""

    why: str = ""
    neutral: Callable[[str, Mapping[str, str]], bool] = _never
    refuse: bool = False
    option: Optional[str] = None
    convert: Callable[[str], Any] = str
    accepted: str = ""    # the values it takes, for the error of a refused or bad value
    switch: bool = False  # a 1/0 switch: a value that is neither is refused as unreadable


_NO_3FS = ("rtpkv has no 3FS tier; its disk tier (ENABLE_MEMORY_CACHE_DISK=1) and remote tier "
           "(ENABLE_REMOTE_CACHE=1) keep blocks below the device pool")
_NO_TIERED = ("rtpkv's host tier takes blocks as the device pool evicts them (ENABLE_MEMORY_CACHE=1 "
              "with MEMORY_CACHE_SIZE_MB) and its remote tier is written through; rtp-llm's "
              "free-block threshold mode is not implemented")
_NO_FP8 = ("an fp8 (e4m3) KV cache is not implemented: AVX2 has no fp8 conversion, so the "
           "attention kernel would decode every K/V value bit by bit; INT8_KV_CACHE=1 stores K/V "
           "in int8")
_NO_EFFECT = EnvRule()   # has no effect whatever its value: warned

ENV_VARIABLES: dict[str, EnvRule] = {
    **dict.fromkeys((
        "TOKENIZER_PATH", "MODEL_TYPE", "ACT_TYPE", "DATA_TYPE", "LORA_INFO", "PTUNING_PATH",
        "STOP_WORDS_STR", "STOP_WORDS_LIST", "QUANTIZATION", "TP_SIZE", "DP_SIZE", "PP_SIZE",
        "WORLD_SIZE", "SP_TYPE", "SP_MODEL_TYPE", "SP_CHECKPOINT_PATH", "GEN_NUM_PER_CIRCLE",
        "MAX_CONTEXT_BATCH_SIZE", "RESERVER_RUNTIME_MEM_MB"), _NO_EFFECT),
    "FP8_KV_CACHE": EnvRule(_NO_FP8, _switch(False), refuse=True, accepted="0 (or unset)",
                            switch=True),
    "BLOCKWISE_USE_FP8_KV_CACHE": EnvRule(_NO_FP8, _switch(False), refuse=True,
                                          accepted="0 (or unset)", switch=True),
    "ENABLE_DEVICE_CACHE": EnvRule(
        "rtpkv always reuses blocks from the device pool; serving from the lower tiers alone "
        "is not implemented", _switch(True), refuse=True, accepted="1 (or unset)", switch=True),
    "KERNEL_SEQ_SIZE_PER_BLOCK": EnvRule(
        "rtpkv's attention kernels read the pool's blocks as they are; a kernel block size "
        "other than SEQ_SIZE_PER_BLOCK is not implemented", _pool_block_size, refuse=True,
        accepted="0 or SEQ_SIZE_PER_BLOCK"),
    "MAX_BATCH_TOKENS_SIZE": EnvRule(neutral=_one_of("0"), option="max_num_batched_tokens",
                                     convert=_positive_int, accepted="0 (rtpkv's default) or a "
                                     "number of tokens from 1"),
    "RESERVE_BLOCK_RATIO": EnvRule(
        "admission reserves the blocks each admitted request needs (CAPACITY_SCHEDULER_POLICY), "
        "not a share of the pool"),
    "MEMORY_CACHE_SYNC_TIMEOUT_MS": EnvRule(neutral=_any),   # one process: no ranks to sync
    "MEMORY_CACHE_DISK_SYNC_TIMEOUT_MS": EnvRule(neutral=_any),
    "ENABLE_TIERED_MEMORY_CACHE": EnvRule(_NO_TIERED, _switch(False)),
    "DEVICE_CACHE_MIN_FREE_BLOCKS": EnvRule(_NO_TIERED, _one_of("0")),
    "ENABLE_3FS": EnvRule(_NO_3FS, _switch(False)),
    "PDFUSION_SCHEDULER_MODE": EnvRule(
        "rtpkv runs prefill chunks and decodes in the same steps (CONTEXT_CHUNKING_POLICY); "
        "rtp-llm's ratio scheduler is not implemented", _one_of("")),
}
# Families of variables, by prefix: every member has no effect (warned).
ENV_PREFIXES: dict[str, EnvRule] = {
    "THREEFS_": EnvRule(_NO_3FS),
    "RECO_": EnvRule("rtpkv's remote tier is Redis (ENABLE_REMOTE_CACHE, REMOTE_CACHE_URL); "
                     "rtp-llm's KV cache manager client is not implemented"),
}


def env_rule(name: str) -> Optional[EnvRule]:
    """The rule for rtp-llm's variable `name`, or None when it is not one of them."""
    if name in ENV_VARIABLES:
        return ENV_VARIABLES[name]
    return next((rule for prefix, rule in ENV_PREFIXES.items() if name.startswith(prefix)), None)


def _invalid(name: str, value: str, why: str, rule: EnvRule) -> ConfigError:
    accepted = f"; accepted: {rule.accepted}" if rule.accepted else ""
    return ConfigError(f"{name}={value!r} is invalid: {why}{accepted}")


def check_env_refused(environ: Mapping[str, str]) -> None:
    """ConfigError naming the first rtp-llm variable whose value would change what the user
    gets (or that cannot be read as its rule needs)."""
    for name in sorted(environ):
        rule = env_rule(name)
        if rule is None or rule.neutral(environ[name], environ):
            continue
        if rule.refuse:
            if rule.switch and not _readable(environ[name]):
                raise _invalid(name, environ[name], "accepted values are 1/0, true/false, "
                               "on/off (any case)", EnvRule())
            raise _invalid(name, environ[name], rule.why, rule)
        if rule.option is not None:
            env_options({name: environ[name]})   # a bad value is refused here, by name


def _readable(value: str) -> bool:
    try:
        parse_switch(value)
    except ValueError:
        return False
    return True


def env_warning(name: str, environ: Mapping[str, str]) -> Optional[str]:
    """The start-up warning for rtp-llm's variable `name`, or None (not one of them, neutral,
    mapped or refused)."""
    rule = env_rule(name)
    if rule is None or rule.refuse or rule.option is not None \
            or rule.neutral(environ[name], environ):
        return None
    text = f"{name} is an rtp-llm variable that has no effect in rtpkv"
    return f"{text}: {rule.why}" if rule.why else text


def env_options(environ: Mapping[str, str]) -> dict[str, Any]:
    """The rtpkv options rtp-llm's variables set (a neutral value sets none); rtpkv's own
    variable for the same option must agree (ConfigError naming both)."""
    options: dict[str, Any] = {}
    for name, rule in ENV_VARIABLES.items():
        if rule.option is None or name not in environ:
            continue
        value = environ[name]
        if rule.neutral(value, environ):
            continue
        try:
            options[rule.option] = rule.convert(value.strip())
        except ValueError:
            raise _invalid(name, value, "not a valid value", rule) from None
        own = rule.option.upper()
        if own in environ and environ[own].strip() != str(options[rule.option]):
            raise ConfigError(f"{name}={value!r} and {own}={environ[own]!r} disagree; {name} is "
                              f"rtp-llm's name for {own}, give one of them")
    return options
