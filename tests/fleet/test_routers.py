"""Two `rtpkv serve` replicas behind the real routers from PyPI (vllm-router, sglang-router),
on loopback: prefix affinity from KV events, round robin with and without the shared Redis
tier, a router that starts late, a replica that dies, and outputs equal to one replica's."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from fleet_helpers import B, EVENT_DELAY_S, cached, complete, free_base, served_by, text
from rtpkv.fleet.launcher import Fleet
from server_helpers import wait_until


@pytest.fixture(scope="module")
def fleet(checkpoints, redis_server, tmp_path_factory):
    base = free_base(10)
    f = Fleet(checkpoints("qwen2"), 2, replica_port=base, events_port=base + 2,
              router_port=base + 6, block_size=B, redis_url=redis_server.url,
              env={"KV_CACHE_MAX_TOKENS": "8192", "CONCURRENCY_LIMIT": "8"},
              log_dir=str(tmp_path_factory.mktemp("fleet")), time_limit_s=900,
              served_model_name="qwen2")
    try:
        f.start_replicas()
        yield f
    finally:
        f.stop()


def test_kv_aware_routes_a_shared_prefix_to_the_replica_that_holds_it(fleet):
    fleet.start_router("vllm", "kv_aware")
    for holder in (0, 1):
        shared = text(100 + holder)
        complete(fleet.replicas[holder].url, shared + " first")  # straight to the replica
        time.sleep(EVENT_DELAY_S)
        for turn in range(2):
            who, res = served_by(fleet, fleet.router_url, shared + f" turn {turn}")
            assert who == holder and cached(res) >= 4 * B, (holder, who, res["usage"])


def test_round_robin_loses_the_prefix_unless_the_redis_tier_is_on(fleet):
    fleet.start_router("vllm", "round_robin")
    shared = text(200)
    first, _ = served_by(fleet, fleet.router_url, shared + " one", enable_remote_cache=False)
    second, res = served_by(fleet, fleet.router_url, shared + " two", enable_remote_cache=False)
    assert second != first and cached(res) == 0
    shared = text(201)
    first, _ = served_by(fleet, fleet.router_url, shared + " one")

    def from_redis() -> bool:  # the write-through to Redis is asynchronous
        who, res = served_by(fleet, fleet.router_url, shared + " two")
        return who != first and cached(res) >= 4 * B
    assert wait_until(from_redis, 10, 0.3)


def test_sglang_router_cache_aware_keeps_a_conversation_on_one_replica(fleet):
    fleet.start_router("sglang", "cache_aware")
    shared = text(300)
    first, _ = served_by(fleet, fleet.router_url, shared + " one", enable_remote_cache=False)
    for turn in range(3):
        who, res = served_by(fleet, fleet.router_url, shared + f" turn {turn}",
                             enable_remote_cache=False)
        assert who == first and cached(res) >= 4 * B


def test_a_router_started_late_catches_up_through_the_replay_socket(fleet):
    fleet.stop_router()
    shared = {holder: text(400 + holder) for holder in (0, 1)}
    for holder, prefix in shared.items():
        complete(fleet.replicas[holder].url, prefix + " before the router")
    fleet.start_router("vllm", "kv_aware")   # its subscription starts after those events
    time.sleep(EVENT_DELAY_S)
    for holder, prefix in shared.items():
        who, res = served_by(fleet, fleet.router_url, prefix + " after")
        assert who == holder and cached(res) >= 4 * B, (holder, who, res["usage"])
    # the router's own count: its index answered with the replicas' blocks
    metrics = httpx.get(f"http://127.0.0.1:{fleet.router_port + 1}/metrics", timeout=10).text
    assert 'vllm_router_kv_placement_lookups_total{result="hit"} 2' in metrics, metrics


def test_greedy_outputs_through_the_router_equal_one_replica_alone(fleet):
    fleet.start_router("vllm", "kv_aware")
    for seed in range(500, 504):
        prompt = text(seed, 30)
        alone = complete(fleet.replicas[0].url, prompt, reuse_cache=False)
        routed = complete(fleet.router_url, prompt)
        assert routed["choices"][0]["text"] == alone["choices"][0]["text"]
    chat = {"model": "qwen2", "messages": [{"role": "user", "content": text(510, 30)}],
            "max_tokens": 6, "temperature": 0}
    answers = [httpx.post(url + "/v1/chat/completions", json=chat, timeout=60).json()
               for url in (fleet.replicas[1].url, fleet.router_url)]
    assert answers[0]["choices"][0]["message"] == answers[1]["choices"][0]["message"]


def test_kv_aware_session_affinity_keeps_a_conversation_where_it_began(fleet):
    """With the router's own option passed through (`router_args`), a request carrying a
    session id stays on the replica its session began on, even when the other replica holds
    its prefix; without a session id the same kind of request goes to the holder."""
    fleet.start_router("vllm", "kv_aware",
                       router_args=["--kv-aware-session-affinity-ttl-secs", "60"])
    session = {"x-session-id": "conversation-1"}
    home, _ = served_by(fleet, fleet.router_url, text(800) + " hello", headers=session)
    other = 1 - home
    shared = [text(801), text(802)]
    for prefix in shared:   # the other replica holds both
        complete(fleet.replicas[other].url, prefix + " first")
    time.sleep(EVENT_DELAY_S)
    who, res = served_by(fleet, fleet.router_url, shared[0] + " no session")
    assert who == other and cached(res) >= 4 * B, (other, who, res["usage"])
    who, res = served_by(fleet, fleet.router_url, shared[1] + " next turn", headers=session)
    assert who == home, (home, who, res["usage"])   # (its prefix may come from the Redis tier)


def test_kv_aware_never_credits_a_salted_tenants_blocks_to_plain_text(fleet):
    """Tenant A's salted request leaves its blocks on one replica (its first block announced
    with folded ids and the salt's digest); the other replica holds the text's first words,
    unsalted. The same text without a salt, through the router, goes where its plain prefix
    is, never to A's replica: before the fold it went to A's replica every time."""
    fleet.start_router("vllm", "kv_aware")
    for holder in (0, 1):
        other = 1 - holder
        words = text(950 + holder).split()
        complete(fleet.replicas[holder].url, " ".join(words) + " first",
                 cache_salt=f"tenant-a-{holder}")
        complete(fleet.replicas[other].url, " ".join(words[:40]) + " elsewhere")
        time.sleep(EVENT_DELAY_S)
        for turn in range(2):
            who, res = served_by(fleet, fleet.router_url, " ".join(words) + f" plain {turn}")
            assert who == other, (holder, who, res["usage"])


def test_the_readme_curl_works_through_the_router(fleet):
    """The manual's "Many replicas" curl (docs/USAGE.md) as written (its headers and body; the
    model name is the one this fleet serves, as `rtpkv fleet` prints it)."""
    from test_launcher import readme_fleet_curl

    fleet.start_router("vllm", "kv_aware")
    headers, body = readme_fleet_curl()
    res = httpx.post(fleet.router_url + "/v1/completions", headers=headers, timeout=60,
                     content=json.dumps({**body, "model": fleet.served_model_name}))
    assert res.status_code == 200, res.text
    # the random test model may end on its EOS before max_tokens (the curl sends no ignore_eos)
    assert 0 < res.json()["usage"]["completion_tokens"] <= body["max_tokens"]


class DiskFleet(Fleet):
    """Replicas each over their own disk-tier directory (`disks[index]`)."""

    def __init__(self, *args: Any, disks: list[str], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.disks = disks

    def replica_env(self, index: int) -> dict[str, str]:
        return {**super().replica_env(index), "ENABLE_MEMORY_CACHE_DISK": "1",
                "MEMORY_CACHE_DISK_PATHS": self.disks[index], "WRITE_CACHE_SYNC": "1"}


def test_kv_aware_sends_a_prefix_to_the_replica_restarted_with_it_on_disk(checkpoints,
                                                                          tmp_path):
    """Replica 1 restarts over a disk tier that holds three prefixes, replica 0 over an empty
    one: the announced records (medium DISK) bring every prefix to replica 1, which serves
    them from disk."""
    disks = [str(tmp_path / "empty"), str(tmp_path / "written")]
    prefixes = [text(700 + i) for i in range(3)]
    base = free_base(10)
    kw = dict(replica_port=base, events_port=base + 2, router_port=base + 6, block_size=B,
              log_dir=str(tmp_path / "logs"), time_limit_s=600, served_model_name="qwen2")
    with DiskFleet(checkpoints("qwen2"), 1, disks=disks[1:], **kw) as first_life:
        first_life.start_replicas()
        for prefix in prefixes:
            complete(first_life.replicas[0].url, prefix + " first life")
    with DiskFleet(checkpoints("qwen2"), 2, disks=disks, **kw) as fleet:
        fleet.start_replicas()
        fleet.start_router("vllm", "kv_aware")
        time.sleep(EVENT_DELAY_S)
        for prefix in prefixes:
            who, res = served_by(fleet, fleet.router_url, prefix + " after the restart")
            assert who == 1 and cached(res) >= 4 * B, (who, res["usage"])


def test_a_killed_replica_stops_receiving_requests(fleet):
    """Last in the module: it leaves one replica."""
    fleet.start_router("vllm", "round_robin")
    dead = fleet.replicas[1].url
    fleet.kill_replica(1)

    def gone() -> bool:  # not merely unhealthy: nothing answers on its port
        try:
            httpx.get(dead + "/health", timeout=5)
        except httpx.TransportError:
            return True
        return False
    assert wait_until(gone, 10, 0.2)
    survivor = fleet.replicas[0].url

    def routed_around() -> bool:  # the router's health check (every second) drops replica 1
        return all(httpx.post(fleet.router_url + "/v1/completions", timeout=60,
                              json={"model": "qwen2", "prompt": text(600 + i), "max_tokens": 2}
                              ).status_code == 200 for i in range(2))
    assert wait_until(routed_around, 20, 0.5)
    before = httpx.get(survivor + "/cache_status", timeout=10).json()["queries"]
    prompts = [text(700 + i) for i in range(6)]
    for prompt in prompts:
        complete(fleet.router_url, prompt, enable_remote_cache=False)
    after = httpx.get(survivor + "/cache_status", timeout=10).json()["queries"]
    sent = sum(len(r["token_ids"]) for r in httpx.post(
        survivor + "/v1/completions/render", json={"prompt": prompts}, timeout=30).json())
    assert after - before == sent   # every one of them was served by the survivor
