"""Scheduler: which requests run in the next engine step, how many tokens each computes, and
the bookkeeping after the step (`postprocess`).

Each step has a token budget (`max_num_batched_tokens`) shared by decode tokens (one per running
request, scheduled first so a long prompt never stalls them) and prefill chunks. The context
chunking policy shares what is left among prompts being prefilled: FIRST_COME_FIRST_SERVED
gives it to the oldest first; EQUAL_PROGRESS hands out one block's worth of tokens to each in
turn. The capacity policy decides admission: GUARANTEED_NO_EVICT reserves a request's prompt and
its full max_new_tokens so it is never paused; MAX_UTILIZATION admits whatever fits now and,
when blocks run out, pauses the most recently admitted request (its full blocks stay cached, so
resuming is cheap); STATIC_BATCH (legacy) admits a batch only when the previous one has finished.
With an attention window, blocks that fell out of it are released after each step, and the
reservations count the blocks a request holds at once (the window's), not its whole length.

Blocks are the KVCacheManager's: the scheduler asks it to look up, admit, grow, commit, pin and
free, and never touches a block itself. Whatever fails while a request is admitted fails that
request alone, with its blocks released (`take_failed` hands such requests to the engine).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

from rtpkv.cache.manager import KVCacheManager
from rtpkv.config import CapacitySchedulerPolicy, ContextChunkingPolicy, RuntimeConfig, SchedulePolicy
from rtpkv.engine.request import FinishReason, Request
from rtpkv.engine.stop import check_stop
from rtpkv.errors import CapacityError

log = logging.getLogger("rtpkv")

_LPM_MAX_QUEUE = 128  # longer queues fall back to arrival order: matching them all costs too much


@dataclass
class ScheduledChunk:
    request: Request
    num_tokens: int           # tokens computed this step, starting at request.num_computed
    is_decode: bool = False   # the request's one sampled token (not a prompt chunk)

    @property
    def start(self) -> int:
        return self.request.num_computed


class Scheduler:
    def __init__(self, config: RuntimeConfig, cache: KVCacheManager):
        self.config = config
        self.cache = cache
        self.block_size = cache.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []       # in admission order
        self._admitting = True
        self._failed: list[Request] = []       # failed while being admitted, to be answered

    def add(self, req: Request) -> None:
        """Queue a new request, and start fetching its cached blocks from background tiers:
        it is admitted once they are in memory; others are admitted meanwhile."""
        self.waiting.append(req)
        try:
            self.cache.prefetch(req)
        except Exception as exc:
            self._fail(req, exc)

    def check_fits(self, req: Request) -> None:
        """CapacityError when `req` could never fit the pool, even alone."""
        usable = self.cache.usable_blocks
        need = self.cache.blocks_held_at_most(self.tokens_for(req),
                                              self.config.max_num_batched_tokens)
        if need > usable:
            window = self.cache.window
            shown = "" if window is None else f", attention window {window}"
            total = self.cache.num_blocks
            raise CapacityError(
                f"request needs {need} KV blocks ({req.num_prompt} prompt tokens + "
                f"max_new_tokens {req.max_new_tokens}, {self.block_size} tokens per block"
                f"{shown}) but the pool has {usable} usable blocks ({total} total, "
                f"{total - usable} pinned)")

    def take_failed(self) -> list[Request]:
        """Requests that failed while being admitted (their `error` says why); each is out of
        the queues and holds no block."""
        failed, self._failed = self._failed, []
        return failed

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._failed)

    @staticmethod
    def tokens_for(req: Request) -> int:
        """Tokens the request holds at its longest (prompt plus every new token)."""
        return req.num_prompt + req.max_new_tokens

    # ------------------------------------------------------------------ one step
    def schedule(self) -> list[ScheduledChunk]:
        budget = self.config.max_num_batched_tokens
        plan: dict[Request, int] = {}
        # STATIC_BATCH admits only into an empty engine, then runs that batch to completion.
        self._admitting = (self.config.capacity_scheduler_policy != CapacitySchedulerPolicy.STATIC_BATCH
                           or not self.running)
        if self._admitting:
            self._order_waiting()
        decoding = set()
        for req in list(self.running):                       # decodes first
            if budget and req in self.running and req.is_decoding:
                if self._grow(req, 1, plan):
                    plan[req] = 1
                    decoding.add(req)
                    budget -= 1
        prefilling = [r for r in self.running if r not in plan]
        if self.config.context_chunking_policy == ContextChunkingPolicy.EQUAL_PROGRESS:
            self._admit_all(prefilling, budget)
            self._equal_progress(prefilling, budget, plan)
        else:
            self._first_come_first_served(prefilling, budget, plan)
        return [ScheduledChunk(req, n, req in decoding) for req, n in plan.items()
                if req in self.running and n > 0]

    def _first_come_first_served(self, prefilling: list[Request], budget: int,
                                 plan: dict[Request, int]) -> None:
        for req in prefilling:
            if budget <= 0:
                return
            if req in self.running:
                budget -= self._give(req, budget, plan)
        while budget > 0 and self._admit_next():
            budget -= self._give(self.running[-1], budget, plan)

    def _admit_all(self, prefilling: list[Request], budget: int) -> None:
        """Admit while every prompt being prefilled can still get a token of the budget."""
        while budget > len(prefilling) and self._admit_next():
            prefilling.append(self.running[-1])

    def _equal_progress(self, prefilling: list[Request], budget: int,
                        plan: dict[Request, int]) -> None:
        """Round-robin in units of one block until the budget or the prompts run out."""
        active = [r for r in prefilling if r in self.running]
        while budget > 0 and active:
            for req in list(active):
                want = min(self.block_size, budget,
                           req.num_tokens - req.num_computed - plan.get(req, 0))
                if want <= 0 or req not in self.running:
                    active.remove(req)
                    continue
                if not self._grow(req, plan.get(req, 0) + want, plan):
                    active.remove(req)
                    continue
                plan[req] = plan.get(req, 0) + want
                budget -= want
                if budget <= 0:
                    break

    def _give(self, req: Request, budget: int, plan: dict[Request, int]) -> int:
        n = min(budget, req.num_tokens - req.num_computed)
        if n <= 0 or not self._grow(req, n, plan):
            return 0
        plan[req] = n
        return n

    # ------------------------------------------------------------------ blocks
    def _grow(self, req: Request, n: int, plan: dict[Request, int]) -> bool:
        """Ensure req's table covers n more tokens, pausing later-admitted requests if blocks
        run out. False when req itself had to be paused."""
        while not self.cache.grow(req, req.num_computed + n):
            victim = self.running[-1]
            self.preempt(victim)
            plan.pop(victim, None)
            if victim is req:
                return False
        return True

    def preempt(self, req: Request) -> None:
        """Pause: free the request's blocks (full ones stay cached) and queue it first."""
        self.cache.free(req)
        req.num_computed = 0
        req.num_preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        """Drop the request from the queues and give back its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.cache.free(req)

    # ------------------------------------------------------------------ after the step
    def postprocess(self, chunks: list[ScheduledChunk], sampled: list[ScheduledChunk],
                    tokens: list[int]) -> list[Request]:
        """Progress, new tokens and their stop checks, commit of filled blocks, pin of a task
        prompt, finish. Returns the requests that finished this step."""
        for c in chunks:
            c.request.num_computed += c.num_tokens
            c.request.iter_count += 1
        for c, token in zip(sampled, tokens):
            self._append(c.request, token)
        finished = []
        for c in chunks:
            req = c.request
            try:
                if req.finish_reason != FinishReason.ERROR:
                    self.cache.commit(req)
                if req.prefill_only and req.num_computed == req.num_tokens:
                    if not req.prewarm:
                        req.pinned = self.cache.pin(req)
                    req.finish_reason = FinishReason.PREFILLED
                if req.finish_reason is None:
                    self.cache.release_out_of_window(req)
            except Exception as exc:  # fails this request alone; the others keep their tokens
                log.exception("request %d failed in postprocessing", req.request_id)
                req.error, req.finish_reason = exc, FinishReason.ERROR
            if req.finish_reason is not None:
                self.finish(req)
                finished.append(req)
        return finished

    def _append(self, req: Request, token: int) -> None:
        req.token_ids.append(token)
        if req.first_token_at is None:
            req.first_token_at = time.monotonic()
        req.finish_reason = check_stop(req)

    # ------------------------------------------------------------------ admission
    def _reserved(self) -> int:
        """Blocks that running requests may still claim under the guaranteed policies."""
        chunk = self.config.max_num_batched_tokens
        return sum(self.cache.blocks_to_grow(r, self.tokens_for(r), chunk) for r in self.running)

    def _order_waiting(self) -> None:
        if (self.config.schedule_policy == SchedulePolicy.LPM
                and 1 < len(self.waiting) <= _LPM_MAX_QUEUE):
            cached = {r: len(self.cache.lookup(r).device) for r in self.waiting}
            self.waiting = deque(sorted(self.waiting, key=lambda r: -cached[r]))

    def _next_fetched(self) -> Optional[Request]:
        """The first waiting request whose blocks are not still being fetched from a tier."""
        for req in self.waiting:
            if self.cache.prefetched(req):
                return req
        return None

    def _fail(self, req: Request, exc: Exception) -> None:
        """`req` failed while being admitted: out of the queues, its blocks released."""
        log.error("request %d failed during admission: %s: %s", req.request_id,
                  type(exc).__name__, exc, exc_info=exc)
        if req in self.waiting:
            self.waiting.remove(req)
        self.cache.free(req)
        req.error, req.finish_reason = exc, FinishReason.ERROR
        self._failed.append(req)

    def _admit_next(self) -> bool:
        """Admit the next waiting request if the policies allow; it joins `running`. A request
        that fails on the way is failed alone and the next one is tried."""
        while self.waiting and len(self.running) < self.config.concurrency_limit \
                and self._admitting:
            req = self._next_fetched()
            if req is None:
                return False
            try:
                return self._admit(req)
            except Exception as exc:
                self._fail(req, exc)
        return False

    def _admit(self, req: Request) -> bool:
        match = self.cache.lookup(req)  # the fit depends on device hits; tiers come at admission
        chunk = self.config.max_num_batched_tokens
        if self.config.capacity_scheduler_policy == CapacitySchedulerPolicy.MAX_UTILIZATION:
            fits = self.cache.can_admit(req, match, req.num_tokens, chunk=chunk)
        else:
            fits = self.cache.can_admit(req, match, self.tokens_for(req), self._reserved(), chunk)
        if not fits:
            return False
        reused = self.cache.admit(req, match)
        self.waiting.remove(req)
        if req.local_reuse_len is None:
            req.local_reuse_len = reused.pop("local")
            req.partial_reuse_len = reused.pop("partial", 0)
            req.reuse_by_tier = reused
            stop = self.cache.record_lookup(req)
            req.reuse_stop, req.reuse_stop_tokens = stop.reason, stop.tokens
        if req.admitted_at is None:
            req.admitted_at = time.monotonic()
        self.running.append(req)
        return True
