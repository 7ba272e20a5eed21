"""Engine: one background thread that steps the model; requests come from any thread.

A step reads schedule -> run -> sample -> postprocess -> emit: take new submissions and drop
cancelled or timed-out requests, ask the Scheduler for the batch, run the forward, sample, let
the Scheduler do the bookkeeping (progress, stop checks, commit, pin, finish), then hand each
request its token — marked finished on its last one. Every cache structure is touched only
under `self.lock`, which a step holds from start to end.

A burst (NUM_SCHEDULER_STEPS > 1) runs several decode steps in one call of the fused CPU
decoder, where that changes nothing but when tokens reach their streams: every scheduled chunk
is a plain greedy decode that wants no logits and has no deadline, and no request waits. A
burst never crosses the end of a block any of its requests is writing, so it needs no block
single steps would not hold. The C loop feeds each step's arg-max tokens to the next (stopping
once every row has met an EOS or one-token stop word); then each step is postprocessed and
emitted in order exactly as a step of its own would be, a request that finished (or was
cancelled) at one step dropped from the later ones (the K/V it computed past its end lie in its
own block, past its length, never committed).

A step that gives a request its first token ends with the engine thread yielding its core
(`sched_yield`, the GIL released): the reader of that stream, woken by the token, runs before
the next step's kernels take every core. Without it, on the 2-core benchmark host, the reader
waited for the OS scheduler's time slice, 3-4 ms of a 30 ms time to first token.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from typing import Any, Iterator, Optional

import torch

from rtpkv.cache.block import parents_first
from rtpkv.cache.builder import build_cache
from rtpkv.cache.sequence import PinnedPrefix
from rtpkv.config import RuntimeConfig
from rtpkv.engine.heap_trim import HeapTrimmer, libc_malloc_trim
from rtpkv.engine.model_runner import ModelRunner
from rtpkv.engine.request import FinishReason, Request, StepOutput
from rtpkv.engine.sampler import plain_greedy, sample_batch
from rtpkv.engine.scheduler import ScheduledChunk, Scheduler
from rtpkv.engine.stop import ending_token_ids
from rtpkv.engine.window import attention_window
from rtpkv.errors import EngineStoppedError, RequestTimeoutError
from rtpkv.log_limit import RateLimitedLog
from rtpkv.torch_threads import engine_threads
from rtpkv.model_factory.factory import Model

log = logging.getLogger("rtpkv")

# one step of a model call: its chunks, the chunks that sampled, their tokens, their logits
Step = tuple[list[ScheduledChunk], list[ScheduledChunk], list[int], Optional[torch.Tensor]]

STEP_LOG_SIZE = 4096
# gives this thread's core to another runnable thread, the GIL released meanwhile (POSIX)
yield_core = getattr(os, "sched_yield", lambda: None)
# A failing step is retried after a pause doubling from the first to the second figure, so
# a step that keeps failing (a bug) cannot spin a core; the first success resets it.
STEP_RETRY_S = (0.01, 1.0)


class Engine:
    def __init__(self, model: Model, config: RuntimeConfig):
        self.model = model
        self.config = config
        self.block_size = config.seq_size_per_block
        self.window = attention_window(config, model.spec)
        self.cache = build_cache(model, config, self.window.tokens)
        self.events = self.cache.events
        self.scheduler = Scheduler(config, self.cache)
        self.runner = ModelRunner(model.module, self.cache.memory, self.window.tokens,
                                  config.concurrency_limit, config.enforce_eager,
                                  self.cache.groups, self.cache.layer_slots,
                                  self.cache.layer_groups, self.cache.state_group)
        self.lock = threading.RLock()
        self.step_log: deque[list[tuple[int, int, str]]] = deque(maxlen=STEP_LOG_SIZE)
        self.steps = 0
        self._inbox: "queue.Queue[Optional[Request]]" = queue.Queue()
        self._stopped = threading.Event()
        self._submitting = threading.Lock()
        self._threads = engine_threads()
        if self._threads < torch.get_num_threads():
            log.info("engine threads: %d of torch's %d (the CPUs this process may use: affinity "
                     "and cgroup quota)", self._threads, torch.get_num_threads())
        self._step_failed = RateLimitedLog(log, logging.ERROR)
        self.heap = HeapTrimmer(config.rtpkv_malloc_trim_s, libc_malloc_trim())
        log.info("attention window: %s, attention backend: %s", self.window.describe(),
                 model.module.attention_name)
        # the engine thread maps its forward scratch for a step's token budget before the
        # engine is handed out, so that start-up, not the first long prompt, pays it
        self._reserved = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rtpkv-engine", daemon=True)
        self._thread.start()
        self._reserved.wait()

    # ------------------------------------------------------------------ API (any thread)
    def submit(self, req: Request) -> Request:
        self.scheduler.check_fits(req)  # reads two counters: no lock, so a step never delays it
        with self._submitting:  # stop() sets _stopped under it: a request it admits is drained
            if self._stopped.is_set():
                raise EngineStoppedError("the pipeline has been stopped")
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
        with self._submitting:
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
            self.cache.close()  # flushes queued disk and Redis writes

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def cache_stats(self) -> dict[str, Any]:
        with self.lock:
            stats = self.cache.stats()
            stats["requests_running"] = len(self.scheduler.running)
            stats["requests_waiting"] = len(self.scheduler.waiting)
            stats["attention_window"] = self.window.tokens
            stats["attention_window_source"] = self.window.source
            return stats

    def cached_tokens(self, req: Request) -> int:
        """How many of `req`'s tokens the device pool holds now, as a prefix."""
        with self.lock:
            return self.cache.cached_tokens(req)

    def check_integrity(self) -> None:
        with self.lock:
            self.cache.check_integrity(self.scheduler.running)

    def announce_tiers(self) -> None:
        """Emit a stored event for each block the tiers held before events were listened to."""
        with self.lock:
            self.cache.announce_tiers()

    def tenant_quota(self, salt: str) -> dict[str, Any]:
        """One tenant's cached blocks, quota and quota evictions (Tenants.report)."""
        with self.lock:
            return self.cache.tenants.report(salt)

    def set_tenant_quota(self, salt: str, blocks: Optional[int]) -> dict[str, Any]:
        """Change one tenant's quota between steps; returns its counts after the change."""
        with self.lock:
            self.cache.tenants.set_quota(salt, blocks)
            return self.cache.tenants.report(salt)

    def reuse_applies(self, req: Request) -> bool:
        """Whether `req` looks up and registers cached blocks (REUSE_CACHE and its own
        `reuse_cache`)."""
        return self.cache.reuse_applies(req)

    @property
    def root_key(self) -> bytes:
        """The key every chain of block keys starts from (the KV events' first parent)."""
        return self.cache.index.root

    @property
    def num_blocks(self) -> int:
        """Blocks in the device pool."""
        return self.cache.num_blocks

    @property
    def cache_version(self) -> int:
        """How often the device pool's cached set changed (index insertions and removals)."""
        return self.cache.pool.changes

    @property
    def pool_tokens(self) -> int:
        """Tokens the device pool holds when full."""
        return self.cache.num_blocks * self.block_size

    def tier_names(self) -> list[str]:
        """The tiers below the device pool, nearest first."""
        return [tier.name for tier in self.cache.ladder.tiers]

    def indexed_blocks(self) -> tuple[int, list[tuple[bytes, bytes, tuple[int, ...], bytes]]]:
        """(the pool's change count, its indexed blocks as (key, parent key, tokens, extra),
        parents first): what a router that polls for the cached set reads, taken at once."""
        with self.lock:
            pool = self.cache.pool
            blocks = parents_first(b for b in pool.blocks if b.indexed)
            return pool.changes, [(b.key, b.parent_key, b.tokens, b.extra) for b in blocks]

    def announce_contents(self) -> None:
        """Emit a stored event for each block the pool and the tiers hold now (parents first)."""
        with self.lock:
            self.cache.announce_contents()

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        torch.set_num_threads(self._threads)  # thread counts are per OS thread
        try:
            self.runner.reserve_scratch(self.config.max_num_batched_tokens)
        except (MemoryError, OSError):   # each forward maps what it needs instead
            log.warning("could not reserve the forward scratch at start", exc_info=True)
        finally:
            self._reserved.set()
        failures = 0
        while not self._stopped.is_set():
            try:
                self._turn()
                failures = 0
            except Exception:  # a bug must not kill the loop silently, nor flood the log
                failures += 1
                self._step_failed("engine step failed", exc_info=True)
                with self.lock:
                    for req in list(self.scheduler.running):
                        self._finish(req, FinishReason.ERROR, RuntimeError("engine step failed"))
                first, most = STEP_RETRY_S
                self._stopped.wait(min(first * 2 ** min(failures - 1, 16), most))

    def _turn(self) -> None:
        """One step, or, when idle or when every waiting request waits for blocks, a wait for
        news; either may give freed heap memory back (HeapTrimmer)."""
        if self.scheduler.has_work() and self.step():
            self.heap.stepped()
            return
        try:
            item = self._inbox.get(timeout=0.5 if not self.scheduler.has_work() else 0.01)
        except queue.Empty:
            self.heap.maybe_trim()
            return
        if item is not None:
            self.scheduler.add(item)

    def step(self) -> bool:
        """One model call: a step, or a burst of decode steps, each postprocessed and emitted
        by `_complete`. Returns False when there was nothing to run."""
        with self.lock:
            self._take_inbox()
            self._reap()
            batch = self.scheduler.schedule()
            failed = self.scheduler.take_failed()
            for req in failed:
                self._finish(req, FinishReason.ERROR, req.error)
            if not batch:
                return bool(failed)
            count = self._burst_steps(batch)
            try:
                if count == 1:
                    steps = self._sampled(batch, *self.runner.run(batch))
                else:
                    stops = [ending_token_ids(c.request) for c in batch]
                    steps = self._burst(batch, self.runner.run_burst(batch, count, stops))
            except Exception as exc:
                log.exception("forward failed")
                for c in batch:
                    self._finish(c.request, FinishReason.ERROR, exc)
                return True
            for step in steps:
                self._complete(*step)
            return True

    def _complete(self, chunks: list[ScheduledChunk], sampled: list[ScheduledChunk],
                  tokens: list[int], logits: Optional[torch.Tensor]) -> None:
        """One step's end, whether its model call ran alone or in a burst: the scheduler's
        bookkeeping (progress, stop checks, commits, pins, finishes), then each stream's token."""
        self.steps += 1
        self.step_log.append([(c.request.request_id, c.num_tokens,
                               "decode" if c.is_decode else "prefill") for c in chunks])
        finished = self.scheduler.postprocess(chunks, sampled, tokens)
        self._emit(sampled, tokens, logits, finished)

    def _sampled(self, batch: list[ScheduledChunk], logits: torch.Tensor,
                 sampled: list[ScheduledChunk]) -> Iterator[Step]:
        """The one step of a single call: its rows sampled, each request whose sampling fails
        failed alone (the others keep their tokens)."""
        tokens, failed = sample_batch(logits, [c.request for c in sampled]) if sampled \
            else ([], {})
        if failed:
            for req, exc in failed.items():
                log.error("request %d failed in sampling: %r", req.request_id, exc)
                self._finish(req, FinishReason.ERROR, exc)
            keep = [i for i, c in enumerate(sampled) if c.request not in failed]
            batch = [c for c in batch if c.request not in failed]
            sampled, tokens = [sampled[i] for i in keep], [tokens[i] for i in keep]
            logits = logits[keep]
        yield batch, sampled, tokens, logits

    def _burst(self, batch: list[ScheduledChunk], tokens: list[list[int]]) -> Iterator[Step]:
        """The steps of a burst, in order, each over the requests still running when it comes
        (read lazily: the previous step's `_complete` may have finished some)."""
        for step in tokens:
            for c in batch:   # what a single step's _reap would have seen before this step
                if c.request.cancelled:
                    self._finish(c.request, FinishReason.CANCELLED)
            rows = [r for r, c in enumerate(batch) if c.request.finish_reason is None]
            if not rows:
                return
            running = [batch[r] for r in rows]
            yield running, running, [step[r] for r in rows], None

    def _burst_steps(self, batch: list[ScheduledChunk]) -> int:
        """Decode steps the next call runs (see the module's docstring): up to
        NUM_SCHEDULER_STEPS, never past any request's last new token nor the end of the block
        it writes; 1 where a burst would change what a request sees besides timing."""
        steps = self.config.num_scheduler_steps
        if (steps <= 1 or not self.runner.runs_bursts or self.scheduler.waiting
                or not self._inbox.empty()):
            return 1
        B = self.block_size
        for c in batch:
            req = c.request
            if (not (c.is_decode and plain_greedy(req)) or req.config.return_logits
                    or req.config.logprobs is not None or req.deadline is not None):
                return 1
            steps = min(steps, req.max_new_tokens - req.num_output, B - c.start % B)
        return steps

    def _emit(self, sampled: list[ScheduledChunk], tokens: list[int],
              logits: Optional[torch.Tensor], finished: list[Request]) -> None:
        """Hand each request its new token, marked finished on the last one; a request that
        ended without a token this step (a pinned task prompt) gets an empty final output."""
        now = time.monotonic()
        for req in finished:
            req.finished_at = now
        emitted = set()
        first = False
        for row, (c, token) in enumerate(zip(sampled, tokens)):
            req = c.request
            done = req.finish_reason is not None
            req.outputs.put(StepOutput(
                [token], finished=done, error=req.error,
                logits=logits[row:row + 1].clone()
                if req.config.return_logits or req.config.logprobs is not None else None))
            emitted.add(req)
            first = first or req.num_output == 1
        for req in finished:
            if req not in emitted:
                req.outputs.put(StepOutput([], finished=True, error=req.error))
            req.done.set()
        if first:   # a first token's reader runs before the next step (the module's docstring)
            yield_core()

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
