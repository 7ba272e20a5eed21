"""rtp-llm's native route `POST /`: request parsing and response shapes.

    {"prompt": "hello", "generate_config": {"max_new_tokens": 32}, "yield_generator": true}
    {"prompt_batch": ["a", "b"], "generation_config": {...}}

Top-level keys other than these merge into generate_config (as keyword arguments do in
`pipeline(...)`), so an unknown key is refused by name. Answers are
`{"response", "finished", "aux_info"}`, or `{"response_batch": [...]}` for a batch; streams are
`data:<json>` events ending with `data:[done]`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncGenerator, AsyncIterator, Union

import orjson

from rtpkv.pipeline import BatchResponse, Response
from rtpkv.server.errors import ApiError, ErrorCode, api_error

DONE = "data:[done]\n\n"


@dataclass
class NativeRequest:
    prompt: Union[str, list[int], list[str]]
    generate_config: dict[str, Any]
    stream: bool
    batch: bool

    @property
    def num_prompts(self) -> int:
        return len(self.prompt) if self.batch else 1


def _bad(message: str, param: str,
         code: ErrorCode = ErrorCode.ERROR_INPUT_FORMAT_ERROR) -> ApiError:
    return ApiError(400, code, message, param)


def parse(body: dict[str, Any]) -> NativeRequest:
    body = dict(body)
    prompt = body.pop("prompt", None)
    batch = body.pop("prompt_batch", None)
    if prompt is not None and batch is not None:
        raise _bad("give either 'prompt' or 'prompt_batch', not both", "prompt_batch")
    if prompt is None and batch is None:
        raise _bad("request has no prompt: give 'prompt' (a string or token ids) or "
                   "'prompt_batch' (a list of strings)", "prompt", ErrorCode.NO_PROMPT_ERROR)
    if batch is not None and not (isinstance(batch, list) and batch
                                  and all(isinstance(p, str) for p in batch)):
        raise _bad("'prompt_batch' must be a non-empty list of strings", "prompt_batch")
    if prompt is not None and not isinstance(prompt, (str, list)):
        raise _bad(f"'prompt' must be a string or a list of token ids, got "
                   f"{type(prompt).__name__}", "prompt")
    if isinstance(prompt, list) and any(isinstance(p, str) for p in prompt):
        raise _bad("'prompt' is a list of strings: send a batch as 'prompt_batch'", "prompt")
    if "generate_config" in body and "generation_config" in body:
        raise _bad("give either 'generate_config' or 'generation_config', not both",
                   "generation_config")
    name = "generation_config" if "generation_config" in body else "generate_config"
    config = body.pop(name, None) or {}
    if not isinstance(config, dict):
        raise _bad(f"'{name}' must be an object, got {type(config).__name__}", name)
    config = {**config, **body}  # remaining top-level keys are generate_config keys
    stream = config.pop("yield_generator", False)
    if not isinstance(stream, bool):
        raise _bad(f"'yield_generator' must be true or false, got {stream!r}", "yield_generator")
    return NativeRequest(batch if batch is not None else prompt, config, stream, batch is not None)


def _one(res: Response) -> dict[str, Any]:
    item: dict[str, Any] = {"response": res.generate_texts[0], "finished": res.finished,
                            "aux_info": res.aux_info}
    if res.logits is not None:
        item["logits"] = res.logits.tolist()
    return item


def body(res: Union[Response, BatchResponse]) -> dict[str, Any]:
    if isinstance(res, BatchResponse):
        return {"response_batch": [_one(r) for r in res.responses]}
    return _one(res)


async def events(responses: AsyncGenerator[Union[Response, BatchResponse], None]
                 ) -> AsyncIterator[str]:
    """`data:<json>` per update, then `data:[done]`; an error mid-stream becomes a last
    `data:{"error_code", "message"}` event."""
    try:
        async for res in responses:
            yield "data:" + orjson.dumps(body(res)).decode() + "\n\n"
    except Exception as exc:
        yield "data:" + orjson.dumps(api_error(exc).native_body()).decode() + "\n\n"
    finally:
        await responses.aclose()
    yield DONE
