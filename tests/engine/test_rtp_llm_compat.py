"""rtp-llm's generate_config keys and environment variables: all known, mapped where rtpkv
implements them, accepted at their neutral values, warned about or refused by name otherwise."""

import logging

import pytest

from conftest import run
from rtpkv.config import Settings
from rtpkv.errors import ConfigError
from rtpkv.generate_config import GenerateConfig
from rtpkv.rtp_llm_compat import GENERATE_ALIASES, GENERATE_KEYS
from rtpkv.text_stream import TextStream

PROMPT = "hello, what's your name"

# Every field of rtp-llm's GenerateConfig (rtp_llm/config/generate_config.py) with its default.
RTP_LLM_DEFAULTS = {
    "max_new_tokens": 32000, "max_input_tokens": 32000, "max_thinking_tokens": 32000,
    "in_think_mode": False, "chat_template_kwargs": None, "end_think_token_ids": [],
    "num_beams": 1, "variable_num_beams": [], "do_sample": True, "num_return_sequences": 0,
    "top_k": 0, "top_p": 1.0, "temperature": 1.0, "repetition_penalty": 1.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_new_tokens": 0,
    "no_repeat_ngram_size": None, "random_seed": None, "top_p_decay": None, "top_p_min": None,
    "top_p_reset_ids": None, "stop_words_str": [], "stop_words_list": [], "bad_words_list": None,
    "eos_token_id": None, "pad_token_id": None, "bos_token_id": None, "using_hf_sampling": False,
    "print_stop_words": False, "timeout_ms": -1, "ttft_timeout_ms": -1,
    "traffic_reject_priority": 100, "chat_id": None, "task_id": None, "request_format": "raw",
    "calculate_loss": 0, "return_logits": False, "logits_index": None,
    "return_incremental": False, "return_hidden_states": False,
    "return_all_hidden_states": False, "hidden_states_cut_dim": 0,
    "normalized_hidden_states": False, "select_tokens_str": [], "select_tokens_id": [],
    "return_input_ids": False, "return_output_ids": False, "md5_value": "", "custom_prop": "{}",
    "sp_advice_prompt": "", "sp_advice_prompt_token_ids": [], "sp_edit": False,
    "force_disable_sp_run": False, "force_sp_accept": False, "return_cum_log_probs": False,
    "return_all_probs": False, "return_softmax_probs": False, "can_use_pd_separation": True,
    "gen_timeline": False, "profile_step": 3, "out_prefix": "", "role_addrs": [], "trace_id": "",
    "inter_request_id": -1, "ignore_eos": False, "skip_special_tokens": False,
    "adapter_name": None, "is_streaming": False, "resized_shape": None, "add_vision_id": True,
    "tool_call_message_extract_strategy": "default", "global_request_id": -1,
    "reuse_cache": True, "enable_memory_block_cache": True, "enable_remote_cache": True,
    "enable_device_cache": True, "sync_wait_write": True,
}
# Fields the current GenerateConfig added since, with their defaults.
RTP_LLM_CURRENT_DEFAULTS = {
    "combo_token_size": 0, "banned_combo_token_ids": [], "auto_parse_banned_combo": False,
    "enable_cross_sequence_ban": False, "cross_seq_diverge_start_combo": 0,
    "return_prompt_logits": False, "prompt_logits_top_k": 64, "prompt_logits_start": -1,
    "prompt_logits_end": -1, "return_target_logprob": True, "return_all_probs": 0,
    "aux_info": True, "profile_trace_name": "", "max_pixels": None, "min_pixels": None,
    "fps": None, "min_frames": None, "max_frames": None, "crop_positions": None,
    "mm_timeout_ms": None, "enable_memory_cache": True, "force_batch": False,
    "batch_group_timeout": None, "unique_key": "",
}


