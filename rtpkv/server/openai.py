"""OpenAI's schema: /v1/chat/completions and /v1/completions requests mapped onto
generate_config, and their responses and SSE chunks.

Fields rtpkv does not implement are not declared: like any undeclared key they pass through to
generate_config (that is how rtpkv's extras such as `task_id`, `cache_salt`, `top_k` arrive from
the `openai` client's `extra_body`), so an unsupported one is refused by name there.
`usage.prompt_tokens_details.cached_tokens` is the request's `reuse_len`.

OpenAI's prompt-cache controls: `prompt_cache_retention` ("in_memory", "24h") holds the whole
prompt at a retention priority for a while (rtpkv.server.cache_controls has the table);
`prompt_cache_key` is accepted, and is the request's `cache_salt` only on a server started with
PROMPT_CACHE_KEY_SALT=1 (OpenAI's key groups requests for routing; it isolates nothing unless
the operator makes it).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncGenerator, Literal, Optional, Union

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rtpkv.pipeline import BatchResponse, Response, TokenLogprob
from rtpkv.server.cache_controls import OPENAI_RETENTION, whole_prompt
from rtpkv.server.errors import ApiError, ErrorCode, api_error

DONE = "data: [DONE]\n\n"
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


# OpenAI parameters rtpkv does not implement, with the value that leaves each off: any other
# value is refused as "not supported", naming the parameter (not as an unknown generate_config
# key).
_OFF = object()
UNSUPPORTED: dict[str, Any] = {
    "n": 1, "best_of": 1, "echo": False,
    "response_format": _OFF, "tools": _OFF, "tool_choice": _OFF, "functions": _OFF,
    "function_call": _OFF, "parallel_tool_calls": _OFF, "logit_bias": _OFF, "suffix": _OFF,
    "presence_penalty": 0, "frequency_penalty": 0,
}


def _leaves_off(name: str, value: Any) -> bool:
    if value is None:
        return True
    off = UNSUPPORTED[name]
    if off is _OFF:  # null, false, an empty list or object, or plain text output
        return value in (False, [], {}) or (name == "response_format" and value == {"type": "text"})
    if isinstance(off, bool):
        return value is off
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == off


def refuse_unsupported(body: dict[str, Any]) -> None:
    for name in UNSUPPORTED:
        if name in body and not _leaves_off(name, body[name]):
            off = UNSUPPORTED[name]
            hint = "" if off is _OFF else f"; {name}: {off!r} is"
            raise ApiError(400, ErrorCode.ERROR_INPUT_FORMAT_ERROR,
                           f"{name}: {body[name]!r} is not supported by rtpkv{hint}", name)


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    user: Optional[str] = None  # OpenAI's end-user id: accepted for compatibility, not used
    prompt_cache_key: Optional[str] = Field(None, min_length=1, max_length=256)
    prompt_cache_retention: Optional[Literal["in_memory", "24h"]] = None
    # The routers forward their own request models whole (SGLang's, vLLM's): their fields at the
    # values that leave them off are accepted, so a router in front of rtpkv works unmodified;
    # any other value is refused.
    no_stop_trim: Literal[False] = False

    def generate_config(self, key_is_salt: bool = False) -> dict[str, Any]:
        """The rtpkv generate_config: mapped OpenAI fields, then the extras as given (the
        unsupported OpenAI parameters, checked in `parse`, left off); `key_is_salt`: the
        prompt_cache_key is the cache_salt (PROMPT_CACHE_KEY_SALT)."""
        config: dict[str, Any] = {k: v for k, v in (self.model_extra or {}).items()
                                  if k not in UNSUPPORTED}
        if self.prompt_cache_retention is not None:
            if config.get("kv_cache_retention_config") is not None:
                raise ApiError(400, ErrorCode.ERROR_INPUT_FORMAT_ERROR,
                               "give either prompt_cache_retention or kv_cache_retention_config, "
                               "not both", "prompt_cache_retention")
            config["kv_cache_retention_config"] = whole_prompt(
                OPENAI_RETENTION[self.prompt_cache_retention])
        if key_is_salt and self.prompt_cache_key is not None:
            if config.get("cache_salt") not in (None, self.prompt_cache_key):
                raise ApiError(400, ErrorCode.ERROR_INPUT_FORMAT_ERROR,
                               "prompt_cache_key is this server's cache_salt "
                               "(PROMPT_CACHE_KEY_SALT=1); give one of them", "prompt_cache_key")
            config["cache_salt"] = self.prompt_cache_key
        mapped = {"max_new_tokens": self.max_new_tokens(), "temperature": self.temperature,
                  "top_p": self.top_p, "random_seed": self.seed,
                  "stop_words_str": [self.stop] if isinstance(self.stop, str) else self.stop}
        config.update({k: v for k, v in mapped.items() if v is not None})
        if self.top_alternatives() is not None:
            config["logprobs"] = self.top_alternatives()
        # a stream relays the pipeline's own deltas; an answer is the final text
        config["return_incremental"] = self.stream
        return config

    def max_new_tokens(self) -> Optional[int]:
        return self.max_tokens

    def top_alternatives(self) -> Optional[int]:
        """generate_config's `logprobs`: None (no log-probabilities) or how many alternatives."""
        return None


