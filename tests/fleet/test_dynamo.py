"""Two `rtpkv dynamo-worker`s behind NVIDIA Dynamo's frontend and KV router (ai-dynamo,
file discovery, everything on loopback), started once for the module: a prefix (salted or not)
goes to the worker that holds it, not with the overlap credit at 0; with session affinity a
conversation stays on one worker; each worker registers its pool, step budget and concurrency;
a task prompt pinned before the router subscribed is credited; greedy outputs equal one
pipeline's; a client that leaves cancels its request; a refused field is named; a killed worker
gets no more requests."""

from __future__ import annotations

import json
import random
import time
from typing import Any

import httpx
import pytest

from fleet_helpers import B, EVENT_DELAY_S, WORDS, cached, complete, free_base, text
from fleet_helpers import served_by as served_at
from rtpkv.fleet.launcher import Fleet
from server_helpers import wait_until

TASK_PROMPT = " ".join(random.Random(77).choice(WORDS) for _ in range(90))


def served_by(fleet: Fleet, prompt: str, **extra: Any) -> tuple[int, dict[str, Any]]:
    """The worker Dynamo's frontend sent `prompt` to, and the answer."""
    return served_at(fleet, fleet.router_url, prompt, **extra)


class TaskFleet(Fleet):
    """Worker 1 starts with TASK_PROMPT pinned (its blocks published before Dynamo's relay
    subscribes)."""

    def replica_env(self, index: int) -> dict[str, str]:
        env = super().replica_env(index)
        if index == 1:
            env["MULTI_TASK_PROMPT_STR"] = json.dumps([{"task_id": "t", "prompt": TASK_PROMPT}])
        return env


@pytest.fixture(scope="module")
def fleet(checkpoints, tmp_path_factory):
    base = free_base(10)
    f = TaskFleet(checkpoints("qwen2"), 2, replica_port=base, events_port=base + 2,
                  router_port=base + 6, block_size=B,
                  env={"KV_CACHE_MAX_TOKENS": "8192", "CONCURRENCY_LIMIT": "8",
                       "RTPKV_CACHE_DIR": str(tmp_path_factory.mktemp("cards"))},
                  log_dir=str(tmp_path_factory.mktemp("dynamo")), time_limit_s=900,
                  served_model_name="qwen2", dynamo=True)
    try:
        f.start_replicas()
        f.start_router("dynamo", "kv")
        yield f
    finally:
        f.stop()


def test_a_repeated_long_prefix_goes_to_the_worker_that_holds_it(fleet):
    for holder in (0, 1):
        shared = text(100 + holder)
        complete(fleet.replicas[holder].url, shared + " first")   # straight to the worker
        time.sleep(EVENT_DELAY_S)
        for turn in range(2):
            who, res = served_by(fleet, shared + f" turn {turn}")
            assert who == holder and cached(res) >= 4 * B, (holder, who, res["usage"])


def test_a_salted_prefix_is_never_credited_to_plain_text(fleet):
    """A tenant's salted blocks go out with folded ids and the salt's digest (never the salt),
    so Dynamo's router cannot match them from plain text: plain text reuses nothing of them on
    any worker, and the tenant's own follow-up still reuses them where it lands on the holder."""
    for holder in (0, 1):
        shared = text(150 + holder)
        complete(fleet.replicas[holder].url, shared + " first", cache_salt="tenant-a")
        time.sleep(EVENT_DELAY_S)
        _, plain = served_by(fleet, shared + " next")
        assert cached(plain) == 0, plain["usage"]
        who, res = served_by(fleet, shared + " again", nvext={"cache_salt": "tenant-a"})
        assert who != holder or cached(res) >= 4 * B, (holder, who, res["usage"])


def test_a_worker_started_with_a_task_prompt_is_credited_for_it(fleet):
    """The task's blocks were pinned (and published) before the relay subscribed: only the
    announcement made when it subscribed tells the router."""
    for seed in range(3):
        who, res = served_by(fleet, TASK_PROMPT + " " + text(200 + seed, 8))
        assert who == 1 and cached(res) >= 4 * B, (who, res["usage"])


