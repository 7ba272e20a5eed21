"""The HTTP app: rtp-llm's native `POST /`, OpenAI's /v1 routes, /health, /cache_status and
/worker_status (also in FlexLB's shape) and /metrics over one Pipeline. Every route is async
on `pipeline_async`: the engine thread hands tokens to the event loop, so there is no thread
per request."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, AsyncIterator, Callable, Union

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response as HttpResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from prometheus_client import CONTENT_TYPE_LATEST

from rtpkv.pipeline import BatchResponse, Pipeline, Response, ResponseStream
from rtpkv.server import flexlb, native, openai
from rtpkv.server.body_limit import DEFAULT_MAX_BODY_MB, BodyLimit
from rtpkv.server.errors import ApiError, ErrorCode, api_error
from rtpkv.server.metrics import ServerMetrics
from rtpkv.server.sse import ClientGone, EventStreamResponse, until_disconnect
from rtpkv.server.worker import add_worker_routes

log = logging.getLogger("rtpkv")

GENERATION_ROUTES = ("/", "/v1/chat/completions", "/v1/completions")
CLIENT_CLOSED = 499  # nginx's status for "client closed the request"
MAX_JSON_DEPTH = 64  # far above any real request (chat content parts nest 5 deep)


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


async def _last(responses: AsyncGenerator[Any, None]) -> Any:
    last = None
    try:
        async for last in responses:
            pass
    finally:
        await responses.aclose()
    return last


def _check_depth(body: Any) -> None:
    """Refuse JSON nested deeper than MAX_JSON_DEPTH: validating and reporting such a value
    would recurse past Python's limit."""
    level: list[Any] = [body]
    for _ in range(MAX_JSON_DEPTH + 1):
        level = [child for value in level
                 for child in (value.values() if isinstance(value, dict) else value)
                 if isinstance(child, (dict, list))]
        if not level:
            return
    raise ApiError(400, ErrorCode.ERROR_INPUT_FORMAT_ERROR,
                   f"request body is nested more than {MAX_JSON_DEPTH} levels deep")


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        raw = await request.body()
    except ClientDisconnect:  # an ordinary event: one line at debug level, no traceback
        log.debug("client %s left before sending its body", request.client)
        raise ClientGone() from None
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, ErrorCode.ERROR_INPUT_FORMAT_ERROR,
                       f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, ErrorCode.ERROR_INPUT_FORMAT_ERROR,
                       f"request body must be a JSON object, got {type(body).__name__}")
    _check_depth(body)
    return body


def _submitting(fn: Callable[[], ResponseStream]) -> Callable[[], ResponseStream]:
    """Pipeline validation errors become HTTP errors (400 naming the field, ...)."""
    def call() -> ResponseStream:
        try:
            return fn()
        except Exception as exc:
            raise api_error(exc) from exc
    return call


