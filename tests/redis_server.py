"""A private redis-server for tests and benchmarks: loopback only, a free port, a temporary
directory, no persistence, stopped (never left running) by whoever started it."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

LOOPBACK = "127.0.0.1"


class RedisServerError(RuntimeError):
    """redis-server is missing or did not come up."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


class RedisServer:
    """`redis-server` on 127.0.0.1:<port> in `directory`; `kill` and `start` again keep the port."""

    def __init__(self, directory: Optional[Path] = None, port: Optional[int] = None,
                 args: Sequence[str] = ()):
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RedisServerError(
                "redis-server is not on PATH: install the system package (apt-get install -y "
                "redis-server; .ci/run does this) to run the remote-tier tests")
        self._own_dir = directory is None
        self.directory = Path(directory or tempfile.mkdtemp(prefix="rtpkv-redis-"))
        self.port = port or free_port()
        self.args = list(args)
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "RedisServer":
        log = open(self.directory / "redis.log", "ab")
        self.proc = subprocess.Popen(
            [self.binary, "--bind", LOOPBACK, "--port", str(self.port), "--dir", str(self.directory),
             "--save", "", "--appendonly", "no", "--daemonize", "no", "--protected-mode", "yes",
             "--maxmemory", "1gb", "--maxmemory-policy", "allkeys-lru", *self.args],
            stdout=log, stderr=subprocess.STDOUT, cwd=self.directory)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if self.ping():
                return self
            time.sleep(0.02)
        self.kill()
        tail = (self.directory / "redis.log").read_text(errors="replace")[-2000:]
        raise RedisServerError(f"redis-server did not answer on {LOOPBACK}:{self.port} within "
                               f"{timeout:.0f} s; its log ends with:\n{tail}")

    def ping(self) -> bool:
        try:
            with socket.create_connection((LOOPBACK, self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def kill(self) -> None:
        """Stop at once (SIGKILL), like a crashed server."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        self.kill()
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class SilentServer:
    """Accepts TCP connections on loopback and never answers: a hung server."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind((LOOPBACK, 0))
        self.sock.listen(64)
        self.sock.settimeout(0.05)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._closed = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        self._closed = True
        self._thread.join()
        self.sock.close()
        for conn in self.accepted:
            conn.close()
