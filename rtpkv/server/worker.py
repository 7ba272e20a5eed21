"""The routes cache-aware routers probe on a worker, beyond generation and /health.

vllm-router's `kv_aware` policy scores replicas on the exact token ids of a request, which it
gets from the worker's render routes (vLLM's `/v1/completions/render` and
`/v1/chat/completions/render`: the request tokenized and templated, nothing generated), then
hashes them by block the way the replicas' KV events do. SGLang's router reads `/model_info`
and `/server_info` (or their older `/get_` names) when it registers a worker. A render here
tokenizes exactly as a generation request does (`Pipeline.prompt_token_ids` / `chat_prompt`),
so the ids a router hashes are the ids whose blocks the replica caches. Rendering takes the
generation routes' path (vllm-router's `kv_aware` renders every request it routes): off the
event loop, long texts on the pipeline's private tokenizer copy, a text too long for
max_seq_len refused untokenized, and at most CONCURRENCY_LIMIT prompts a request (the most one
generation request can be admitted with).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from fastapi import FastAPI, Request

from rtpkv.server import openai
from rtpkv.server.errors import ApiError, ErrorCode, api_error

if TYPE_CHECKING:
    from rtpkv.server.state import ServerState


def _generate_request(model: str, token_ids: list[int], max_tokens: Any) -> dict[str, Any]:
    """vLLM's GenerateRequest shape: the token ids a generation would be sent with."""
    return {"request_id": f"render-{uuid.uuid4().hex}", "model": model, "token_ids": token_ids,
            "sampling_params": {"max_tokens": max_tokens}}


def add_worker_routes(app: FastAPI, state: "ServerState",
                      json_body: Callable[[Request], Awaitable[dict[str, Any]]]) -> None:
    pipeline, model = state.pipeline, state.model_name

    def check_model(name: Any) -> None:
        if name is not None and name != model:
            raise ApiError(404, ErrorCode.ERROR_INPUT_FORMAT_ERROR,
                           f"model {name!r} does not exist; this server serves {model!r}", "model")

    def tokenized(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:
            raise api_error(exc) from exc

    def check_prompts(count: int) -> None:
        limit = state.concurrency_limit
        if count > limit:
            raise ApiError(400, ErrorCode.ERROR_INPUT_FORMAT_ERROR,
                           f"prompt has {count} entries; a request takes 1 to "
                           f"CONCURRENCY_LIMIT={limit}", "prompt")

    @app.post("/v1/completions/render")
    async def completions_render(request: Request) -> list[dict[str, Any]]:
        req = openai.parse(openai.CompletionRequest, await json_body(request))
        check_model(req.model)
        prompts = req.prompt if req.batch else [req.prompt]
        check_prompts(len(prompts))
        ids = await asyncio.to_thread(
            tokenized, lambda: [pipeline.prompt_token_ids(p) for p in prompts])
        return [_generate_request(model, i, req.max_tokens) for i in ids]

    @app.post("/v1/chat/completions/render")
    async def chat_render(request: Request) -> dict[str, Any]:
        req = openai.parse(openai.ChatCompletionRequest, await json_body(request))
        check_model(req.model)
        ids = await asyncio.to_thread(tokenized, lambda: pipeline.chat_prompt(req.messages))
        return _generate_request(model, ids, req.max_new_tokens())

    def model_info() -> dict[str, Any]:
        return {"model_path": model, "tokenizer_path": model, "is_generation": True,
                "served_model_name": model}

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return model_info()

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        config = pipeline.config
        block = config.seq_size_per_block
        return {**model_info(), "page_size": block,
                "max_total_num_tokens": pipeline.engine.pool_tokens,
                "max_running_requests": config.concurrency_limit,
                "context_length": config.max_seq_len, "dp_size": 1,
                "kv_events_endpoint": config.kv_events_endpoint,
                "kv_events_replay_endpoint": config.kv_events_replay_endpoint,
                "kv_events_topic": config.kv_events_topic}
