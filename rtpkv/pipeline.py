"""Pipeline: prompt in, streaming responses out, with aux info on what the cache reused.

    pipeline = Pipeline(model, model.tokenizer)
    for res in pipeline("hello", generate_config={"top_k": 1, "max_new_tokens": 32}):
        print(res.batch_response, res.aux_info["reuse_len"])
    pipeline.stop()
"""

from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterator, Optional, Sequence, Union

import torch

from rtpkv.chat import Messages, normalize_messages, render_chat
from rtpkv.config import RuntimeConfig
from rtpkv.engine import Engine, Request, StepOutput
from rtpkv.errors import ConfigError, EmptyPromptError, PromptTooLongError, RequestError
from rtpkv.generate_config import GenerateConfig
from rtpkv.locked_tokenizer import LockedTokenizer
from rtpkv.model_factory.factory import Model
from rtpkv.tasks import Task, TaskPrompt, TaskRegistry, parse_tasks, tasks_from_config
from rtpkv.text_stream import TextStream

if TYPE_CHECKING:
    from rtpkv.fleet.publisher import KVEventPublisher

log = logging.getLogger("rtpkv")

DEFAULT_MAX_NEW_TOKENS = 256
# Texts longer than this are encoded by the pipeline's own copy of the tokenizer, under its own
# lock: every stream's detokenization takes the shared tokenizer's lock, and must not wait
# while a long prompt is encoded (a stream consumed on the event loop would stall the server).
LONG_PROMPT_CHARS = 4096
Prompt = Union[str, Sequence[int]]


def longest_token_chars(tokenizer: Any) -> Optional[int]:
    """The most characters one token of the vocabulary spells (raw vocabulary strings are never
    shorter than their text: byte-level BPE maps a byte to a character, `<0x0A>` is longer than
    its byte), so a prompt of more than `tokens * this` characters needs more than `tokens`
    tokens and is refused without tokenizing it. None when the vocabulary cannot be read."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:
        return None
    return max((len(piece) for piece in vocab), default=None) or None


def _tokens(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


@dataclass
class TokenLogprob:
    """A generated token's log-probability under the model, and the most likely alternatives
    (token id, log-probability), best first: what `logprobs=k` asks for."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], k: int) -> list[TokenLogprob]:
    """One TokenLogprob per row of `logits` (the rows that produced `token_ids`)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logp, k, dim=-1) if k else None
    return [TokenLogprob(int(t), float(logp[i, t]),
                         list(zip(top.indices[i].tolist(), top.values[i].tolist())) if top else [])
            for i, t in enumerate(token_ids)]


@dataclass
class Response:
    """One streamed update. `batch_response` is rtp-llm's name for `generate_texts`."""

    generate_texts: list[str]
    finished: bool
    output_ids: list[int]
    aux_info: dict[str, Any] = field(default_factory=dict)
    logits: Optional[torch.Tensor] = None  # (output_len, vocab) float32, with return_logits
    logprobs: Optional[list[TokenLogprob]] = None  # one per output id, with logprobs=k

    @property
    def batch_response(self) -> list[str]:
        return self.generate_texts


class _ResponseBuilder:
    """Folds a request's StepOutputs into Responses (cumulative text, or deltas): one response
    per generated token, even when the token adds no visible text yet."""

    def __init__(self, req: Request, stream: TextStream, incremental: bool, aux: dict[str, Any]):
        self.req, self.stream, self.incremental, self.aux = req, stream, incremental, aux
        self.ids: list[int] = []
        self.logits: list[torch.Tensor] = []
        self.logprobs: Optional[list[TokenLogprob]] = \
            None if req.config.logprobs is None else []
        self.shown = ""

    def feed(self, out: StepOutput) -> Optional[Response]:
        if out.error is not None:
            raise out.error
        self.ids.extend(out.new_token_ids)
        if out.logits is not None and self.req.config.return_logits:
            self.logits.append(out.logits)
        if out.logits is not None and self.logprobs is not None:
            self.logprobs.extend(token_logprobs(out.logits, out.new_token_ids,
                                                self.req.config.logprobs))
        if self.stream.stopped and not out.finished:
            return None
        text = self.stream.visible(self.ids, out.finished)
        if out.finished and not self.incremental:  # cumulative: the last text is exact
            text = self.stream.final_text(self.ids)
        delta = text[len(self.shown):] if text.startswith(self.shown) else text
        self.shown = text
        aux = {**self.aux, **self.req.aux_info()}
        logits = torch.cat(self.logits) if self.logits else None
        return Response([delta if self.incremental else text], out.finished, list(self.ids), aux,
                        logits, None if self.logprobs is None else list(self.logprobs))