def create_app(pipeline: Pipeline, model_name: str, stop_pipeline_on_shutdown: bool = True,
               max_body_bytes: int = int(DEFAULT_MAX_BODY_MB * 2**20)) -> FastAPI:
    """The app over `pipeline`; on shutdown it stops the pipeline unless told otherwise.
    Request bodies over `max_body_bytes` are refused with 413 before they are parsed."""
    state = ServerState(pipeline, model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if stop_pipeline_on_shutdown:
            pipeline.stop()

    app = FastAPI(title="rtpkv", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.rtpkv = state

    @app.exception_handler(ClientGone)
    async def on_client_gone(request: Request, exc: ClientGone) -> HttpResponse:
        return HttpResponse(status_code=CLIENT_CLOSED)  # nobody is left to read it
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        path = request.url.path
        if path in GENERATION_ROUTES and not exc.counted:
            state.metrics.requests.labels(path, exc.outcome).inc()
        body = exc.openai_body() if path.startswith("/v1") else exc.native_body()
        return JSONResponse(body, status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """404, 405, ... in the route family's error shape, not FastAPI's {"detail"}."""
        err = ApiError(exc.status_code, ErrorCode.ERROR_INPUT_FORMAT_ERROR,
                       f"{request.method} {request.url.path}: {exc.detail}")
        body = err.openai_body() if request.url.path.startswith("/v1") else err.native_body()
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    async def _respond(request: Request, responses: Any, render: Callable[[Any], Any]) -> Any:
        """A non-streaming answer: the last update rendered as JSON; a client that went away
        cancels its work (499)."""
        try:
            last = await until_disconnect(request.receive, _last(responses))
        except ClientGone:
            return HttpResponse(status_code=CLIENT_CLOSED)
        except Exception as exc:
            err = api_error(exc)
            err.counted = True  # the stream's end counted it
            raise err from exc
        return JSONResponse(render(last))

    # ------------------------------------------------------------------ rtp-llm native
    @app.post("/")
    async def generate(request: Request) -> Any:
        req = native.parse(await _json_body(request))
        responses = await state.start("/", req.num_prompts, _submitting(
            lambda: pipeline.pipeline_async(req.prompt, req.generate_config)))
        if req.stream:
            return EventStreamResponse(native.events(responses))
        return await _respond(request, responses, native.body)

    @app.post("/prewarm")
    async def prewarm(request: Request) -> dict[str, Any]:
        """Compute and cache a prompt's K/V without generating (`pipeline.prewarm`): the
        native route's body, one `prompt`; answers how many of its tokens are now cached."""
        req = native.parse(await _json_body(request))
        if req.batch:
            raise ApiError(400, ErrorCode.ERROR_INPUT_FORMAT_ERROR,
                           "prewarm takes one 'prompt', not 'prompt_batch'", "prompt_batch")
        state.reserve(1)
        try:
            cached = await asyncio.to_thread(
                lambda: pipeline.prewarm(req.prompt, req.generate_config))
        except Exception as exc:
            raise api_error(exc) from exc
        finally:
            state.in_flight -= 1
        return {"cached_tokens": cached}

    # ------------------------------------------------------------------ OpenAI
    def _check_model(name: Any) -> None:
        if name is not None and name != model_name:
            raise ApiError(404, ErrorCode.ERROR_INPUT_FORMAT_ERROR,
                           f"model {name!r} does not exist; this server serves {model_name!r}",
                           "model")

    async def _openai(request: Request, route: str, req: Any, num_prompts: int,
                      submit: Callable[[], ResponseStream]) -> Any:
        _check_model(req.model)
        shaper = openai.Shaper(chat=route.endswith("chat/completions"), model=model_name,
                               tokenizer=pipeline.tokenizer)
        responses = await state.start(route, num_prompts, _submitting(submit))
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventStreamResponse(shaper.events(responses, include_usage))
        return await _respond(request, responses, shaper.response)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        req = openai.parse(openai.ChatCompletionRequest, await _json_body(request))
        config = req.generate_config()
        return await _openai(request, "/v1/chat/completions", req, 1,
                             lambda: pipeline.pipeline_async(messages=req.messages,
                                                             generate_config=config))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        req = openai.parse(openai.CompletionRequest, await _json_body(request))
        config = req.generate_config()
        return await _openai(request, "/v1/completions", req, req.num_prompts,
                             lambda: pipeline.pipeline_async(req.prompt, config))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": model_name, "object": "model", "created": state.created, "owned_by": "rtpkv",
             "max_model_len": pipeline.config.max_seq_len}]}

    # ------------------------------------------------------------------ operations
    @app.get("/health")
    async def health() -> JSONResponse:
        if pipeline.engine.stopped:
            return JSONResponse({"status": "stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def _poll_params(request: Request) -> dict[str, Any]:
        body = await _json_body(request) if request.method == "POST" and \
            await request.body() else None
        return flexlb.poll_params(request.query_params, body)

    @app.get("/cache_status")
    @app.post("/cache_status")
    @app.get("/rtp_llm/cache_status")
    @app.post("/rtp_llm/cache_status")
    async def cache_status(request: Request) -> dict[str, Any]:
        """rtpkv's cache stats, and FlexLB's CacheStatus fields (rtpkv.server.flexlb)."""
        params = await _poll_params(request)
        stats = await asyncio.to_thread(pipeline.cache_stats)  # waits for the step's lock
        polled = await asyncio.to_thread(flexlb.cache_status, pipeline, stats, params)
        return {**stats, "requests_in_flight": state.in_flight,
                "task_ids": pipeline.tasks.ids(), **polled}

    @app.get("/worker_status")
    @app.post("/worker_status")
    @app.get("/rtp_llm/worker_status")
    @app.post("/rtp_llm/worker_status")
    async def worker_status(request: Request) -> dict[str, Any]:
        """FlexLB's WorkerStatusResponse (rtpkv.server.flexlb)."""
        params = await _poll_params(request)
        stats = await asyncio.to_thread(pipeline.cache_stats)
        return await asyncio.to_thread(flexlb.worker_status, pipeline, stats, state.in_flight,
                                       params)

    @app.get("/metrics")
    async def metrics() -> HttpResponse:
        body = await asyncio.to_thread(state.metrics.render)  # reads cache_stats under its lock
        return HttpResponse(body, media_type=CONTENT_TYPE_LATEST)

    add_worker_routes(app, state, _json_body)  # render, model and server info (routers probe)
    return app
