"""The server's hard edges: a big or deeply nested body, a slow tokenization, and one bad
request never hurt the other clients; every invalid body is a 4xx in the route's error shape."""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import threading
import time

import httpx
import orjson
import pytest

from conftest import load
from rtpkv.errors import PromptTooLongError
from rtpkv.pipeline import Pipeline
from rtpkv.server import create_app
from rtpkv.server.state import ServerState
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


@pytest.mark.parametrize("method,path", [("GET", "/v1/nothing"), ("GET", "/v1/completions"),
                                         ("DELETE", "/v1/models")])
def test_404_and_405_under_v1_have_openais_shape(client, method, path):
    res = client.request(method, path)
    assert res.status_code in (404, 405)
    err = res.json()["error"]
    assert path in err["message"] and err["type"]


def test_404_on_the_native_side_has_rtp_llms_shape(client):
    res = client.get("/nothing")
    assert res.status_code == 404 and "/nothing" in res.json()["message"]
    assert "error_code" in res.json()


@pytest.mark.parametrize("extra", [{"n": 2}, {"echo": True},
                                   {"response_format": {"type": "json_object"}},
                                   {"tools": [{"type": "function", "function": {"name": "f"}}]},
                                   {"presence_penalty": 0.5}])
def test_openai_parameters_rtpkv_lacks_are_refused_as_not_supported(client, extra):
    (name, _), = extra.items()
    res = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, **extra})
    assert res.status_code == 400
    err = res.json()["error"]
    assert err["param"] == name and "not supported" in err["message"]
    assert "unknown generate_config" not in err["message"]


def test_openai_parameters_at_their_off_value_are_accepted(client):
    res = client.post("/v1/completions", json={
        "prompt": "hello", "max_tokens": 2, "n": 1, "echo": False,
        "response_format": {"type": "text"}, "tools": [], "presence_penalty": 0,
        "frequency_penalty": 0.0})
    assert res.status_code == 200, res.text


def _timeouts(client, route: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("rtpkv_requests_total{") and f'route="{route}"' in line \
                and 'outcome="timeout"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("route,body", [
    ("/", {"prompt": "hello", "max_new_tokens": 500, "ignore_eos": True, "timeout_ms": 30}),
    ("/v1/completions", {"prompt": "hello", "max_tokens": 500, "ignore_eos": True,
                         "timeout_ms": 30})])
def test_a_timeout_is_counted_once(client, route, body):
    before = _timeouts(client, route)
    assert client.post(route, json=body).status_code == 504
    assert _timeouts(client, route) == before + 1


def test_a_client_that_leaves_before_its_body_logs_no_traceback(edge_server, client):
    server, _ = edge_server
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    loggers = [logging.getLogger(n) for n in ("uvicorn.error", "uvicorn", "rtpkv", "")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", server.port)) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                             b"content-type: application/json\r\ncontent-length: 1000\r\n\r\n"
                             b'{"prompt": ')
            time.sleep(0.3)
        assert client.get("/health").status_code == 200
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    noisy = [r for r in records if r.exc_info or r.levelno >= logging.WARNING]
    assert not noisy, [r.getMessage() for r in noisy]


@pytest.fixture
def byte_run_output(edge_server, monkeypatch):
    """Every request generates a ByteFallback run valid so far ("é"), then invalid, then a
    word: a stream shows "é" before the full decode turns the run into U+FFFD."""
    from rtpkv.engine import engine as engine_module

    _, pipe = edge_server
    tok = pipe.tokenizer
    forced = [tok.convert_tokens_to_ids(t) for t in ("<0xC3>", "<0xA9>", "<0x95>", "▁hello")]

    def sample_batch(logits, requests):
        return [forced[r.num_output % len(forced)] for r in requests], {}

    monkeypatch.setattr(engine_module, "sample_batch", sample_batch)
    full = tok.decode(forced, skip_special_tokens=True)
    assert full.startswith("\ufffd\ufffd")
    return pipe, full


def test_non_streaming_text_is_the_full_decode(byte_run_output, client):
    pipe, full = byte_run_output
    config = {"max_new_tokens": 4, "ignore_eos": True}
    deltas = [r.generate_texts[0] for r in pipe("hi", return_incremental=True, **config)]
    assert "".join(deltas) == full and "é" not in deltas  # the run was held, never shown
    last = list(pipe("hi", **config))[-1]
    assert last.generate_texts[0] == full == pipe.tokenizer.decode(last.output_ids,
                                                                   skip_special_tokens=True)
    assert client.post("/", json={"prompt": "hi", **config}).json()["response"] == full
    res = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4,
                                               "ignore_eos": True})
    assert res.json()["choices"][0]["text"] == full


