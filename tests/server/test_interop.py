"""A worker read as the routers others run read theirs: rtp-llm FlexLB's /cache_status and
/worker_status (its CacheStatus and WorkerStatusResponse fields, its block hash), vLLM's
metric names on /metrics (parsed from the text format, as llm-d's and vllm-router's scrapers
do), and the medium names KV_EVENTS_MEDIUMS gives the host and disk tiers on the wire."""

from __future__ import annotations

import random

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rtpkv.config import Settings
from rtpkv.errors import ConfigError
from rtpkv.fleet.view import ReplicaView
from rtpkv.model_factory import ModelConfig, ModelFactory
from rtpkv.pipeline import Pipeline
from rtpkv.server import create_app
from rtpkv.server.flexlb import prompt_keys
from server_helpers import ServerThread, free_port, wait_until

B = 4
WORDS = "hello what's your name how old are you the river city mountain book story".split()


@pytest.fixture(scope="module")
def model(checkpoints):
    return ModelFactory.from_huggingface(checkpoints("qwen2"), ModelConfig())


@pytest.fixture(scope="module")
def server(model):
    pipeline = Pipeline(model, reuse_cache=True, seq_size_per_block=B,
                        kv_cache_max_tokens=4096, concurrency_limit=4)
    with ServerThread(create_app(pipeline, "qwen2")) as srv:
        yield srv


def text(seed: int, words: int = 40) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def complete(url: str, prompt: str, **extra) -> dict:
    res = httpx.post(url + "/v1/completions", timeout=60, json={
        "model": "qwen2", "prompt": prompt, "max_tokens": 3, "temperature": 0, **extra})
    assert res.status_code == 200, res.text
    return res.json()


def render(url: str, prompt: str) -> list[int]:
    return httpx.post(url + "/v1/completions/render", json={"prompt": prompt},
                      timeout=30).json()[0]["token_ids"]


def test_flexlbs_block_hash_matches_its_golden_vectors():
    """FlexLB's BlockCacheKeyCalculatorTest: token ids 0..127 (and 0..129: the partial block
    is dropped) in blocks of 64."""
    golden = [-7527834946346035334, -7860823284622341314]
    assert prompt_keys(list(range(128)), 64) == golden
    assert prompt_keys(list(range(130)), 64) == golden
    assert prompt_keys([1, 2], 4) == []


def test_cache_status_as_flexlb_polls_it(server):
    url = server.url
    prompt = text(1)
    complete(url, prompt)
    ids = render(url, prompt)
    # FlexLB's master: POST {latest_cache_version, need_cache_keys}, reads CacheStatus
    status = httpx.post(url + "/cache_status", timeout=10,
                        json={"latest_cache_version": -1, "need_cache_keys": True}).json()
    assert status["block_size"] == B
    assert status["total_kv_cache"] == status["blocks_total"] * B
    assert 0 < status["available_kv_cache"] <= status["total_kv_cache"]
    assert status["cache_key_size"] == len(status["cached_keys"])
    # the request's full prompt blocks, hashed as FlexLB hashes a request, are all cached
    wanted = prompt_keys(ids, B)
    assert len(wanted) == len(ids) // B and set(wanted) <= set(status["cached_keys"])
    assert all(-2**63 <= k < 2**63 for k in status["cached_keys"])
    # polled again at its version: nothing changed, no keys; GET with query parameters too
    version = status["version"]
    again = httpx.get(url + "/cache_status", timeout=10,
                      params={"latest_cache_version": version, "need_cache_keys": "true"}).json()
    assert again["version"] == version and "cached_keys" not in again
    complete(url, text(2))
    newer = httpx.get(url + "/cache_status", timeout=10,
                      params={"latest_cache_version": version, "need_cache_keys": "true"}).json()
    assert newer["version"] > version
    assert set(prompt_keys(render(url, text(2)), B)) <= set(newer["cached_keys"])
    # rtpkv's own fields are still there
    assert newer["queries"] > 0 and "task_ids" in newer


