"""The HTTP app: rtp-llm's native `POST /`, OpenAI's /v1 routes, /health, /cache_status and
/worker_status (also in FlexLB's shape) and /metrics over one Pipeline. Every route is async
on `pipeline_async`: the engine thread hands tokens to the event loop, so there is no thread
per request."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncGenerator, AsyncIterator, Callable

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response as HttpResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from prometheus_client import CONTENT_TYPE_LATEST

from rtpkv.pipeline import Pipeline, ResponseStream
from rtpkv.server import anthropic, flexlb, native, openai
from rtpkv.server.body_limit import DEFAULT_MAX_BODY_MB, BodyLimit
from rtpkv.server.errors import ApiError, ErrorCode, anthropic_body, api_error
from rtpkv.server.sse import ClientGone, EventStreamResponse, until_disconnect
from rtpkv.server.state import ServerState
from rtpkv.server.tenants import CacheSwitches, add_tenant_routes
from rtpkv.server.worker import add_worker_routes

log = logging.getLogger("rtpkv")

GENERATION_ROUTES = ("/", "/v1/chat/completions", "/v1/completions", "/v1/messages")
CLIENT_CLOSED = 499  # nginx's status for "client closed the request"
POLLED = ["GET", "POST"]   # the routes FlexLB polls take either (a POST body holds its params)
MAX_JSON_DEPTH = 64  # far above any real request (chat content parts nest 5 deep)
LARGE_BODY_BYTES = 64 * 1024   # bodies past this are parsed and checked off the event loop


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
    if len(raw) > LARGE_BODY_BYTES:  # megabytes take the loop tens of milliseconds
        return await asyncio.to_thread(_parsed, raw)
    return _parsed(raw)


def _parsed(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, its depth checked."""
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


def _error_body(path: str, err: ApiError) -> dict[str, Any]:
    """The error in its route family's shape: Anthropic's, OpenAI's under /v1, rtp-llm's."""
    if path.startswith("/v1/messages"):
        return anthropic_body(err)
    return err.openai_body() if path.startswith("/v1") else err.native_body()


def create_app(pipeline: Pipeline, model_name: str, stop_pipeline_on_shutdown: bool = True,
               max_body_bytes: int = int(DEFAULT_MAX_BODY_MB * 2**20),
               switches: CacheSwitches = CacheSwitches()) -> FastAPI:
    """The app over `pipeline`; on shutdown it stops the pipeline unless told otherwise.
    Request bodies over `max_body_bytes` are refused with 413 before they are parsed;
    `switches` say what clients' cache words may do (tenants, prompt_cache_key)."""
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
        return JSONResponse(_error_body(path, exc), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """404, 405, ... in the route family's error shape, not FastAPI's {"detail"}."""
        err = ApiError(exc.status_code, ErrorCode.ERROR_INPUT_FORMAT_ERROR,
                       f"{request.method} {request.url.path}: {exc.detail}")
        return JSONResponse(_error_body(request.url.path, err), status_code=exc.status_code,
                            headers=exc.headers)

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
        config = switches.salt(req.generate_config, request.headers)
        responses = await state.start("/", req.num_prompts, _submitting(
            lambda: pipeline.pipeline_async(req.prompt, config)))
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
        config = switches.salt(req.generate_config, request.headers)
        state.reserve(1)
        try:
            cached = await asyncio.to_thread(lambda: pipeline.prewarm(req.prompt, config))
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
        config = switches.salt(req.generate_config(switches.prompt_cache_key_salt),
                               request.headers)
        return await _openai(request, "/v1/chat/completions", req, 1,
                             lambda: pipeline.pipeline_async(messages=req.messages,
                                                             generate_config=config))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        req = openai.parse(openai.CompletionRequest, await _json_body(request))
        config = switches.salt(req.generate_config(switches.prompt_cache_key_salt),
                               request.headers)
        return await _openai(request, "/v1/completions", req, req.num_prompts,
                             lambda: pipeline.pipeline_async(req.prompt, config))

    # ------------------------------------------------------------------ Anthropic
    @app.post("/v1/messages")
    async def messages(request: Request) -> Any:
        body = await _json_body(request)
        anthropic.check_tools_supported(pipeline.tokenizer, body)
        req = anthropic.parse(anthropic.MessagesRequest, body)
        _check_model(req.model)
        chat = anthropic.to_chat(req.system, req.messages, req.cache_control)
        config = switches.salt(req.generate_config(), request.headers)
        shaper = anthropic.Shaper(model_name, pipeline.tokenizer, req.stop_sequences or [])

        def submit() -> ResponseStream:
            ids, cfg, shaper.cached_upto = anthropic.prepare(
                pipeline.tokenizer, chat, config, pipeline.config.seq_size_per_block,
                pipeline.config.reuse_cache)
            return pipeline.pipeline_async(ids, cfg)

        responses = await state.start("/v1/messages", 1, _submitting(submit))
        if req.stream:
            return EventStreamResponse(shaper.events(responses))
        return await _respond(request, responses, shaper.response)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict[str, Any]:
        body = await _json_body(request)
        anthropic.check_tools_supported(pipeline.tokenizer, body)
        req = anthropic.parse(anthropic.CountTokensRequest, body)
        _check_model(req.model)
        chat = anthropic.to_chat(req.system, req.messages)
        try:
            ids = await asyncio.to_thread(
                lambda: anthropic.render(pipeline.tokenizer, chat).token_ids)
        except Exception as exc:
            raise api_error(exc) from exc
        return {"input_tokens": len(ids)}

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

    @app.api_route("/cache_status", methods=POLLED)
    @app.api_route("/rtp_llm/cache_status", methods=POLLED)
    async def cache_status(request: Request) -> dict[str, Any]:
        """rtpkv's cache stats, and FlexLB's CacheStatus fields (rtpkv.server.flexlb)."""
        params = await _poll_params(request)
        stats = await asyncio.to_thread(pipeline.cache_stats)  # waits for the step's lock
        polled = await asyncio.to_thread(flexlb.cache_status, pipeline, stats, params)
        return {**stats, "requests_in_flight": state.in_flight,
                "task_ids": pipeline.tasks.ids(), **polled}

    @app.api_route("/worker_status", methods=POLLED)
    @app.api_route("/rtp_llm/worker_status", methods=POLLED)
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

    add_tenant_routes(app, pipeline, switches, _json_body)
    add_worker_routes(app, state, _json_body)  # render, model and server info (routers probe)
    return app