def test_a_native_stream_never_takes_back_a_byte_run_it_showed(byte_run_output, client):
    """`POST /` streaming (`yield_generator`) cumulative texts over byte runs that decode ("é") until a stray
    byte makes the whole run U+FFFD: every update is a prefix of the next, the last is the
    full decode."""
    pipe, _ = byte_run_output
    body = {"prompt": "hi", "max_new_tokens": 10, "ignore_eos": True, "yield_generator": True}
    with client.stream("POST", "/", json=body) as res:
        texts = [orjson.loads(line[5:])["response"] for line in res.iter_lines()
                 if line.startswith("data:{")]
    last = list(pipe("hi", max_new_tokens=10, ignore_eos=True))[-1]
    full = pipe.tokenizer.decode(last.output_ids, skip_special_tokens=True)
    assert len(texts) == 10 and texts[-1] == full and "\ufffd" in full
    for shown, later in zip(texts, texts[1:]):
        assert later.startswith(shown), (shown, later)


def test_a_byte_run_is_shown_once_it_ends_or_is_known_invalid(make_pipeline):
    """Held while it may still decode (at most HOLD_TOKENS pieces); a run that ends decodes
    as the full decode does; an invalid run shows U+FFFD per byte as it grows."""
    from rtpkv.text_stream import TextStream

    tok = make_pipeline().tokenizer
    ids = [tok.convert_tokens_to_ids(t) for t in
           ("▁hi", "<0xC3>", "<0xA9>", "▁a", "<0x95>", "<0x95>", "<0xC3>", "<0xA9>", "▁b")]
    stream = TextStream(tok, [])
    shown = [stream.visible(ids[:n], n == len(ids)) for n in range(1, len(ids) + 1)]
    assert shown[1] == shown[2] == shown[0]                       # "é" held
    assert shown[3] == tok.decode(ids[:4], skip_special_tokens=True)   # it ended: "é a"
    assert shown[4].endswith("\ufffd") and shown[5].endswith("\ufffd" * 2)  # known invalid
    assert shown[-1] == tok.decode(ids, skip_special_tokens=True)
    for a, b in zip(shown, shown[1:]):
        assert b.startswith(a)


def test_a_poisoned_temperature_over_http_is_answered(client):
    res = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4,
                                               "temperature": 1e-45, "ignore_eos": True})
    assert res.status_code == 200, res.text
    assert res.json()["usage"]["completion_tokens"] == 4