Tagged = tuple[int, StepOutput]   # (index of the prompt in the call, its output)


class _StreamOutputs:
    """The outputs of one `pipeline(...)` call as the engine hands them over: a thread-safe
    queue for `for`, moved to an asyncio queue (no thread per stream) the first time the stream
    is awaited."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: "queue.Queue[Tagged]" = queue.Queue()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._async_queue: Optional["asyncio.Queue[Tagged]"] = None

    def put(self, item: Tagged) -> None:
        """From the engine thread."""
        with self._lock:
            if self._loop is None:
                self._queue.put(item)
            elif not self._loop.is_closed():  # a closed loop has no consumer left
                self._loop.call_soon_threadsafe(self._async_queue.put_nowait, item)

    def get(self) -> Tagged:
        if self._loop is not None:
            raise RuntimeError("this stream is iterated with `async for`; keep to it")
        return self._queue.get()

    async def get_async(self) -> Tagged:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._loop is None:
                self._loop, self._async_queue = loop, asyncio.Queue()
                while not self._queue.empty():
                    self._async_queue.put_nowait(self._queue.get_nowait())
            elif self._loop is not loop:
                raise RuntimeError("this stream is awaited from another event loop")
        return await self._async_queue.get()


@dataclass
class _TaggedSink:
    """Routes one member's outputs into the call's shared queue, tagged with its index."""

    put_tagged: Callable[[Tagged], None]
    index: int

    def put(self, item: StepOutput) -> None:
        self.put_tagged((self.index, item))


@dataclass
class BatchResponse:
    """One streamed update of a batch (`pipeline(["a", "b"])`): one entry per prompt, in order.
    Each update follows a new token of any member; members not started yet show ""."""

    responses: list[Response]

    @property
    def generate_texts(self) -> list[str]:
        return [r.generate_texts[0] for r in self.responses]

    @property
    def batch_response(self) -> list[str]:
        return self.generate_texts

    @property
    def finished(self) -> bool:
        return all(r.finished for r in self.responses)

    @property
    def output_ids(self) -> list[list[int]]:
        return [r.output_ids for r in self.responses]

    @property
    def aux_info(self) -> list[dict[str, Any]]:
        return [r.aux_info for r in self.responses]


class ResponseStream(Iterator[Union[Response, BatchResponse]],
                     AsyncIterator[Union[Response, BatchResponse]]):
    """What `pipeline(...)` returns: the requests of one call (one prompt, or a batch) folded
    into responses; iterate it with `for` or `async for`. Unlike a generator, it cancels its
    requests when closed or garbage-collected even if it was never iterated."""

    def __init__(self, engine: Engine, members: list[tuple[Request, _ResponseBuilder]],
                 outputs: _StreamOutputs, batch: bool):
        self._engine, self._members, self._outputs, self._batch = engine, members, outputs, batch
        self._open = len(members)
        self._latest = [Response([""], False, []) for _ in members]

    @property
    def requests(self) -> list[Request]:
        return [req for req, _ in self._members]

    def _fold(self, index: int, out: StepOutput) -> "Response | BatchResponse | None":
        if out.finished:
            self._open -= 1
        try:
            res = self._members[index][1].feed(out)
        except BaseException:
            self.close()
            raise
        if res is None or not self._batch:
            return res
        self._latest[index] = res
        batch = BatchResponse(list(self._latest))
        self._latest = [replace(r, generate_texts=[""]) if b.incremental else r
                        for r, (_, b) in zip(self._latest, self._members)]
        return batch

    def __next__(self) -> Union[Response, BatchResponse]:
        while self._open:
            res = self._fold(*self._outputs.get())
            if res is not None:
                return res
        raise StopIteration

    def __aiter__(self) -> "ResponseStream":
        return self

    async def __anext__(self) -> Union[Response, BatchResponse]:
        while self._open:
            try:
                item = await self._outputs.get_async()
            except BaseException:  # the awaiting task was cancelled
                self.close()
                raise
            res = self._fold(*item)
            if res is not None:
                return res
        raise StopAsyncIteration

    def close(self) -> None:
        """Stop early: unfinished requests leave the engine within one step, blocks released."""
        self._open = 0
        for req, _ in self._members:
            if not req.done.is_set():
                self._engine.abort(req)

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


class Pipeline:
    def __init__(self, model: Model, tokenizer: Any = None, *,
                 tasks: Optional[Sequence[Union[dict[str, Any], TaskPrompt]]] = None,
                 **options: Any):
        """`options` are ModelConfig field names (reuse_cache=True, seq_size_per_block=16, ...)
        overriding the environment and the model's ModelConfig. `tasks` are task prompts given
        in code; otherwise ModelConfig.tasks, MULTI_TASK_PROMPT or MULTI_TASK_PROMPT_STR."""
        self.model = model
        # One lock for every tokenizer call: the engine thread, stream consumers and callers.
        self.tokenizer = LockedTokenizer.around(
            tokenizer if tokenizer is not None else model.tokenizer)
        config = model.config.replace(**options)
        task_list = self._initial_tasks(tasks, model, config)
        eos = set(model.spec.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self._token_chars = longest_token_chars(self.tokenizer)
        self._long_encoder: Optional[LockedTokenizer] = None
        self._long_encoder_lock = threading.Lock()
        self.engine = Engine(model, config)
        self._retention_noted = False
        self.tasks = TaskRegistry()
        self.kv_event_publisher: Optional["KVEventPublisher"] = None
        try:
            if config.kv_events_endpoint:  # before the task prompts: their blocks are events too
                from rtpkv.fleet import publisher  # the `fleet` extra: only when asked for

                self.kv_event_publisher = publisher.KVEventPublisher.from_config(
                    config, self.engine.events, self.engine.block_size, self.engine.root_key)
                self.engine.announce_tiers()  # a restarted replica's disk records
            for task in task_list:
                self.add_task(task.task_id, task.prompt)
        except Exception:
            self.stop()
            raise

    @property
    def config(self) -> RuntimeConfig:
        """The options in force (the engine's: add_task may turn reuse on)."""
        return self.engine.config

    @staticmethod
    def _initial_tasks(tasks: Any, model: Model, config: Any) -> list[TaskPrompt]:
        if tasks is not None:
            return parse_tasks([t.model_dump() if isinstance(t, TaskPrompt) else t for t in tasks],
                               "Pipeline(tasks=...)")
        if model.tasks is not None:
            return parse_tasks(model.tasks, "ModelConfig.tasks")
        return tasks_from_config(config)

    # ------------------------------------------------------------------ tasks
    def add_task(self, task_id: Union[str, int], prompt: Prompt) -> None:
        """Prefill `prompt` (text, or token ids used as given) once and pin its full blocks;
        requests name it by task_id."""
        text = prompt if isinstance(prompt, str) else f"<{len(prompt)} token ids>"
        entry = parse_tasks([{"task_id": task_id, "prompt": text}], "add_task")[0]
        if entry.task_id in self.tasks:
            raise ConfigError(f"task_id {entry.task_id!r} already exists; remove it first")
        ids = self._tokenize(prompt, with_special=True)
        if not self.config.reuse_cache and not self.tasks.ids():
            log.warning("REUSE_CACHE is off and task prompts are loaded: requests with a task_id "
                        "start from its pinned blocks; other requests neither look up nor insert")
        shortfall = self.engine.pin_shortfall(len(ids))
        if shortfall:
            raise ConfigError(f"task {entry.task_id!r}: {shortfall}")
        req = Request(ids, GenerateConfig(), max_new_tokens=0, prefill_only=True)
        self.engine.submit(req)
        req.done.wait()
        out = req.outputs.get()
        if out.error is not None:
            raise out.error
        self.tasks.add(Task(entry.task_id, entry.prompt, ids, req.pinned))
        log.info("task %r: %d tokens, %d pinned", entry.task_id, len(ids), req.pinned.num_tokens)

    def remove_task(self, task_id: Union[str, int]) -> None:
        """Forget the task; its blocks are unpinned and become ordinary cached blocks."""
        self.engine.unpin(self.tasks.pop(task_id).pinned)

    # ------------------------------------------------------------------ requests
    def _prepare(self, prompt: Prompt, generate_config: Optional[dict[str, Any]],
                 kwargs: dict[str, Any], prewarm: bool = False
                 ) -> tuple[Request, _ResponseBuilder]:
        if self.engine.stopped:
            raise RequestError("the pipeline has been stopped")
        cfg = GenerateConfig.build(generate_config, kwargs)
        prefix: list[int] = []
        task = None
        if cfg.task_id is not None:
            task = self.tasks.get(cfg.task_id)
            prefix = task.token_ids
        limit = self.config.max_seq_len
        if isinstance(prompt, str):
            self._refuse_untokenized(len(prompt), limit - len(prefix), "prompt")
        own = self._tokenize(prompt, with_special=not prefix)
        ids = prefix + own
        room = limit - len(ids)
        if room < 1:
            raise PromptTooLongError(f"prompt is {_tokens(len(ids))} ({len(prefix)} of them the "
                                     f"task prompt); max_seq_len is {limit}, leaving no room to "
                                     "generate")
        max_new = 0 if prewarm else cfg.max_new_tokens or min(DEFAULT_MAX_NEW_TOKENS, room)
        if max_new > room:
            raise PromptTooLongError(f"prompt of {_tokens(len(ids))} + max_new_tokens {max_new} "
                                     f"exceeds max_seq_len {limit}")
        stream = TextStream(self.tokenizer, cfg.stop_words_str, cfg.min_new_tokens,
                            cfg.skip_special_tokens)
        req = Request(ids, cfg, max_new_tokens=max_new, eos_token_ids=self.eos_token_ids,
                      stop_text=stream.stop_check(), prefix_handle=task.pinned if task else None,
                      prefill_only=prewarm, prewarm=prewarm)
        if cfg.kv_cache_retention_config is not None and not self.config.reuse_cache:
            self._note_retention_without_reuse()
        aux = {"input_len": len(own), "prefix_len": len(prefix)}
        return req, _ResponseBuilder(req, stream, cfg.return_incremental, aux)

    def _refuse_untokenized(self, chars: int, room: int, what: str) -> None:
        """A text too long for any tokenization of it to fit is refused before the tokenizer
        spends time on it (seconds for megabytes, holding the tokenizer's lock)."""
        if self._token_chars is not None and chars > max(room, 0) * self._token_chars:
            raise PromptTooLongError(
                f"{what} of {chars} characters is longer than any prompt that fits "
                f"max_seq_len {self.config.max_seq_len} can be (at most {self._token_chars} "
                "characters a token); refused before tokenizing")

    def _tokenize(self, prompt: Prompt, with_special: bool) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise EmptyPromptError("prompt is empty; pass a non-empty string or token id list")
            encoder = self._encoder(len(prompt))
            if with_special:
                return list(encoder(prompt).input_ids)
            return list(encoder(prompt, add_special_tokens=False).input_ids)
        if isinstance(prompt, (list, tuple)) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if not prompt:
                raise EmptyPromptError("prompt is an empty token id list")
            vocab = self.model.spec.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
            return list(prompt)
        raise RequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def _encoder(self, chars: int) -> LockedTokenizer:
        """The shared tokenizer for texts of up to LONG_PROMPT_CHARS characters; for longer
        ones a private copy made once (the shared one where it cannot be copied)."""
        if chars <= LONG_PROMPT_CHARS:
            return self.tokenizer
        with self._long_encoder_lock:
            if self._long_encoder is None:
                try:
                    self._long_encoder = LockedTokenizer(copy.deepcopy(self.tokenizer.wrapped))
                except Exception:
                    self._long_encoder = self.tokenizer
            return self._long_encoder

    def _submit(self, prompt: Union[Prompt, list[str], None], messages: Optional[Messages],
                generate_config: Optional[dict[str, Any]], kwargs: dict[str, Any],
                put: Callable[[tuple[int, StepOutput]], None]
                ) -> tuple[list[tuple[Request, _ResponseBuilder]], bool]:
        """Validate every prompt first, then submit them all: a bad member fails the call
        before anything reaches the engine."""
        if messages is not None:
            if prompt is not None:
                raise RequestError("pass either prompt or messages, not both")
            task = GenerateConfig.build(generate_config, kwargs).task_id
            prompt = self._chat_ids(messages, after_task_prompt=task is not None)
        if prompt is None:
            raise RequestError("prompt is missing (got NoneType); pass a string, token ids, a "
                               "list of strings (a batch) or messages=[...]")
        batch = isinstance(prompt, (list, tuple)) and bool(prompt) and all(
            isinstance(p, str) for p in prompt)
        prompts = list(prompt) if batch else [prompt]
        prepared = [self._prepare(p, generate_config, kwargs) for p in prompts]
        members = []
        try:
            for index, (req, builder) in enumerate(prepared):
                req.outputs = _TaggedSink(put, index)
                self.engine.submit(req)
                members.append((req, builder))
        except BaseException:
            for req, _ in members:
                self.engine.abort(req)
            raise
        return members, batch

    def __call__(self, prompt: Union[Prompt, list[str], None] = None,
                 generate_config: Optional[dict[str, Any]] = None, *,
                 messages: Optional[Messages] = None, **kwargs: Any) -> ResponseStream:
        """Validate and submit now (errors raise here); iterate the stream with `for` or
        `async for`. `prompt` is text, token ids, or a list of strings (a batch: each update is
        a BatchResponse with one entry per prompt); `messages` are chat messages rendered with
        the checkpoint's chat template. Closing or dropping the stream, even before its first
        response, cancels the request(s)."""
        outputs = _StreamOutputs()
        members, batch = self._submit(prompt, messages, generate_config, kwargs, outputs.put)
        return ResponseStream(self.engine, members, outputs, batch)

    def pipeline_async(self, prompt: Union[Prompt, list[str], None] = None,
                       generate_config: Optional[dict[str, Any]] = None, *,
                       messages: Optional[Messages] = None, **kwargs: Any) -> ResponseStream:
        """rtp-llm's name for the same stream, for asyncio callers:
        `async for res in pipeline.pipeline_async(...)`."""
        return self(prompt, generate_config, messages=messages, **kwargs)

    def prewarm(self, prompt: Prompt, generate_config: Optional[dict[str, Any]] = None,
                **kwargs: Any) -> int:
        """Compute and cache `prompt`'s K/V without generating (its `task_id`, `cache_salt`
        and `kv_cache_retention_config` act as in a request) and return how many of its tokens
        are now cached: a request that extends the prompt reuses that many (one equal to it,
        all but its last token at most). Blocks until done; refused when reuse is off."""
        req, _ = self._prepare(prompt, generate_config, kwargs, prewarm=True)
        if not self.engine.reuse_applies(req):
            raise RequestError("prewarm would cache nothing: reuse is off (REUSE_CACHE=0, or "
                               "reuse_cache false for this request)")
        self.engine.submit(req)
        req.done.wait()
        out = req.outputs.get()
        if out.error is not None:
            raise out.error
        return self.engine.cached_tokens(req)

    def prompt_token_ids(self, prompt: Prompt) -> list[int]:
        """The token ids a request without a task_id computes for `prompt` (text is tokenized
        with the tokenizer's special tokens): what a router must hash to find its blocks. A
        text no tokenization of which fits max_seq_len is refused, as a request refuses it."""
        if isinstance(prompt, str):
            self._refuse_untokenized(len(prompt), self.config.max_seq_len, "prompt")
        return self._tokenize(prompt, with_special=True)

    def chat_prompt(self, messages: Messages) -> list[int]:
        """The token ids of `messages` rendered for the assistant's reply (rtpkv.chat)."""
        return self._chat_ids(messages)

    def _chat_ids(self, messages: Messages, after_task_prompt: bool = False) -> list[int]:
        """render_chat as a prompt is tokenized: messages too long for any tokenization to fit
        refused untokenized, long ones rendered and encoded by the private tokenizer copy."""
        msgs = normalize_messages(messages)
        chars = sum(len(m["content"]) for m in msgs)
        self._refuse_untokenized(chars, self.config.max_seq_len, "messages")
        return render_chat(self._encoder(chars), msgs, after_task_prompt=after_task_prompt)

    def _note_retention_without_reuse(self) -> None:
        """A client may send a retention config everywhere: with reuse off it has no effect,
        which is said once rather than refused."""
        if not self._retention_noted:
            self._retention_noted = True
            log.info("kv_cache_retention_config has no effect: REUSE_CACHE is off")

    # ------------------------------------------------------------------ lifecycle, stats
    def cache_stats(self) -> dict[str, Any]:
        return self.engine.cache_stats()

    def tenant_quota(self, salt: str) -> dict[str, Any]:
        """One tenant's (cache_salt's) cached blocks, quota and quota evictions."""
        return self.engine.tenant_quota(salt)

    def set_tenant_quota(self, salt: str, blocks: Optional[int]) -> dict[str, Any]:
        """Change one tenant's bound on cached blocks while the engine runs (None: back to
        CACHE_SALT_QUOTA_BLOCKS); past it, the tenant's blocks go first from the next eviction.
        Needs quotas configured at start (CACHE_SALT_QUOTA_BLOCKS or CACHE_SALT_QUOTAS)."""
        return self.engine.set_tenant_quota(salt, blocks)

    def kv_cache_events(self, timeout: Optional[float] = None) -> list[dict[str, Any]]:
        """Drain the KV cache events (`stored`, `removed`, `updated`) buffered since the last
        call, oldest first; with a timeout, wait up to that many seconds for the first one.
        Needs KV_CACHE_EVENT_BUFFER_MAX_SIZE > 0 (events are off by default)."""
        return self.engine.events.drain(timeout)

    def check_integrity(self) -> None:
        self.engine.check_integrity()

    def stop(self) -> None:
        self.engine.stop()
        if self.kv_event_publisher is not None:  # after the engine: its last events go out
            self.kv_event_publisher.stop()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
