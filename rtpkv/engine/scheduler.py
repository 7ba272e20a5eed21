"""Scheduler: which requests run in the next engine step, and how many tokens each computes.

Each step has a token budget (`max_num_batched_tokens`) shared by decode tokens (one per running
request, scheduled first so a long prompt never stalls them) and prefill chunks. The context
chunking policy shares what is left among prompts being prefilled: FIRST_COME_FIRST_SERVED
gives it to the oldest first; EQUAL_PROGRESS hands out one block's worth of tokens to each in
turn. The capacity policy decides admission: GUARANTEED_NO_EVICT reserves a request's prompt and
its full max_new_tokens so it is never paused; MAX_UTILIZATION admits whatever fits now and,
when blocks run out, pauses the most recently admitted request (its full blocks stay cached, so
resuming is cheap); STATIC_BATCH (legacy) admits a batch only when the previous one has finished.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from rtpkv.cache import KVCacheManager
from rtpkv.config import CapacitySchedulerPolicy, ContextChunkingPolicy, RuntimeConfig, SchedulePolicy
from rtpkv.engine.request import Request

_LPM_MAX_QUEUE = 128  # longer queues fall back to arrival order: matching them all costs too much


@dataclass
class ScheduledChunk:
    request: Request
    num_tokens: int           # tokens computed this step, starting at request.num_computed

    @property
    def start(self) -> int:
        return self.request.num_computed


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    def __init__(self, config: RuntimeConfig, cache: KVCacheManager):
        self.config = config
        self.cache = cache
        self.block_size = cache.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []       # in admission order
        self._admitting = True

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def blocks_for(self, req: Request) -> int:
        """Blocks the request needs at its longest (prompt plus every new token)."""
        return _cdiv(req.num_prompt + req.max_new_tokens, self.block_size)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> list[ScheduledChunk]:
        budget = self.config.max_num_batched_tokens
        plan: dict[Request, int] = {}
        # STATIC_BATCH admits only into an empty engine, then runs that batch to completion.
        self._admitting = (self.config.capacity_scheduler_policy != CapacitySchedulerPolicy.STATIC_BATCH
                           or not self.running)
        if self._admitting:
            self._order_waiting()
        for req in list(self.running):                       # decodes first
            if budget and req in self.running and req.num_tokens - req.num_computed == 1:
                if self._grow(req, 1, plan):
                    plan[req] = 1
                    budget -= 1
        prefilling = [r for r in self.running if r not in plan]
        if self.config.context_chunking_policy == ContextChunkingPolicy.EQUAL_PROGRESS:
            self._admit_all(prefilling, budget)
            self._equal_progress(prefilling, budget, plan)
        else:
            self._first_come_first_served(prefilling, budget, plan)
        return [ScheduledChunk(req, n) for req, n in plan.items()
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
        need = _cdiv(req.num_computed + n, self.block_size) - len(req.block_table)
        while need > 0:
            got = self.cache.allocate(need)
            if got is not None:
                req.block_table.extend(got)
                return True
            victim = self.running[-1]
            self.preempt(victim)
            plan.pop(victim, None)
            if victim is req:
                return False
        return True

    def preempt(self, req: Request) -> None:
        """Pause: free the request's blocks (full ones stay cached) and queue it first."""
        self.cache.release(req.block_table)
        req.block_table, req.block_keys, req.num_computed = [], [], 0
        req.num_preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        """Drop the request from the queues and give back its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.cache.release(req.block_table)
        req.block_table = []

    # ------------------------------------------------------------------ admission
    def _reserved(self) -> int:
        """Blocks that running requests may still claim under the guaranteed policies."""
        return sum(max(0, self.blocks_for(r) - len(r.block_table)) for r in self.running)

    def _cached_prefix(self, req: Request) -> list[int]:
        if not (self.config.reuse_cache and req.reuse):
            return []
        return self.cache.match(req.token_ids, req.salt, (req.num_tokens - 1) // self.block_size)

    def _order_waiting(self) -> None:
        if (self.config.schedule_policy == SchedulePolicy.LPM
                and 1 < len(self.waiting) <= _LPM_MAX_QUEUE):
            ranked = sorted(self.waiting, key=lambda r: -len(self._cached_prefix(r)))
            self.waiting = deque(ranked)

    def _admit_next(self) -> bool:
        """Admit the next waiting request if the policies allow; it joins `running`."""
        if not self.waiting or len(self.running) >= self.config.concurrency_limit:
            return False
        policy = self.config.capacity_scheduler_policy
        if not self._admitting:
            return False
        req = self.waiting[0]
        hits = self._cached_prefix(req)
        cached_hits = sum(1 for b in hits if self.cache.pool.blocks[b].ref_count == 0)
        available = self.cache.num_allocatable() - cached_hits
        if policy == CapacitySchedulerPolicy.MAX_UTILIZATION:
            need = _cdiv(req.num_tokens, self.block_size) - len(hits)
        else:
            need = self.blocks_for(req) - len(hits)
            available -= self._reserved()
        if need > available:
            return False
        self.waiting.popleft()
        self.cache.acquire(hits)
        req.block_table = list(hits)
        req.block_keys = [self.cache.pool.blocks[b].key for b in hits]
        req.num_computed = len(hits) * self.block_size
        if req.reuse_len is None:
            req.reuse_len = req.num_computed
            if self.config.reuse_cache and req.reuse:
                self.cache.record_lookup(req.num_prompt, req.num_computed)
        if req.admitted_at is None:
            req.admitted_at = time.monotonic()
        self.running.append(req)
        return True
