"""The cache core without a model (issue 20): one insert into the index for commit, release and
onboard; lineage kept through an onboard; the salt in every key a request owns; an admission
that fails holds no block; the tiers asked once per request."""

from __future__ import annotations

import pytest
import torch
from cache_sequence import Seq

from rtpkv.cache import KVCacheManager, KVMemory, KvCacheRetentionConfig, PrefixIndex
from rtpkv.cache import TokenRangeRetentionConfig as Range
from rtpkv.cache.prefix_index import sha256
from rtpkv.cache.tiers import TierLayout
from rtpkv.cache.tiers.disk import DiskTier
from rtpkv.cache.tiers.host import HostTier

B = 4
LAYERS, HEADS, DIM = 1, 1, 2


def layout() -> TierLayout:
    return TierLayout(fingerprint="ab" * 32, block_size=B, dtype=torch.float32,
                      shape=(2, LAYERS, HEADS, B, DIM))


def manager(num_blocks: int, tiers=()) -> KVCacheManager:
    memory = KVMemory(LAYERS, num_blocks, B, HEADS, DIM, torch.float32, torch.device("cpu"))
    return KVCacheManager(num_blocks, B, PrefixIndex("core", B), memory=memory,
                          reuse_enabled=True, tiers=tiers)


def compute(cache: KVCacheManager, seq: Seq) -> None:
    """'Compute' the tokens the request does not reuse: each slot holds its token id, so a
    block's payload says which tokens it was computed from."""
    kv = cache.memory.kv
    for pos in range(seq.num_computed, seq.num_tokens):
        block, offset = seq.block_table[pos // B], pos % B
        kv[:, :, :, block * B + offset] = float(seq.token_ids[pos])
    seq.num_computed = seq.num_tokens


def serve(cache: KVCacheManager, seq: Seq, free: bool = True) -> dict[str, int]:
    match = cache.lookup(seq)
    assert cache.can_admit(seq, match, seq.num_tokens)
    reused = cache.admit(seq, match)
    assert cache.grow(seq, seq.num_tokens)
    compute(cache, seq)
    cache.commit(seq)
    if free:
        cache.free(seq)
    cache.check_integrity([] if free else [seq])
    return reused


def payload_tokens(cache: KVCacheManager, block_id: int) -> list[int]:
    return cache.memory.kv[0, 0, 0, block_id * B:(block_id + 1) * B, 0].int().tolist()


A = list(range(10, 18)) + [99]          # two full blocks, then the token always computed
LOW_THEN_HIGH = KvCacheRetentionConfig(token_range_retention_configs=[Range(0, B, 10),
                                                                       Range(B, None, 80)])


def test_an_onboarded_block_replaces_a_stale_holder_of_its_key(tmp_path):
    """Issue 20's crash: A's first block (priority 10) is evicted, its second (80) stays; A
    again onboards both from disk, the second over the stale device block of the same key.
    The index and the blocks agree, and a request that needs the whole pool gets it."""
    disk = DiskTier(layout(), tmp_path, 1 << 20, write_sync=True)
    cache = manager(6, tiers=[disk])
    serve(cache, Seq(list(A), retention=LOW_THEN_HIGH))
    assert cache.pool.num_cached == 2 and cache.pool.num_free == 4
    serve(cache, Seq([1] * 17))          # 5 blocks: 4 free, then A's first block (priority 10)
    assert cache.pool.evictions_by_priority == {10: 1}
    again = serve(cache, Seq(list(A)))
    assert again == {"local": 0, "disk": 8}
    cache.check_integrity([])
    everything = Seq([2] * 24)
    assert serve(cache, everything, free=False) == {"local": 0}
    assert len(everything.block_table) == 6
    cache.free(everything)
    cache.check_integrity([])


def test_a_third_request_after_an_onboard_is_a_device_hit_with_its_lineage():
    host = HostTier(layout(), 1 << 20, torch.device("cpu"))
    cache = manager(4, tiers=[host])
    serve(cache, Seq(list(A)))
    serve(cache, Seq([1] * 16))          # evicts A's blocks into the host tier
    assert serve(cache, Seq(list(A))) == {"local": 0, "memory": 8}
    third = Seq(list(A) + [5])
    match = cache.lookup(third)
    assert len(match.device) == 2, "the onboarded chain lost its lineage"
    first, second = (cache.pool.blocks[b] for b in match.device)
    assert first.parent_serial == 0 and second.parent_serial == first.serial != 0
    assert [payload_tokens(cache, b) for b in match.device] == [A[:4], A[4:8]]
    assert serve(cache, third) == {"local": 8}


def test_the_salt_is_in_every_key_a_request_owns():
    cache = manager(16)
    serve(cache, Seq(list(A)))
    assert serve(cache, Seq(list(A), salt=b"tenant-b")) == {"local": 0}
    assert serve(cache, Seq(list(A), salt=b"tenant-b")) == {"local": 8}
    assert serve(cache, Seq(list(A), salt=b"tenant-c")) == {"local": 0}
    assert serve(cache, Seq(list(A))) == {"local": 8}


def test_two_salts_after_a_pinned_task_prompt_share_only_the_task():
    cache = manager(32)
    task = Seq(list(range(50, 58)) + [7], prefill_only=True, wants_reuse=False)
    serve(cache, task, free=False)
    handle = cache.pin(task)
    cache.free(task)
    text = task.token_ids[:8] + list(range(200, 209))       # task blocks, then 2 full blocks
    a = serve(cache, Seq(list(text), salt=b"a", prefix_handle=handle))
    assert a == {"local": 8}
    assert serve(cache, Seq(list(text), salt=b"b", prefix_handle=handle)) == {"local": 8}
    assert serve(cache, Seq(list(text), salt=b"a", prefix_handle=handle)) == {"local": 16}
    assert serve(cache, Seq(list(text), prefix_handle=handle)) == {"local": 8}
    cache.unpin(handle)
    cache.check_integrity([])


def test_the_key_chain_is_hashed_once_per_block():
    calls = []

    def counting(data: bytes) -> bytes:
        calls.append(data)
        return sha256(data)

    memory = KVMemory(LAYERS, 8, B, HEADS, DIM, torch.float32, torch.device("cpu"))
    cache = KVCacheManager(8, B, PrefixIndex("core", B, counting), memory=memory,
                           reuse_enabled=True)
    seq = Seq(list(range(30)))
    root_hashes = len(calls)
    for _ in range(5):
        cache.lookup(seq)
    assert len(calls) - root_hashes == 1, "a miss on block 0 hashes block 0 only, once"
    cache.admit(seq, cache.lookup(seq))
    assert cache.grow(seq, seq.num_tokens)
    for end in (5, 13, 30):             # chunked prefill: commits after each chunk
        seq.num_computed = end
        cache.commit(seq)
    assert len(calls) - root_hashes == 7       # 7 full blocks of 30 tokens, each hashed once
    cache.free(seq)
    cache.check_integrity([])


class Boom(RuntimeError):
    pass


class FailingTier(HostTier):
    """A tier whose load raises after a given number of blocks (a bug in a tier)."""

    def __init__(self, *args, fail_after: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.fail_after = fail_after

    def load(self, meta):
        if self.fail_after == 0:
            raise Boom("tier load failed")
        self.fail_after -= 1
        return super().load(meta)


def test_an_admission_that_fails_holds_no_block():
    host = FailingTier(layout(), 1 << 20, torch.device("cpu"), fail_after=1)
    cache = manager(8, tiers=[host])
    serve(cache, Seq(list(A)))
    serve(cache, Seq([1] * 32))          # every block of A in the host tier only
    seq = Seq(list(A))
    with pytest.raises(Boom):
        cache.admit(seq, cache.lookup(seq))
    assert seq.block_table == [] and seq.block_keys == []
    cache.check_integrity([])
    assert cache.pool.num_free + cache.pool.num_cached == 8
