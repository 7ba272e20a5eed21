"""Partial-block reuse (ENABLE_PARTIAL_REUSE): reuse_len is the exact common prefix with the
cache (capped at prompt_len - 1), and tokens and logits are bit for bit those of partial reuse
off, and those of transformers. Every pipeline is integrity-checked by make_pipeline."""

from __future__ import annotations

import pytest
import torch
from cache_sequence import Seq
from conftest import hf_reference, run

from rtpkv.cache import KVCacheManager, KVEventBuffer, KvCacheRetentionConfig, KVMemory, PrefixIndex
from rtpkv.report import reuse_arithmetic

B = 4
ON = dict(reuse_cache=True, enable_partial_reuse=True, seq_size_per_block=B)
OFF = dict(reuse_cache=True, seq_size_per_block=B)
BASE = list(range(10, 24))        # 14 tokens: 3 full blocks and a tail of 2


def answer(pipe, ids, **cfg):
    return run(pipe, ids, max_new_tokens=4, return_logits=True, **cfg)


def same(a, b) -> None:
    assert a.output_ids == b.output_ids
    assert torch.equal(a.logits, b.logits), "partial reuse changed the logits"


@pytest.mark.parametrize("offset", [0, 1, B - 1])
def test_partial_reuse_at_every_offset_inside_a_block(make_pipeline, hf, offset):
    """A full cached block (BASE's third) matches `offset` tokens of the next prompt's block."""
    on, off = make_pipeline(**ON), make_pipeline(**OFF)
    probe = BASE[:8 + offset] + [900 + i for i in range(6)]
    for pipe in (on, off):
        answer(pipe, BASE)
    got, ref = answer(on, probe), answer(off, probe)
    assert got.aux_info["reuse_len"] == 8 + offset
    assert got.aux_info["partial_reuse_len"] == offset
    assert got.aux_info["local_reuse_len"] == 8 + offset
    assert ref.aux_info["reuse_len"] == 8 and ref.aux_info["partial_reuse_len"] == 0
    same(got, ref)
    tokens, logits = hf_reference(hf, probe, 4)
    assert got.output_ids == tokens
    torch.testing.assert_close(got.logits, logits, atol=1e-4, rtol=0)
    assert on.cache_stats()["partial_hit_tokens"] == offset


def test_the_next_turn_reuses_the_exact_common_prefix(make_pipeline, hf):
    """The partly filled last block of a finished request is kept: the next chat turn reuses
    everything its predecessor computed (all but the last generated token)."""
    on, off = make_pipeline(**ON), make_pipeline(**OFF)
    history = list(BASE)
    for turn in range(4):
        got, ref = answer(on, history), answer(off, history)
        same(got, ref)
        if turn:
            assert got.aux_info["reuse_len"] == len(history) - 5 - 1
        assert ref.aux_info["reuse_len"] % B == 0
        history = history + got.output_ids + [500 + turn, 501 + turn, 502 + turn, 503 + turn, 7]
    tokens, logits = hf_reference(hf, history, 4)
    final = answer(on, history)
    assert final.output_ids == tokens
    torch.testing.assert_close(final.logits, logits, atol=1e-4, rtol=0)
    assert on.cache_stats()["blocks_tail"] >= 1


def test_a_prompt_equal_to_a_cached_one_reuses_all_but_its_last_token(make_pipeline):
    on, off = make_pipeline(**ON), make_pipeline(**OFF)
    for pipe in (on, off):
        answer(pipe, BASE)
    got, ref = answer(on, BASE), answer(off, BASE)
    assert got.aux_info["reuse_len"] == len(BASE) - 1
    assert ref.aux_info["reuse_len"] == 12
    same(got, ref)


def test_partial_reuse_after_a_task_prompt(make_pipeline):
    """A task prompt's partly filled last block serves the task's requests of its own salt;
    another salt computes it again (task prompts are shared, the block after them is not)."""
    task = list(range(100, 110))      # 2 pinned blocks and a tail of 2 tokens
    on, off = make_pipeline(**ON), make_pipeline(**OFF)
    for pipe in (on, off):
        pipe.add_task("t", task)
    question = [40, 41, 42, 43, 44, 45]
    got, ref = answer(on, question, task_id="t"), answer(off, question, task_id="t")
    assert got.aux_info["reuse_len"] == 10 and got.aux_info["partial_reuse_len"] == 2
    assert ref.aux_info["reuse_len"] == 8
    same(got, ref)
    salted = answer(on, question, task_id="t", cache_salt="tenant-b")
    assert salted.aux_info["reuse_len"] == 8 and salted.aux_info["partial_reuse_len"] == 0
    same(salted, answer(off, question, task_id="t", cache_salt="tenant-b"))


