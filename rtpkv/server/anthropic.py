"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`): requests
rendered through the chat template, answers and SSE events in Anthropic's shapes.

`system` and the messages' text blocks become chat messages (a message's blocks joined as
OpenAI's text parts are). A `cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}` on a
block (up to 4; a top-level `cache_control` is one on the last block) marks the prompt up to the end of that block: each breakpoint's position is
where the chat rendered up to that block stops agreeing with the whole chat's tokens, and the
tokens from the previous breakpoint to it are held at the TTL's retention priority
(rtpkv.server.cache_controls). As Anthropic requires, a "1h" breakpoint may not follow a "5m".

Usage: `cache_read_input_tokens` is `reuse_len` (tokens read from the cache);
`cache_creation_input_tokens` the tokens up to the last breakpoint, whole blocks only, that this
request computed and cached (0 when reuse is off); `input_tokens` the rest of the prompt.

Refused by name, with 400 in Anthropic's error shape: images and documents, tool definitions
and tool blocks (a model whose chat template has no tool support cannot be given them, and rtpkv
parses no tool calls out of the output either way), extended thinking, and a final assistant
message (prefill). Keys the API does not define pass to generate_config as the `openai` routes'
extras do (`extra_body={"cache_salt": ...}`), so an unknown one is refused by name there.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, AsyncGenerator, Literal, Optional, Union

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rtpkv.cache.manager import common_prefix
from rtpkv.chat import render_chat
from rtpkv.pipeline import Response
from rtpkv.server.cache_controls import ANTHROPIC_TTL, prefixes
from rtpkv.server.errors import ApiError, ErrorCode, anthropic_body, api_error

MAX_BREAKPOINTS = 4
STOP_REASONS = {"eos": "end_turn", "stop": "stop_sequence", "length": "max_tokens"}
TTL_ORDER = {"1h": 0, "5m": 1}   # a breakpoint's TTL may not be longer than an earlier one's

# Messages API parameters rtpkv does not implement, with the values that leave each off.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []), "tool_choice": (None, {"type": "none"}, {"type": "auto"}),
    "thinking": (None, {"type": "disabled"}), "mcp_servers": (None, []), "container": (None,),
    "context_management": (None,), "output_config": (None, {}), "diagnostics": (None,),
    "speed": (None, "standard"),
}
REFUSED_BLOCKS = {"image": "images", "document": "documents", "search_result": "search results",
                  "tool_use": "tool calls", "tool_result": "tool results",
                  "server_tool_use": "tool calls", "web_search_tool_result": "tool results",
                  "thinking": "extended thinking", "redacted_thinking": "extended thinking"}


def _bad(message: str, param: Optional[str] = None) -> ApiError:
    return ApiError(400, ErrorCode.ERROR_INPUT_FORMAT_ERROR, message, param)


