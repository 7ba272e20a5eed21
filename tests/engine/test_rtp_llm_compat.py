"""rtp-llm's generate_config keys: all accepted, mapped where rtpkv implements them, refused by
key and value where a value asks for a feature rtpkv lacks."""

import pytest

from conftest import run
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


def test_every_rtp_llm_key_is_known():
    ours = set(GenerateConfig.model_fields)
    assert set(RTP_LLM_DEFAULTS) <= ours | set(GENERATE_KEYS) | set(GENERATE_ALIASES)
    assert not set(GENERATE_KEYS) & ours, "a GenerateConfig field must not be dropped as rtp-llm's"
    assert set(GENERATE_ALIASES.values()) <= ours


def test_rtp_llm_defaults_are_accepted_as_a_whole():
    cfg = GenerateConfig.build(RTP_LLM_DEFAULTS, {})
    assert cfg.max_new_tokens == 32000 and cfg.timeout_ms is None and not cfg.greedy
    assert cfg.skip_special_tokens is False


@pytest.mark.parametrize("key,value,supported", [
    ("num_beams", 4, "num_beams: 1 is"),
    ("num_return_sequences", 2, "num_return_sequences: 0 or 1 is"),
    ("return_hidden_states", True, "return_hidden_states: False is"),
    ("presence_penalty", 0.5, "presence_penalty: 0 or 0.0 is"),
    ("request_format", "chatapi", "request_format: 'raw' is"),
])
def test_unsupported_values_are_refused_by_key_and_value(make_pipeline, key, value, supported):
    pipe = make_pipeline()
    with pytest.raises(ConfigError, match=f"^{key}: {value!r} is not supported; {supported}$"):
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