def test_another_salt_never_gets_a_partial_hit(make_pipeline):
    on = make_pipeline(**ON)
    answer(on, BASE, cache_salt="a")
    probe = BASE[:10] + [700, 701, 702]
    for salt in ("b", None):
        res = answer(on, probe, cache_salt=salt)
        assert res.aux_info["reuse_len"] == 0 and res.aux_info["partial_reuse_len"] == 0
    # the salted tenant's own requests do, from its first block on
    assert answer(on, probe, cache_salt="a").aux_info["reuse_len"] == 10
    answer(on, BASE)
    assert answer(on, BASE[:2] + [3, 3, 3], cache_salt="c").aux_info["reuse_len"] == 0


def test_partial_reuse_under_an_attention_window(make_pipeline):
    window = dict(max_attention_window=6, max_seq_len=256)
    on, off = make_pipeline(**ON, **window), make_pipeline(**OFF, **window)
    prompt = list(range(30, 57))      # 27 tokens: windowed blocks are released while it runs
    for pipe in (on, off):
        answer(pipe, prompt)
    probe = prompt[:22] + [800, 801, 802]
    got, ref = answer(on, probe), answer(off, probe)
    assert got.aux_info["reuse_len"] == 22 and got.aux_info["partial_reuse_len"] == 2
    assert ref.aux_info["reuse_len"] == 20
    same(got, ref)
    nxt = prompt + got.output_ids + [9, 9]
    same(answer(on, nxt), answer(off, nxt))


def test_partial_reuse_after_a_tier_onboard(make_pipeline):
    """Blocks onboarded from the host tier get a new lineage: a device block computed after
    the evicted original is not a source (its parent is gone); one computed after the onboard
    is."""
    small = dict(kv_cache_max_tokens=24, host_cache_size=1 << 20)     # 6 device blocks
    on, off = make_pipeline(**ON, **small), make_pipeline(**OFF, **small)
    prompt = list(range(10, 22))      # 3 full blocks
    flood = list(range(300, 318))     # with its 4 new tokens: all 6 blocks
    for pipe in (on, off):
        answer(pipe, prompt)
        answer(pipe, flood)
    first = prompt[:9] + [600, 601]
    got, ref = answer(on, first), answer(off, first)
    assert got.aux_info["memory_reuse_len"] == 8 and got.aux_info["partial_reuse_len"] == 0
    same(got, ref)
    second = prompt[:10] + [650]
    got, ref = answer(on, second), answer(off, second)
    assert got.aux_info["reuse_len"] == 9 and got.aux_info["partial_reuse_len"] == 1
    same(got, ref)


def test_a_kept_tail_takes_the_retention_priority_of_its_position(make_pipeline):
    """A high-priority prompt's partly filled last block outlives a flood of default-priority
    requests, as its whole blocks do."""
    small = dict(kv_cache_max_tokens=40)                   # 10 blocks
    on, off = make_pipeline(**ON, **small), make_pipeline(**OFF, **small)
    high = {"token_range_retention_configs": [{"token_start": 0, "token_end": 14,
                                                "priority": 90}],
            "decode_retention_priority": 90}
    for pipe in (on, off):
        run(pipe, BASE, max_new_tokens=1, kv_cache_retention_config=high)   # 14 computed
    assert on.cache_stats()["blocks_cached_by_priority"] == {90: 4}
    for i in range(3):
        answer(on, list(range(300 + 20 * i, 314 + 20 * i)))
    probe = BASE + [5]
    got, ref = answer(on, probe), answer(off, probe)
    assert got.aux_info["reuse_len"] == 14 and got.aux_info["partial_reuse_len"] == 2
    same(got, ref)


def test_two_requests_copy_the_same_block_at_once(make_pipeline):
    on, off = make_pipeline(**ON), make_pipeline(**OFF)
    for pipe in (on, off):
        answer(pipe, BASE)
    probes = [BASE[:11] + [900, 901], BASE[:11] + [950, 951, 952]]
    streams = [on(p, generate_config=dict(top_k=1, max_new_tokens=4, ignore_eos=True,
                                          return_logits=True)) for p in probes]
    results = [list(s)[-1] for s in streams]
    for probe, res in zip(probes, results):
        assert res.aux_info["reuse_len"] == 11 and res.aux_info["partial_reuse_len"] == 3
        same(res, answer(off, probe))


def _manager(num_blocks: int) -> KVCacheManager:
    memory = KVMemory(1, num_blocks, B, 1, 2, torch.float32, torch.device("cpu"))
    return KVCacheManager(num_blocks, B, PrefixIndex("test-model", B), memory=memory,
                          reuse_enabled=True, partial_reuse=True, events=KVEventBuffer(16))


