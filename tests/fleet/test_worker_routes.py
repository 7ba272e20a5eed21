"""The routes cache-aware routers probe on a worker, in-process: render gives exactly the token
ids a generation request computes (what the router hashes against the replica's events), the
info routes describe the replica, and the fields the routers add are accepted only at their
off values."""

from __future__ import annotations

import httpx
import pytest

from rtpkv.model_factory import ModelConfig, ModelFactory
from rtpkv.pipeline import Pipeline
from rtpkv.server.app import create_app
from server_helpers import ServerThread


@pytest.fixture(scope="module")
def served(checkpoints):
    model = ModelFactory.from_huggingface(checkpoints("qwen2"), ModelConfig())
    pipe = Pipeline(model, reuse_cache=True, seq_size_per_block=4)
    with ServerThread(create_app(pipe, "tiny")) as server:
        yield server.url, pipe
    pipe.stop()


def test_render_gives_the_ids_a_request_computes(served):
    url, pipe = served
    prompts = ["the cat sat on the mat", "a second prompt"]
    res = httpx.post(url + "/v1/completions/render",
                     json={"model": "tiny", "prompt": prompts, "max_tokens": 3})
    assert res.status_code == 200, res.text
    rendered = res.json()
    assert [r["token_ids"] for r in rendered] == [pipe.prompt_token_ids(p) for p in prompts]
    assert rendered[0]["model"] == "tiny" and rendered[0]["sampling_params"]["max_tokens"] == 3
    for p in prompts:  # and generation sees exactly those ids
        aux = httpx.post(url + "/", json={"prompt": p, "max_new_tokens": 1}).json()["aux_info"]
        assert aux["input_len"] == len(pipe.prompt_token_ids(p))
    messages = [{"role": "user", "content": "hi there"}]
    chat = httpx.post(url + "/v1/chat/completions/render",
                      json={"model": "tiny", "messages": messages}).json()
    assert chat["token_ids"] == pipe.chat_prompt(messages)
    bad = httpx.post(url + "/v1/completions/render", json={"model": "other", "prompt": "x"})
    assert bad.status_code == 404 and bad.json()["error"]["param"] == "model"


def test_info_routes_describe_the_replica(served):
    url, pipe = served
    for path in ("/server_info", "/get_server_info"):
        info = httpx.get(url + path).json()
        assert info["page_size"] == 4 and info["served_model_name"] == "tiny"
        assert info["max_total_num_tokens"] == pipe.engine.cache.num_blocks * 4
    for path in ("/model_info", "/get_model_info"):
        assert httpx.get(url + path).json()["is_generation"] is True


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "hello", "echo": False, "no_stop_trim": False}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": False,
                              "continue_final_message": False, "separate_reasoning": True,
                              "stream_reasoning": True, "include_reasoning": True}),
])
def test_the_routers_fields_are_accepted_at_their_off_values(served, route, body):
    url, _ = served
    assert httpx.post(url + route, json={**body, "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("route, body, field", [
    ("/v1/completions", {"prompt": "hello", "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "hello", "no_stop_trim": True}, "no_stop_trim"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "continue_final_message": True}, "continue_final_message"),
])
def test_the_routers_fields_are_refused_when_on(served, route, body, field):
    url, _ = served
    res = httpx.post(url + route, json={**body, "max_tokens": 2})
    assert res.status_code == 400 and res.json()["error"]["param"] == field
