"""Engine: one background thread that steps the model; requests come from any thread.

A step reads schedule -> run -> sample -> postprocess -> emit: take new submissions and drop
cancelled or timed-out requests, ask the Scheduler for the batch, run the forward, sample, let
the Scheduler do the bookkeeping (progress, stop checks, commit, pin, finish), then hand each
request its token — marked finished on its last one. Every cache structure is touched only
under `self.lock`, which a step holds from start to end.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from rtpkv.cache import BlockPool, KVCacheManager, KVEventBuffer, PinnedPrefix, PrefixIndex
from rtpkv.cache.prefix_index import HashFn, sha256
from rtpkv.cache.tiers.factory import build_tiers
from rtpkv.config import RuntimeConfig
from rtpkv.engine.model_runner import ModelRunner
from rtpkv.engine.request import FinishReason, Request, StepOutput
from rtpkv.engine.sampler import sample_batch
from rtpkv.engine.scheduler import ScheduledChunk, Scheduler
from rtpkv.engine.window import attention_window
from rtpkv.errors import CapacityError, EngineStoppedError, RequestTimeoutError
from rtpkv.log_limit import RateLimitedLog
from rtpkv.model_factory.factory import Model
from rtpkv.torch_threads import serial_torch

if TYPE_CHECKING:
    from rtpkv.cache.tiers.base import KVTier

log = logging.getLogger("rtpkv")

DEFAULT_CPU_MEMORY_FRACTION = 0.10   # of available host memory, when KV_CACHE_MEM_MB is unset
DEFAULT_GPU_MEMORY_FRACTION = 0.90   # of free device memory after the weights
STEP_LOG_SIZE = 4096


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * DEFAULT_GPU_MEMORY_FRACTION)
    pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(pages * DEFAULT_CPU_MEMORY_FRACTION)


def pool_blocks(model: Model, config: RuntimeConfig) -> int:
    """Blocks in the pool: from kv_cache_mem_mb and kv_cache_max_tokens (the smaller wins when
    both are set), else a fixed fraction of available memory, never above what
    concurrency_limit sequences of max_seq_len could use."""
    spec, B = model.spec, config.seq_size_per_block
    per_block = BlockPool.bytes_per_block(spec.num_layers, B, spec.num_kv_heads, spec.head_dim,
                                          model.dtype)
    limits = []
    if config.kv_cache_mem_mb:
        limits.append(int(config.kv_cache_mem_mb * 2**20) // per_block)
    if config.kv_cache_max_tokens:
        limits.append(config.kv_cache_max_tokens // B)
    if not limits:
        useful = config.concurrency_limit * -(-config.max_seq_len // B)
        limits = [min(_available_bytes(model.device) // per_block, useful)]
    return max(1, min(limits))


class Engine:
    def __init__(self, model: Model, config: RuntimeConfig, hash_fn: HashFn = sha256,
                 tiers: Optional[Sequence["KVTier"]] = None):
        self.model = model
        self.config = config
        self.block_size = config.seq_size_per_block
        spec = model.spec
        self.window = attention_window(config, spec)
        num_blocks = pool_blocks(model, config)
        with serial_torch():
            self.pool = BlockPool(spec.num_layers, num_blocks, self.block_size, spec.num_kv_heads,
                                  spec.head_dim, model.dtype, model.device)
        self.events = KVEventBuffer(config.kv_cache_event_buffer_max_size)
        self.cache = KVCacheManager(num_blocks, self.block_size,
                                    PrefixIndex(model.fingerprint, self.block_size, hash_fn),
                                    pool=self.pool, reuse_enabled=config.reuse_cache,
                                    events=self.events, window=self.window.tokens,
                                    tiers=build_tiers(config, model, self.block_size) if tiers is None else tiers,
                                    offload_min_priority=config.secondary_offload_min_priority)
        self.scheduler = Scheduler(config, self.cache)
        self.runner = ModelRunner(model.module, self.pool, self.window.tokens)
        self.lock = threading.RLock()
        self.step_log: deque[list[tuple[int, int, str]]] = deque(maxlen=STEP_LOG_SIZE)
        self.steps = 0
        self._inbox: "queue.Queue[Optional[Request]]" = queue.Queue()
        self._stopped = threading.Event()
        self._threads = torch.get_num_threads()
        self._step_failed = RateLimitedLog(log, logging.ERROR)
        log.info("reuse_cache: %s", config.reuse_cache)
        log.info("attention window: %s", self.window.describe())
        log.info("KV pool: %d blocks of %d tokens (%.1f MiB), attention backend: %s",
                 num_blocks, self.block_size, self.pool.kv.numel() * self.pool.kv.element_size() / 2**20,
                 model.module.attention_name)
        self._thread = threading.Thread(target=self._loop, name="rtpkv-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ API (any thread)
    def submit(self, req: Request) -> Request:
        if self._stopped.is_set():
            raise EngineStoppedError("the pipeline has been stopped")
        usable = self.cache.usable_blocks
        need = self.cache.blocks_held_at_most(self.scheduler.tokens_for(req),
                                              self.config.max_num_batched_tokens)
        if need > usable:
            window = "" if self.window.tokens is None else f", attention window {self.window.tokens}"
            raise CapacityError(
                f"request needs {need} KV blocks ({req.num_prompt} prompt tokens + "
                f"max_new_tokens {req.max_new_tokens}, {self.block_size} tokens per block"
                f"{window}) but "
                f"the pool has {usable} usable blocks ({self.cache.num_blocks} total, "
                f"{self.cache.num_blocks - usable} pinned)")
        self._inbox.put(req)
        return req

    def abort(self, req: Request) -> None:
        """Cancel: the request leaves within one step and its blocks are released."""
        req.cancelled = True
        self._inbox.put(None)

    def unpin(self, handle: PinnedPrefix) -> None:
        """Let a task prompt's blocks go: they become ordinary cached blocks."""
        with self.lock:
            self.cache.unpin(handle)

    def pin_shortfall(self, num_tokens: int) -> Optional[str]:
        with self.lock:
            return self.cache.pin_shortfall(num_tokens)

    def stop(self) -> None:
        """End the loop, fail what is in flight with EngineStoppedError, join the thread."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._inbox.put(None)
        self._thread.join()
        with self.lock:
            self._take_inbox()
            for req in list(self.scheduler.running) + list(self.scheduler.waiting):
                self._finish(req, FinishReason.ERROR,
                             EngineStoppedError("the pipeline was stopped before this request finished"))
            for tier in self.cache.tiers:
                tier.close()  # flushes queued disk writes

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def cache_stats(self) -> dict[str, Any]:
        with self.lock:
            stats = self.cache.stats()
            stats["attention_window"] = self.window.tokens
            stats["attention_window_source"] = self.window.source
            stats["requests_running"] = len(self.scheduler.running)
            stats["requests_waiting"] = len(self.scheduler.waiting)
            return stats

    def check_integrity(self) -> None:
        with self.lock:
            self.cache.check_integrity(self.scheduler.running)

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        torch.set_num_threads(self._threads)  # thread counts are per OS thread
        while not self._stopped.is_set():
            try:
                if not self.scheduler.has_work() or not self.step():
                    # idle, or every waiting request waits for blocks: sleep until news
                    item = self._inbox.get(timeout=0.5 if not self.scheduler.has_work() else 0.01)
                    if item is not None:
                        self.scheduler.add(item)
            except queue.Empty:
                continue
            except Exception:  # a bug must not kill the loop silently, nor flood the log
                self._step_failed("engine step failed", exc_info=True)
                with self.lock:
                    for req in list(self.scheduler.running):
                        self._finish(req, FinishReason.ERROR, RuntimeError("engine step failed"))

    def step(self) -> bool:
        """One engine step. Returns False when there was nothing to run."""
        with self.lock:
            self._take_inbox()
            self._reap()
            batch = self.scheduler.schedule()
            if not batch:
                return False
            self.steps += 1
            self.step_log.append([(c.request.request_id, c.num_tokens,
                                   "decode" if c.is_decode else "prefill") for c in batch])
            try:
                logits, sampled = self.runner.run(batch)
            except Exception as exc:
                log.exception("forward failed")
                for c in batch:
                    self._finish(c.request, FinishReason.ERROR, exc)
                return True
            tokens, failed = sample_batch(logits, [c.request for c in sampled]) if sampled \
                else ([], {})
            if failed:  # each fails alone; the others keep their tokens
                for req, exc in failed.items():
                    log.error("request %d failed in sampling: %r", req.request_id, exc)
                    self._finish(req, FinishReason.ERROR, exc)
                keep = [i for i, c in enumerate(sampled) if c.request not in failed]
                batch = [c for c in batch if c.request not in failed]
                sampled, tokens = [sampled[i] for i in keep], [tokens[i] for i in keep]
                logits = logits[keep]
            finished = self.scheduler.postprocess(batch, sampled, tokens)
            self._emit(sampled, tokens, logits, finished)
            return True

    def _emit(self, sampled: list[ScheduledChunk], tokens: list[int], logits: torch.Tensor,
              finished: list[Request]) -> None:
        """Hand each request its new token, marked finished on the last one; a request that
        ended without a token this step (a pinned task prompt) gets an empty final output."""
        now = time.monotonic()
        for req in finished:
            req.finished_at = now
        emitted = set()
        for row, (c, token) in enumerate(zip(sampled, tokens)):
            req = c.request
            done = req.finish_reason is not None
            req.outputs.put(StepOutput(
                [token], finished=done, error=req.error,
                logits=logits[row:row + 1].clone()
                if req.config.return_logits or req.config.logprobs is not None else None))
            emitted.add(req)
        for req in finished:
            if req not in emitted:
                req.outputs.put(StepOutput([], finished=True, error=req.error))
            req.done.set()

    def _take_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                self.scheduler.add(item)

    def _reap(self) -> None:
        now = time.monotonic()
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            if req.cancelled:
                self._finish(req, FinishReason.CANCELLED)
            elif req.deadline is not None and now > req.deadline:
                self._finish(req, FinishReason.TIMEOUT, RequestTimeoutError(
                    f"request {req.request_id} did not finish within timeout_ms="
                    f"{req.config.timeout_ms} ({req.num_output} tokens generated)"))

    def _finish(self, req: Request, reason: FinishReason, error: Optional[BaseException] = None) -> None:
        """End a request outside the step's normal flow (cancel, timeout, failure, stop)."""
        if req.done.is_set():
            return
        self.scheduler.finish(req)
        req.finish_reason, req.error = reason, error
        req.finished_at = time.monotonic()
        req.outputs.put(StepOutput([], finished=True, error=error))
        req.done.set()
