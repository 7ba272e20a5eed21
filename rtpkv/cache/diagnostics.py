"""CacheDiagnostics: what the cache says about itself, read-only: why a request's reuse stopped
where it did (`reuse_stop`), the hit counters, `stats()` and the integrity check.

A base of `KVCacheManager`, kept apart so the request lifecycle reads alone: nothing here
changes a block, an index entry or an event (a `/metrics` scrape must not change the event
stream). It reads the manager's pool, tiers, groups and key chains, named below.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

from rtpkv.cache.sequence import RELEASED, CacheSequence

if TYPE_CHECKING:
    from rtpkv.cache.block_pool import BlockPool
    from rtpkv.cache.ghost_list import GhostTails
    from rtpkv.cache.groups import KVGroup
    from rtpkv.cache.prefix_index import KeyChain
    from rtpkv.cache.state_group import StateGroup
    from rtpkv.cache.tiers.ladder import TierLadder

# Why a request's reuse stopped where it did (aux_info["reuse_stop"]), in the order checked.
REUSE_STOPS = ("reuse_off", "prompt_end", "partial_block", "window", "state", "tier_disabled",
               "evicted", "not_cached")


@dataclass(frozen=True)
class ReuseStop:
    """Why reuse stopped where it did. `tokens`: for partial_block, the tokens partial reuse
    would have taken; for evicted, the prompt tokens that missed only because their blocks had
    been evicted (ghost hits)."""

    reason: str
    tokens: int = 0


class CacheDiagnostics:
    """The read-only half of `KVCacheManager`. Besides the state below, it uses the manager's
    rules: `reuse_applies`, `_chain`, `_views` and `_partial_hit`."""

    block_size: int
    pool: "BlockPool"
    ladder: "TierLadder"
    groups: Sequence["KVGroup"]
    window: Optional[int]
    partial_reuse: bool
    ghost_tails: "GhostTails"
    state_group: Optional["StateGroup"]

    def _init_counters(self) -> None:
        self.query_tokens = 0
        self.hit_tokens = 0
        self.partial_hit_tokens = 0
        self.ghost_hit_tokens = 0
        self.reuse_stops: Counter[str] = Counter()

    def record_lookup(self, seq: CacheSequence) -> ReuseStop:
        """Count a request's first admission in the token-weighted hit statistics, and say why
        its reuse stopped where it did."""
        stop = self._reuse_stop(seq)
        self.reuse_stops[stop.reason] += 1
        if self.reuse_applies(seq):
            self.query_tokens += seq.num_prompt
            self.hit_tokens += seq.num_computed
            self.partial_hit_tokens += seq.num_computed % self.block_size
            if stop.reason == "evicted":
                self.ghost_hit_tokens += stop.tokens
        return stop

    def _reuse_stop(self, seq: CacheSequence) -> ReuseStop:
        """Why the reuse of `seq` (just admitted) ends at `seq.num_computed`. Everything asked
        is `seq`'s own chain (salted keys, salt-scoped candidates), so the answer never tells
        anything about another tenant's cache."""
        if not self.reuse_applies(seq):
            return ReuseStop("reuse_off")
        B, cap, reused = self.block_size, seq.num_tokens - 1, seq.num_computed
        i = reused // B                          # the block where reuse stopped
        if len(self.groups) > 1 and i < cap // B and self._holds(self._chain(seq), i):
            return ReuseStop("window")   # group 0 goes on: a sliding group lacks its window
        if self.state_group is not None and i < cap // B and self._holds(self._chain(seq), i):
            return ReuseStop("state")    # blocks go on, but no saved recurrent state past here
        if not self.partial_reuse:
            parent_serial = self.pool.blocks[seq.block_table[i - 1]].serial if i else 0
            hit = self._partial_hit(seq, i, parent_serial, cap)
            chain = self._chain(seq)
            tail = self.ghost_tails.longest(chain.parent(i), chain.extra(i), parent_serial,
                                            seq.token_ids[i * B:min((i + 1) * B, cap)])
            k = max(tail, hit.num_tokens if hit is not None else 0)
            if k:
                return ReuseStop("partial_block", k)
        last = cap // B                          # whole blocks the prompt may reuse
        if i >= last:
            return ReuseStop("prompt_end" if reused == cap or not self.partial_reuse
                             else "not_cached")
        chain = self._chain(seq)
        if self.window is not None and any(self._holds(chain, j) for j in range(i + 1, last)):
            return ReuseStop("window")
        key = chain.key(i)
        if self.ladder.held_by_skipped(key, seq.allows_tier):
            return ReuseStop("tier_disabled")
        if key in self.pool.ghosts:
            j = i
            while j < last and (chain.key(j) in self.pool.ghosts or self._holds(chain, j)):
                j += 1
            return ReuseStop("evicted", j * B - reused)
        return ReuseStop("not_cached")

    def _holds(self, chain: "KeyChain", i: int) -> bool:
        """Whether the device pool holds block i of `chain` (key, tokens, extra bytes)."""
        block = self.pool.cached(chain.key(i))
        return block is not None and block.tokens == chain.tokens(i) \
            and block.extra == chain.extra(i)

    def stats(self) -> dict[str, object]:
        """Counters and block counts. Read-only: a retention duration that ran out shows as
        lapsed, but nothing is lapsed and no event is emitted (a /metrics scrape must not
        change the event stream)."""
        pool = self.pool
        stats: dict[str, object] = {
            "queries": self.query_tokens,
            "hits": self.hit_tokens,
            "hit_rate": self.hit_tokens / self.query_tokens if self.query_tokens else 0.0,
            "blocks_total": pool.num_blocks,
            "blocks_free": pool.num_free,
            "blocks_cached": pool.num_cached,
            "blocks_in_use": sum(1 for b in pool.blocks if b.ref_count),
            "blocks_pinned": pool.num_pinned,
            "blocks_tail": pool.num_tails,
            "partial_hit_tokens": self.partial_hit_tokens,
            "blocks_cached_by_priority": pool.cached_by_priority(),
            "evictions": pool.evictions,
            "evictions_by_priority": dict(sorted(pool.evictions_by_priority.items())),
            "block_size": self.block_size,
            "kv_cache_groups": [{"kind": g.kind, "window": g.window, "layers": len(g.layers)}
                                for g in self.groups] if len(self.groups) > 1 else [],
            "reuse_stops": {r: self.reuse_stops[r] for r in REUSE_STOPS},
            "ghost_blocks": len(pool.ghosts),
            "ghost_capacity": pool.ghosts.capacity,
            "ghost_hit_tokens": self.ghost_hit_tokens,
            "hit_rate_with_ghosts": ((self.hit_tokens + self.ghost_hit_tokens) / self.query_tokens
                                     if self.query_tokens else 0.0),
            "events_dropped": pool.events.dropped,
        }
        stats.update(pool.tenants.stats())
        stats.update(self.ladder.stats())
        stats["residency"] = {"device": pool.residency.stats(), **self.ladder.residency()}
        if self.state_group is not None:
            stats["state_group"] = self.state_group.stats()
        return stats

    def check_integrity(self, live: Optional[Iterable[CacheSequence]] = None) -> None:
        """Assert the pool's invariant (`BlockPool.check_integrity`), every tier's, that every
        full block belongs to one of the groups, and (given the live requests) that every
        reference count equals its holders plus its pins, every full block in a group's table
        is that group's and holds the key the table has for it, and no block inside a
        request's attention window was released."""
        self.pool.check_integrity()
        self.ladder.check_integrity()
        blocks = self.pool.blocks
        assert all(b.group < len(self.groups) for b in blocks if b.full or b.tail), \
            "a block of a group the cache does not have"
        live = None if live is None else list(live)
        if self.state_group is not None:
            self.state_group.check_integrity(live)
        if live is None:
            return
        expected = [b.pin_count for b in blocks]
        for seq in live:
            for group, view in self._views(seq):
                for i, block_id in enumerate(view.block_table):
                    if block_id == RELEASED:
                        continue
                    expected[block_id] += 1
                    block = blocks[block_id]
                    if block.full:
                        assert block.group == group.index, \
                            f"block {block_id} of group {block.group} in group {group.index}'s table"
                        assert i >= len(view.block_keys) or block.key == view.block_keys[i], \
                            f"block {block_id} does not hold the key group {group.index} has for it"
                if group.window is None:
                    assert RELEASED not in view.block_table, \
                        f"group {group.index} attends fully but released a block"
                else:
                    first = max(0, seq.num_computed - group.window + 1) // self.block_size
                    assert RELEASED not in view.block_table[first:], \
                        "a block inside the attention window was released"
                assert len(view.block_keys) <= len(view.block_table), "keys past the table"
        actual = [b.ref_count for b in blocks]
        assert expected == actual, "reference counts differ from the live block tables"
