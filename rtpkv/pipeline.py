"""Pipeline: prompt in, streaming responses out, with aux info on what the cache reused.

    pipeline = Pipeline(model, model.tokenizer)
    for res in pipeline("hello", generate_config={"top_k": 1, "max_new_tokens": 32}):
        print(res.batch_response, res.aux_info["reuse_len"])
    pipeline.stop()
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator, Optional, Sequence, Union

import torch

from rtpkv.cache.prefix_index import HashFn, sha256
from rtpkv.config import RuntimeConfig
from rtpkv.engine import Engine, Request, StepOutput
from rtpkv.engine.request import OutputSink
from rtpkv.errors import ConfigError, RequestError
from rtpkv.generate_config import GenerateConfig
from rtpkv.model_factory.factory import Model
from rtpkv.tasks import Task, TaskPrompt, TaskRegistry, parse_tasks, tasks_from_config
from rtpkv.text_stream import TextStream

log = logging.getLogger("rtpkv")

DEFAULT_MAX_NEW_TOKENS = 256
Prompt = Union[str, Sequence[int]]


@dataclass
class Response:
    """One streamed update. `batch_response` is rtp-llm's name for `generate_texts`."""

    generate_texts: list[str]
    finished: bool
    output_ids: list[int]
    aux_info: dict[str, Any] = field(default_factory=dict)
    logits: Optional[torch.Tensor] = None  # (output_len, vocab) float32, with return_logits

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
        self.shown = ""

    def feed(self, out: StepOutput) -> Optional[Response]:
        if out.error is not None:
            raise out.error
        self.ids.extend(out.new_token_ids)
        if out.logits is not None:
            self.logits.append(out.logits)
        if self.stream.stopped and not out.finished:
            return None
        text = self.stream.visible(self.ids, out.finished)
        delta = text[len(self.shown):] if text.startswith(self.shown) else text
        self.shown = text
        aux = {**self.aux, **self.req.aux_info()}
        logits = torch.cat(self.logits) if self.logits else None
        return Response([delta if self.incremental else text], out.finished, list(self.ids), aux,
                        logits)


class ResponseStream(Iterator[Response]):
    """The iterator `pipeline(...)` returns. Unlike a generator, it cancels its request when
    closed or garbage-collected even if it was never iterated."""

    def __init__(self, engine: Engine, req: Request, builder: _ResponseBuilder):
        self._engine, self._req, self._builder = engine, req, builder
        self._ended = False

    def __next__(self) -> Response:
        while not self._ended:
            out = self._req.outputs.get()
            self._ended = out.finished
            res = self._builder.feed(out)
            if res is not None:
                return res
        raise StopIteration

    def close(self) -> None:
        """Stop early: the request leaves the engine within one step, its blocks released."""
        self._ended = True
        if not self._req.done.is_set():
            self._engine.abort(self._req)

    def __del__(self) -> None:
        self.close()


