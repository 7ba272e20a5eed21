"""One hit for every KV cache group, from the device pool and the tiers at once.

A model with KV cache groups (groups.py) is served a prefix only where every group can serve
it: its full groups every block, its sliding groups the blocks of the window before the hit. The
device pool and the tiers may each hold a part of that, so `_group_onboard` finds the longest
prefix the two serve together, takes the device's blocks first (a load may evict), then loads
the tiers' in chain order; a block that cannot be had shortens the hit, never changes it.

`GroupOnboarding` is a base of `KVCacheManager` (manager.py), the room of that one walk: it uses
the manager's pool, ladder, memory and block size, and its per-group views of a request
(`_views`, `_chain`, `_metas`, `_group_blocks`, `_first_needed`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Union

from rtpkv.cache.groups import KVGroup
from rtpkv.cache.sequence import RELEASED, CacheSequence
from rtpkv.cache.tiers.base import BlockMeta

if TYPE_CHECKING:
    from rtpkv.cache.tiers.base import KVTier

DEVICE = "device"   # a block `_group_onboard` takes from the device pool, not a tier
Source = Union[str, tuple["KVTier", BlockMeta]]


class GroupOnboarding:
    def _group_onboard(self, seq: CacheSequence, h: int) -> dict[str, int]:
        """Extend `seq`'s hit of `h` blocks (every group's) from the device and the tiers at
        once: to the longest prefix H where each full group holds blocks h..H-1 and each
        sliding group the blocks of the window before H (its other entries RELEASED), each
        block on the device or a tier. The device's blocks are taken first (a load may evict),
        then the tiers' are loaded in chain order; one that fails (missing, corrupt, not the
        block asked for, or gone from the device) shortens H, so a bad record costs a miss,
        never a wrong answer. Returns the tokens each source gave past `h`."""
        B, limit = self.block_size, (seq.num_tokens - 1) // self.block_size
        if h >= limit:
            return {}
        views = self._views(seq)
        self.ladder.begin_walk()
        held: list[dict[int, Source]] = []
        asked: list[int] = []     # per group: where its chain was asked of the tiers from
        top = limit
        for group, view in views:     # full groups first (kv_groups' order) bound the hit
            device: dict[int, Source] = dict.fromkeys(
                (i for i in self._group_blocks(view, group, (), limit, True) if i >= h), DEVICE)
            if group.window is None:
                start = h + len(device)
                tiers = self._tier_blocks(view, group.index, start, limit)
                top = min(top, start + len(tiers))
            else:   # from the window before the hit on: a sliding group's older blocks need not be kept
                start = next((i for i in range(self._needed_from(group, h, top), top)
                              if i not in device), top)
                tiers = self._tier_blocks(view, group.index, start, top)
            held.append({**tiers, **device})
            asked.append(start)

        def served(H: int) -> int:
            """The longest hit up to H every group holds: full groups bound it by their run
            from h, then it shortens until each sliding group holds its window (its tiers
            asked for the blocks before where they were asked from, as the hit shortens)."""
            for (group, _), g_held in zip(views, held):
                if group.window is None:
                    end = h
                    while end < H and end in g_held:
                        end += 1
                    H = end
            sliding = [(k, group, view) for k, (group, view) in enumerate(views)
                       if group.window is not None]
            for H in range(H, h, -1):
                for k, group, view in sliding:
                    first = self._needed_from(group, h, H)
                    if first < asked[k]:
                        for i, source in self._tier_blocks(view, group.index, first,
                                                           asked[k]).items():
                            held[k].setdefault(i, source)
                        asked[k] = first
                if all(i in held[k] for k, group, _ in sliding
                       for i in range(self._needed_from(group, h, H), H)):
                    return H
            return h

        H, taken = served(top), [{} for _ in views]
        while True:
            failed = False
            for from_tiers in (False, True):
                for i in range(h, H):
                    for (group, view), g_held, mine in zip(views, held, taken):
                        source = g_held[i] if i >= self._needed_from(group, h, H) else None
                        if source is None or i in mine or (source != DEVICE) != from_tiers:
                            continue
                        block_id = self._take_block(view, group.index, i, source, mine)
                        if block_id is None:
                            del g_held[i]
                            failed = True
                            break
                        mine[i] = block_id
                    if failed:
                        break
                if failed:
                    break
            if not failed:
                break
            H = served(H)
        reused: dict[str, int] = {}
        for (group, view), g_held, mine in zip(views, held, taken):
            first = self._needed_from(group, h, H)
            chain = self._chain(view, group.index)
            for i, block_id in mine.items():
                if i >= H:
                    self.pool.release(block_id)   # taken for a longer hit: cached again
            for i in range(h, H):
                view.block_table.append(mine[i] if i >= first else RELEASED)
                view.block_keys.append(chain.key(i))
        for i in range(h, H):
            names = [g_held[i][0].name for (g, _), g_held in zip(views, held)
                     if i >= self._needed_from(g, h, H) and g_held[i] != DEVICE]
            name = names[0] if names else "local"
            reused[name] = reused.get(name, 0) + B
        return reused

    def _needed_from(self, group: KVGroup, h: int, H: int) -> int:
        """The first block past a device hit of `h` blocks that a hit of H needs in `group`."""
        return max(h, self._first_needed(group, H))

    def _tier_blocks(self, view: CacheSequence, group: int, start: int,
                     end: int) -> dict[int, Source]:
        """The tier holding each block of `view`'s chain in `group` from `start` (before
        `end`), as the ladder's walk finds them: contiguous from `start`."""
        if start >= end:
            return {}
        metas = self._metas(view, start, group)[:end - start]
        held: dict[int, Source] = {}
        pos = start
        for hit in self.ladder.walk(metas, start, view.allows_tier, view.tier_plan):
            for meta in hit.metas:
                held[pos] = (hit.tier, meta)
                pos += 1
        return held

    def _take_block(self, view: CacheSequence, group: int, i: int, source: Source,
                    mine: dict[int, int]) -> Optional[int]:
        """Block i of `view`'s chain in `group` for its table: the device's, verified again
        and referenced, or loaded from its tier into a fresh block (indexed with the lineage of
        the block before it in the table); None when it cannot be had."""
        chain = self._chain(view, group)
        if source == DEVICE:
            block = self.pool.cached(chain.key(i))
            if block is None or block.tokens != chain.tokens(i) or block.extra != chain.extra(i):
                return None
            self.pool.acquire(block.block_id)
            return block.block_id
        if not self.pool.num_allocatable():
            return None
        tier, meta = source
        payload = self.ladder.load(tier, meta)
        if payload is None:
            return None
        prev = mine.get(i - 1)
        if prev is None and 0 < i <= len(view.block_table):
            prev = view.block_table[i - 1] if view.block_table[i - 1] != RELEASED else None
        parent_serial = self.pool.blocks[prev].serial if prev is not None else 0
        block_id = self.pool.allocate()
        self.memory.write_block(block_id, payload)
        self.pool.onboard(block_id, meta.key, meta.parent_key, parent_serial, meta.tokens,
                          meta.extra, chain.tenant(i), group)
        return block_id
