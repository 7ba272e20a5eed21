"""The cache core's second cut through running pipelines (issue 20): the crash of a block onboarded
over a stale holder of its key, tenants apart on the device and in every tier (task prompts
included), one lookup per request and tier, a read-only `cache_stats`, an admission failure that
fails one request, and fingerprints that tell two checkpoints apart by one weight.

Every pipeline is integrity-checked by the make_pipeline fixture; answers are compared with a
pipeline without reuse."""

from __future__ import annotations

import json
import shutil
import struct
import time
from pathlib import Path

import pytest
import torch
from conftest import load, run

from rtpkv.cache.tiers.host import HostTier

B = 4
A_IDS = list(range(10, 32))            # 22 tokens: 5 full blocks are reusable
FLOOD = list(range(300, 322))          # as long as A: evicts all of A from a 6-block pool
SMALL = dict(reuse_cache=True, seq_size_per_block=B, kv_cache_max_tokens=24)   # 6 blocks
HOST = 1 << 20
TIERS = ["device", "memory", "disk", "remote"]


@pytest.fixture
def tier_options(request, tmp_path):
    """Options of a pipeline whose reuse of A after a flood comes from the named place."""

    def options(name: str, **extra):
        if name == "device":
            base = dict(reuse_cache=True, seq_size_per_block=B, kv_cache_max_tokens=512)
        elif name == "memory":
            base = dict(SMALL, host_cache_size=HOST)
        elif name == "disk":
            base = dict(SMALL, enable_memory_cache_disk=True, write_cache_sync=True,
                        memory_cache_disk_paths=str(tmp_path / "disk"))
        else:
            base = dict(SMALL, enable_remote_cache=True,
                        remote_cache_url=request.getfixturevalue("redis_url"))
        return {**base, **extra}

    return options


def flush_writes(pipe) -> None:
    """Wait for queued Redis writes, so a later request can find them."""
    for tier in pipe.engine.cache.ladder.tiers:
        if tier.name == "remote":
            assert tier.flush(10.0)


def served(pipe, ids, **cfg):
    res = run(pipe, ids, max_new_tokens=2, return_logits=True, **cfg)
    flush_writes(pipe)
    run(pipe, FLOOD, max_new_tokens=2)
    flush_writes(pipe)
    return res