@dataclass
class _LoopSink:
    """Hands engine outputs to an asyncio queue from the engine thread: no thread per stream."""

    loop: asyncio.AbstractEventLoop
    queue: "asyncio.Queue[StepOutput]"

    def put(self, item: StepOutput) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class Pipeline:
    def __init__(self, model: Model, tokenizer: Any = None, *,
                 tasks: Optional[Sequence[Union[dict[str, Any], TaskPrompt]]] = None,
                 hash_fn: HashFn = sha256, **options: Any):
        """`options` are ModelConfig field names (reuse_cache=True, seq_size_per_block=16, ...)
        overriding the environment and the model's ModelConfig. `tasks` are task prompts given
        in code; otherwise ModelConfig.tasks, MULTI_TASK_PROMPT or MULTI_TASK_PROMPT_STR."""
        self.model = model
        self.tokenizer = tokenizer if tokenizer is not None else model.tokenizer
        config = model.config.replace(**options)
        task_list = self._initial_tasks(tasks, model, config)
        eos = set(model.spec.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.engine = Engine(model, config, hash_fn=hash_fn)
        self._retention_noted = False
        self.tasks = TaskRegistry()
        try:
            for task in task_list:
                self.add_task(task.task_id, task.prompt)
        except Exception:
            self.engine.stop()
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
    def _request(self, prompt: Prompt, generate_config: Optional[dict[str, Any]],
                 kwargs: dict[str, Any], sink: Optional[OutputSink] = None
                 ) -> tuple[Request, _ResponseBuilder]:
        if self.engine.stopped:
            raise RequestError("the pipeline has been stopped")
        cfg = GenerateConfig.build(generate_config, kwargs)
        prefix: list[int] = []
        task = None
        if cfg.task_id is not None:
            task = self.tasks.get(cfg.task_id)
            prefix = task.token_ids
        own = self._tokenize(prompt, with_special=not prefix)
        ids = prefix + own
        limit = self.config.max_seq_len
        room = limit - len(ids)
        if room < 1:
            raise RequestError(f"prompt is {len(ids)} tokens ({len(prefix)} of them the task "
                               f"prompt); max_seq_len is {limit}, leaving no room to generate")
        max_new = cfg.max_new_tokens or min(DEFAULT_MAX_NEW_TOKENS, room)
        if max_new > room:
            raise RequestError(f"prompt of {len(ids)} tokens + max_new_tokens {max_new} exceeds "
                               f"max_seq_len {limit}")
        stream = TextStream(self.tokenizer, cfg.stop_words_str)
        req = Request(ids, cfg, max_new_tokens=max_new, eos_token_ids=self.eos_token_ids,
                      stop_text=stream.stop_check(), prefix_handle=task.pinned if task else None)
        if cfg.kv_cache_retention_config is not None and not self.config.reuse_cache:
            self._note_retention_without_reuse()
        if sink is not None:
            req.outputs = sink
        aux = {"input_len": len(own), "prefix_len": len(prefix)}
        self.engine.submit(req)
        return req, _ResponseBuilder(req, stream, cfg.return_incremental, aux)

    def _tokenize(self, prompt: Prompt, with_special: bool) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt is empty; pass a non-empty string or token id list")
            if with_special:
                return list(self.tokenizer(prompt).input_ids)
            return list(self.tokenizer(prompt, add_special_tokens=False).input_ids)
        if isinstance(prompt, (list, tuple)) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if not prompt:
                raise RequestError("prompt is an empty token id list")
            vocab = self.model.spec.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
            return list(prompt)
        raise RequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def __call__(self, prompt: Prompt, generate_config: Optional[dict[str, Any]] = None,
                 **kwargs: Any) -> "ResponseStream":
        """Validate and submit now (errors raise here); iterate for streamed responses.
        Closing or dropping the stream, even before its first response, cancels the request."""
        req, builder = self._request(prompt, generate_config, kwargs)
        return ResponseStream(self.engine, req, builder)

    async def pipeline_async(self, prompt: Prompt, generate_config: Optional[dict[str, Any]] = None,
                             **kwargs: Any) -> AsyncIterator[Response]:
        """The same stream for asyncio callers: `async for res in pipeline.pipeline_async(...)`."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[StepOutput] = asyncio.Queue()
        req, builder = self._request(prompt, generate_config, kwargs, _LoopSink(loop, outputs))
        try:
            while True:
                out = await outputs.get()
                res = builder.feed(out)
                if res is not None:
                    yield res
                if out.finished:
                    return
        finally:
            if not req.done.is_set():
                self.engine.abort(req)

    def _note_retention_without_reuse(self) -> None:
        """A client may send a retention config everywhere: with reuse off it has no effect,
        which is said once rather than refused."""
        if not self._retention_noted:
            self._retention_noted = True
            log.info("kv_cache_retention_config has no effect: REUSE_CACHE is off")

    # ------------------------------------------------------------------ lifecycle, stats
    def cache_stats(self) -> dict[str, Any]:
        return self.engine.cache_stats()

    def kv_cache_events(self, timeout: Optional[float] = None) -> list[dict[str, Any]]:
        """Drain the KV cache events (`stored`, `removed`, `updated`) buffered since the last
        call, oldest first; with a timeout, wait up to that many seconds for the first one.
        Needs KV_CACHE_EVENT_BUFFER_MAX_SIZE > 0 (events are off by default)."""
        return self.engine.events.drain(timeout)

    def check_integrity(self) -> None:
        self.engine.check_integrity()

    def stop(self) -> None:
        self.engine.stop()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