def _compute(cache: KVCacheManager, seq: Seq) -> None:
    """Admit, 'compute' (each slot's K/V set to its token id), commit and free."""
    cache.admit(seq, cache.lookup(seq))
    assert cache.grow(seq, seq.num_tokens)
    for pos in range(seq.num_computed, seq.num_tokens):
        block, slot = seq.block_table[pos // B], pos % B
        cache.memory.kv[:, :, :, block * B + slot] = float(seq.token_ids[pos])
    seq.num_computed = seq.num_tokens
    cache.commit(seq)
    cache.free(seq)


def test_the_source_is_held_while_it_is_copied_when_it_is_the_next_victim():
    """A full pool whose only evictable block is the partial source: admission waits rather
    than take it; with one more block the copy never lands in, nor evicts, the source."""
    cache = _manager(3)
    _compute(cache, Seq(list(range(1, 11))))     # blocks: 2 full + a tail of 2 (all cached)
    assert cache.stats()["blocks_tail"] == 1 and cache.pool.num_free == 0
    probe = Seq(list(range(1, 10)) + [77, 78])   # 2 full hits + 1 token of the tail
    match = cache.lookup(probe)
    assert len(match.device) == 2 and match.partial.num_tokens == 1
    # the source is the next victim; it is counted as taken, so the last block needs a 4th
    assert not cache.can_admit(probe, match, probe.num_tokens)
    cache = _manager(4)
    _compute(cache, Seq(list(range(1, 11))))
    probe = Seq(list(range(1, 10)) + [77, 78])
    match = cache.lookup(probe)
    source = match.partial.block_id
    before = cache.memory.read_block(source).clone()
    assert cache.can_admit(probe, match, probe.num_tokens)
    assert cache.admit(probe, match)["partial"] == 1
    fresh = probe.block_table[-1]
    assert fresh != source and probe.num_computed == 9
    assert torch.equal(cache.memory.read_block(source), before)
    assert cache.memory.kv[0, 0, 0, fresh * B, 0].item() == 9.0
    assert cache.pool.blocks[source].tail and source in cache.pool.policy
    cache.check_integrity([probe])
    cache.free(probe)
    cache.check_integrity([])


def test_a_source_evicted_after_the_copy_leaves_the_copy_intact():
    cache = _manager(4)
    _compute(cache, Seq(list(range(1, 11))))
    probe = Seq(list(range(1, 10)) + [77, 78])
    match = cache.lookup(probe)
    source = match.partial.block_id
    cache.admit(probe, match)
    fresh = probe.block_table[-1]
    assert cache.grow(probe, probe.num_tokens) and cache.pool.num_free == 0
    other = Seq([50, 51, 52, 53])
    cache.admit(other, cache.lookup(other))
    assert cache.grow(other, 4)                      # evicts the only cached block: the source
    assert not cache.pool.blocks[source].tail
    assert cache.memory.kv[0, 0, 0, fresh * B, 0].item() == 9.0
    cache.check_integrity([probe, other])


def test_a_partial_block_is_never_a_stored_event():
    cache = _manager(8)
    _compute(cache, Seq(list(range(1, 11))))
    stored = [e for e in cache.events.drain() if e["type"] == "stored"]
    assert len(stored) == 2 and cache.stats()["blocks_tail"] == 1
    cache.check_integrity([])


def test_the_cli_spells_out_the_partial_block():
    aux = {"reuse_len": 11, "partial_reuse_len": 3, "input_len": 13, "prefix_len": 0}
    assert reuse_arithmetic(aux, 4) == \
        "reuse_len 11 = 2 blocks of 4 + 3 tokens of a partial block of 13 prompt tokens"


def test_a_kept_tail_whose_priority_lapses_is_never_an_event():
    """A tail is never announced: its retention duration running out is no `updated` event
    (it has no key a router could know)."""
    now = [0.0]
    memory = KVMemory(1, 3, B, 1, 2, torch.float32, torch.device("cpu"))
    cache = KVCacheManager(3, B, PrefixIndex("test-model", B), memory=memory,
                           reuse_enabled=True, partial_reuse=True, events=KVEventBuffer(16),
                           clock=lambda: now[0])
    high = KvCacheRetentionConfig(token_range_retention_configs=[
        {"token_start": 0, "token_end": 10, "priority": 90, "duration_ms": 1000}])
    _compute(cache, Seq(list(range(1, 11)), retention=high))   # 2 full blocks + a tail of 2
    assert cache.stats()["blocks_tail"] == 1
    cache.events.drain()
    now[0] = 2.0
    other = Seq([50, 51, 52, 53])
    cache.admit(other, cache.lookup(other))
    assert cache.grow(other, 4)                  # a full pool: lapses, then evicts
    updated = [e for e in cache.events.drain() if e["type"] == "updated"]
    assert len(updated) == 2 and all(e["block_hash"] for e in updated), updated
    cache.check_integrity([other])
