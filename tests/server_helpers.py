"""A real uvicorn server on a free loopback port, in a thread of the test process, and SSE
parsing for the tests of rtpkv.server."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any, Iterator

import httpx
import uvicorn


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1:<free port> until stop()."""

    def __init__(self, app: Any, shutdown_timeout: float = 5.0):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=shutdown_timeout)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


def sse_data(lines: Iterator[str]) -> Iterator[str]:
    """The payloads of `data:` lines (with or without the space after the colon)."""
    for line in lines:
        if line.startswith("data:"):
            yield line[5:].lstrip(" ")


def native_events(client: httpx.Client, body: dict[str, Any]) -> list[Any]:
    """POST / with yield_generator: the JSON events, then the literal "[done]"."""
    with client.stream("POST", "/", json={**body, "yield_generator": True}) as res:
        assert res.status_code == 200, res.read()
        assert res.headers["content-type"].startswith("text/event-stream")
        payloads = list(sse_data(res.iter_lines()))
    assert payloads[-1] == "[done]"
    return [json.loads(p) for p in payloads[:-1]] + ["[done]"]


def wait_until(predicate: Any, timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
