"""The host-memory tier on its own: bound, eviction order, verification, hand-off, stats."""

from __future__ import annotations

import threading
from typing import Any, Optional, Sequence

import pytest
import torch

from rtpkv.cache.tiers import BlockMeta, KVTier, TierLayout
from rtpkv.cache.tiers.host import HostTier
from rtpkv.cache.tiers.ladder import TierLadder

LAYOUT = TierLayout(fingerprint="ab" * 32, block_size=4, dtype=torch.float32, shape=(2, 2, 2, 4, 8))
BLOCK = LAYOUT.nbytes


def meta(i: int, priority: int = 35) -> BlockMeta:
    return BlockMeta(key=i.to_bytes(32, "little", signed=True),
                     parent_key=(i - 1).to_bytes(32, "little", signed=True),
                     tokens=(i, i + 1, i + 2, i + 3), priority=priority)


def payload(i: int) -> torch.Tensor:
    return torch.full(LAYOUT.shape, float(i))


class RecordingTier(KVTier):
    """A next tier that keeps what it is handed (a real dict store)."""

    name = "next"

    def __init__(self):
        self.blocks: dict[bytes, tuple[BlockMeta, torch.Tensor]] = {}

    def lookup(self, keys: Sequence[bytes]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.blocks:
            n += 1
        return n

    def load(self, m: BlockMeta) -> Optional[torch.Tensor]:
        return self.blocks[m.key][1].clone() if m.key in self.blocks else None

    def store(self, m: BlockMeta, p: torch.Tensor) -> None:
        self.blocks[m.key] = (m, p.clone())

    def drop(self, key: bytes) -> None:
        self.blocks.pop(key, None)

    def stats(self) -> dict[str, Any]:
        return {"next_blocks": len(self.blocks)}

    def check_integrity(self) -> None:
        pass


def test_size_is_counted_in_whole_blocks():
    tier = HostTier(LAYOUT, 3 * BLOCK + BLOCK - 1)
    assert tier.num_blocks == 3 and tier.stats()["memory_blocks_total"] == 3
    assert tier.buffer.shape == (3, *LAYOUT.shape)
    with pytest.raises(ValueError, match="holds no block"):
        HostTier(LAYOUT, BLOCK - 1)


def test_store_then_load_returns_a_copy():
    tier = HostTier(LAYOUT, 4 * BLOCK)
    source = payload(7)
    tier.store(meta(7), source)
    source.zero_()                          # the caller reuses its memory at once
    out = tier.load(meta(7))
    assert torch.equal(out, payload(7))
    out.zero_()                             # and the loaded copy is the caller's
    assert torch.equal(tier.load(meta(7)), payload(7))
    tier.check_integrity()


def test_lookup_orders_the_chain_so_blocks_loaded_first_go_first():
    tier = HostTier(LAYOUT, 3 * BLOCK)
    for i in (3, 2, 1):                          # stored tail first, as the device evicts
        tier.store(meta(i), payload(i))
    assert tier.lookup([meta(i).key for i in (1, 2, 3)]) == 3
    assert tier.load(meta(1)) is not None
    tier.store(meta(9), payload(9))              # onboarding block 1 offloaded another block
    assert tier.lookup([meta(1).key]) == 0       # the block already loaded made room
    assert tier.load(meta(2)) is not None and tier.load(meta(3)) is not None


def test_lookup_counts_a_contiguous_prefix_of_the_chain():
    tier = HostTier(LAYOUT, 4 * BLOCK)
    for i in (1, 2, 4):
        tier.store(meta(i), payload(i))
    keys = [meta(i).key for i in (1, 2, 3, 4)]
    assert tier.lookup(keys) == 2
    assert tier.lookup(keys[1:]) == 1
    assert tier.lookup(keys[2:]) == 0
    stats = tier.stats()
    assert stats["memory_hits"] == 3 and stats["memory_lookup_blocks"] == 4 + 3 + 2
    assert stats["memory_hit_rate"] == pytest.approx(3 / 9)


@pytest.mark.parametrize("field,value", [("tokens", (0, 0, 0, 0)), ("parent_key", b"x" * 32),
                                          ("extra", b"salt")])
def test_load_of_another_block_under_the_key_is_a_miss(field, value):
    tier = HostTier(LAYOUT, 2 * BLOCK)
    tier.store(meta(1), payload(1))
    other = BlockMeta(**{**meta(1).__dict__, field: value})
    assert tier.load(other) is None
    assert tier.stats()["memory_mismatches"] == 1
    assert tier.stats()["memory_onboarded_blocks"] == 0


def test_eviction_takes_lowest_priority_then_least_recently_used():
    tier = HostTier(LAYOUT, 3 * BLOCK)
    tier.store(meta(1, priority=80), payload(1))
    tier.store(meta(2, priority=35), payload(2))
    tier.store(meta(3, priority=35), payload(3))
    assert tier.lookup([meta(2).key]) == 1      # a lookup uses 2: more recent than 3
    assert tier.load(meta(3)) is not None       # a load does not reorder
    tier.store(meta(4, priority=50), payload(4))  # evicts 3: lowest priority, least recent
    assert tier.lookup([meta(3).key]) == 0
    tier.store(meta(5, priority=50), payload(5))  # evicts 2 (35 is still the lowest)
    assert tier.lookup([meta(2).key]) == 0
    tier.store(meta(6, priority=90), payload(6))  # evicts 4 (50, older than 5)
    assert [tier.lookup([meta(i).key]) for i in (1, 4, 5, 6)] == [1, 0, 1, 1]
    assert tier.stats()["memory_evictions"] == 3
    for i in (1, 5, 6):
        assert torch.equal(tier.load(meta(i)), payload(i))
    tier.check_integrity()


def test_storing_a_held_block_again_refreshes_it_without_a_copy():
    tier = HostTier(LAYOUT, 2 * BLOCK)
    tier.store(meta(1), payload(1))
    tier.store(meta(2), payload(2))
    tier.store(meta(1, priority=60), payload(99))   # same block: last writer's priority, no copy
    assert tier.stats()["memory_offloaded_blocks"] == 2
    assert torch.equal(tier.load(meta(1)), payload(1))
    tier.store(meta(3), payload(3))                 # 2 (priority 35) goes, not 1 (60)
    assert tier.lookup([meta(1).key]) == 1 and tier.lookup([meta(2).key]) == 0
    tier.check_integrity()


def test_evictions_are_handed_to_the_next_tier():
    nxt = RecordingTier()
    nxt.takes_evictions = True
    tier = HostTier(LAYOUT, 2 * BLOCK)
    TierLadder([tier, nxt], offload_min_priority=35)   # the ladder wires host -> next
    for i in range(1, 5):
        tier.store(meta(i), payload(i))
    assert sorted(nxt.blocks) == sorted([meta(1).key, meta(2).key])
    stored_meta, stored = nxt.blocks[meta(1).key]
    assert stored_meta == meta(1) and torch.equal(stored, payload(1))
    assert tier.stats()["memory_handed_off"] == 2
    tier.check_integrity()


def test_drop_frees_the_slot():
    tier = HostTier(LAYOUT, 2 * BLOCK)
    tier.store(meta(1), payload(1))
    tier.drop(meta(1).key)
    tier.drop(meta(1).key)                          # twice is harmless
    assert tier.load(meta(1)) is None
    assert tier.stats()["memory_blocks_used"] == 0
    tier.check_integrity()


def test_stats_count_blocks_and_bytes():
    tier = HostTier(LAYOUT, 2 * BLOCK)
    for i in (1, 2, 3):
        tier.store(meta(i), payload(i))
    tier.load(meta(3))
    tier.load(meta(1))                              # evicted: a miss, not counted
    s = tier.stats()
    assert (s["memory_blocks_used"], s["memory_offloaded_blocks"], s["memory_onboarded_blocks"]) == (2, 3, 1)
    assert s["memory_offloaded_bytes"] == 3 * BLOCK and s["memory_onboarded_bytes"] == BLOCK


def test_integrity_check_catches_broken_accounting():
    tier = HostTier(LAYOUT, 2 * BLOCK)
    tier.store(meta(1), payload(1))
    tier._free.append(tier._slots[meta(1).key].index)
    with pytest.raises(AssertionError, match="free"):
        tier.check_integrity()


def test_payload_of_another_layout_is_refused():
    tier = HostTier(LAYOUT, 2 * BLOCK)
    with pytest.raises(ValueError, match="layout"):
        tier.store(meta(1), torch.zeros(2, 2, 2, 4, 7))
    tier.check_integrity()


def test_concurrent_stores_and_loads_keep_the_accounting():
    tier = HostTier(LAYOUT, 8 * BLOCK)
    errors = []

    def worker(base: int) -> None:
        try:
            for i in range(base, base + 200):
                tier.store(meta(i), payload(i))
                out = tier.load(meta(i - 3))
                assert out is None or torch.equal(out, payload(i - 3))
        except Exception as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k * 1000,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    tier.check_integrity()
    assert tier.stats()["memory_blocks_used"] == 8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")
def test_cuda_pool_uses_pinned_memory_and_a_side_stream():
    tier = HostTier(LAYOUT, 4 * BLOCK, device="cuda")
    assert tier.buffer.is_pinned()
    source = payload(3).cuda()
    tier.store(meta(3), source)
    source.zero_()                                  # ordered after the copy on the side stream
    out = tier.load(meta(3))
    assert out.is_pinned() and torch.equal(out, payload(3))
    back = torch.empty(LAYOUT.shape, device="cuda")
    back.copy_(out, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back.cpu(), payload(3))
    tier.check_integrity()