def test_a_long_tokenization_does_not_hold_up_other_streams(make_pipeline, monkeypatch):
    from rtpkv.pipeline import LONG_PROMPT_CHARS

    pipe = make_pipeline()
    cls = type(pipe.tokenizer.wrapped)
    real = cls.__call__
    started = threading.Event()

    def slow(self, text, *args, **kwargs):
        if isinstance(text, str) and len(text) > LONG_PROMPT_CHARS:
            started.set()
            time.sleep(3)                                  # a long prompt being encoded
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(cls, "__call__", slow)
    long_prompt = "hello " * (LONG_PROMPT_CHARS // 6 + 10)
    worker = threading.Thread(target=_swallow, args=(pipe, long_prompt))
    worker.start()
    assert started.wait(10)
    began = time.monotonic()
    last = list(pipe([5, 6, 7, 8], top_k=1, max_new_tokens=3, ignore_eos=True))[-1]
    assert last.finished and time.monotonic() - began < 1.5, "decoding waited for the encoder"
    worker.join(10)


def _swallow(pipe, prompt: str) -> None:
    """Run a request whose outcome does not matter here (it may be too long)."""
    try:
        list(pipe(prompt, max_new_tokens=1))
    except Exception:
        pass


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_during_submission_is_released_at_once(edge_server, client,
                                                                    monkeypatch, stream):
    """The request is cancelled and uncounted when its submission returns, not when its
    stream is garbage-collected."""
    server, pipe = edge_server
    real = pipe._tokenize
    started, release = threading.Event(), threading.Event()

    def slow(prompt, with_special):
        started.set()
        release.wait(10)
        return real(prompt, with_special)

    monkeypatch.setattr(pipe, "_tokenize", slow)
    cancelled = _cancelled(client)
    gc.disable()
    try:
        body = orjson.dumps({"prompt": "a long story", "max_tokens": 500, "ignore_eos": True,
                             "stream": stream})
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                         b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            assert started.wait(10)
        time.sleep(0.3)                                  # the server reads the disconnect
        release.set()

        def released() -> bool:                          # the engine drops it within one step
            stats = client.get("/cache_status").json()
            return (stats["requests_in_flight"] == stats["requests_running"]
                    == stats["requests_waiting"] == 0
                    and stats["blocks_in_use"] == stats["blocks_pinned"])

        assert wait_until(released, timeout=5)
        assert _cancelled(client) == cancelled + 1      # cancelled, not run to max_tokens
    finally:
        gc.enable()


def _cancelled(client) -> float:
    sample = 'rtpkv_requests_total{outcome="cancelled",route="/v1/completions"} '
    lines = [line for line in client.get("/metrics").text.splitlines() if line.startswith(sample)]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_a_submission_whose_caller_is_cancelled_is_closed_when_it_returns(edge_server):
    """Cancelled while its prompt is submitted in a thread, a request is cancelled and released
    as soon as the thread returns (the test holds the stream: no collection can close it)."""
    _, pipe = edge_server
    state = ServerState(pipe, "tiny")
    entered, release = threading.Event(), threading.Event()
    streams = []

    def submit():
        entered.set()
        release.wait(10)
        streams.append(pipe.pipeline_async("a long story", max_new_tokens=500, ignore_eos=True))
        return streams[-1]

    async def main() -> None:
        task = asyncio.ensure_future(state.start("/", 1, submit))
        assert await asyncio.to_thread(entered.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert state.in_flight == 1                     # still submitting: still counted
        release.set()
        for _ in range(200):
            if state.in_flight == 0:
                break
            await asyncio.sleep(0.01)
        assert state.in_flight == 0

    asyncio.run(main())
    (stream,) = streams
    (req,) = stream.requests
    assert req.cancelled and req.done.wait(5)
    assert req.num_output < 500


@pytest.fixture(scope="module")
def render_server(llama_path):
    """The default body limit (16 MB): an 8 MB body is read and parsed."""
    model = load(llama_path, kv_cache_max_tokens=8192, concurrency_limit=8)
    pipe = Pipeline(model, model.tokenizer)
    with ServerThread(create_app(pipe, "tiny")) as server:
        yield server, pipe
    pipe.stop()


def test_large_render_and_chat_bodies_never_stall_health_or_a_stream(render_server):
    """Beside a live stream: an 8 MB render body, 2,000 prompts of 4,000 characters to
    render, an 8 MB chat message to render and to generate from. Each is refused by name
    (too long for max_seq_len, untokenized; more prompts than CONCURRENCY_LIMIT) while
    /health answers within 0.5 s throughout and the stream runs to its end."""
    server, pipe = render_server
    big = "word " * (8 * 2**20 // 5)
    bodies = [("/v1/completions/render", {"prompt": big}, "characters"),
              ("/v1/completions/render", {"prompt": ["x" * 4000] * 2000}, "CONCURRENCY_LIMIT"),
              ("/v1/chat/completions/render",
               {"messages": [{"role": "user", "content": big}]}, "characters"),
              ("/v1/chat/completions",
               {"messages": [{"role": "user", "content": big}], "max_tokens": 2}, "characters")]
    done, worst, stream = threading.Event(), [0.0], {}

    def watch() -> None:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            while not done.is_set():
                began = time.monotonic()
                assert c.get("/health").status_code == 200
                worst[0] = max(worst[0], time.monotonic() - began)
                time.sleep(0.02)

    def run_stream() -> None:
        body = {"prompt": "hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=server.url, timeout=120) as c:
            with c.stream("POST", "/v1/completions", json=body) as res:
                stream["lines"] = [line for line in res.iter_lines() if line]

    watcher, streamer = threading.Thread(target=watch), threading.Thread(target=run_stream)
    watcher.start()
    streamer.start()
    try:
        with httpx.Client(base_url=server.url, timeout=120) as c:
            for route, body, said in bodies:
                res = c.post(route, content=orjson.dumps({"model": "tiny", **body}),
                             headers={"content-type": "application/json"})
                assert res.status_code == 400, (route, res.status_code, res.text[:300])
                assert said in res.json()["error"]["message"], res.text[:300]
        streamer.join(120)
    finally:
        done.set()
        watcher.join(30)
    last = orjson.loads(stream["lines"][-2].removeprefix("data: "))
    assert stream["lines"][-1] == "data: [DONE]"
    assert last["choices"][0]["finish_reason"] == "length"
    assert worst[0] < 0.5, f"/health took {worst[0]:.2f} s"