class CacheControl(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: Optional[Union[str, list[dict[str, Any]]]] = None
    stream: bool = False
    temperature: Optional[float] = Field(None, ge=0.0, le=1.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=0)
    stop_sequences: Optional[list[str]] = None
    # the request's last block as a breakpoint (Anthropic's automatic caching)
    cache_control: Optional[CacheControl] = None
    # bookkeeping: accepted, not used
    metadata: Optional[dict[str, Any]] = None
    service_tier: Optional[Literal["auto", "standard_only"]] = None
    inference_geo: Optional[str] = None
    user_profile_id: Optional[str] = None
    workspace_id: Optional[str] = None

    def generate_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {k: v for k, v in (self.model_extra or {}).items()
                                  if k not in UNSUPPORTED}
        if "task_id" in config:   # breakpoints count from the request's own first token
            raise _bad("task_id: not supported on /v1/messages; send the task's prompt as "
                       "`system` with a cache_control breakpoint", "task_id")
        mapped = {"max_new_tokens": self.max_tokens, "temperature": self.temperature,
                  "top_p": self.top_p, "top_k": self.top_k,
                  "stop_words_str": self.stop_sequences}
        config.update({k: v for k, v in mapped.items() if v is not None})
        config["return_incremental"] = self.stream
        return config


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: Optional[Union[str, list[dict[str, Any]]]] = None


def parse(kind: type[BaseModel], body: dict[str, Any]) -> Any:
    """Validate a request; the error names the first bad field and what it accepts."""
    for name, off in UNSUPPORTED.items():
        if name in body and not any(body[name] == v for v in off):
            raise _bad(f"{name}: {body[name]!r:.200} is not supported by rtpkv", name)
    try:
        return kind.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        shown = "missing" if err["type"] == "missing" else f"{err.get('input')!r:.200} is invalid"
        raise _bad(f"{field}: {shown}: {err['msg'].removeprefix('Value error, ')}",
                   field) from None


@dataclass
class Breakpoint:
    message: int     # index in the chat messages (the system message first, when there is one)
    part: int        # text part within that message
    ttl: str
    where: str       # the block it was given on, for errors


@dataclass
class Chat:
    """A request's chat messages (content as text parts) and its cache breakpoints."""

    messages: list[dict[str, Any]]
    breakpoints: list[Breakpoint]


def _text_blocks(content: Any, where: str, chat_index: int,
                 marks: list[Breakpoint]) -> list[dict[str, str]]:
    """A content (a string or a list of blocks) as text parts; its breakpoints go to `marks`."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not content:
        raise _bad(f"{where}: must be a string or a non-empty list of content blocks", where)
    parts = []
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in REFUSED_BLOCKS:
            raise _bad(f"{at}.type: {kind!r}: {REFUSED_BLOCKS[kind]} are not supported by rtpkv "
                       "(text blocks only)", f"{at}.type")
        if kind != "text" or not isinstance(block.get("text"), str):
            raise _bad(f"{at}: must be {{'type': 'text', 'text': str}}, got {block!r:.200}", at)
        unknown = sorted(set(block) - {"type", "text", "cache_control", "citations"})
        if unknown or block.get("citations"):
            raise _bad(f"{at}: {(unknown or ['citations'])[0]} is not supported by rtpkv", at)
        if block.get("cache_control") is not None:
            try:
                control = CacheControl.model_validate(block["cache_control"])
            except ValidationError as exc:
                err = exc.errors()[0]
                field = ".".join(str(p) for p in err["loc"])
                raise _bad(f"{at}.cache_control.{field}: {err.get('input')!r:.100} is invalid: "
                           f"{err['msg']}", f"{at}.cache_control") from None
            marks.append(Breakpoint(chat_index, j, control.ttl, at))
        parts.append({"type": "text", "text": block["text"]})
    return parts


def to_chat(system: Any, messages: list[dict[str, Any]],
            last: Optional[CacheControl] = None) -> Chat:
    """The request as chat messages; errors name the offending block. `last`: the top-level
    cache_control, a breakpoint on the last block."""
    chat: list[dict[str, Any]] = []
    marks: list[Breakpoint] = []
    if system is not None:
        chat.append({"role": "system",
                     "content": _text_blocks(system, "system", 0, marks)})
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        role = msg.get("role")
        if role not in ("user", "assistant"):
            raise _bad(f"{where}.role: {role!r} is invalid; accepted: user, assistant",
                       f"{where}.role")
        unknown = sorted(set(msg) - {"role", "content"})
        if unknown:
            raise _bad(f"{where}.{unknown[0]} is not a message field", f"{where}.{unknown[0]}")
        chat.append({"role": role, "content": _text_blocks(msg.get("content"),
                                                           f"{where}.content", len(chat), marks)})
    if last is not None:
        where = f"messages[{len(messages) - 1}].content[{len(chat[-1]['content']) - 1}]"
        marks.append(Breakpoint(len(chat) - 1, len(chat[-1]["content"]) - 1, last.ttl, where))
    if chat[-1]["role"] == "assistant":
        raise _bad(f"messages[{len(messages) - 1}]: a final assistant message (prefilling the "
                   "answer) is not supported by rtpkv", f"messages[{len(messages) - 1}]")
    if len(marks) > MAX_BREAKPOINTS:
        raise _bad(f"cache_control: {len(marks)} breakpoints; at most {MAX_BREAKPOINTS} are "
                   "accepted", "cache_control")
    for a, b in zip(marks, marks[1:]):
        if TTL_ORDER[b.ttl] < TTL_ORDER[a.ttl]:
            raise _bad(f"{b.where}.cache_control.ttl: a '1h' breakpoint may not follow a '5m' "
                       f"one ({a.where})", f"{b.where}.cache_control")
    return Chat(chat, marks)


def check_tools_supported(tokenizer: Any, body: dict[str, Any]) -> None:
    """`tools` is refused by name, saying why for this model."""
    if body.get("tools"):
        template = getattr(tokenizer, "chat_template", None) or ""
        why = ("this model's chat template has no tool support" if "tools" not in template
               else "rtpkv does not parse tool calls out of the output")
        raise _bad(f"tools: not supported: {why}", "tools")


@dataclass
class Rendered:
    token_ids: list[int]
    ends: list[int]   # each breakpoint's end token, in order


def render(tokenizer: Any, chat: Chat) -> Rendered:
    """The prompt's token ids and where each breakpoint's prefix ends in them."""
    ids = render_chat(tokenizer, chat.messages)
    ends = []
    for mark in chat.breakpoints:
        head = chat.messages[:mark.message]
        cut = dict(chat.messages[mark.message],
                   content=chat.messages[mark.message]["content"][:mark.part + 1])
        prefix = render_chat(tokenizer, head + [cut], generation=False)
        ends.append(common_prefix(prefix, ids))
    return Rendered(ids, ends)


def retention(chat: Chat, rendered: Rendered) -> Any:
    """The breakpoints as a KvCacheRetentionConfig, or None without any."""
    if not chat.breakpoints:
        return None
    return prefixes([(end, ANTHROPIC_TTL[mark.ttl])
                     for mark, end in zip(chat.breakpoints, rendered.ends)])


def prepare(tokenizer: Any, chat: Chat, config: dict[str, Any], block_size: int,
            reuse: bool) -> tuple[list[int], dict[str, Any], int]:
    """The prompt's token ids, its generate_config with the breakpoints' retention, and the
    whole-block tokens up to the last breakpoint that the cache keeps (0: none, or reuse off).
    Tokenizes: called off the event loop."""
    rendered = render(tokenizer, chat)
    held = retention(chat, rendered)
    if held is None:
        return rendered.token_ids, config, 0
    if config.get("kv_cache_retention_config") is not None:
        raise _bad("give either cache_control breakpoints or kv_cache_retention_config, not both",
                   "kv_cache_retention_config")
    kept = rendered.ends[-1] // block_size * block_size
    return (rendered.token_ids, {**config, "kv_cache_retention_config": held},
            kept if reuse and config.get("reuse_cache", True) is not False else 0)


def _stop_sequence(res: Response, tokenizer: Any, stops: list[str]) -> Optional[str]:
    """The stop sequence that ended the output: the one found first in its full decode."""
    if res.aux_info.get("finish_reason") != "stop" or not stops:
        return None
    text = tokenizer.decode(res.output_ids)
    found = [(text.find(s), s) for s in stops if s in text]
    return min(found)[1] if found else None


class Shaper:
    """Builds one request's Anthropic objects: the message, or its SSE events."""

    def __init__(self, model: str, tokenizer: Any, stops: list[str]):
        self.model, self.tokenizer, self.stops = model, tokenizer, stops
        self.cached_upto = 0   # whole-block tokens up to the last breakpoint (`prepare`)
        self.id = "msg_" + uuid.uuid4().hex

    def usage(self, aux: dict[str, Any]) -> dict[str, int]:
        prompt = aux.get("input_len", 0) + aux.get("prefix_len", 0)
        read = aux.get("reuse_len", 0)
        created = max(0, min(self.cached_upto, prompt) - read)
        return {"input_tokens": prompt - read - created, "output_tokens": aux.get("output_len", 0),
                "cache_creation_input_tokens": created, "cache_read_input_tokens": read}

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model}

    def _stop(self, res: Response) -> dict[str, Any]:
        return {"stop_reason": STOP_REASONS.get(res.aux_info.get("finish_reason"), "end_turn"),
                "stop_sequence": _stop_sequence(res, self.tokenizer, self.stops)}

    def response(self, res: Response) -> dict[str, Any]:
        return {**self._head(), "content": [{"type": "text", "text": res.generate_texts[0]}],
                **self._stop(res), "usage": self.usage(res.aux_info)}

    @staticmethod
    def _event(kind: str, body: dict[str, Any]) -> str:
        return f"event: {kind}\ndata: " + orjson.dumps({"type": kind, **body}).decode() + "\n\n"

    async def events(self, responses: AsyncGenerator[Response, None]
                     ) -> AsyncGenerator[str, None]:
        """Anthropic's SSE stream: message_start (usage of the prompt), one text block
        (content_block_start, a content_block_delta per pipeline delta, content_block_stop),
        message_delta (stop reason, usage), message_stop; an error is an `error` event."""
        last: Optional[Response] = None
        try:
            async for res in responses:
                if last is None:
                    usage = {**self.usage(res.aux_info), "output_tokens": 0}
                    yield self._event("message_start", {"message": {
                        **self._head(), "content": [], "stop_reason": None,
                        "stop_sequence": None, "usage": usage}})
                    yield self._event("content_block_start", {
                        "index": 0, "content_block": {"type": "text", "text": ""}})
                    yield self._event("ping", {})
                last = res
                if res.generate_texts[0]:
                    yield self._event("content_block_delta", {
                        "index": 0, "delta": {"type": "text_delta",
                                              "text": res.generate_texts[0]}})
            if last is not None:
                yield self._event("content_block_stop", {"index": 0})
                yield self._event("message_delta", {"delta": self._stop(last),
                                                    "usage": self.usage(last.aux_info)})
                yield self._event("message_stop", {})
        except Exception as exc:
            yield self._event("error", {"error": anthropic_body(api_error(exc))["error"]})
        finally:
            await responses.aclose()
