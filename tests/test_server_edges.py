"""The server's hard edges: a big or deeply nested body, a slow tokenization, and one bad
request never hurt the other clients; every invalid body is a 4xx in the route's error shape."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from conftest import load
from rtpkv.errors import PromptTooLongError
from rtpkv.pipeline import Pipeline
from rtpkv.server import create_app
from server_helpers import ServerThread, wait_until

LIMIT_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def edge_server(llama_path):
    model = load(llama_path, kv_cache_max_tokens=8192, concurrency_limit=8)
    pipe = Pipeline(model, model.tokenizer)
    with ServerThread(create_app(pipe, "tiny", max_body_bytes=LIMIT_BYTES)) as server:
        yield server, pipe
    pipe.check_integrity()


@pytest.fixture
def client(edge_server):
    server, pipe = edge_server
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
    assert wait_until(lambda: pipe.cache_stats()["requests_running"] == 0)


@pytest.mark.parametrize("route", ["/", "/v1/completions"])
def test_body_over_the_limit_is_413_before_parsing(client, route):
    body = b'{"prompt": "' + b"a" * LIMIT_BYTES + b'"}'
    res = client.post(route, content=body, headers={"content-type": "application/json"})
    assert res.status_code == 413
    err = res.json()
    message = err["error"]["message"] if route.startswith("/v1") else err["message"]
    assert str(LIMIT_BYTES) in message and "MAX_REQUEST_BODY_MB" in message
    if route == "/":
        assert err["error_code"] == 413


def test_chunked_body_over_the_limit_is_413(client):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(LIMIT_BYTES // 4096 + 2):
            yield b"a" * 4096
        yield b'"}'

    res = client.post("/v1/completions", content=chunks(),
                      headers={"content-type": "application/json"})
    assert res.status_code == 413
    assert res.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("depth", [60, 990])
@pytest.mark.parametrize("route", ["/", "/v1/completions"])
def test_deeply_nested_json_is_a_4xx_in_the_routes_shape(client, route, depth):
    body = '{"prompt": "hello", "max_new_tokens": ' + "[" * depth + "]" * depth + "}"
    res = client.post(route, content=body.encode(),
                      headers={"content-type": "application/json"})
    assert res.status_code == 400, res.text
    err = res.json()
    if route == "/":
        assert err["error_code"] in (507, 604)
    else:
        assert err["error"]["type"] == "invalid_request_error"


def test_a_slow_tokenization_does_not_stall_health(edge_server, client, monkeypatch):
    _, pipe = edge_server
    real = pipe._tokenize
    started = threading.Event()

    def slow(prompt, with_special):
        started.set()
        time.sleep(3)
        return real(prompt, with_special)

    monkeypatch.setattr(pipe, "_tokenize", slow)
    result = {}
    thread = threading.Thread(target=lambda: result.update(res=client.post(
        "/", json={"prompt": "hello", "max_new_tokens": 2, "top_k": 1})))
    thread.start()
    assert started.wait(10)
    began = time.monotonic()
    with httpx.Client(base_url=client.base_url, timeout=10) as other:
        assert other.get("/health").status_code == 200
    assert time.monotonic() - began < 1.5, "the event loop was blocked by tokenization"
    thread.join(30)
    assert result["res"].status_code == 200


def test_a_prompt_too_long_for_any_tokenization_is_refused_untokenized(make_pipeline,
                                                                      monkeypatch):
    pipe = make_pipeline()
    monkeypatch.setattr(pipe, "_tokenize", lambda *a: pytest.fail("tokenized a 4 MB prompt"))
    with pytest.raises(PromptTooLongError, match="characters"):
        pipe("word " * 800_000)


def test_prompt_of_one_token_is_said_in_the_singular(make_pipeline):
    pipe = make_pipeline()
    with pytest.raises(PromptTooLongError, match="prompt of 1 token \\+ max_new_tokens"):
        pipe([5], max_new_tokens=pipe.config.max_seq_len)