def test_a_salted_prefix_is_not_offered_under_flexlbs_unsalted_hash(server):
    url = server.url
    prompt = text(3)
    complete(url, prompt, cache_salt="tenant-a")
    keys = httpx.post(url + "/cache_status", timeout=10,
                      json={"need_cache_keys": True}).json()["cached_keys"]
    assert not set(prompt_keys(render(url, prompt), B)) & set(keys)


def test_worker_status_as_flexlb_reads_it(server):
    status = httpx.post(server.url + "/worker_status", timeout=10,
                        json={"latest_cache_version": -1, "need_cache_keys": True}).json()
    assert status["role"] == "PDFUSION" and status["alive"] is True
    assert status["available_concurrency"] == 4
    assert status["running_query_len"] == 0 and status["waiting_query_len"] == 0
    assert status["iterate_count"] > 0
    assert (status["dpSize"], status["tpSize"], status["dpRank"]) == (1, 1, 0)
    cache = status["cache_status"]
    assert cache["version"] == status["version"] and cache["cached_keys"]
    assert cache["total_kv_cache"] == status["total_kv_cache"]


def vllm_samples(url: str) -> dict[str, float]:
    """/metrics parsed from the text format; vLLM's samples of model qwen2 by name."""
    families = text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text)
    return {s.name: s.value for f in families for s in f.samples
            if s.name.startswith("vllm:") and s.labels.get("model_name") == "qwen2"}


def test_vllm_metric_names_beside_rtpkvs_own(server):
    url = server.url
    prompt = text(4)
    before = vllm_samples(url)
    complete(url, prompt)
    complete(url, prompt + " again")
    after = vllm_samples(url)
    stats = httpx.get(url + "/cache_status", timeout=10).json()
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == stats["blocks_in_use"] / stats["blocks_total"]
    assert 0 <= after["vllm:kv_cache_usage_perc"] <= 1
    assert after["vllm:prefix_cache_queries_total"] == stats["queries"]
    assert after["vllm:prefix_cache_hits_total"] == stats["hits"]
    grew = after["vllm:prefix_cache_hits_total"] - before.get("vllm:prefix_cache_hits_total", 0)
    assert grew >= len(render(url, prompt)) // B * B - B   # the second request reused the first
    rtpkv = httpx.get(url + "/metrics", timeout=10).text
    assert "rtpkv_cache_hit_tokens_total" in rtpkv and "rtpkv_requests_running" in rtpkv


@pytest.mark.parametrize("names, host, disk", [("disk", "CPU", "DISK"),
                                               ("storage", "CPU", "STORAGE"),
                                               ("tiers", "CPU_TIER1", "CPU_TIER2")])
def test_the_host_and_disk_tiers_are_named_as_the_consumer_expects(model, tmp_path, names,
                                                                   host, disk):
    pub = f"tcp://127.0.0.1:{free_port()}"
    rng = random.Random(0)
    with Pipeline(model, reuse_cache=True, seq_size_per_block=B, kv_cache_max_tokens=48,
                  concurrency_limit=1, enable_memory_cache=True, memory_cache_size_mb=1,
                  enable_memory_cache_disk=True, memory_cache_disk_paths=str(tmp_path),
                  write_cache_sync=True, kv_events_endpoint=pub, kv_events_mediums=names
                  ) as pipeline:
        view = ReplicaView(pub)

        def mediums() -> set[str]:
            for _ in pipeline([rng.randrange(5, 500) for _ in range(13)],
                              generate_config={"max_new_tokens": 1, "top_k": 1}):
                pass
            view.poll(0.1)
            return {m for m, blocks in view.blocks.items() if blocks}
        assert wait_until(lambda: {"GPU", host, disk} <= mediums(), 30, 0.05), \
            dict(view.blocks)
        view.close()


def test_an_unknown_medium_naming_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("KV_EVENTS_MEDIUMS", "nvme")
    with pytest.raises(ConfigError, match="KV_EVENTS_MEDIUMS.*disk, storage, tiers"):
        Settings.from_env()