def test_every_rtp_llm_key_is_known():
    ours = set(GenerateConfig.model_fields)
    assert set(RTP_LLM_DEFAULTS) | set(RTP_LLM_CURRENT_DEFAULTS) <= \
        ours | set(GENERATE_KEYS) | set(GENERATE_ALIASES)
    assert not set(GENERATE_KEYS) & ours, "a GenerateConfig field must not be dropped as rtp-llm's"
    assert set(GENERATE_ALIASES.values()) <= ours


def test_rtp_llm_defaults_are_accepted_as_a_whole():
    GenerateConfig.build(RTP_LLM_CURRENT_DEFAULTS, {"qos_priority": 2, "thinking_mode": False,
                                                    "response_format": {"type": "text"},
                                                    "json_schema": None})
    cfg = GenerateConfig.build(RTP_LLM_DEFAULTS, {})
    assert cfg.max_new_tokens == 32000 and cfg.timeout_ms is None and not cfg.greedy
    assert cfg.skip_special_tokens is False


@pytest.mark.parametrize("key,value,supported", [
    ("num_beams", 4, "num_beams: 1 is"),
    ("num_return_sequences", 2, "num_return_sequences: 0 or 1 is"),
    ("return_hidden_states", True, "return_hidden_states: False is"),
    ("presence_penalty", 0.5, "presence_penalty: 0 or 0.0 is"),
    ("request_format", "chatapi", "request_format: 'raw' is"),
    ("aux_info", False, "aux_info: True is"),
    ("return_prompt_logits", True, "return_prompt_logits: False is"),
    ("combo_token_size", 3, "combo_token_size: 0 is"),
    ("thinking_mode", True, "thinking_mode: None or False is"),
    ("json_schema", {"type": "object"}, "json_schema: None is"),
])
def test_unsupported_values_are_refused_by_key_and_value(make_pipeline, key, value, supported):
    pipe = make_pipeline()
    with pytest.raises(ConfigError, match=f"^{key}: {value!r:.14}.* is not supported; {supported}$"):
        pipe(PROMPT, generate_config={key: value})


def test_a_key_nobody_defines_is_still_refused():
    with pytest.raises(ConfigError, match=r"unknown generate_config key\(s\) \['num_beam'\]"):
        GenerateConfig.build({"num_beam": 1}, {})


def test_do_sample_false_is_greedy(make_pipeline):
    pipe = make_pipeline()
    greedy = run(pipe, PROMPT, max_new_tokens=12).output_ids
    sampled = dict(top_k=50, top_p=0.95, temperature=1.5, max_new_tokens=12)
    assert run(pipe, PROMPT, do_sample=False, **sampled).output_ids == greedy
    seeds = {tuple(run(pipe, PROMPT, random_seed=s, **sampled).output_ids) for s in range(3)}
    assert seeds != {tuple(greedy)}, "with do_sample these settings sample"


def test_gen_length_is_max_new_tokens(make_pipeline):
    pipe = make_pipeline()
    res = list(pipe(PROMPT, generate_config={"gen_length": 7, "top_k": 1, "ignore_eos": True}))[-1]
    assert res.aux_info["output_len"] == 7
    with pytest.raises(ConfigError, match="gen_length: 7 and max_new_tokens: 9 disagree"):
        pipe(PROMPT, generate_config={"gen_length": 7}, max_new_tokens=9)


def test_skip_special_tokens_false_shows_them(llama_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(llama_path))
    ids = tok("hello", add_special_tokens=False).input_ids + [tok.eos_token_id]
    assert TextStream(tok, []).visible(ids, True) == "hello"
    assert TextStream(tok, [], skip_special_tokens=False).visible(ids, True) == "hello</s>"


@pytest.fixture
def warnings_once_more(monkeypatch):
    from rtpkv import env_check

    monkeypatch.setattr(env_check, "_warned", set())