def test_greedy_outputs_through_dynamo_equal_one_pipeline_alone(fleet):
    for seed in range(300, 304):
        prompt = text(seed, 30)
        alone = complete(fleet.replicas[0].url, prompt, reuse_cache=False)
        routed = complete(fleet.router_url, prompt)
        assert routed["choices"][0]["text"] == alone["choices"][0]["text"]
    chat = {"model": "qwen2", "messages": [{"role": "user", "content": text(310, 30)}],
            "max_tokens": 6, "temperature": 0}
    answers = [httpx.post(url + "/v1/chat/completions", json=chat, timeout=60).json()
               for url in (fleet.replicas[1].url, fleet.router_url)]
    assert (answers[0]["choices"][0]["message"]["content"]
            == answers[1]["choices"][0]["message"]["content"])


def test_a_client_that_goes_away_cancels_its_request_in_the_engine(fleet):
    """The stream is closed after its first chunk: the worker stops the request before its
    max_tokens (each engine step makes at most one of its tokens). The abort reaches the engine
    10-35 ms after the close, and a step of this tiny model takes about 0.25 ms, so a loaded
    host may run a few hundred steps first: the bound is the request's end, not its half."""
    max_tokens = 800
    before = [httpx.get(r.url + "/worker_status", timeout=10).json()["iterate_count"]
              for r in fleet.replicas]
    body = {"model": "qwen2", "prompt": text(700, 30), "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", fleet.router_url + "/v1/completions", json=body,
                      timeout=60) as res:
        assert res.status_code == 200, res.read()
        assert any(line.startswith("data:") for line in res.iter_lines())

    def idle() -> bool:
        return all(httpx.get(r.url + "/cache_status", timeout=10).json()["requests_running"]
                   == 0 for r in fleet.replicas)
    assert wait_until(idle, 30, 0.1)
    after = [httpx.get(r.url + "/worker_status", timeout=10).json()["iterate_count"]
             for r in fleet.replicas]
    steps = sum(a - b for a, b in zip(after, before))
    assert 0 < steps < max_tokens * 9 // 10, steps


def test_what_rtpkv_cannot_honour_is_refused_by_name_through_the_frontend(fleet):
    res = httpx.post(fleet.router_url + "/v1/completions", timeout=60, json={
        "model": "qwen2", "prompt": text(800, 20), "max_tokens": 4, "presence_penalty": 0.5})
    assert res.status_code >= 400 and "presence_penalty=0.5" in res.text, res.text
    assert complete(fleet.router_url, text(801, 20))["choices"][0]["text"] is not None


def test_with_the_overlap_credit_at_0_the_holder_is_not_preferred(fleet):
    """Credit 0: cached blocks count for nothing, so a prefix held by one worker does not pull
    its requests there (with equal loads the router's tie-break decides)."""
    fleet.start_router("dynamo", "kv", dynamo_policy={"overlap_score_credit": 0.0})
    sent = to_holder = 0
    for holder in (0, 1):
        shared = text(400 + holder)
        complete(fleet.replicas[holder].url, shared + " first")
        time.sleep(EVENT_DELAY_S)
        for turn in range(6):
            who, _ = served_by(fleet, shared + f" turn {turn}")
            sent, to_holder = sent + 1, to_holder + (who == holder)
    assert to_holder < sent
    fleet.start_router("dynamo", "kv")   # the default credit for the tests after this one


def test_with_session_affinity_a_conversation_stays_on_its_first_worker(fleet):
    """Dynamo's session affinity (`--router-session-affinity-ttl-secs`, the client's
    `x-dynamo-session-id`) keeps a conversation's turns on the worker its first turn went to,
    even at credit 0, where the same turns without it spread over both workers (the test
    above); the turns share no text, so no cached block pulls them either."""
    fleet.start_router("dynamo", "kv", dynamo_policy={"overlap_score_credit": 0.0},
                       router_args=("--router-session-affinity-ttl-secs", "600"))
    try:
        for i, session in enumerate(("chat-a", "chat-b", "chat-c")):
            workers = {served_by(fleet, text(500 + 10 * i + turn),
                                 headers={"x-dynamo-session-id": session})[0]
                       for turn in range(5)}
            assert len(workers) == 1, (session, workers)
    finally:
        fleet.start_router("dynamo", "kv")


