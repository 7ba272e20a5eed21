"""The Redis tier in running pipelines (issue 11): replicas share blocks through one real
redis-server; a server that fails, hangs or holds bad records never changes an answer.

Every answer is compared with transformers (or a pipeline without reuse) on the same weights;
every pipeline is integrity-checked (the tier included) by the make_pipeline fixture."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import redis
import torch
from conftest import hf_reference, run
from redis_server import SilentServer, free_port

from rtpkv.cache.tiers.base import BlockMeta
from rtpkv.cache.tiers.record import decode_record, encode_record

B = 4
A_IDS = list(range(10, 32))          # 22 tokens: 5 full blocks reusable (the last token never)
REMOTE_REUSE = 20


def assert_same(res, tokens: list[int], logits: torch.Tensor) -> None:
    assert res.output_ids == tokens
    torch.testing.assert_close(res.logits, logits, atol=1e-4, rtol=0)


def remote(url: str, **extra):
    return dict(reuse_cache=True, seq_size_per_block=B, kv_cache_max_tokens=256,
                enable_remote_cache=True, remote_cache_url=url, **extra)


def flushed(pipe) -> None:
    """Wait for the pipeline's queued Redis writes (they are asynchronous)."""
    assert _tier(pipe).flush(10.0)


def _tier(pipe):
    return next(t for t in pipe.engine.cache.ladder.tiers if t.name == "remote")


# ---------------------------------------------------------------------------- sharing
RUNNER = textwrap.dedent("""
    import json, sys
    import torch
    from rtpkv.model_factory import ModelConfig, ModelFactory
    from rtpkv.pipeline import Pipeline
    torch.set_num_threads(1)
    path, url, requests = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    model = ModelFactory.from_huggingface(path, ModelConfig(
        reuse_cache=True, seq_size_per_block=4, kv_cache_max_tokens=256,
        enable_remote_cache=True, remote_cache_url=url), show_progress=False)
    results = []
    with Pipeline(model, model.tokenizer) as pipe:
        for prompt, salt in requests:
            for res in pipe(prompt, top_k=1, ignore_eos=True, max_new_tokens=6,
                            return_logits=True, cache_salt=salt):
                pass
            results.append({"ids": res.output_ids, "logits": res.logits.tolist(),
                            "aux": res.aux_info})
        pipe.check_integrity()
    stats = pipe.cache_stats()   # after stop, which waits for the queued stores (async writer)
    print(json.dumps({"results": results, "stats": {k: v for k, v in stats.items()
                                                    if k.startswith("remote")}}))
""")