@pytest.mark.parametrize("name,value,warned", [
    ("ENABLE_DEVICE_CACHE", "1", None),
    ("MEMORY_CACHE_SYNC_TIMEOUT_MS", "5000", None),     # one process: nothing to sync
    ("KERNEL_SEQ_SIZE_PER_BLOCK", "0", None),
    ("KERNEL_SEQ_SIZE_PER_BLOCK", "64", None),          # the pool's own block size
    ("MAX_BATCH_TOKENS_SIZE", "0", None),               # rtp-llm's "automatic"
    ("ENABLE_TIERED_MEMORY_CACHE", "0", None),
    ("ENABLE_TIERED_MEMORY_CACHE", "1", "free-block threshold mode is not implemented"),
    ("DEVICE_CACHE_MIN_FREE_BLOCKS", "0", None),
    ("DEVICE_CACHE_MIN_FREE_BLOCKS", "8", "free-block threshold"),
    ("ENABLE_3FS", "0", None),
    ("ENABLE_3FS", "1", "no 3FS tier"),
    ("THREEFS_READ_TIMEOUT_MS", "1000", "no 3FS tier"),
    ("RECO_SERVER_ADDRESS", "10.0.0.1:80", "remote tier is Redis"),
    ("RESERVE_BLOCK_RATIO", "5", "not a share of the pool"),
    ("PDFUSION_SCHEDULER_MODE", "", None),
    ("PDFUSION_SCHEDULER_MODE", "ratio", "ratio scheduler is not implemented"),
])
def test_rtp_llm_variables_are_accepted_or_warned_by_name(monkeypatch, caplog, warnings_once_more,
                                                          name, value, warned):
    monkeypatch.setenv(name, value)
    with caplog.at_level(logging.WARNING, logger="rtpkv"):
        Settings.from_env()
    lines = [r.getMessage() for r in caplog.records if "environment:" in r.getMessage()]
    if warned is None:
        assert lines == []
    else:
        assert len(lines) == 1 and lines[0].startswith(
            f"environment: {name} is an rtp-llm variable that has no effect in rtpkv: ")
        assert warned in lines[0]


@pytest.mark.parametrize("env,match", [
    ({"ENABLE_DEVICE_CACHE": "0"}, r"ENABLE_DEVICE_CACHE='0' is invalid: rtpkv always reuses "
                                   r"blocks from the device pool.*accepted: 1 \(or unset\)"),
    ({"ENABLE_DEVICE_CACHE": "maybe"}, r"ENABLE_DEVICE_CACHE='maybe' is invalid: accepted values"),
    ({"KERNEL_SEQ_SIZE_PER_BLOCK": "16"}, r"KERNEL_SEQ_SIZE_PER_BLOCK='16' is invalid: .*"
                                          r"accepted: 0 or SEQ_SIZE_PER_BLOCK"),
    ({"BLOCKWISE_USE_FP8_KV_CACHE": "1"}, r"BLOCKWISE_USE_FP8_KV_CACHE='1' is invalid: an fp8"),
    ({"MAX_BATCH_TOKENS_SIZE": "lots"}, r"MAX_BATCH_TOKENS_SIZE='lots' is invalid"),
    ({"MAX_BATCH_TOKENS_SIZE": "4096", "MAX_NUM_BATCHED_TOKENS": "1024"},
     r"MAX_BATCH_TOKENS_SIZE='4096' and MAX_NUM_BATCHED_TOKENS='1024' disagree"),
])
def test_rtp_llm_variables_asking_for_what_rtpkv_lacks_are_refused(monkeypatch, env, match):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=match):
        Settings.from_env()


def test_max_batch_tokens_size_is_max_num_batched_tokens(monkeypatch):
    monkeypatch.setenv("MAX_BATCH_TOKENS_SIZE", "4096")
    assert Settings.from_env().max_num_batched_tokens == 4096
    monkeypatch.setenv("MAX_NUM_BATCHED_TOKENS", "4096")   # agreeing: fine
    assert Settings.from_env().max_num_batched_tokens == 4096
    monkeypatch.setenv("MAX_BATCH_TOKENS_SIZE", "0")
    monkeypatch.setenv("MAX_NUM_BATCHED_TOKENS", "1024")
    assert Settings.from_env().max_num_batched_tokens == 1024