def test_each_worker_registers_its_pool_its_step_budget_and_its_concurrency(fleet):
    """The frontend's router sizes its load model from a worker's registration (the model card
    under the discovery directory): the pool's blocks, the prompt tokens a step takes
    (`max_num_batched_tokens`, which `--active-prefill-tokens-threshold-frac` and the router's
    queue threshold are fractions of) and CONCURRENCY_LIMIT."""
    cards = [json.loads(p.read_text()) for p in (fleet.discovery_dir / "v1" / "mdc").iterdir()]
    assert len(cards) == len(fleet.replicas)
    for card in cards:
        runtime = card["card_json"]["runtime_config"]
        assert runtime["total_kv_blocks"] * B == 8192   # the fixture's KV_CACHE_MAX_TOKENS
        assert runtime["max_num_seqs"] == 8             # CONCURRENCY_LIMIT
        assert runtime["max_num_batched_tokens"] == 2048   # MAX_NUM_BATCHED_TOKENS' default


def test_a_llama_chat_through_the_frontend_is_rendered_as_rtpkv_renders_it(checkpoints,
                                                                           tmp_path):
    """A tokenizer that adds a BOS (Llama's): the card's template starts with it, so the
    frontend's ids and greedy reply equal rtpkv's own. (A plain completion reaches the worker
    without the BOS: the frontend adds none to a prompt.)"""
    base = free_base(6)
    with Fleet(checkpoints("llama"), 1, replica_port=base, events_port=base + 1,
               router_port=base + 4, block_size=B, log_dir=str(tmp_path), time_limit_s=300,
               served_model_name="llama", dynamo=True,
               env={"RTPKV_CACHE_DIR": str(tmp_path / "cards")}) as llama:
        llama.start_replicas()
        llama.start_router("dynamo", "kv")
        messages = [{"role": "user", "content": text(900, 20)}]
        worker = llama.replicas[0].url
        ids = httpx.post(worker + "/v1/chat/completions/render", timeout=30,
                         json={"messages": messages}).json()["token_ids"]
        body = {"model": "llama", "messages": messages, "max_tokens": 6, "temperature": 0}
        routed, alone = (httpx.post(url + "/v1/chat/completions", timeout=60, json={
            **body, **extra}).json() for url, extra in ((llama.router_url, {}),
                                                        (worker, {"reuse_cache": False})))
        assert routed["usage"]["prompt_tokens"] == len(ids)
        # a byte-fallback token cut short of its character decodes to U+FFFD: the two
        # detokenizers may print one per byte or one per sequence; the rest is the same text
        replies = [r["choices"][0]["message"]["content"].replace("\ufffd", "")
                   for r in (routed, alone)]
        assert replies[0] == replies[1] and replies[0]


def test_a_killed_worker_stops_receiving_requests(fleet):
    """Last in the module: it leaves one worker."""
    fleet.kill_replica(1)
    survivor = fleet.replicas[0].url

    def routed_around() -> bool:
        """The frontend has dropped the dead worker's registration (its /health lists one
        `generate` instance) and serves requests. Requests served in a row alone were not
        enough: 16 once passed while the registration stood, and a later request got a 503."""
        health = httpx.get(fleet.router_url + "/health", timeout=10).json()
        alive = [i for i in health.get("instances", []) if i.get("endpoint") == "generate"]
        return len(alive) == 1 and all(
            httpx.post(fleet.router_url + "/v1/completions", timeout=60,
                       json={"model": "qwen2", "prompt": text(500 + i), "max_tokens": 2}
                       ).status_code == 200 for i in range(4))
    assert wait_until(routed_around, 90, 1.0)
    before = httpx.get(survivor + "/cache_status", timeout=10).json()["queries"]
    prompts = [text(600 + i) for i in range(6)]
    for prompt in prompts:
        complete(fleet.router_url, prompt)
    after = httpx.get(survivor + "/cache_status", timeout=10).json()["queries"]
    sent = sum(len(r["token_ids"]) for r in httpx.post(
        survivor + "/v1/completions/render", json={"prompt": prompts}, timeout=30).json())
    assert after - before == sent   # every one of them was served by the survivor
