"""Options: one declaration per option, layered defaults < environment < ModelConfig <
keywords, and one error formatter naming the variable, the value and the accepted range."""

import logging

import pytest

from rtpkv.config import (CapacitySchedulerPolicy, RuntimeConfig, Settings, env_var_names,
                          resolve)
from rtpkv.errors import ConfigError
from rtpkv.generate_config import GenerateConfig
from rtpkv.model_factory import ModelConfig

# A valid non-default value for every option: a new option without an entry here fails
# test_every_option_is_read_from_its_environment_variable, so it cannot skip the environment.
NON_DEFAULT = {
    "dtype": ("bfloat16", "bfloat16"),
    "device": ("cpu", "cpu"),
    "max_seq_len": ("128", 128),
    "max_attention_window": ("64", 64),
    "seq_size_per_block": ("16", 16),
    "kv_cache_mem_mb": ("12.5", 12.5),
    "kv_cache_max_tokens": ("4096", 4096),
    "kv_cache_free_gpu_mem_fraction": ("0.5", 0.5),
    "kv_cache_event_buffer_max_size": ("1000", 1000),
    "reuse_cache": ("on", True),
    "enable_partial_reuse": ("1", True),
    "kv_cache_ghost_blocks": ("100", 100),
    "cache_salt_quota_blocks": ("64", 64),
    "linear_step": ("4", 4),
    "cache_salt_quotas": ('{"tenant-a": 8, "": 100}', {"tenant-a": 8, "": 100}),
    "multi_task_prompt": ("/tmp/tasks.json", "/tmp/tasks.json"),
    "multi_task_prompt_str": ("[]", "[]"),
    "capacity_scheduler_policy": ("max_utilization", CapacitySchedulerPolicy.MAX_UTILIZATION),
    "context_chunking_policy": ("EQUAL_PROGRESS", "EQUAL_PROGRESS"),
    "max_num_batched_tokens": ("512", 512),
    "num_scheduler_steps": ("8", 8),
    "concurrency_limit": ("4", 4),
    "schedule_policy": ("LPM", "lpm"),
    "enable_memory_cache": ("1", True),
    "memory_cache_size_mb": ("64", 64.0),
    "host_cache_size": ("1048576", 1048576),
    "secondary_offload_min_priority": ("50", 50),
    "enable_memory_cache_disk": ("true", True),
    "memory_cache_disk_paths": ("/tmp/kv", "/tmp/kv"),
    "memory_cache_disk_size_mb": ("100", 100.0),
    "write_cache_sync": ("1", True),
    "kv_connector_module": ("my.module", "my.module"),
    "kv_connector_class": ("MyConnector", "MyConnector"),
    "kv_connector": ("my.module.MyConnector", "my.module.MyConnector"),
    "enable_remote_cache": ("1", True),
    "remote_cache_url": ("redis://127.0.0.1:6380/1", "redis://127.0.0.1:6380/1"),
    "remote_cache_password": ("pw", "pw"),
    "remote_cache_ttl_s": ("3600", 3600),
    "remote_cache_timeout_ms": ("50", 50),
    "rtpkv_attention": ("torch", "torch"),
    "rtpkv_linear": ("native", "native"),
    "rtpkv_isa": ("avx2", "avx2"),
    "enforce_eager": ("1", True),
    "rtpkv_malloc_trim_s": ("2.5", 2.5),
    "weight_type": ("W8A8_INT8", "w8a8_int8"),
    "int8_mode": ("1", True),
    "kv_cache_dtype": ("INT8", "int8"),
    "int8_kv_cache": ("on", True),
    "kv_events_endpoint": ("tcp://*:5557", "tcp://*:5557"),
    "kv_events_replay_endpoint": ("tcp://127.0.0.1:5558", "tcp://127.0.0.1:5558"),
    "kv_events_topic": ("kv@", "kv@"),
    "kv_events_buffer_steps": ("500", 500),
    "kv_events_layout": ("Array", "array"),
    "kv_events_mediums": ("STORAGE", "storage"),
}


def test_every_option_is_read_from_its_environment_variable(monkeypatch):
    assert sorted(NON_DEFAULT) == sorted(RuntimeConfig.model_fields)
    assert env_var_names() == [name.upper() for name in RuntimeConfig.model_fields]
    for name, (raw, _) in NON_DEFAULT.items():
        monkeypatch.setenv(name.upper(), raw)
    config = resolve(Settings.from_env())
    for name, (_, expected) in NON_DEFAULT.items():
        assert getattr(config, name) == expected, name
        assert getattr(config, name) != RuntimeConfig.model_fields[name].default, name


def test_layers_win_in_order_and_only_for_what_they_were_given(monkeypatch):
    monkeypatch.setenv("SEQ_SIZE_PER_BLOCK", "16")
    monkeypatch.setenv("CONCURRENCY_LIMIT", "8")
    config = resolve(Settings.from_env(), ModelConfig(seq_size_per_block=4, max_seq_len=None))
    assert (config.seq_size_per_block, config.concurrency_limit, config.max_seq_len) == (4, 8, 0)
    assert config.max_num_batched_tokens == 2048  # the declared default
    final = config.replace(concurrency_limit=2, kv_cache_mem_mb=None)
    assert (final.seq_size_per_block, final.concurrency_limit, final.kv_cache_mem_mb) == (4, 2, None)
    assert config.concurrency_limit == 8, "replace returns a copy"