@pytest.mark.parametrize("where", TIERS)
def test_an_unsalted_prompt_is_not_reused_by_a_salted_one(make_pipeline, tier_options, where):
    pipe = make_pipeline(**tier_options(where))
    plain = make_pipeline(seq_size_per_block=B)
    served(pipe, A_IDS)
    salted = served(pipe, A_IDS, cache_salt="tenant-b")
    assert salted.aux_info["reuse_len"] == 0
    again = served(pipe, A_IDS, cache_salt="tenant-b")
    assert again.aux_info["reuse_len"] == 20         # the control: the salted blocks are found
    if where != "device":
        assert again.aux_info[f"{where}_reuse_len"] == 20
    ref = run(plain, A_IDS, max_new_tokens=2, return_logits=True)
    for res in (salted, again):
        assert res.output_ids == ref.output_ids
        torch.testing.assert_close(res.logits, ref.logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("where", TIERS)
def test_two_salts_after_one_task_prompt_share_only_the_task(make_pipeline, tier_options, where):
    task = list(range(40, 48))                        # 2 blocks, pinned
    options = tier_options(where) if where == "device" else tier_options(where, kv_cache_max_tokens=48)
    pipe = make_pipeline(**options)
    pipe.add_task("sys", task)
    text = list(range(500, 513))                      # the task, then 3 full blocks of text
    flood = list(range(600, 638))                     # evicts every unpinned block
    first = run(pipe, text, task_id="sys", cache_salt="a", max_new_tokens=2)
    flush_writes(pipe)
    run(pipe, flood, max_new_tokens=2)
    other = run(pipe, text, task_id="sys", cache_salt="b", max_new_tokens=2)
    flush_writes(pipe)
    run(pipe, flood, max_new_tokens=2)
    again = run(pipe, text, task_id="sys", cache_salt="a", max_new_tokens=2)
    assert first.aux_info["reuse_len"] == 8 == other.aux_info["reuse_len"]   # the task only
    assert again.aux_info["reuse_len"] == 20                                 # its own text too
    assert first.output_ids == other.output_ids == again.output_ids


def test_a_block_onboarded_over_a_stale_holder_of_its_key(make_pipeline, tmp_path):
    """Issue 20's crash, as a multi-turn user gets there: the first block of A at priority 10,
    the rest at 80; a flood evicts only A's first block; A again onboards from disk over the
    stale second block; then a request that needs the whole pool."""
    options = dict(reuse_cache=True, seq_size_per_block=B, kv_cache_max_tokens=32,
                   enable_memory_cache_disk=True, write_cache_sync=True,
                   memory_cache_disk_paths=str(tmp_path))
    pipe = make_pipeline(**options)
    plain = make_pipeline(seq_size_per_block=B, kv_cache_max_tokens=32)
    retention = {"token_range_retention_configs": [
        {"token_start": 0, "token_end": 4, "priority": 10},
        {"token_start": 4, "priority": 80}], "decode_retention_priority": 80}
    a = list(range(10, 19))                                    # 2 full blocks + 1 token
    first = run(pipe, a, max_new_tokens=1, kv_cache_retention_config=retention)
    run(pipe, list(range(300, 325)), max_new_tokens=1)         # 7 blocks: evicts A's first
    assert pipe.cache_stats()["evictions_by_priority"] == {10: 1}
    again = run(pipe, a, max_new_tokens=1)
    assert again.aux_info["disk_reuse_len"] == 8 and again.output_ids == first.output_ids
    pipe.check_integrity()
    whole = list(range(700, 730))                              # 31 tokens: all 8 blocks
    assert run(pipe, whole, max_new_tokens=1).output_ids == run(plain, whole, max_new_tokens=1).output_ids
    pipe.check_integrity()
    assert run(pipe, a, max_new_tokens=1).output_ids == first.output_ids


@pytest.mark.parametrize("with_redis", [False, True])
def test_each_tier_is_asked_once_per_request(make_pipeline, tmp_path, request, with_redis):
    options = dict(SMALL, host_cache_size=HOST, enable_memory_cache_disk=True,
                   write_cache_sync=True, memory_cache_disk_paths=str(tmp_path))
    if with_redis:
        options.update(enable_remote_cache=True, remote_cache_url=request.getfixturevalue("redis_url"))
    pipe = make_pipeline(**options)
    prompts = [A_IDS, FLOOD, A_IDS, list(range(900, 922)), A_IDS]
    for ids in prompts:
        run(pipe, ids, max_new_tokens=2)
        flush_writes(pipe)
    stats = pipe.cache_stats()
    names = ["memory", "disk"] + (["remote"] if with_redis else [])
    asked = {name: stats[f"{name}_lookups"] for name in names}
    # A's third request finds its whole chain in host memory: the tiers below are not asked
    assert asked["memory"] == 5
    assert all(0 < n <= 5 for n in asked.values())
    assert stats["memory_lookup_blocks"] <= 5 * 5, "a chain was looked up twice"


def test_cache_stats_change_nothing(make_pipeline):
    pipe = make_pipeline(reuse_cache=True, seq_size_per_block=B, kv_cache_max_tokens=64,
                         kv_cache_event_buffer_max_size=1000)
    brief = {"token_range_retention_configs": [{"token_start": 0, "priority": 90,
                                                "duration_ms": 1}]}
    run(pipe, A_IDS, max_new_tokens=2, kv_cache_retention_config=brief)
    time.sleep(0.01)                                    # every duration ran out
    events = pipe.kv_cache_events()
    with pipe.engine.lock:
        blocks = pipe.engine.cache.pool.blocks
        before = [(b.priority, b.duration_s) for b in blocks]
    stats = [pipe.cache_stats() for _ in range(100)]
    assert pipe.kv_cache_events() == [] and events
    with pipe.engine.lock:
        assert [(b.priority, b.duration_s) for b in blocks] == before
    assert stats[0]["blocks_cached_by_priority"] == {35: 5}
    assert all(s == stats[0] for s in stats)


def test_an_admission_failure_fails_that_request_alone(make_pipeline, monkeypatch):
    class Broken(RuntimeError):
        pass

    pipe = make_pipeline(**SMALL, host_cache_size=HOST)
    run(pipe, A_IDS, max_new_tokens=2)
    run(pipe, FLOOD, max_new_tokens=2)                  # A now in host memory only
    tier = next(t for t in pipe.engine.cache.ladder.tiers if isinstance(t, HostTier))

    def broken(meta):
        raise Broken("host tier bug")

    monkeypatch.setattr(tier, "load", broken)
    start = time.monotonic()
    with pytest.raises(Broken, match="host tier bug"):
        run(pipe, A_IDS, max_new_tokens=2, timeout_ms=60_000)
    assert time.monotonic() - start < 10
    monkeypatch.undo()
    assert run(pipe, list(range(800, 810)), max_new_tokens=2).finished
    stats = pipe.cache_stats()
    assert stats["blocks_in_use"] == 0 and stats["requests_running"] == 0
    assert stats["requests_waiting"] == 0


def _one_weight_changed(src: Path, dst: Path) -> Path:
    """A copy of the checkpoint with one float32 weight changed in its last bit, in the middle of
    the file, between the places a sampling digest would read."""
    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    data = bytearray(path.read_bytes())
    header = struct.unpack("<Q", data[:8])[0]
    base = 8 + header
    json.loads(data[8:base])
    offset = base + ((len(data) * 7 // 17 + 65536 + 100 - base) // 4) * 4
    data[offset] ^= 1
    path.write_bytes(bytes(data))
    return dst


@pytest.mark.parametrize("where", ["disk", "remote"])
def test_checkpoints_differing_in_one_weight_share_no_block(checkpoints, tmp_path, request, where):
    original = checkpoints("llama")
    changed = _one_weight_changed(original, tmp_path / "changed")
    options = dict(reuse_cache=True, seq_size_per_block=B, kv_cache_max_tokens=256)
    if where == "disk":
        options.update(enable_memory_cache_disk=True, write_cache_sync=True,
                       memory_cache_disk_paths=str(tmp_path / "disk"))
    else:
        options.update(enable_remote_cache=True, remote_cache_url=request.getfixturevalue("redis_url"))
    from rtpkv.pipeline import Pipeline

    models = [load(path, **options) for path in (original, changed)]
    assert models[0].fingerprint != models[1].fingerprint
    results = []
    for model in models:
        with Pipeline(model, model.tokenizer) as pipe:
            results.append(run(pipe, A_IDS, max_new_tokens=2))
            flush_writes(pipe)
            pipe.check_integrity()
    assert results[1].aux_info["reuse_len"] == 0
    assert results[1].aux_info[f"{where}_reuse_len"] == 0


@pytest.mark.parametrize("where", ["memory", "disk", "remote"])
def test_a_third_request_after_an_onboard_is_served_from_the_device(make_pipeline, tier_options,
                                                                   where):
    pipe = make_pipeline(**tier_options(where))
    first = served(pipe, A_IDS)
    onboarded = run(pipe, A_IDS, max_new_tokens=2, return_logits=True)
    third = run(pipe, A_IDS, max_new_tokens=2, return_logits=True)
    assert onboarded.aux_info[f"{where}_reuse_len"] == 20
    assert third.aux_info["local_reuse_len"] == 20, "the onboarded chain lost its lineage"
    for res in (onboarded, third):
        assert res.output_ids == first.output_ids
        torch.testing.assert_close(res.logits, first.logits, atol=1e-4, rtol=0)