def test_two_processes_share_blocks_through_one_redis(tmp_path, llama_path, redis_url, hf):
    script = tmp_path / "runner.py"
    script.write_text(RUNNER)
    prompt = list(range(300, 341))                  # 41 tokens: 10 full blocks reusable

    def process(requests) -> dict:
        out = subprocess.run([sys.executable, str(script), str(llama_path), redis_url,
                              json.dumps(requests)], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    first = process([[prompt, "tenant-a"]])
    second = process([[prompt, "tenant-a"], [prompt, "tenant-b"]])
    assert first["results"][0]["aux"]["remote_reuse_len"] == 0
    assert first["stats"]["remote_stores"] >= 10 and first["stats"]["remote_dropped"] == 0
    shared, other_tenant = second["results"]
    assert shared["aux"]["remote_reuse_len"] == 40 == shared["aux"]["reuse_len"]
    assert other_tenant["aux"]["remote_reuse_len"] == 0 == other_tenant["aux"]["reuse_len"]
    assert second["stats"]["remote_hits"] == 10 and second["stats"]["remote_up"] is True
    tokens, logits = hf_reference(hf, prompt, 6)
    for res in (first["results"][0], shared, other_tenant):
        assert res["ids"] == tokens
        torch.testing.assert_close(torch.tensor(res["logits"]), logits, atol=1e-4, rtol=0)


def test_a_second_pipeline_reuses_the_first_ones_blocks(make_pipeline, redis_url, hf):
    first = make_pipeline(**remote(redis_url))
    computed = run(first, A_IDS, max_new_tokens=6, return_logits=True)
    flushed(first)
    second = make_pipeline(**remote(redis_url))
    reused = run(second, A_IDS, max_new_tokens=6, return_logits=True)
    aux = reused.aux_info
    assert (aux["remote_reuse_len"], aux["local_reuse_len"], aux["reuse_len"]) == (REMOTE_REUSE, 0, REMOTE_REUSE)
    assert_same(reused, computed.output_ids, computed.logits)
    assert_same(reused, *hf_reference(hf, A_IDS, 6))
    stats = second.cache_stats()
    assert stats["remote_hits"] == 5 and stats["remote_onboarded_blocks"] == 5
    assert stats["remote_up"] is True and stats["remote_bytes_read"] > 0
    again = run(second, A_IDS, max_new_tokens=6)        # now a device hit
    assert again.aux_info["local_reuse_len"] == REMOTE_REUSE
    assert again.aux_info["remote_reuse_len"] == 0


def test_a_prefetched_request_never_waits_on_redis_in_the_engine_thread(make_pipeline, redis_url):
    first = make_pipeline(**remote(redis_url))
    run(first, A_IDS, max_new_tokens=2)
    flushed(first)
    second = make_pipeline(**remote(redis_url))
    client = _tier(second)._client
    threads: list[str] = []
    for name in ("get", "mget", "pipeline", "exists"):
        method = getattr(client, name)
        setattr(client, name, lambda *a, _m=method, **k: (
            threads.append(threading.current_thread().name), _m(*a, **k))[1])
    res = run(second, A_IDS, max_new_tokens=2)
    assert res.aux_info["remote_reuse_len"] == REMOTE_REUSE
    assert threads and "rtpkv-engine" not in threads, threads


def test_salted_requests_of_another_tenant_get_nothing(make_pipeline, redis_url):
    first = make_pipeline(**remote(redis_url))
    run(first, A_IDS, max_new_tokens=2, cache_salt="tenant-a")
    flushed(first)
    second = make_pipeline(**remote(redis_url))
    assert run(second, A_IDS, max_new_tokens=2, cache_salt="tenant-b").aux_info["reuse_len"] == 0
    assert run(second, A_IDS, max_new_tokens=2).aux_info["reuse_len"] == 0
    same = run(second, A_IDS, max_new_tokens=2, cache_salt="tenant-a")
    assert same.aux_info["remote_reuse_len"] == REMOTE_REUSE


def test_enable_remote_cache_false_neither_reads_nor_writes(make_pipeline, redis_url):
    first = make_pipeline(**remote(redis_url))
    run(first, A_IDS, max_new_tokens=2, enable_remote_cache=False)
    flushed(first)
    assert redis.Redis.from_url(redis_url).dbsize() == 0
    run(first, list(range(500, 522)), max_new_tokens=2)
    flushed(first)
    second = make_pipeline(**remote(redis_url))
    off = run(second, list(range(500, 522)), max_new_tokens=2, enable_remote_cache=False)
    assert off.aux_info["reuse_len"] == 0
    assert second.cache_stats()["remote_hits"] == 0


def test_remote_cache_off_by_default(make_pipeline, redis_url):
    pipe = make_pipeline(reuse_cache=True, seq_size_per_block=B)
    assert not any(t.name == "remote" for t in pipe.engine.cache.ladder.tiers)
    assert "remote_up" not in pipe.cache_stats()


def test_environment_names_turn_the_tier_on(make_pipeline, redis_url, monkeypatch):
    monkeypatch.setenv("ENABLE_REMOTE_CACHE", "1")
    monkeypatch.setenv("REMOTE_CACHE_URL", redis_url)
    monkeypatch.setenv("REMOTE_CACHE_TTL_S", "60")
    monkeypatch.setenv("REMOTE_CACHE_TIMEOUT_MS", "500")
    pipe = make_pipeline(reuse_cache=True, seq_size_per_block=B)
    tier = _tier(pipe)
    assert (tier.ttl_s, tier.timeout_s) == (60, 0.5)
    run(pipe, A_IDS, max_new_tokens=2)
    flushed(pipe)
    client = redis.Redis.from_url(redis_url)
    assert client.dbsize() == 5 and all(0 < client.ttl(k) <= 60 for k in client.keys("*"))


# ---------------------------------------------------------------------------- bad records
def _a_keys(pipe) -> list[bytes]:
    index = pipe.engine.cache.index
    key, keys = index.root, []
    for i in range(5):
        key = index.key(key, A_IDS[i * B:(i + 1) * B])
        keys.append(key)
    return keys


@pytest.mark.parametrize("damage", ["truncated", "corrupt", "foreign"])
def test_a_bad_record_is_a_miss_and_the_answer_is_still_right(make_pipeline, redis_url, hf,
                                                              damage):
    first = make_pipeline(**remote(redis_url))
    run(first, A_IDS, max_new_tokens=2)
    flushed(first)
    second = make_pipeline(**remote(redis_url))
    tier = _tier(second)
    client = redis.Redis.from_url(redis_url)
    name = tier.redis_key(_a_keys(second)[2])
    record = client.get(name)
    if damage == "truncated":
        client.set(name, record[: len(record) - 100])
    elif damage == "corrupt":
        client.set(name, record[:-8] + bytes(8))
    else:
        layout = tier.layout
        other = type(layout)(fingerprint="f" * 64, block_size=layout.block_size,
                             dtype=layout.dtype, shape=layout.shape)
        stored_meta, payload = decode_record(record, layout)
        client.set(name, encode_record(stored_meta, payload, other))
    res = run(second, A_IDS, max_new_tokens=6, return_logits=True)
    assert res.aux_info["remote_reuse_len"] == 2 * B      # the chain ends at the bad record
    assert_same(res, *hf_reference(hf, A_IDS, 6))
    stats = second.cache_stats()
    if damage == "foreign":
        assert stats["remote_foreign"] == 1 and client.exists(name)
    else:
        assert stats["remote_corrupt"] == 1
        flushed(second)                 # the recomputed block is written again, whole
        assert tier.load(tier_meta(second, 2)) is not None


def tier_meta(pipe, i: int) -> BlockMeta:
    keys = [pipe.engine.cache.index.root] + _a_keys(pipe)
    return BlockMeta(key=keys[i + 1], parent_key=keys[i], tokens=tuple(A_IDS[i * B:(i + 1) * B]))


# ---------------------------------------------------------------------------- faults
def _alone(make_pipeline, prompts: list[list[int]], n: int) -> list[list[int]]:
    pipe = make_pipeline(seq_size_per_block=B)
    outs = [run(pipe, p, max_new_tokens=n).output_ids for p in prompts]
    pipe.stop()
    return outs


def _concurrently(pipe, prompts: list[list[int]], n: int, on_first_done=None):
    """Start one thread per prompt; returns (threads, results, errors) to join and check.
    `on_first_done()` runs once, in the thread of the first request to finish."""
    results: list = [None] * len(prompts)
    errors: list[BaseException] = []
    first = threading.Lock()

    def one(i: int) -> None:
        try:
            results[i] = run(pipe, prompts[i], max_new_tokens=n)
            if on_first_done is not None and first.acquire(blocking=False):
                on_first_done()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    return threads, results, errors


def test_redis_killed_during_concurrent_requests(make_pipeline, own_redis, caplog):
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 1000, (16,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 1000, (10 + i,), generator=g).tolist() for i in range(12)]
    expected = _alone(make_pipeline, prompts, 8)
    warm = make_pipeline(**remote(own_redis.url))
    for p in prompts[:4]:
        run(warm, p, max_new_tokens=8)
    flushed(warm)
    pipe = make_pipeline(**remote(own_redis.url, concurrency_limit=4))
    with caplog.at_level(logging.WARNING, logger="rtpkv"):
        # Redis dies when the first request ends: the others are running or still queued
        threads, results, errors = _concurrently(pipe, prompts, 8, on_first_done=own_redis.kill)
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert [r.output_ids for r in results] == expected
        fresh = iter(range(100, 1000, 10))
        deadline = time.monotonic() + 10
        while pipe.cache_stats()["remote_up"] and time.monotonic() < deadline:
            start = next(fresh)                         # a write-through meets the dead server
            run(pipe, list(range(start, start + 9)), max_new_tokens=1)
        down = pipe.cache_stats()
        assert down["remote_up"] is False and down["remote_errors"] >= 1
        assert caplog.text.count("failed during") == 1
        own_redis.start()                               # the same port, empty
        deadline = time.monotonic() + 20
        while not pipe.cache_stats()["remote_up"]:
            assert time.monotonic() < deadline, "the tier did not come back after the restart"
            time.sleep(0.1)
    assert "answers again" in caplog.text
    after = run(pipe, list(range(700, 722)), max_new_tokens=2)
    flushed(pipe)
    assert after.aux_info["reuse_len"] == 0
    assert redis.Redis.from_url(own_redis.url).dbsize() >= 5


