"""What the server's routes share (ServerState): the pipeline, the served model's name, the
metrics, and in-flight accounting under CONCURRENCY_LIMIT with submission off the event loop."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, Callable, Union

from rtpkv.pipeline import BatchResponse, Pipeline, Response, ResponseStream
from rtpkv.server.errors import ApiError, ErrorCode, api_error
from rtpkv.server.metrics import ServerMetrics


@dataclass
class ServerState:
    """What the routes share: the pipeline, the served model's name, in-flight accounting."""

    pipeline: Pipeline
    model_name: str
    metrics: ServerMetrics = field(init=False)
    in_flight: int = 0
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.pipeline.cache_stats, lambda: self.in_flight,
                                     self.model_name)

    @property
    def concurrency_limit(self) -> int:
        return self.pipeline.config.concurrency_limit

    def check_available(self) -> None:
        if self.pipeline.engine.stopped:
            raise ApiError(503, ErrorCode.ENGINE_STOPPED,
                           "the engine is stopped (the server is shutting down)")

    def reserve(self, num_prompts: int) -> None:
        """Count `num_prompts` in flight under CONCURRENCY_LIMIT (409 past it)."""
        self.check_available()
        if self.in_flight + num_prompts > self.concurrency_limit:
            raise ApiError(409, ErrorCode.CONCURRENCY_LIMIT_ERROR,
                           f"{self.in_flight} requests in flight + {num_prompts} new > "
                           f"CONCURRENCY_LIMIT={self.concurrency_limit}; retry later")
        self.in_flight += num_prompts

    async def start(self, route: str, num_prompts: int,
                    submit: Callable[[], ResponseStream]) -> AsyncGenerator[Any, None]:
        """Admit a request under CONCURRENCY_LIMIT (counted in prompts) and submit it off the
        event loop (tokenizing a long prompt must not stall other clients or /health)."""
        self.reserve(num_prompts)  # held while submitting, so the limit stays exact
        submitting = asyncio.ensure_future(asyncio.to_thread(submit))
        try:
            stream = await asyncio.shield(submitting)
        except asyncio.CancelledError:
            # the caller went away (its client left): the thread cannot be stopped, so what it
            # submits is cancelled as soon as it returns, not when its stream is collected
            submitting.add_done_callback(lambda done: self._abandon(route, num_prompts, done))
            raise
        except BaseException:
            self.in_flight -= num_prompts
            raise
        return self._run(route, num_prompts, stream)

    def _abandon(self, route: str, num_prompts: int, submitted: "asyncio.Future[Any]") -> None:
        """Close the stream of a submission whose caller was cancelled, and release it."""
        self.in_flight -= num_prompts
        if not submitted.cancelled() and submitted.exception() is None:
            submitted.result().close()
            self.metrics.requests.labels(route, "cancelled").inc()

    async def _run(self, route: str, num_prompts: int, stream: ResponseStream
                   ) -> AsyncGenerator[Union[Response, BatchResponse], None]:
        """The stream's responses; at the end (finished, failed, or closed because the client
        left) the requests are released and counted."""
        outcome = "cancelled"
        last: Union[Response, BatchResponse, None] = None
        try:
            async for res in stream:
                last = res
                yield res
            outcome = "finished"
        except Exception as exc:
            outcome = api_error(exc).outcome
            raise
        finally:
            stream.close()
            self.in_flight -= num_prompts
            if last is not None:
                for aux in (last.aux_info if isinstance(last, BatchResponse) else [last.aux_info]):
                    self.metrics.observe(aux)
            self.metrics.requests.labels(route, outcome).inc()
