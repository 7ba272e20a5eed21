"""`rtpkv serve`: bind HOST:START_PORT first (a busy port fails before the weights load), load
the checkpoint named by CHECKPOINT_PATH (or --model), warm up (WARM_UP, on by default), build the
app and run uvicorn on the bound socket until SIGTERM/SIGINT; then stop accepting and let
in-flight requests finish for up to `shutdown_timeout` seconds. At the deadline the engine is
stopped, so the requests still running end with "engine stopped" (503 JSON, or an error event
and `[done]` on a stream) before the connections close; the process exits 0."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from pathlib import Path
from typing import Any, Optional

import uvicorn

from rtpkv.config import Settings
from rtpkv.errors import ConfigError
from rtpkv.server.app import create_app
from rtpkv.server.tenants import CacheSwitches

log = logging.getLogger("rtpkv")

DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
ANSWER_GRACE_S = 5.0   # after the deadline: time to write the 503s and error events
WARM_UP_PROMPT_TOKENS = 96   # a prefill of more than one block and a few decodes


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound now; a busy or forbidden address is a ConfigError."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port} (HOST/--host, START_PORT/--port): "
                          f"{exc.strerror or exc}") from None
    return sock


def warm_up(pipeline: Any) -> float:
    """Run one short greedy request outside the cache (kernel builds and GEMM probes happen
    here, not in the first client's request); returns the seconds it took."""
    began = time.monotonic()
    vocab = pipeline.model.spec.vocab_size
    prompt = [(7 * i + 3) % vocab for i in range(min(WARM_UP_PROMPT_TOKENS,
                                                     pipeline.config.max_seq_len // 2))]
    for _ in pipeline(prompt, generate_config={"do_sample": False, "max_new_tokens": 4,
                                               "ignore_eos": True, "reuse_cache": False}):
        pass
    return time.monotonic() - began


class _Server(uvicorn.Server):
    """uvicorn, stopping the engine at the shutdown deadline so that the requests still running
    are answered with an error instead of being cut off by task cancellation."""

    def __init__(self, config: uvicorn.Config, pipeline: Any, deadline_s: float, url: str):
        super().__init__(config)
        self.pipeline, self.deadline_s, self.url = pipeline, deadline_s, url

    async def startup(self, sockets: Optional[list[socket.socket]] = None) -> None:
        await super().startup(sockets)
        if self.started:
            log.info("ready: serving %s", self.url)

    async def shutdown(self, sockets: Optional[list[socket.socket]] = None) -> None:
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self.deadline_s, lambda: loop.run_in_executor(
            None, self.pipeline.stop))
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def serve(model: Optional[str] = None, host: Optional[str] = None, port: Optional[int] = None,
          served_model_name: Optional[str] = None,
          shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S, log_level: str = "info",
          access_log: bool = True) -> None:
    """Serve one model in this process. Arguments override the environment's CHECKPOINT_PATH,
    HOST and START_PORT; every other option comes from the environment (Settings)."""
    from rtpkv.model_factory import ModelConfig, ModelFactory
    from rtpkv.pipeline import Pipeline

    settings = Settings.from_env()
    path = model or settings.checkpoint_path
    if not path:
        raise ConfigError("no model: set CHECKPOINT_PATH or pass --model")
    host, port = host or settings.host, port or settings.start_port
    sock = bind(host, port)
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    log.info("rtpkv serve: listening on %s once ready", url)
    try:
        loaded = ModelFactory.from_huggingface(path, ModelConfig())
        pipeline = Pipeline(loaded, loaded.tokenizer)
    except BaseException:
        sock.close()
        raise
    name = served_model_name or Path(str(path).rstrip("/")).name
    tiers = pipeline.engine.tier_names()
    log.info("model %r from %s: dtype %s, device %s, max_seq_len %d; tiers below the device "
             "pool: %s; CONCURRENCY_LIMIT %d", name, path, loaded.dtype, loaded.device,
             pipeline.config.max_seq_len, ", ".join(tiers) or "none",
             pipeline.config.concurrency_limit)
    try:
        if settings.warm_up:
            log.info("warming up (WARM_UP=0 skips it)")
            log.info("warm-up done in %.1f s", warm_up(pipeline))
        app = create_app(pipeline, name,
                         max_body_bytes=int(settings.max_request_body_mb * 2**20),
                         switches=CacheSwitches.from_settings(settings))
        config = uvicorn.Config(app, log_level=log_level, access_log=access_log,
                                timeout_graceful_shutdown=shutdown_timeout + ANSWER_GRACE_S)
        # uvicorn re-raises the stop signal once it has shut down gracefully; a container's
        # SIGTERM is the normal way to stop, so the re-raised signal is ignored: exit 0.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
        _Server(config, pipeline, shutdown_timeout, url).run(sockets=[sock])
    finally:
        sock.close()
        pipeline.stop()