def test_a_server_that_is_down_at_start_changes_nothing(make_pipeline, caplog):
    url = f"redis://127.0.0.1:{free_port()}/0"
    with caplog.at_level(logging.WARNING, logger="rtpkv"):
        pipe = make_pipeline(**remote(url))
        first = run(pipe, A_IDS, max_new_tokens=4)
        second = run(pipe, A_IDS, max_new_tokens=4)
    assert first.output_ids == second.output_ids
    assert second.aux_info["local_reuse_len"] == REMOTE_REUSE
    assert caplog.text.count("failed during") == 1
    stats = pipe.cache_stats()
    assert stats["remote_up"] is False and stats["remote_stores"] == 0


def test_a_server_that_never_answers_stalls_nothing(make_pipeline, hf):
    silent = SilentServer()
    try:
        pipe = make_pipeline(**remote(silent.url, remote_cache_timeout_ms=300))
        prompts = [list(range(40 + i, 62 + i)) for i in range(4)]
        t0 = time.monotonic()
        threads, results, errors = _concurrently(pipe, prompts, 4)
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert time.monotonic() - t0 < 30                 # bounded, not hung
        for prompt, res in zip(prompts, results):
            assert res.output_ids == hf_reference(hf, prompt, 4)[0]
        assert pipe.cache_stats()["remote_up"] is False
        pipe.stop()                                       # closing does not hang either
    finally:
        silent.close()
