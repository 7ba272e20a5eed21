"""Engine: one background thread that steps the model; requests come from any thread.

Each step: take new submissions, drop cancelled and timed-out requests, ask the Scheduler for
the batch, run it, sample, hand tokens to each request's queue, register blocks that filled,
and release the blocks of finished requests. Every cache structure is touched only under
`self.lock`, which a step holds from start to end.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from typing import Any, Callable, Optional

import torch

from rtpkv.cache import BlockPool, KVCacheManager, PrefixIndex
from rtpkv.cache.prefix_index import HashFn, sha256
from rtpkv.config import RuntimeConfig
from rtpkv.engine.model_runner import ModelRunner
from rtpkv.engine.request import FinishReason, Request, StepOutput
from rtpkv.engine.sampler import sample
from rtpkv.engine.scheduler import Scheduler
from rtpkv.errors import CapacityError, EngineStoppedError, RequestTimeoutError
from rtpkv.model_factory.factory import Model
from rtpkv.torch_threads import serial_torch

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
    def __init__(self, model: Model, config: RuntimeConfig, hash_fn: HashFn = sha256):
        self.model = model
        self.config = config
        self.block_size = config.seq_size_per_block
        spec = model.spec
        num_blocks = pool_blocks(model, config)
        with serial_torch():
            self.pool = BlockPool(spec.num_layers, num_blocks, self.block_size, spec.num_kv_heads,
                                  spec.head_dim, model.dtype, model.device)
        self.cache = KVCacheManager(self.pool, PrefixIndex(model.fingerprint, self.block_size,
                                                           hash_fn))
        self.scheduler = Scheduler(config, self.cache)
        self.runner = ModelRunner(model.module, self.pool)
        self.lock = threading.RLock()
        self.step_log: deque[list[tuple[int, int, str]]] = deque(maxlen=STEP_LOG_SIZE)
        self.steps = 0
        self._inbox: "queue.Queue[Optional[Request]]" = queue.Queue()
        self._stopped = threading.Event()
        self._threads = torch.get_num_threads()
        log.info("reuse_cache: %s", config.reuse_cache)
        log.info("KV pool: %d blocks of %d tokens (%.1f MiB), attention backend: %s",
                 num_blocks, self.block_size, self.pool.kv.numel() * self.pool.kv.element_size() / 2**20,
                 model.module.attention_name)
        self._thread = threading.Thread(target=self._loop, name="rtpkv-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ API (any thread)
    def submit(self, req: Request) -> Request:
        if self._stopped.is_set():
            raise EngineStoppedError("the pipeline has been stopped")
        usable = self.pool.num_blocks - self.cache.num_pinned
        need = self.scheduler.blocks_for(req)
        if need > usable:
            raise CapacityError(
                f"request needs {need} KV blocks ({req.num_prompt} prompt tokens + "
                f"max_new_tokens {req.max_new_tokens}, {self.block_size} tokens per block) but "
                f"the pool has {usable} usable blocks ({self.pool.num_blocks} total, "
                f"{self.pool.num_blocks - usable} pinned)")
        self._inbox.put(req)
        return req

    def abort(self, req: Request) -> None:
        """Cancel: the request leaves within one step and its blocks are released."""
        req.cancelled = True
        self._inbox.put(None)

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

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def cache_stats(self) -> dict[str, Any]:
        with self.lock:
            stats = self.cache.stats()
            stats["requests_running"] = len(self.scheduler.running)
            stats["requests_waiting"] = len(self.scheduler.waiting)
            return stats

    def check_integrity(self) -> None:
        with self.lock:
            tables = [r.block_table for r in self.scheduler.running]
            self.cache.check_integrity(tables)

    def enable_reuse(self) -> None:
        """Turn prefix reuse on (task prompts need it); call under the lock."""
        self.config = self.scheduler.config = self.config.replace(reuse_cache=True)
        log.info("reuse_cache: True")

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn under the engine lock (between steps)."""
        with self.lock:
            return fn()

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
            except Exception:  # a bug must not kill the loop silently
                log.exception("engine step failed")
                with self.lock:
                    for req in list(self.scheduler.running):
                        self._finish(req, FinishReason.ERROR, RuntimeError("engine step failed"))

    def step(self) -> bool:
        """One engine step. Returns False when there was nothing to run."""
        with self.lock:
            self._take_inbox()
            self._reap()
            chunks = self.scheduler.schedule()
            if not chunks:
                return False
            self.steps += 1
            self.step_log.append([(c.request.request_id, c.num_tokens,
                                   "decode" if c.start + 1 == c.request.num_tokens else "prefill")
                                  for c in chunks])
            try:
                logits, sampled_chunks = self.runner.run(chunks)
            except Exception as exc:
                log.exception("forward failed")
                for c in chunks:
                    self._finish(c.request, FinishReason.ERROR, exc)
                return True
            for c in chunks:
                c.request.num_computed += c.num_tokens
                c.request.iter_count += 1
            new_tokens = sample(logits, [c.request for c in sampled_chunks]) if sampled_chunks else []
            for row, (c, token) in enumerate(zip(sampled_chunks, new_tokens)):
                self._append(c.request, token,
                             logits[row:row + 1].clone() if c.request.config.return_logits else None)
            for c in chunks:
                req = c.request
                if self.config.reuse_cache and req.reuse and req.finish_reason != FinishReason.ERROR:
                    self.cache.commit_full_blocks(req, req.num_computed)
                if req.prefill_only and req.num_computed == req.num_tokens:
                    req.pinned_blocks = req.block_table[: req.num_tokens // self.block_size]
                    self.cache.pin(req.pinned_blocks)
                    self._finish(req, FinishReason.PREFILLED)
                elif req.finish_reason is not None:
                    self._finish(req, req.finish_reason)
            return True

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

    def _append(self, req: Request, token: int, logits: Optional[torch.Tensor]) -> None:
        req.token_ids.append(token)
        if req.first_token_at is None:
            req.first_token_at = time.monotonic()
        cfg = req.config
        reason = None
        n = req.num_output
        if n >= cfg.min_new_tokens:
            if token in req.eos_token_ids and not cfg.ignore_eos:
                reason = FinishReason.EOS
            elif any(req.token_ids[-len(s):] == s for s in cfg.stop_words_list):
                reason = FinishReason.STOP
            elif req.stop_text is not None:
                try:
                    if req.stop_text(req.output_ids):
                        reason = FinishReason.STOP
                except Exception as exc:  # a bad stop-word check fails this request only
                    self._finish(req, FinishReason.ERROR, exc)
                    return
        if reason is None and n >= req.max_new_tokens:
            reason = FinishReason.LENGTH
        req.finish_reason = reason
        req.outputs.put(StepOutput([token], finished=False, logits=logits))

    def _finish(self, req: Request, reason: FinishReason, error: Optional[BaseException] = None) -> None:
        if req.done.is_set():
            return
        self.scheduler.finish(req)
        req.finish_reason = reason
        req.finished_at = time.monotonic()
        req.outputs.put(StepOutput([], finished=True, error=error))
        req.done.set()
