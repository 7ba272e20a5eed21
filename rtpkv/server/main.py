"""`rtpkv serve`: load the checkpoint named by CHECKPOINT_PATH (or --model), build the app, and
run uvicorn on HOST:START_PORT until SIGTERM/SIGINT; then stop accepting, let in-flight requests
finish for up to `shutdown_timeout` seconds, cancel the rest, stop the engine, exit 0."""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Optional

import uvicorn

from rtpkv.config import Settings
from rtpkv.errors import ConfigError
from rtpkv.server.app import create_app

log = logging.getLogger("rtpkv")

DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0


def serve(model: Optional[str] = None, host: Optional[str] = None, port: Optional[int] = None,
          served_model_name: Optional[str] = None,
          shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S, log_level: str = "info") -> None:
    """Serve one model in this process. Arguments override the environment's CHECKPOINT_PATH,
    HOST and START_PORT; every other option comes from the environment (Settings)."""
    from rtpkv.model_factory import ModelConfig, ModelFactory
    from rtpkv.pipeline import Pipeline

    settings = Settings.from_env()
    path = model or settings.checkpoint_path
    if not path:
        raise ConfigError("no model: set CHECKPOINT_PATH or pass --model")
    loaded = ModelFactory.from_huggingface(path, ModelConfig())
    pipeline = Pipeline(loaded, loaded.tokenizer)
    name = served_model_name or Path(str(path).rstrip("/")).name
    app = create_app(pipeline, name, max_body_bytes=int(settings.max_request_body_mb * 2**20))
    config = uvicorn.Config(app, host=host or settings.host, port=port or settings.start_port,
                            log_level=log_level, timeout_graceful_shutdown=shutdown_timeout,
                            access_log=False)
    # uvicorn re-raises the stop signal once it has shut down gracefully; a container's SIGTERM
    # is the normal way to stop, so the re-raised signal is ignored and the process exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        uvicorn.Server(config).run()
    finally:
        pipeline.stop()
