"""The launcher's arguments: what each router and policy is started with, and clear errors."""

from __future__ import annotations

import pytest

from rtpkv.fleet.launcher import Fleet, Replica


def fleet_with_two(tmp_path) -> Fleet:
    fleet = Fleet("/models/m", 2, replica_port=9000, events_port=9100, router_port=9200,
                  block_size=32, log_dir=str(tmp_path))
    fleet.replicas = [Replica(i, f"http://127.0.0.1:{9000 + i}", f"tcp://127.0.0.1:{9100 + 2 * i}",
                              f"tcp://127.0.0.1:{9101 + 2 * i}", None, tmp_path / "log")
                      for i in range(2)]
    return fleet


def test_kv_aware_gets_each_replicas_event_sockets_and_the_block_size(tmp_path):
    argv = fleet_with_two(tmp_path).router_command("vllm", "kv_aware")
    pairs = list(zip(argv, argv[1:]))
    assert ("--kv-event-source", "http://127.0.0.1:9001=tcp://127.0.0.1:9102") in pairs
    assert ("--kv-event-replay-source", "http://127.0.0.1:9000=tcp://127.0.0.1:9101") in pairs
    assert ("--kv-event-block-size", "32") in pairs and ("--kv-event-model", "m") in pairs
    assert ("--host", "127.0.0.1") in pairs and ("--policy", "kv_aware") in pairs


def test_replica_environment_names_its_own_sockets(tmp_path):
    fleet = Fleet("/models/m", 2, events_port=9100, block_size=32, redis_url="redis://h:1/0",
                  log_dir=str(tmp_path), env={"KV_CACHE_MAX_TOKENS": "4096"})
    env = fleet.replica_env(1)
    assert env["KV_EVENTS_ENDPOINT"] == "tcp://127.0.0.1:9102"
    assert env["KV_EVENTS_REPLAY_ENDPOINT"] == "tcp://127.0.0.1:9103"
    assert env["SEQ_SIZE_PER_BLOCK"] == "32" and env["REUSE_CACHE"] == "1"
    assert env["REMOTE_CACHE_URL"] == "redis://h:1/0" and env["KV_CACHE_MAX_TOKENS"] == "4096"


def test_replicas_publish_the_layout_the_routers_read(tmp_path, monkeypatch):
    """vllm-router reads only tagged maps: a KV_EVENTS_LAYOUT=array left in the caller's
    environment (for llm-d) must not reach the replicas the launcher starts for it."""
    monkeypatch.setenv("KV_EVENTS_LAYOUT", "array")
    assert fleet_with_two(tmp_path).replica_env(0)["KV_EVENTS_LAYOUT"] == "map"


def test_router_args_are_appended_unchanged(tmp_path):
    extra = ["--kv-aware-session-affinity-ttl-secs", "600"]
    for router, policy in (("vllm", "kv_aware"), ("vllm", "round_robin"),
                           ("sglang", "cache_aware")):
        argv = fleet_with_two(tmp_path).router_command(router, policy, router_args=extra)
        assert argv[-2:] == extra, (router, policy, argv)


@pytest.mark.parametrize("router, policy", [("vllm", "consistent_hash"), ("sglang", "manual")])
def test_session_keyed_policies_need_only_the_worker_urls(tmp_path, router, policy):
    argv = fleet_with_two(tmp_path).router_command(router, policy)
    assert ("--policy", policy) in list(zip(argv, argv[1:]))
    assert "--kv-event-source" not in argv
    assert argv[argv.index("--worker-urls") + 1:][:2] == ["http://127.0.0.1:9000",
                                                          "http://127.0.0.1:9001"]


@pytest.mark.parametrize("router, policy", [("sglang", "kv_aware"), ("nginx", "round_robin")])
def test_an_unknown_router_or_policy_names_the_accepted_ones(tmp_path, router, policy):
    with pytest.raises(ValueError, match="accepted: vllm: round_robin, cache_aware, kv_aware"):
        fleet_with_two(tmp_path).router_command(router, policy)


def test_counts_are_checked(tmp_path):
    with pytest.raises(ValueError, match="replicas=0: at least 1"):
        Fleet("/models/m", 0, log_dir=str(tmp_path))
    with pytest.raises(ValueError, match="threads_per_replica=0: at least 1"):
        Fleet("/models/m", 1, threads_per_replica=0, log_dir=str(tmp_path))


def test_the_banner_names_the_model_requests_must_give(tmp_path):
    fleet = fleet_with_two(tmp_path)
    text = fleet.describe("vllm", "kv_aware")
    assert "replica 1: http://127.0.0.1:9001" in text
    assert "model: m " in text and "router (vllm, kv_aware): http://127.0.0.1:9200" in text


def readme_fleet_curl() -> tuple[dict[str, str], dict]:
    """The headers and JSON body of the manual's "Many replicas" curl (docs/USAGE.md), as
    written."""
    import json
    import re
    import shlex
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "docs" / "USAGE.md").read_text()
    section = readme[readme.index("## Many replicas"):]
    command = re.search(r"^curl localhost:30000/v1/completions.*?(?<!\\)$", section,
                        re.M | re.S).group(0).replace("\\\n", " ")
    words = shlex.split(command)
    headers = dict(words[i + 1].split(": ", 1) for i, w in enumerate(words) if w == "-H")
    return headers, json.loads(words[words.index("-d") + 1])


def test_the_readme_curl_names_the_demo_model_and_its_content_type(monkeypatch, tmp_path):
    """vllm-router answers 415 without the content type and 404 for another model name:
    the manual's curl sends both as `rtpkv fleet` (the demo model) serves them."""
    import argparse

    from rtpkv.fleet import launcher

    headers, body = readme_fleet_curl()
    assert headers.get("Content-Type") == "application/json"
    monkeypatch.setattr("rtpkv.model_factory.tiny.model_or_demo",
                        lambda model: model or "/cache/demo-0123")
    parser = argparse.ArgumentParser()
    launcher.add_parser(parser.add_subparsers(), [])
    fleet = launcher.fleet_from_args(parser.parse_args(["fleet", "--log-dir", str(tmp_path)]))
    assert fleet.served_model_name == body["model"] == "demo"
    named = launcher.fleet_from_args(parser.parse_args(
        ["fleet", "--model", "/models/m", "--log-dir", str(tmp_path)]))
    assert named.served_model_name == "m"