class ChatCompletionRequest(_Common):
    messages: list[dict[str, Any]]
    continue_final_message: Literal[False] = False   # SGLang's router's fields, see no_stop_trim
    # no effect: rtpkv parses no reasoning out of the text (SGLang's and vLLM's routers send them)
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    include_reasoning: bool = True
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)

    def top_alternatives(self) -> Optional[int]:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, ErrorCode.ERROR_INPUT_FORMAT_ERROR,
                           "top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def max_new_tokens(self) -> Optional[int]:
        if self.max_completion_tokens is not None and self.max_tokens is not None \
                and self.max_completion_tokens != self.max_tokens:
            raise ApiError(400, ErrorCode.ERROR_INPUT_FORMAT_ERROR,
                           f"max_tokens={self.max_tokens} and max_completion_tokens="
                           f"{self.max_completion_tokens} disagree; give one", "max_tokens")
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Common):
    prompt: Union[str, list[str], list[int]]
    logprobs: Optional[int] = Field(None, ge=0, le=5)

    def top_alternatives(self) -> Optional[int]:
        return self.logprobs

    @property
    def batch(self) -> bool:
        return isinstance(self.prompt, list) and any(isinstance(p, str) for p in self.prompt)

    @property
    def num_prompts(self) -> int:
        return len(self.prompt) if self.batch else 1


def parse(kind: type[_Common], body: dict[str, Any]) -> Any:
    """Validate a request; the error names the first bad field and what it accepts."""
    refuse_unsupported(body)
    try:
        return kind.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        value = err.get("input")
        shown = "missing" if err["type"] == "missing" else f"{value!r} is invalid"
        raise ApiError(400, ErrorCode.ERROR_INPUT_FORMAT_ERROR,
                       f"{field}: {shown}: {err['msg'].removeprefix('Value error, ')}",
                       field) from None


def usage(aux: list[dict[str, Any]]) -> dict[str, Any]:
    prompt = sum(a.get("input_len", 0) + a.get("prefix_len", 0) for a in aux)
    completion = sum(a.get("output_len", 0) for a in aux)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(a.get("reuse_len", 0) for a in aux)}}


def _members(res: Union[Response, BatchResponse]) -> list[Response]:
    return res.responses if isinstance(res, BatchResponse) else [res]


def _finish_reason(res: Response) -> Optional[str]:
    if not res.finished:
        return None
    return FINISH_REASONS.get(res.aux_info.get("finish_reason"), "stop")


