"""KVCacheManager: the cache's request-level API.

The scheduler speaks in requests; the manager turns that into block operations on the
`BlockPool` (the one writer of block state) and tier operations on the `TierLadder` (the one
caller of the tiers), and copies payloads between the tiers and the `KVMemory`. The scheduler,
the engine, the pipeline and the task registry hold block tables (handed to the attention
backend) and opaque `PinnedPrefix` handles, nothing else.

A request's life in the cache:
    prefetch(seq)                on arrival: start the background tier fetches (Redis)
    prefetched(seq)              whether they are done (the request waits until then)
    match = lookup(seq)          which prefix the device pool holds
    can_admit(seq, match, ...)   whether the blocks it needs can be had (device hits decide)
    admit(seq, match)            share the device hits, then walk the tiers and onboard their hits,
                                 then (ENABLE_PARTIAL_REUSE) copy a partial-block hit
    grow(seq, tokens)            append fresh blocks for the next chunk (never rewrites a table)
    commit(seq)                  blocks that filled become hittable (and written through)
    release_out_of_window(seq)   with an attention window: drop blocks no future query reads
    free(seq)                    drop its references, tail first, with its retention priority
    pin(seq) / unpin(handle)     a task prompt's blocks stay in memory until unpinned

Block tables are append-only: a block id stays at its place in a running request's table until
the request ends, or until it falls out of the attention window (`window`): a block whose every
position is older than what the next query attends to is released during the request
(`release_out_of_window`) and its entry becomes `RELEASED`, so positions never shift and the
table keeps its length; attention backends read only inside the window, never such an entry.
A released block is released as at the end of a request: a full, indexed one stays cached
(evictable) and findable, the rest go back to the free list.

KV cache groups (rtpkv/cache/groups.py): a model whose layers attend over different windows has
one table per group of layers over the one pool. Group 0 (full attention where the model has
any) is the request's `block_table`, `block_keys` and `key_chain`; every other group's are a
`GroupTable` in `seq.group_tables`, which the manager reaches through a `GroupView` (the
request with that group's three fields), so every rule below runs per group with the group's
window and key root. The prefix hit is the longest prefix every group can serve (full groups
every block of it, sliding groups the blocks covering the window of the first query after it):
`lookup` finds it on the device, and `admit` extends it from the device and the tiers together
(`_group_onboard`, group_onboard.py), where each group's block is a tier record of its own key.

Partial-block reuse (`partial_reuse`, off by default: rtp-llm's reuse length is a multiple of
the block size): where the chain of whole blocks ends, a device block computed right after the
same block (an indexed one, or a finished request's kept tail) whose first k token ids equal
the prompt's next k gives those k tokens' K/V: they are copied into a fresh block the request
owns, with the source held by a reference while it is copied, so nothing can evict or rewrite it
meanwhile (the copy happens in `admit`, on the engine thread, before the step's forward). A
shared or indexed block is never written.

A recurrent model (Qwen3-Next, Qwen3.5) also has a state group (`state_group`, state_group.py,
vLLM's "mamba" kind): a live state slot per running request and saved states (checkpoints) at
every LINEAR_STEP-th block boundary, keyed like the attention blocks they end. A hit
is then the longest prefix whose attention blocks are held and whose end has a checkpoint
(`lookup` cuts it there), and admission copies that checkpoint into the request's live slot.
Checkpoints ride tiers of their own (the state group's ladder): admission walks the attention
chain through the device and the tiers, then cuts it back to the longest prefix with a
checkpoint at its end on the device or in a state tier (`_cut_to_state`), loading that state.

Its other rooms: `build_cache` (builder.py) builds it from the configuration and sizes the
pool; `tenants` (tenants.py) counts each salt's blocks and holds the quotas; what it says about
itself, read-only (reuse stops, stats, the integrity check), is `CacheDiagnostics`
(diagnostics.py), its base; what it needs of a request is `CacheSequence` (sequence.py).

Only the engine thread calls it (under the engine lock).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from rtpkv.cache.block import DEFAULT_PRIORITY, Block
from rtpkv.cache.block_pool import BlockPool
from rtpkv.cache.diagnostics import CacheDiagnostics
from rtpkv.cache.eviction import EvictionPolicy
from rtpkv.cache.events import KVEventBuffer
from rtpkv.cache.ghost_list import GhostTails
from rtpkv.cache.group_onboard import GroupOnboarding
from rtpkv.cache.groups import KVGroup, group_root, layer_slots
from rtpkv.cache.kv_memory import KVMemory
from rtpkv.cache.prefix_index import KeyChain, PrefixIndex
from rtpkv.cache.retention import KvCacheRetentionConfig
from rtpkv.cache.sequence import (RELEASED, CacheSequence, GroupTable, GroupView,
                                  PinnedPrefix)
from rtpkv.cache.state_group import StateGroup
from rtpkv.cache.tenants import Quota, Tenants
from rtpkv.cache.tiers.base import BlockMeta
from rtpkv.cache.tiers.ladder import TierHit, TierLadder

if TYPE_CHECKING:
    from rtpkv.cache.tiers.base import KVTier

_DEFAULT_RETENTION = KvCacheRetentionConfig()



@dataclass(frozen=True)
class PartialHit:
    """A device block whose first `num_tokens` tokens continue a request's cached chain."""

    block_id: int
    num_tokens: int


