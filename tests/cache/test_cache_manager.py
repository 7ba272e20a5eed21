"""KVCacheManager without a model: admission, append-only tables, duplicates, pins, retention
priorities with expiry (a mocked clock), eviction order, events and the integrity check."""

from __future__ import annotations

import random

import pytest
from cache_sequence import Seq

from rtpkv.cache import KVCacheManager, KVEventBuffer, KvCacheRetentionConfig, PrefixIndex
from rtpkv.cache import TokenRangeRetentionConfig as Range

B = 4


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def manager(num_blocks=16, events=0, clock=None) -> KVCacheManager:
    return KVCacheManager(num_blocks, B, PrefixIndex("test-model", B), reuse_enabled=True,
                          events=KVEventBuffer(events), clock=clock or Clock())


def serve(cache: KVCacheManager, seq: Seq, free: bool = True) -> dict[str, int]:
    """Admit, compute the whole sequence, commit, and (by default) release it."""
    match = cache.lookup(seq)
    assert cache.can_admit(seq, match, seq.num_tokens)
    reused = cache.admit(seq, match)
    assert cache.grow(seq, seq.num_tokens)
    seq.num_computed = seq.num_tokens
    cache.commit(seq)
    if free:
        cache.free(seq)
    cache.check_integrity([] if free else [seq])
    return reused


def test_reuse_is_block_granular_and_never_covers_the_last_token():
    cache = manager()
    serve(cache, Seq(list(range(10))))
    assert serve(cache, Seq(list(range(10))))["local"] == 8
    assert serve(cache, Seq(list(range(8))))["local"] == 4     # the last token is computed
    assert serve(cache, Seq(list(range(6)) + [99, 98]))["local"] == 4
    stats = cache.stats()
    assert stats["blocks_free"] + stats["blocks_cached"] + stats["blocks_in_use"] == 16


def test_tables_are_append_only_and_duplicates_keep_their_chain():
    cache = manager()
    a, b = Seq(list(range(12))), Seq(list(range(12)) + [50, 51, 52, 53, 54])
    for seq in (a, b):  # both admitted before either has computed anything
        cache.admit(seq, cache.lookup(seq))
        cache.grow(seq, seq.num_tokens)
    tables = (list(a.block_table), list(b.block_table))
    for seq in (a, b):
        seq.num_computed = seq.num_tokens
        cache.commit(seq)
    assert (a.block_table, b.block_table) == tables, "a live block table was rewritten"
    cache.check_integrity([a, b])
    # b's first three blocks duplicate a's; its fourth, computed after them, still matches
    probe = Seq(list(b.token_ids) + [7])
    assert len(cache.lookup(probe).device) == 4
    cache.free(a)
    cache.free(b)
    cache.check_integrity([])


def test_a_duplicate_takes_the_place_of_an_evicted_original():
    cache = manager(num_blocks=6)
    a, b = Seq(list(range(9))), Seq(list(range(9)))
    for seq in (a, b):
        cache.admit(seq, cache.lookup(seq))
        cache.grow(seq, seq.num_tokens)
    for seq in (a, b):
        seq.num_computed = seq.num_tokens
        cache.commit(seq)
    cache.free(a)                 # a's blocks cached; b still holds its unindexed copies
    assert cache.grow(Seq([1]), 3 * B)  # a's partial block, then a's two cached blocks
    cache.free(b)                 # b's copies are indexed now that a's are gone
    assert len(cache.lookup(Seq(list(range(9)))).device) == 2


def test_eviction_takes_lowest_priority_first_then_lru_tail_first():
    clock = Clock()
    cache = manager(num_blocks=12, clock=clock)
    high = KvCacheRetentionConfig(token_range_retention_configs=[Range(0, None, 90)])
    keep = Seq(list(range(100, 117)), retention=high)       # 4 full blocks at 90
    old, new = Seq(list(range(200, 209))), Seq(list(range(300, 309)))  # 2 blocks each at 35
    for seq in (keep, old, new):
        serve(cache, seq)
        clock.now += 1
    assert cache.stats()["blocks_cached_by_priority"] == {35: 4, 90: 4}
    taker = Seq([1] * 40)
    assert cache.grow(taker, 10 * B)  # 4 free, then 6 evicted: every 35 first, then 90s tail first
    assert cache.stats()["evictions_by_priority"] == {35: 4, 90: 2}
    cache.free(taker)
    assert len(cache.lookup(keep).device) == 2