def test_unknown_option_is_refused_with_the_accepted_ones():
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['reuse'\]; accepted: .*'reuse_cache'"):
        RuntimeConfig().replace(reuse=True)


@pytest.mark.parametrize("build,match", [
    (lambda: ModelConfig(seq_size_per_block=48),
     r"^seq_size_per_block=48 is invalid: must be a power of two from 1 to 1024$"),
    (lambda: RuntimeConfig().replace(concurrency_limit=0),
     r"^concurrency_limit=0 is invalid: Input should be greater than or equal to 1$"),
    (lambda: GenerateConfig.build({"top_p": 1.5}, {}),
     r"^generate_config\['top_p'\]=1.5 is invalid: Input should be less than or equal to 1$"),
])
def test_one_formatter_names_field_value_and_range(build, match):
    with pytest.raises(ConfigError, match=match):
        build()


def test_environment_errors_quote_the_variable_as_written(monkeypatch):
    monkeypatch.setenv("MAX_NUM_BATCHED_TOKENS", "0")
    monkeypatch.setenv("DEVICE", "tpu")
    with pytest.raises(ConfigError) as info:
        Settings.from_env()
    assert "MAX_NUM_BATCHED_TOKENS='0' is invalid: Input should be greater than or equal to 1" in str(info.value)
    assert "DEVICE='tpu' is invalid" in str(info.value)


def test_kernel_choices_are_options_too(monkeypatch):
    monkeypatch.setenv("RTPKV_ATTENTION", "flash")
    with pytest.raises(ConfigError, match=r"RTPKV_ATTENTION='flash' is invalid: .*cpu-paged\|flash-attn\|torch"):
        Settings.from_env()
    assert ModelConfig(rtpkv_linear="native").rtpkv_linear == "native"


def test_model_config_accepts_rtp_llm_fields_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="rtpkv"):
        config = ModelConfig(ckpt_path="/models/x", act_type="FP16", seq_size_per_block=8)
    assert "'act_type', 'ckpt_path'" in caplog.text and "no effect" in caplog.text
    assert config.given() == {"seq_size_per_block": 8}


def test_model_config_typo_lists_the_accepted_fields():
    with pytest.raises(ConfigError, match=r"unknown ModelConfig field\(s\) \['seq_size_per_blok'\]; "
                                          r"accepted: \[.*'seq_size_per_block'.*'tasks'"):
        ModelConfig(seq_size_per_blok=8)


def test_model_config_assignment_is_validated_and_counts_as_given():
    config = ModelConfig()
    config.reuse_cache = "on"
    assert config.given() == {"reuse_cache": True}
    with pytest.raises(ValueError, match="dtype"):
        config.dtype = "float8"


def test_rtp_llm_variables_without_effect_and_near_misses_are_warned(monkeypatch, caplog):
    from rtpkv import env_check

    monkeypatch.setattr(env_check, "_warned", set())
    for name, value in {"TP_SIZE": "2", "TOKENIZER_PATH": "/t", "REUSE_CAHCE": "1",
                        "SEQ_SIZE_PER_BLOK": "16", "HOSTNAME": "box"}.items():
        monkeypatch.setenv(name, value)
    with caplog.at_level(logging.WARNING, logger="rtpkv"):
        Settings.from_env()
        Settings.from_env()                       # once per process, not per read
    lines = [r.getMessage() for r in caplog.records if "environment:" in r.getMessage()]
    assert len(lines) == 4, lines
    text = "\n".join(lines)
    assert "TP_SIZE is an rtp-llm variable that has no effect in rtpkv" in text
    assert "TOKENIZER_PATH is an rtp-llm variable" in text
    assert "REUSE_CAHCE is not an rtpkv variable and has no effect; did you mean REUSE_CACHE?" in text
    assert "did you mean SEQ_SIZE_PER_BLOCK?" in text and "HOSTNAME" not in text


@pytest.mark.parametrize("name,value,match", [
    ("INT8_KV_CACHE", "2", r"INT8_KV_CACHE='2' is invalid: accepted values are 1/0, true/false"),
    ("KV_CACHE_DTYPE", "fp8", r"KV_CACHE_DTYPE='fp8' is invalid: accepted values are auto, int8"),
    ("FP8_KV_CACHE", "1", r"FP8_KV_CACHE='1' is invalid: an fp8 \(e4m3\) KV cache is not "
                          r"implemented.*INT8_KV_CACHE=1.*accepted: 0 \(or unset\)"),
    ("FP8_KV_CACHE", "yes", r"FP8_KV_CACHE='yes' is invalid: accepted values are 1/0"),
])
def test_kv_cache_dtype_switches_refuse_bad_values_by_name(monkeypatch, name, value, match):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=match):
        Settings.from_env()


def test_int8_kv_cache_switches_and_fp8_off_are_accepted(monkeypatch, caplog):
    monkeypatch.setenv("FP8_KV_CACHE", "0")
    monkeypatch.setenv("INT8_KV_CACHE", "1")
    with caplog.at_level(logging.WARNING, logger="rtpkv"):
        assert resolve(Settings.from_env()).int8_kv
    assert "no effect" not in caplog.text
    assert ModelConfig(kv_cache_dtype="Int8").int8_kv and not ModelConfig().int8_kv