class Shaper:
    """Builds one request's OpenAI objects: chat.completion(.chunk) or text_completion."""

    def __init__(self, chat: bool, model: str, tokenizer: Any = None):
        self.chat, self.model, self.tokenizer = chat, model, tokenizer
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, res: Union[Response, BatchResponse]) -> dict[str, Any]:
        choices = []
        for i, r in enumerate(_members(res)):
            text = r.generate_texts[0]
            choice: dict[str, Any] = {"index": i, "finish_reason": _finish_reason(r),
                                      "logprobs": self._logprobs(r.output_ids, r.logprobs, 0)}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
        return {**self._head(self.object), "choices": choices,
                "usage": usage([r.aux_info for r in _members(res)])}

    def _piece(self, ids: list[int], i: int) -> str:
        """Token i's text: what it adds to the decode of the tokens before it."""
        before = self.tokenizer.decode(ids[:i])
        after = self.tokenizer.decode(ids[:i + 1])
        return after[len(before):] if after.startswith(before) else self.tokenizer.decode(ids[i:i + 1])

    def _logprobs(self, ids: list[int], entries: Optional[list[TokenLogprob]],
                  start: int) -> Optional[dict[str, Any]]:
        """OpenAI's logprobs object for tokens start.. (chat: `content`; completions: parallel
        lists with text offsets), or None when not asked for."""
        if entries is None:
            return None
        entries = entries[start:]
        pieces = [self._piece(ids, start + i) for i in range(len(entries))]

        def alternatives(entry: TokenLogprob) -> list[tuple[str, float]]:
            return [(self.tokenizer.decode([t]), lp) for t, lp in entry.top]

        if self.chat:
            return {"content": [
                {"token": piece, "logprob": e.logprob, "bytes": list(piece.encode()),
                 "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                                  for t, lp in alternatives(e)]}
                for piece, e in zip(pieces, entries)]}
        offset = len(self.tokenizer.decode(ids[:start])) if start else 0
        offsets = []
        for piece in pieces:
            offsets.append(offset)
            offset += len(piece)
        return {"tokens": pieces, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [dict(alternatives(e)) for e in entries],
                "text_offset": offsets}

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return "data: " + orjson.dumps({**self._head(obj), "choices": choices, **extra}).decode() \
            + "\n\n"

    def _choice(self, index: int, text: Optional[str], finish: Optional[str],
                role: bool = False, logprobs: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            return {"index": index, "delta": delta, "finish_reason": finish,
                    "logprobs": logprobs}
        return {"index": index, "text": text or "", "finish_reason": finish,
                "logprobs": logprobs}

    async def events(self, responses: AsyncGenerator[Union[Response, BatchResponse], None],
                     include_usage: bool) -> AsyncGenerator[str, None]:
        """OpenAI's SSE stream: a role chunk first (chat), a chunk per choice whose text grew
        (the pipeline's return_incremental delta), a chunk with its finish_reason, the usage
        chunk when asked, then `data: [DONE]`."""
        done: list[bool] = []
        sent: list[int] = []   # log-probabilities already sent, per choice
        last: Optional[Union[Response, BatchResponse]] = None
        try:
            async for res in responses:
                last = res
                members = _members(res)
                if not done:
                    done, sent = [False] * len(members), [0] * len(members)
                    if self.chat:
                        yield self._chunk([self._choice(i, "", None, role=True)
                                           for i in range(len(members))])
                for i, r in enumerate(members):
                    delta = r.generate_texts[0]
                    finish = r.finished and not done[i]
                    logprobs = None
                    if (delta or finish) and r.logprobs is not None:
                        logprobs = self._logprobs(r.output_ids, r.logprobs, sent[i])
                        sent[i] = len(r.logprobs)
                    if delta:
                        yield self._chunk([self._choice(i, delta, None, logprobs=logprobs)])
                        logprobs = None
                    if finish:
                        done[i] = True
                        yield self._chunk([self._choice(i, None if self.chat else "",
                                                        _finish_reason(r), logprobs=logprobs)])
            if include_usage and last is not None:
                yield self._chunk([], usage=usage([r.aux_info for r in _members(last)]))
        except Exception as exc:
            yield "data: " + orjson.dumps(api_error(exc).openai_body()).decode() + "\n\n"
        finally:
            await responses.aclose()
        yield DONE