@dataclass
class PrefixMatch:
    """What lookup found in the device pool: blocks to share (group 0's; `groups`: the other
    groups' table entries, RELEASED before a sliding group's window), and a partial-block hit."""

    device: list[int] = field(default_factory=list)
    revived: int = 0                     # device hits that are cached (unreferenced) now
    partial: Optional[PartialHit] = None
    groups: list[list[int]] = field(default_factory=list)
    state: Optional[int] = None          # a recurrent model's checkpoint at the hit's end


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading token ids `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager(CacheDiagnostics, GroupOnboarding):
    def __init__(self, num_blocks: int, block_size: int, index: PrefixIndex, *,
                 memory: Optional[KVMemory] = None, reuse_enabled: bool = False,
                 partial_reuse: bool = False,
                 policy: Optional[EvictionPolicy] = None,
                 events: Optional[KVEventBuffer] = None,
                 tiers: Sequence["KVTier"] = (), offload_min_priority: int = DEFAULT_PRIORITY,
                 window: Optional[int] = None, ghosts: Optional[int] = None,
                 quota: Optional[Quota] = None,
                 groups: Sequence[KVGroup] = (),
                 state_group: Optional[StateGroup] = None,
                 clock: Callable[[], float] = time.monotonic):
        """`groups`: the KV cache groups (groups.py); none: one group with `window`.
        `state_group`: a recurrent model's states (state_group.py), its events' group index
        after the attention groups'."""
        if tiers and memory is None:
            raise ValueError("tiers need the KV memory to copy blocks from and to")
        if partial_reuse and memory is None:
            raise ValueError("partial reuse needs the KV memory to copy tokens in")
        groups = tuple(groups) or (KVGroup(0, window, ()),)
        self.block_size = block_size
        self.index = index
        self.memory = memory
        self.reuse_enabled = reuse_enabled
        self.partial_reuse = partial_reuse
        events = events or KVEventBuffer(0)
        self.ladder = TierLadder(tiers, offload_min_priority, events)
        self.pool = BlockPool(num_blocks, index, events, policy=policy, clock=clock,
                              on_evict=self._offload if self.ladder else None, ghosts=ghosts,
                              quota=quota)
        self.tenants: Tenants = self.pool.tenants   # salts' counts and quotas (tenants.py)
        # the tails partial reuse would have kept, as token ids only (to explain a reuse_stop)
        self.ghost_tails = GhostTails(0 if partial_reuse else self.pool.ghosts.capacity)
        self.groups = groups
        self.window = groups[0].window    # group 0's: tokens each query attends to; None: all
        grouped = len(groups) > 1
        self.roots = [group_root(index.root, g, grouped, index.hash_fn) for g in groups]
        self.state_group = state_group
        if grouped or state_group is not None:   # vLLM's fields of each group, on its events
            events.groups = tuple({"group_idx": g.index, "kv_cache_spec_kind": g.kind,
                                   "kv_cache_spec_sliding_window": g.window} for g in groups)
            if state_group is not None:
                events.groups += (state_group.event_fields,)
            events.group_roots = frozenset(self.roots)
        self._init_counters()

    def close(self) -> None:
        """Flush and close the tiers; the cache is not used afterwards."""
        self.ladder.close()
        if self.state_group is not None:
            self.state_group.ladder.close()

    def announce_tiers(self) -> None:
        """Report as KV events what the tiers held before a listener came (a restarted
        replica's disk records), so a router that starts from `AllBlocksCleared` knows them."""
        self.ladder.announce()

    def announce_contents(self) -> None:
        """Report as KV events everything the pool and the tiers hold now, for a consumer that
        subscribed after those blocks were announced (Dynamo's relay subscribes only once the
        worker has started)."""
        self.pool.announce()
        if self.state_group is not None:
            self.state_group.pool.announce()
        self.ladder.announce()

    @property
    def events(self) -> KVEventBuffer:
        return self.pool.events

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    # ------------------------------------------------------------------ policy
    def reuse_applies(self, seq: CacheSequence) -> bool:
        """The one place that decides whether a request looks up and registers cached blocks:
        reuse is on for the engine (REUSE_CACHE) and the request did not turn it off. A task
        request starts from its pinned prompt whatever this says."""
        return self.reuse_enabled and seq.wants_reuse

    def _chain(self, seq: CacheSequence, group: int = 0) -> KeyChain:
        """`seq`'s block keys in `group` (`seq` its view: `_views`), hashed once; the salt
        enters at the first block it owns."""
        if seq.key_chain is None:
            handle = seq.prefix_handle
            seq.key_chain = KeyChain(self.index, seq.token_ids, seq.salt,
                                     len(handle.block_ids) if handle is not None else 0,
                                     task=seq.prefill_only and not seq.prewarm,
                                     root=self.roots[group])
        return seq.key_chain

    def _views(self, seq: CacheSequence) -> list[tuple[KVGroup, CacheSequence]]:
        """Each group with `seq` as it sees it: `seq` itself for group 0, a GroupView over its
        GroupTable for the others."""
        if len(self.groups) == 1:
            return [(self.groups[0], seq)]
        while len(seq.group_tables) < len(self.groups) - 1:
            seq.group_tables.append(GroupTable())
        return [(self.groups[0], seq)] + [(g, GroupView(seq, t))
                                          for g, t in zip(self.groups[1:], seq.group_tables)]

    @property
    def layer_slots(self) -> list[int]:
        """The pool slot each model layer reads and writes (its place in its group)."""
        if len(self.groups) == 1:
            return list(range(self.memory.kv.shape[1])) if self.memory is not None else []
        return [slot for _, slot in layer_slots(self.groups)]

    @property
    def layer_groups(self) -> list[int]:
        """The KV cache group of each model layer."""
        if len(self.groups) == 1:
            return [0] * len(self.layer_slots)
        return [group for group, _ in layer_slots(self.groups)]

    # ------------------------------------------------------------------ capacity
    @property
    def usable_blocks(self) -> int:
        """Blocks a request may ever hold: the pool less the pinned ones."""
        return self.pool.num_blocks - self.pool.num_pinned

    def blocks_held_at_most(self, num_tokens: int, chunk: Optional[int] = None) -> int:
        """The most blocks a request growing to num_tokens holds at once, computing at most
        `chunk` tokens a step (default: all at once), summed over the groups. With a window W a
        step's table spans the W - 1 positions before its chunk plus the chunk: at most
        cdiv(W + chunk - 1, B) + 1 blocks (the span need not start on a block boundary)."""
        return sum(self._group_held_at_most(g.window, num_tokens, chunk) for g in self.groups)

    def _group_held_at_most(self, window: Optional[int], num_tokens: int,
                            chunk: Optional[int]) -> int:
        blocks = cdiv(num_tokens, self.block_size)
        if window is None:
            return blocks
        chunk = num_tokens if chunk is None else min(chunk, num_tokens)
        return min(blocks, cdiv(window + chunk - 1, self.block_size) + 1)

    @staticmethod
    def num_held(seq: CacheSequence) -> int:
        """Blocks `seq` holds: its tables less the entries released out of the window."""
        tables = [seq.block_table] + [t.block_table for t in getattr(seq, "group_tables", ())]
        return sum(1 for table in tables for b in table if b != RELEASED)

    def blocks_to_grow(self, seq: CacheSequence, num_tokens: int,
                       chunk: Optional[int] = None) -> int:
        """Blocks `seq` may still take from the pool on its way to num_tokens tokens."""
        return max(0, self.blocks_held_at_most(num_tokens, chunk) - self.num_held(seq))

    def can_admit(self, seq: CacheSequence, match: PrefixMatch, tokens: int,
                  reserved: int = 0, chunk: Optional[int] = None) -> bool:
        """Whether `seq` can be admitted with `match` and grow to `tokens` tokens (`chunk` at
        most per step) while `reserved` blocks stay promised to requests already running."""
        hits = [len(match.device)] + [len(entries) for entries in match.groups]
        hits += [0] * (len(self.groups) - len(hits))
        need = sum(min(cdiv(tokens, self.block_size) - hit,
                       self._group_held_at_most(g.window, tokens, chunk))
                   for g, hit in zip(self.groups, hits))
        return need <= self.pool.num_allocatable() - match.revived - reserved

    def pin_shortfall(self, num_tokens: int) -> Optional[str]:
        """Why pinning a prompt of num_tokens would break the budget (pinned blocks may take at
        most half the pool), or None when it fits."""
        num_blocks = self.pool.num_blocks
        after = self.pool.num_pinned + num_tokens // self.block_size * len(self.groups)
        if after <= num_blocks // 2:
            return None
        return (f"pinned task prompts would take {after} KV blocks ({num_tokens} tokens in this "
                f"one), more than half of the pool ({num_blocks} blocks of "
                f"{self.block_size} tokens)")

    # ------------------------------------------------------------------ lookup and admission
    def lookup(self, seq: CacheSequence, cap: Optional[int] = None) -> PrefixMatch:
        """The longest cached prefix of `seq`'s first `cap` tokens in the device pool (by
        default all but its last token, whose logits are needed): the pinned task prefix, then
        device hits, then (partial reuse) a partial-block hit; with a state group, cut to the
        longest of them with a checkpoint at its end. Read-only."""
        cap = seq.num_tokens - 1 if cap is None else cap
        match = self._attention_lookup(seq, cap)
        if self.state_group is None:
            return match
        pinned = self._pinned_state(seq)
        while True:   # a shorter prefix may need other sliding-window blocks: look up again
            j, state = self.state_group.hit(self._chain(seq), len(match.device), pinned,
                                            self.reuse_applies(seq))
            if j == len(match.device):
                match.state = state
                return match
            match = self._attention_lookup(seq, j * self.block_size)

    @staticmethod
    def _pinned_state(seq: CacheSequence) -> Optional[tuple[int, int]]:
        """(blocks, checkpoint) of the task prompt `seq` starts from, where it pinned a state."""
        handle = seq.prefix_handle
        if handle is None or handle.state_block is None:
            return None
        return len(handle.block_ids), handle.state_block

    def _attention_lookup(self, seq: CacheSequence, cap: int) -> PrefixMatch:
        """`lookup` over the attention groups alone."""
        limit = cap // self.block_size
        if len(self.groups) > 1:
            return self._group_lookup(seq, limit, cap)
        chain = self._chain(seq)
        blocks = self.pool.blocks
        match = PrefixMatch()
        parent_serial = 0
        handle = seq.prefix_handle
        if handle is not None:
            for i, block_id in enumerate(handle.block_ids[:limit]):
                block = blocks[block_id]  # verified as a hit is: unpinned, it may be gone
                if block.tokens != chain.tokens(i) or block.parent_serial != parent_serial:
                    break
                match.device.append(block_id)
                match.revived += block.ref_count == 0
                parent_serial = block.serial
        if not self.reuse_applies(seq):
            return match
        for i in range(len(match.device), limit):
            block = self.pool.cached(chain.key(i))
            if (block is None or block.tokens != chain.tokens(i) or block.extra != chain.extra(i)
                    or block.parent_serial != parent_serial):
                break
            match.device.append(block.block_id)
            match.revived += block.ref_count == 0
            parent_serial = block.serial
        if self.partial_reuse:
            match.partial = self._partial_hit(seq, len(match.device), parent_serial, cap)
            # held while it is copied, so it is not among the blocks an allocation may take
            match.revived += match.partial is not None and \
                blocks[match.partial.block_id].ref_count == 0
        return match

    def _group_lookup(self, seq: CacheSequence, limit: int, cap: int) -> PrefixMatch:
        """The prefix every group serves, at most `limit` blocks: the longest chain each full
        group holds bounds it, and it shortens until every sliding group holds the blocks the
        first query after it attends (those from its window's first block on). A task's pinned
        blocks serve as device hits; the pin's handle holds them in every group. With partial
        reuse, a partial-block hit every group serves (`_group_partials`)."""
        views = self._views(seq)
        handle = seq.prefix_handle
        pinned = ([handle.block_ids, *handle.group_block_ids] if handle is not None
                  else [()] * len(views))
        reuse = self.reuse_applies(seq)
        served = []   # per group: block index -> a verified block id
        for (group, view), pins in zip(views, pinned):
            served.append(self._group_blocks(view, group, pins, limit, reuse))
        h = min([limit] + [len(blocks) for (g, _), blocks in zip(views, served)
                           if g.window is None])
        while h and not all(all(j in blocks for j in range(self._first_needed(g, h), h))
                            for (g, _), blocks in zip(views, served) if g.window is not None):
            h -= 1
        match = PrefixMatch()
        for (group, _), blocks in zip(views, served):
            first = self._first_needed(group, h)
            entries = [RELEASED] * first + [blocks[j] for j in range(first, h)]
            match.revived += sum(1 for b in entries
                                 if b != RELEASED and self.pool.blocks[b].ref_count == 0)
            if group.index == 0:
                match.device = entries
            else:
                match.groups.append(entries)
        if self.partial_reuse and reuse:
            hits = self._group_partials(seq, [e[-1] if e else None for e in
                                              [match.device, *match.groups]], h, cap)
            if hits:
                match.partial = hits[0]
                # held while they are copied: not among the blocks an allocation may take
                match.revived += sum(1 for hit in hits
                                     if self.pool.blocks[hit.block_id].ref_count == 0)
        return match

    def _group_partials(self, seq: CacheSequence, lasts: Sequence[Optional[int]], h: int,
                        cap: int) -> Optional[list[PartialHit]]:
        """A partial-block hit after `h` whole blocks in every group (`lasts`: each group's
        block h - 1), all of the same length (the shortest group's), or None where a group has
        none: the next query attends the partial block in every group."""
        hits = []
        for (group, view), last in zip(self._views(seq), lasts):
            parent_serial = self.pool.blocks[last].serial if h else 0
            hit = self._partial_hit(view, h, parent_serial, cap, group.index)
            if hit is None:
                return None
            hits.append(hit)
        k = min(hit.num_tokens for hit in hits)
        return [PartialHit(hit.block_id, k) for hit in hits]

    def _first_needed(self, group: KVGroup, h: int) -> int:
        """The first of `h` hit blocks the query after them attends in `group` (0: full)."""
        if group.window is None or not h:
            return 0
        # the last hit block stays whatever the window: the lineage the next commit chains from
        return min(max(0, h * self.block_size - group.window + 1) // self.block_size, h - 1)

    def _group_blocks(self, seq: CacheSequence, group: KVGroup, pins: Sequence[int],
                      limit: int, reuse: bool) -> dict[int, int]:
        """The verified blocks of `seq`'s first `limit` in `group`: the pinned ones, then with
        reuse the indexed ones (key, tokens and extra bytes compared, and the lineage of each
        block after another found). A full group's run stops at its first miss; a sliding
        group's may skip blocks (those behind a window need not be held)."""
        chain = self._chain(seq, group.index)
        blocks = self.pool.blocks
        found: dict[int, int] = {}
        for i, block_id in enumerate(pins[:limit]):
            block = blocks[block_id]
            parent = blocks[found[i - 1]].serial if i else 0
            if block.tokens != chain.tokens(i) or block.parent_serial != parent:
                break
            found[i] = block_id
        if not reuse:
            return found
        for i in range(len(found), limit):
            block = self.pool.cached(chain.key(i))
            if (block is None or block.tokens != chain.tokens(i) or block.extra != chain.extra(i)
                    or (i - 1 in found and block.parent_serial != blocks[found[i - 1]].serial)
                    or (i == 0 and block.parent_serial != 0)):
                if group.window is None:
                    break
                continue
            found[i] = block.block_id
        return found

    def _partial_hit(self, seq: CacheSequence, i: int, parent_serial: int,
                     cap: int, group: int = 0) -> Optional[PartialHit]:
        """The device block that continues `seq`'s chain of i blocks (in `group`: `seq` its
        view) with the most of its next tokens (up to `cap`): listed under the chain's key and
        extra bytes (the salt), of the same lineage (`parent_serial`), token ids compared."""
        B = self.block_size
        want = seq.token_ids[i * B:min((i + 1) * B, cap)]
        if not want:
            return None
        chain = self._chain(seq, group)
        best = None
        for block_id in self.pool.children.candidates(chain.parent(i), chain.extra(i)):
            block = self.pool.blocks[block_id]
            if block.parent_serial != parent_serial:
                continue
            k = common_prefix(block.tokens, want)
            if k and (best is None or k > best.num_tokens):
                best = PartialHit(block_id, k)
                if k == len(want):               # nothing can match more
                    break
        return best

    def cached_tokens(self, seq: CacheSequence) -> int:
        """How many of `seq`'s tokens the device pool holds, as a prefix (all of them may
        count: what a request extending `seq` would reuse). Read-only."""
        match = self.lookup(seq, cap=seq.num_tokens)
        return len(match.device) * self.block_size + (match.partial.num_tokens
                                                      if match.partial is not None else 0)

    def _metas(self, seq: CacheSequence, start: int, group: int = 0) -> list[BlockMeta]:
        """The BlockMeta of `seq`'s full blocks from `start` on (the last token is always
        computed) in `group` (`seq` its view): what the tiers are asked for."""
        chain = self._chain(seq, group)
        return [BlockMeta(key=chain.key(i), parent_key=chain.parent(i), tokens=chain.tokens(i),
                          extra=chain.extra(i))
                for i in range(start, (seq.num_tokens - 1) // self.block_size)]

    def prefetch(self, seq: CacheSequence) -> None:
        """On arrival: start fetching `seq`'s blocks past its device hits from the tiers that
        fetch in the background, so its admission finds them in memory and the engine thread
        never waits on the network (`prefetched` says when)."""
        if not self.ladder or not self.reuse_applies(seq):
            return
        # the walk's start (admit's): a recurrent model's whole device chain, not its cut hit
        start = len((self.lookup(seq) if self.state_group is None
                     else self._attention_lookup(seq, seq.num_tokens - 1)).device)
        for group, view in self._views(seq):   # each group's chain from the device hit
            view.tier_plan = self.ladder.begin(self._metas(view, start, group.index), start,
                                               seq.allows_tier)

    def prefetched(self, seq: CacheSequence) -> bool:
        return all(self.ladder.ready(view.tier_plan) for _, view in self._views(seq))

    def admit(self, seq: CacheSequence, match: PrefixMatch) -> dict[str, int]:
        """Give `seq` its cached prefix: share the device hits, then walk the tiers (once per
        request) and onboard their hits into fresh blocks (a block that fails verification
        ends the prefix there). Returns the tokens reused from each source: "local" (the device
        pool, a partial-block hit included), "partial" (that hit alone, if any) and each tier's
        name. On any exception `seq` holds no block afterwards."""
        assert not seq.block_table, "admit a request once, or again after free"
        try:
            reused, partial = (self._group_admit(seq, match) if len(self.groups) > 1
                               else self._one_table_admit(seq, match))
        except BaseException:
            self.free(seq)
            raise
        if partial:
            reused["local"] += partial
            reused["partial"] = partial
        seq.num_computed = len(seq.block_keys) * self.block_size + partial
        return reused

    def _one_table_admit(self, seq: CacheSequence, match: PrefixMatch
                         ) -> tuple[dict[str, int], int]:
        """admit with one block table: (tokens reused per source, the partial-block hit's)."""
        B = self.block_size
        device = match.device
        if self.state_group is not None and self.ladder and self.reuse_applies(seq):
            # the walk continues the whole device chain, and the hit is cut back afterwards
            # to the last saved state it covers, on the device or a tier (_cut_to_state)
            device = self._attention_lookup(seq, seq.num_tokens - 1).device
        for block_id in device:
            self.pool.acquire(block_id)
            seq.block_table.append(block_id)
            seq.block_keys.append(self.pool.blocks[block_id].key)
        reused = {"local": len(device) * B}
        if self.ladder and self.reuse_applies(seq):
            start = len(seq.block_table)
            self.ladder.begin_walk()
            hits = self.ladder.walk(self._metas(seq, start), start, seq.allows_tier,
                                    seq.tier_plan)
            for hit in hits:
                loaded = self._onboard(seq, hit)
                if loaded:
                    reused[hit.tier.name] = loaded * B
                if loaded < len(hit.metas):
                    break
        seq.tier_plan = None
        if self.state_group is not None:
            self._cut_to_state(seq, reused)
        partial = self.partial_reuse and self.reuse_applies(seq)
        return reused, self._copy_partial(seq) if partial else 0

    def _group_admit(self, seq: CacheSequence, match: PrefixMatch
                     ) -> tuple[dict[str, int], int]:
        """admit with KV cache groups: each group shares its entries of the match, then the
        tiers extend the prefix every group serves (`_group_onboard`), then a partial-block hit
        is copied in every group."""
        B = self.block_size
        views = self._views(seq)
        for (group, view), entries in zip(views, [match.device, *match.groups]):
            chain = self._chain(view, group.index)
            for i, block_id in enumerate(entries):
                if block_id != RELEASED:
                    self.pool.acquire(block_id)
                view.block_table.append(block_id)
                view.block_keys.append(chain.key(i))
        reused = {"local": len(match.device) * B}
        # a recurrent model with several attention groups takes device hits only: its
        # groups' tables are not cut back to a saved state (no such model yet)
        if self.ladder and self.reuse_applies(seq) and self.state_group is None:
            for name, tokens in self._group_onboard(seq, len(match.device)).items():
                reused[name] = reused.get(name, 0) + tokens
        for _, view in views:
            view.tier_plan = None
        if self.state_group is not None:
            self.state_group.start(seq, match.state)
        partial = self.partial_reuse and self.reuse_applies(seq)
        return reused, self._group_copy_partial(seq) if partial else 0

    def _group_copy_partial(self, seq: CacheSequence) -> int:
        """Copy a partial-block hit into a fresh block in every group (found again: tiers may
        have extended the chain since `lookup`). Returns its tokens."""
        views = self._views(seq)
        h = len(seq.block_table)
        lasts = [view.block_table[-1] if h else None for _, view in views]
        if RELEASED in lasts:
            return 0
        hits = self._group_partials(seq, lasts, h, seq.num_tokens - 1)
        if not hits:
            return 0
        for hit in hits:          # the allocations below cannot evict a source
            self.pool.acquire(hit.block_id)
        try:
            for (_, view), hit in zip(views, hits):
                block_id = self.pool.allocate()
                view.block_table.append(block_id)
                self.memory.copy_tokens(hit.block_id, block_id, hit.num_tokens)
        finally:
            for hit in hits:
                self.pool.release(hit.block_id)
        return hits[0].num_tokens

    def _cut_to_state(self, seq: CacheSequence, reused: dict[str, int]) -> None:
        """A recurrent model's table, device and tier hits alike, cut back to the longest
        prefix with a saved state at its end, on the device or in a state tier (the blocks
        past it released: they stay cached), `reused` cut with it (device first, then each
        tier in the walk's order), and the request's live slot started from that state."""
        group, chain = self.state_group, self._chain(seq)
        j, state = group.hit(chain, len(seq.block_table), self._pinned_state(seq),
                             self.reuse_applies(seq))
        held = [state] if state is not None else []
        for block_id in held:          # a checkpoint loaded from a tier cannot evict it
            group.pool.acquire(block_id)
        try:
            if group.ladder and self.reuse_applies(seq) and j < len(seq.block_table):
                loaded = group.from_tiers(chain, len(seq.block_table), j, seq.allows_tier)
                if loaded is not None:
                    j, state = loaded
                    held.append(state)
            for block_id in reversed(seq.block_table[j:]):
                self.pool.release(block_id)
            del seq.block_table[j:], seq.block_keys[j:]
            left = j * self.block_size
            for source in list(reused):
                reused[source] = min(reused[source], left)
                left -= reused[source]
                if not reused[source] and source != "local":
                    del reused[source]
            group.start(seq, state)
        finally:
            for block_id in held:      # copied into the live slot: cached, evictable
                group.pool.release(block_id)

    def _copy_partial(self, seq: CacheSequence) -> int:
        """Copy the partial-block hit at the end of `seq`'s table (found again: tiers may
        have extended the chain since `lookup`) into a fresh block. Returns its tokens."""
        table = seq.block_table
        parent_serial = self.pool.blocks[table[-1]].serial if table else 0
        hit = self._partial_hit(seq, len(table), parent_serial, seq.num_tokens - 1)
        if hit is None:
            return 0
        self.pool.acquire(hit.block_id)      # the allocation below cannot evict the source
        try:
            block_id = self.pool.allocate()
            table.append(block_id)
            self.memory.copy_tokens(hit.block_id, block_id, hit.num_tokens)
        finally:
            self.pool.release(hit.block_id)
        return hit.num_tokens

    def _onboard(self, seq: CacheSequence, hit: TierHit) -> int:
        loaded = 0
        for meta in hit.metas:
            payload = self.ladder.load(hit.tier, meta)
            if payload is None:
                break
            parent_serial = self.pool.blocks[seq.block_table[-1]].serial if seq.block_table else 0
            block_id = self.pool.allocate()
            seq.block_table.append(block_id)
            self.memory.write_block(block_id, payload)
            self.pool.onboard(block_id, meta.key, meta.parent_key, parent_serial, meta.tokens,
                              meta.extra, self._chain(seq).tenant(len(seq.block_table) - 1))
            seq.block_keys.append(meta.key)
            loaded += 1
        return loaded

    # ------------------------------------------------------------------ growth
    def grow(self, seq: CacheSequence, num_tokens: int) -> bool:
        """Append blocks so `seq`'s table covers its first num_tokens positions. False (and
        nothing taken) when the blocks cannot be had: the caller pauses someone."""
        views = [view for _, view in self._views(seq)]
        needs = [cdiv(num_tokens, self.block_size) - len(view.block_table) for view in views]
        if sum(max(0, n) for n in needs) > self.pool.num_allocatable():
            return False
        for view, need in zip(views, needs):
            for _ in range(need):
                view.block_table.append(self.pool.allocate())
        if self.state_group is not None and (self.reuse_applies(seq) or seq.prefill_only):
            self.state_group.plan(seq, self._chain(seq), num_tokens)
        return True

    def _offload(self, block: Block) -> None:
        """The pool is evicting `block`: offer it to the tiers (called before it is cleared)."""
        meta = BlockMeta(key=block.key, parent_key=block.parent_key, tokens=block.tokens,
                         extra=block.extra, priority=block.priority)
        block_id = block.block_id
        self.ladder.offload(meta, block.tiers, lambda: self.memory.read_block(block_id))

    # ------------------------------------------------------------------ commit
    def commit(self, seq: CacheSequence) -> None:
        """Blocks of `seq` that now hold B computed tokens get their key, tokens and lineage,
        and become hittable at once, even while `seq` runs (and are written through to the
        tiers that want it). Requests without reuse commit nothing, except a prompt to pin."""
        if not (self.reuse_applies(seq) or seq.prefill_only):
            return
        for group, view in self._views(seq):
            self._commit_group(view, group.index)
        if self.state_group is not None:
            self.state_group.commit(seq, self._chain(seq), seq.retention or _DEFAULT_RETENTION)

    def _commit_group(self, seq: CacheSequence, group: int) -> None:
        B = self.block_size
        chain = self._chain(seq, group)
        retention = seq.retention or _DEFAULT_RETENTION
        blocks = self.pool.blocks
        for i in range(len(seq.block_keys), seq.num_computed // B):
            block_id = seq.block_table[i]
            key = chain.key(i)
            seq.block_keys.append(key)
            if blocks[block_id].full:  # a shared hit
                continue
            parent_serial = blocks[seq.block_table[i - 1]].serial if i else 0
            priority, duration = retention.block_retention(i * B, seq.num_prompt)
            meta = BlockMeta(key=key, parent_key=chain.parent(i), tokens=chain.tokens(i),
                             extra=chain.extra(i), priority=priority)
            if (self.pool.commit(block_id, key, meta.parent_key, parent_serial, meta.tokens,
                                 meta.extra, priority, duration, chain.tenant(i), group)
                    and self.ladder):
                self.ladder.write_through(meta, seq.allows_tier,
                                          lambda: self.memory.read_block(block_id))

    # ------------------------------------------------------------------ release
    def release_out_of_window(self, seq: CacheSequence) -> int:
        """Release the blocks of `seq` that no future query attends to: those wholly before
        the window of the next query (position num_computed). Their entries become RELEASED.
        A prompt being pinned keeps every block (a prewarm pins nothing: it holds what a
        request holds, as admission assumed); a request that commits keeps the parent of its
        next block to commit (its lineage). Returns the blocks released."""
        return sum(self._release_group(view, group.window) for group, view in self._views(seq))

    def _release_group(self, seq: CacheSequence, window: Optional[int]) -> int:
        if window is None or (seq.prefill_only and not seq.prewarm):
            return 0
        end = max(0, seq.num_computed - window + 1) // self.block_size
        if self.reuse_applies(seq):
            end = min(end, len(seq.block_keys) - 1)
        retention = seq.retention or _DEFAULT_RETENTION
        tiers = self.ladder.allowed(seq.allows_tier)
        released = 0
        for i in reversed(range(end)):
            if seq.block_table[i] == RELEASED:
                break
            self._release_entry(seq, i, retention, tiers)
            seq.block_table[i] = RELEASED
            released += 1
        return released

    def free(self, seq: CacheSequence) -> None:
        """Drop `seq`'s references, tail first, stamping each block with `seq`'s retention
        priority (the last request with a retention config to release a block decides it; one
        without leaves a hold that has not run out as it is). Unreferenced full blocks
        stay cached (evictable); the rest go back to the free list."""
        retention = seq.retention or _DEFAULT_RETENTION
        tiers = self.ladder.allowed(seq.allows_tier)
        if self.reuse_applies(seq):
            self._keep_tail(seq)
        for _, view in reversed(self._views(seq)):
            for i in reversed(range(len(view.block_table))):
                if view.block_table[i] != RELEASED:
                    self._release_entry(view, i, retention, tiers)
            view.block_table.clear()
            view.block_keys.clear()
        if self.state_group is not None:
            self.state_group.release(seq)

    def _keep_tail(self, seq: CacheSequence) -> None:
        """Keep `seq`'s partly filled last block, in every group, as a partial-hit source when
        its computed tokens follow a full block of its chain (the pool may decline a
        duplicate); with partial reuse off, only group 0's token ids, to explain a follow-up's
        reuse_stop."""
        B = self.block_size
        t, k = divmod(seq.num_computed, B)
        if not k:
            return
        tokens = tuple(seq.token_ids[t * B:seq.num_computed])
        for group, view in self._views(seq):
            table = view.block_table
            if t >= len(table) or table[t] == RELEASED or (t and table[t - 1] == RELEASED):
                continue
            parent_serial = self.pool.blocks[table[t - 1]].serial if t else 0
            if t and not parent_serial:
                continue                     # its parent was never committed (a failed step)
            chain = self._chain(view, group.index)
            if not self.partial_reuse:
                if group.index == 0:
                    self.ghost_tails.add(chain.parent(t), chain.extra(t), parent_serial, tokens)
                continue
            self.pool.keep_tail(table[t], chain.parent(t), parent_serial, tokens,
                                chain.extra(t), chain.tenant(t), group.index)

    def _release_entry(self, seq: CacheSequence, i: int, retention: KvCacheRetentionConfig,
                       tiers: frozenset[str]) -> None:
        """Drop `seq`'s reference on its i-th block, stamping a full block (or a kept tail)
        with the retention priority of its position."""
        block_id = seq.block_table[i]
        if self.pool.blocks[block_id].full or self.pool.blocks[block_id].tail:
            priority, duration = retention.block_retention(i * self.block_size, seq.num_prompt)
            self.pool.stamp(block_id, priority, duration, tiers, keep_hold=seq.retention is None)
        self.pool.release(block_id)

    # ------------------------------------------------------------------ pins
    def pin(self, seq: CacheSequence) -> PinnedPrefix:
        """Pin the full blocks of `seq`'s computed prompt; they stay until unpinned."""
        n = min(seq.num_computed, seq.num_tokens) // self.block_size
        tables = [tuple(view.block_table[:n]) for _, view in self._views(seq)]
        for ids in tables:
            assert RELEASED not in ids, "a task prompt's blocks are never released"
            for block_id in ids:
                self.pool.pin(block_id)
        state = self.state_group.pin(self._chain(seq), n) if self.state_group else None
        return PinnedPrefix(tables[0], n * self.block_size, tuple(tables[1:]), state)

    def unpin(self, handle: PinnedPrefix) -> None:
        if handle.state_block is not None:
            self.state_group.unpin(handle.state_block)
        for ids in reversed([handle.block_ids, *handle.group_block_ids]):
            for block_id in reversed(ids):
                self.pool.unpin(block_id)