def test_within_a_priority_the_tail_goes_before_the_head():
    cache = manager(num_blocks=8)
    seq = Seq(list(range(17)))
    serve(cache, seq)  # 4 full blocks cached + the partial one freed
    taker = Seq([1] * 20)
    assert cache.grow(taker, 6 * B)  # 4 free, then 2 evictions: the last two blocks
    cache.free(taker)
    assert len(cache.lookup(Seq(list(range(17)))).device) == 2


def test_duration_lapses_to_the_default_priority_on_a_mocked_clock():
    clock = Clock()
    cache = manager(num_blocks=8, events=64, clock=clock)
    brief = KvCacheRetentionConfig(token_range_retention_configs=[Range(0, None, 90, 1000)])
    serve(cache, Seq(list(range(9)), retention=brief))
    assert cache.stats()["blocks_cached_by_priority"] == {90: 2}
    clock.now += 0.999
    assert cache.stats()["blocks_cached_by_priority"] == {90: 2}
    clock.now += 0.002
    assert cache.stats()["blocks_cached_by_priority"] == {35: 2}   # shown lapsed, not lapsed
    assert not [e for e in cache.events.drain() if e["type"] == "updated"]
    assert cache.grow(Seq([1] * 28), 7 * B)   # 6 free blocks, then an eviction lapses them
    updates = [e for e in cache.events.drain() if e["type"] == "updated"]
    assert [(e["old_priority"], e["priority"]) for e in updates] == [(90, 35), (90, 35)]
    assert cache.stats()["evictions_by_priority"] == {35: 1}


def test_stats_change_nothing():
    """A /metrics scrape must not change the event stream a router replays, nor priorities."""
    clock = Clock()
    cache = manager(num_blocks=8, events=64, clock=clock)
    brief = KvCacheRetentionConfig(token_range_retention_configs=[Range(0, None, 90, 1000)])
    serve(cache, Seq(list(range(9)), retention=brief))
    serve(cache, Seq(list(range(50, 59))))
    clock.now += 5   # every duration ran out
    events = cache.events.drain()
    priorities = [(b.priority, b.duration_s) for b in cache.pool.blocks]
    first = cache.stats()
    for _ in range(100):
        assert cache.stats() == first
    assert cache.events.drain() == []
    assert [(b.priority, b.duration_s) for b in cache.pool.blocks] == priorities
    assert events and first["blocks_cached_by_priority"] == {35: 4}


def test_a_duration_starts_when_the_block_is_released():
    clock = Clock()
    cache = manager(num_blocks=8, clock=clock)
    brief = KvCacheRetentionConfig(token_range_retention_configs=[Range(0, None, 90, 1000)])
    seq = Seq(list(range(9)), retention=brief)
    serve(cache, seq, free=False)
    clock.now += 5  # held all this time: the duration has not started
    cache.free(seq)
    assert cache.stats()["blocks_cached_by_priority"] == {90: 2}


def test_last_writer_wins_and_generated_blocks_take_the_decode_priority():
    cache = manager()
    first = KvCacheRetentionConfig(token_range_retention_configs=[Range(0, None, 90)])
    serve(cache, Seq(list(range(9)), retention=first))
    assert cache.stats()["blocks_cached_by_priority"] == {90: 2}
    low = KvCacheRetentionConfig(token_range_retention_configs=[Range(0, 4, 80), Range(4, None, 10)],
                                 decode_retention_priority=60)
    # 9 prompt tokens + 8 generated: blocks 0 (range 0-4), 1 (range 4-), 2 (straddles, starts
    # in the prompt), 3 (generated)
    serve(cache, Seq(list(range(17)), num_prompt_tokens=9, retention=low))
    assert cache.stats()["blocks_cached_by_priority"] == {10: 2, 60: 1, 80: 1}


def test_pinned_blocks_outlast_every_priority():
    cache = manager(num_blocks=8)
    task = Seq(list(range(9)), prefill_only=True, wants_reuse=False)
    serve(cache, task, free=False)
    handle = cache.pin(task)
    cache.free(task)
    assert handle.num_tokens == 8 and cache.stats()["blocks_pinned"] == 2
    high = KvCacheRetentionConfig(token_range_retention_configs=[Range(0, None, 100)])
    for i in range(6):
        serve(cache, Seq(list(range(50 + 10 * i, 59 + 10 * i)), retention=high))
    user = Seq(list(range(9)) + [77, 78], prefix_handle=handle, wants_reuse=False)
    assert serve(cache, user)["local"] == 8
    assert cache.pin_shortfall(3 * B) is not None and cache.pin_shortfall(2 * B) is None
    cache.unpin(handle)
    cache.check_integrity([])
    assert cache.stats()["blocks_pinned"] == 0


