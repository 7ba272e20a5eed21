"""Retention priorities and KV cache events through the Pipeline: TensorRT-LLM's
kv_cache_retention_config as an object or a dict, what it keeps, and what it never changes."""

import pytest
import torch

from conftest import run
from rtpkv.cache import KvCacheRetentionConfig, TokenRangeRetentionConfig
from rtpkv.errors import ConfigError

SYSTEM = list(range(400, 440))   # 10 blocks of 4
HIGH = {"token_range_retention_configs": [{"token_start": 0, "token_end": 40, "priority": 90}],
        "decode_retention_priority": 10}


def _flood(pipe, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        run(pipe, torch.randint(3, 1000, (30,), generator=g).tolist(), max_new_tokens=2)


@pytest.mark.parametrize("retention", [HIGH, KvCacheRetentionConfig(
    token_range_retention_configs=[KvCacheRetentionConfig.TokenRangeRetentionConfig(0, 40, 90, None)],
    decode_retention_priority=10)])
def test_a_high_priority_prefix_survives_a_flood_and_reuse_stays_exact(make_pipeline, retention):
    pipe = make_pipeline(reuse_cache=True, seq_size_per_block=4, kv_cache_max_tokens=128)
    plain = make_pipeline(seq_size_per_block=4)
    first = run(pipe, SYSTEM + [5, 6], max_new_tokens=4, kv_cache_retention_config=retention)
    assert pipe.cache_stats()["blocks_cached_by_priority"][90] == 10
    _flood(pipe, 12)  # 12 x 8 blocks through a 32-block pool
    stats = pipe.cache_stats()
    assert stats["evictions"] > 32 and 90 not in stats["evictions_by_priority"]
    again = run(pipe, SYSTEM + [7, 8], max_new_tokens=4, return_logits=True,
                kv_cache_retention_config=retention)
    assert again.aux_info["reuse_len"] == 40
    alone = run(plain, SYSTEM + [7, 8], max_new_tokens=4, return_logits=True)
    assert again.output_ids == alone.output_ids
    torch.testing.assert_close(again.logits, alone.logits, atol=1e-4, rtol=0)
    assert first.finished


def test_without_a_priority_the_same_flood_evicts_the_prefix(make_pipeline):
    pipe = make_pipeline(reuse_cache=True, seq_size_per_block=4, kv_cache_max_tokens=128)
    run(pipe, SYSTEM + [5, 6], max_new_tokens=4)
    _flood(pipe, 12)
    assert run(pipe, SYSTEM + [7, 8], max_new_tokens=4).aux_info["reuse_len"] < 40


def test_a_request_without_a_config_neither_drops_nor_extends_a_hold(make_pipeline):
    """The last release decides, among requests that give a retention config; one that gives
    none (most of them) leaves a hold that has not run out as it is, for what is left of it."""
    pipe = make_pipeline(reuse_cache=True, seq_size_per_block=4, kv_cache_max_tokens=128)
    now = [0.0]
    pipe.engine.cache.pool.clock = lambda: now[0]
    held = {"token_range_retention_configs": [{"token_start": 0, "token_end": 40,
                                               "priority": 90, "duration_ms": 100_000}]}
    run(pipe, SYSTEM + [5, 6], max_new_tokens=2, kv_cache_retention_config=held)
    now[0] = 60.0
    assert run(pipe, SYSTEM + [9], max_new_tokens=2).aux_info["reuse_len"] == 40
    assert pipe.cache_stats()["blocks_cached_by_priority"][90] == 10   # not dropped
    now[0] = 101.0
    assert 90 not in pipe.cache_stats()["blocks_cached_by_priority"]   # nor extended
    run(pipe, SYSTEM + [5, 6], max_new_tokens=2, kv_cache_retention_config=held)
    low = {"token_range_retention_configs": [{"token_start": 0, "priority": 20}]}
    run(pipe, SYSTEM + [9], max_new_tokens=2, kv_cache_retention_config=low)
    assert pipe.cache_stats()["blocks_cached_by_priority"][20] >= 10   # a config decides


def test_token_positions_count_the_task_prompt(make_pipeline):
    tasks = [{"task_id": "t", "prompt": " ".join(["hello"] * 12)}]
    pipe = make_pipeline(reuse_cache=True, seq_size_per_block=4, tasks=tasks)
    prefix = len(pipe.tasks.get("t").token_ids)
    own = list(range(500, 512))
    start = (prefix + 3) // 4 * 4   # the first block after the task prompt's blocks
    retention = {"token_range_retention_configs": [
        {"token_start": start, "token_end": start + 8, "priority": 77}]}
    run(pipe, own, task_id="t", max_new_tokens=1, kv_cache_retention_config=retention)
    assert pipe.cache_stats()["blocks_cached_by_priority"].get(77) == 2


@pytest.mark.parametrize("bad,match", [
    ({"token_range_retention_configs": [{"token_start": 8, "token_end": 4}]}, "token_end"),
    ({"token_range_retention_configs": [{"token_start": 0, "token_end": 8},
                                        {"token_start": 4, "token_end": 12}]}, "must not overlap"),
    ({"token_range_retention_configs": [{"token_start": 0}, {"token_start": 8}]}, "open-ended"),
    ({"token_range_retention_configs": [{"token_start": 0, "priority": 101}]}, "priority"),
    ({"decode_retention_priority": -1}, "decode_retention_priority"),
    ({"decode_duration_ms": 0}, "decode_duration_ms"),
    ({"token_range_retention_configs": [{"token_start": 0, "prio": 5}]}, "prio"),
])
def test_a_bad_retention_config_is_refused_naming_the_field(make_pipeline, bad, match):
    pipe = make_pipeline(reuse_cache=True, seq_size_per_block=4)
    with pytest.raises(ConfigError, match=f"kv_cache_retention_config.*{match}"):
        pipe([5, 6, 7], kv_cache_retention_config=bad)
    assert run(pipe, [5, 6, 7], max_new_tokens=1).finished


def test_with_reuse_off_a_retention_config_is_accepted_and_said_once(make_pipeline, caplog):
    pipe = make_pipeline(seq_size_per_block=4)
    with caplog.at_level("INFO", logger="rtpkv"):
        for _ in range(3):
            assert run(pipe, SYSTEM, max_new_tokens=1, kv_cache_retention_config=HIGH).finished
    assert caplog.text.count("kv_cache_retention_config has no effect") == 1
    assert pipe.cache_stats()["blocks_cached"] == 0


def test_kv_cache_events_replay_into_what_the_replica_holds(make_pipeline):
    pipe = make_pipeline(reuse_cache=True, seq_size_per_block=4, kv_cache_max_tokens=128,
                         kv_cache_event_buffer_max_size=100_000)
    run(pipe, SYSTEM + [5, 6], max_new_tokens=4, kv_cache_retention_config=HIGH)
    _flood(pipe, 10, seed=3)
    run(pipe, SYSTEM + [9], max_new_tokens=2,   # last writer: the prefix drops back to 35
        kv_cache_retention_config={"token_range_retention_configs": [{"token_start": 0}]})
    held: dict[str, int] = {}
    last_id = 0
    for event in pipe.kv_cache_events(timeout=1.0):
        assert event["event_id"] > last_id
        last_id = event["event_id"]
        if event["type"] == "stored":
            assert event["tier"] == "device" and len(event["token_ids"][0]) == 4
            held.update(dict.fromkeys(event["block_hashes"], event["priority"]))
        elif event["type"] == "removed":
            for key in event["block_hashes"]:
                held.pop(key)
        else:
            held[event["block_hash"]] = event["priority"]
    with pipe.engine.lock:
        cache = pipe.engine.cache
        indexed = {key.hex(): cache.pool.blocks[b].priority for key, b in cache.index.items()}
    assert pipe.cache_stats()["evictions"] > 0 and held == indexed
    assert set(indexed.values()) >= {35}
    assert pipe.kv_cache_events() == []


def test_events_are_off_by_default(make_pipeline):
    pipe = make_pipeline(reuse_cache=True, seq_size_per_block=4)
    run(pipe, SYSTEM, max_new_tokens=2)
    assert pipe.kv_cache_events(timeout=0.01) == []


def test_event_buffer_size_is_validated_by_name(monkeypatch, llama_path):
    from conftest import load
    monkeypatch.setenv("KV_CACHE_EVENT_BUFFER_MAX_SIZE", "-1")
    with pytest.raises(ConfigError, match="KV_CACHE_EVENT_BUFFER_MAX_SIZE='-1'"):
        load(llama_path)


def test_token_range_is_positional_like_tensorrt_llm():
    r = TokenRangeRetentionConfig(0, 4, 100, None)
    assert (r.token_start, r.token_end, r.priority, r.duration_ms) == (0, 4, 100, None)