def test_reuse_off_neither_looks_up_nor_registers():
    cache = KVCacheManager(8, B, PrefixIndex("m", B), reuse_enabled=False)
    serve(cache, Seq(list(range(9))))
    assert serve(cache, Seq(list(range(9))))["local"] == 0
    assert cache.stats()["blocks_cached"] == 0


def test_events_replayed_equal_the_index_after_evictions():
    clock = Clock()
    cache = manager(num_blocks=24, events=100_000, clock=clock)
    rng = random.Random(0)
    heads = [[rng.randrange(1000) for _ in range(12)] for _ in range(5)]
    for i in range(200):
        priority = rng.choice([10, 35, 90])
        retention = KvCacheRetentionConfig(
            token_range_retention_configs=[Range(0, None, priority, rng.choice([None, 500]))])
        serve(cache, Seq(rng.choice(heads) + [rng.randrange(1000) for _ in range(rng.randrange(1, 9))],
                         retention=retention))
        clock.now += 0.1
    held: dict[str, int] = {}
    ids = []
    for event in cache.events.drain():
        ids.append(event["event_id"])
        if event["type"] == "stored":
            for key in event["block_hashes"]:
                held[key] = event["priority"]
        elif event["type"] == "removed":
            for key in event["block_hashes"]:
                del held[key]
        else:
            held[event["block_hash"]] = event["priority"]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert cache.stats()["evictions"] > 50
    indexed = {key.hex(): cache.pool.blocks[b].priority for key, b in cache.index.items()}
    assert held == indexed


def test_event_buffer_is_bounded_and_counts_what_it_dropped():
    cache = manager(num_blocks=24, events=3)
    serve(cache, Seq(list(range(21))))
    events = cache.events.drain()
    assert len(events) == 3 and cache.events.dropped == 2
    assert [e["event_id"] for e in events] == [3, 4, 5]
    assert cache.events.drain(timeout=0.01) == []


def test_integrity_check_catches_a_leak():
    cache = manager()
    seq = Seq(list(range(9)))
    serve(cache, seq, free=False)
    with pytest.raises(AssertionError, match="reference counts"):
        cache.check_integrity([])
    cache.free(seq)
    cache.pool.blocks[cache.pool.free_ids[0]].ref_count = 1
    with pytest.raises(AssertionError):
        cache.check_integrity([])


def test_window_releases_blocks_behind_the_window_in_place():
    """Window 8, B=4: after 14 computed tokens the next query (position 14) attends to 7..14, so
    block 0 (0..3) goes, block 1 (4..7) stays; entries become RELEASED without shifting."""
    from rtpkv.cache import RELEASED

    cache = KVCacheManager(16, B, PrefixIndex("test-model", B), reuse_enabled=True, window=8)
    seq = Seq(list(range(100, 116)))
    cache.admit(seq, cache.lookup(seq))
    assert cache.grow(seq, 14)
    seq.num_computed = 14
    cache.commit(seq)
    table = list(seq.block_table)
    assert cache.release_out_of_window(seq) == 1
    assert seq.block_table == [RELEASED] + table[1:]
    assert cache.num_held(seq) == 3 and cache.pool.num_cached == 1   # block 0 is full: cached
    cache.check_integrity([seq])
    assert cache.release_out_of_window(seq) == 0
    assert cache.blocks_held_at_most(1000, chunk=1) == 8 // B + 1
    assert cache.blocks_held_at_most(1000, chunk=6) == -(-(8 + 6 - 1) // B) + 1
    assert cache.blocks_held_at_most(6) == 2
    cache.free(seq)
    cache.check_integrity([])
    assert cache.pool.num_cached == 3 and cache.pool.num_free == 13


def test_a_pinned_prompt_keeps_every_block_under_a_window():
    cache = KVCacheManager(16, B, PrefixIndex("test-model", B), reuse_enabled=True, window=4)
    seq = Seq(list(range(100, 116)), prefill_only=True)
    cache.admit(seq, cache.lookup(seq))
    assert cache.grow(seq, 16)
    seq.num_computed = 16
    cache.commit(seq)
    assert cache.release_out_of_window(seq) == 0
    handle = cache.pin(seq)
    assert len(handle.block_ids) == 4
    cache.free(seq)
    cache.unpin(handle)
    cache.check_integrity([])
