"""The disk tier on its own: persistence across instances, atomic files, re-indexing, damaged
and foreign files, the size bound, the writer thread, and processes sharing a directory."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from rtpkv.cache.tiers import BlockMeta, TierLayout
from rtpkv.cache.tiers.disk import DiskTier
from rtpkv.cache.tiers.record import encode_record

LAYOUT = TierLayout(fingerprint="ab" * 32, block_size=4, dtype=torch.float32, shape=(2, 2, 2, 4, 8))
BIG = 1 << 30


def meta(i: int, priority: int = 35) -> BlockMeta:
    return BlockMeta(key=i.to_bytes(32, "little"), parent_key=(i + 10_000).to_bytes(32, "little"),
                     tokens=(i, i + 1, i + 2, i + 3), priority=priority)


def payload(i: int) -> torch.Tensor:
    return torch.arange(LAYOUT.nbytes // 4, dtype=torch.float32).reshape(LAYOUT.shape) + i


def file_of(directory: Path, i: int) -> Path:
    return directory / (meta(i).key.hex() + ".safetensors")


@pytest.fixture
def tiers():
    """Tiers made in a test are closed and integrity-checked after it."""
    made = []

    def make(directory, capacity=BIG, write_sync=True, **kw) -> DiskTier:
        tier = DiskTier(LAYOUT, directory, capacity, write_sync=write_sync, **kw)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()
        tier.check_integrity()


def test_blocks_survive_a_new_instance(tmp_path, tiers):
    first = tiers(tmp_path)
    for i in range(3):
        first.store(meta(i, priority=40 + i), payload(i))
    first.close()
    second = tiers(tmp_path)
    assert second.stats()["disk_files"] == 3
    assert second.lookup([meta(i).key for i in range(4)]) == 3
    for i in range(3):
        assert torch.equal(second.load(meta(i)), payload(i))
    assert second.stats()["disk_onboarded_blocks"] == 3
    assert second._order.priority(meta(2).key) == 42       # priority from the header


def test_files_are_safetensors_named_by_key_with_no_temporaries_left(tmp_path, tiers):
    tier = tiers(tmp_path)
    tier.store(meta(1), payload(1))
    assert sorted(p.name for p in tmp_path.iterdir()) == [file_of(tmp_path, 1).name]
    from safetensors import safe_open
    with safe_open(file_of(tmp_path, 1), "pt") as f:
        assert f.metadata()["tokens"] == "1,2,3,4"


def test_load_of_another_block_under_the_key_is_a_miss(tmp_path, tiers):
    tier = tiers(tmp_path)
    tier.store(meta(1), payload(1))
    other = BlockMeta(meta(1).key, meta(1).parent_key, (9, 9, 9, 9))
    assert tier.load(other) is None
    assert tier.stats()["disk_mismatches"] == 1
    assert file_of(tmp_path, 1).exists()                   # a valid file is kept


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_damaged_file_found_on_load_is_a_miss_removed_and_counted(tmp_path, tiers, caplog, damage):
    tier = tiers(tmp_path)
    tier.store(meta(1), payload(1))
    path = file_of(tmp_path, 1)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-5] ^= 0x10
    elif damage == "truncate":
        data = data[:len(data) // 2]
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="rtpkv"):
        assert tier.load(meta(1)) is None
    assert path.name in caplog.text
    assert not path.exists()
    assert tier.stats()["disk_corrupt_files"] == 1 and tier.stats()["disk_files"] == 0
    assert tier.lookup([meta(1).key]) == 0


@pytest.mark.parametrize("damage", ["flip_header", "truncate", "unreadable_name"])
def test_damaged_file_found_at_start_is_removed_and_counted(tmp_path, tiers, caplog, damage):
    writer = tiers(tmp_path)
    writer.store(meta(1), payload(1))
    writer.store(meta(2), payload(2))
    path = file_of(tmp_path, 1)
    data = bytearray(path.read_bytes())
    if damage == "flip_header":
        data[data.index(b'"tokens"') + 10] ^= 0x01
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[:-1]))
    else:                                                  # a record stored under another key's name
        path.write_bytes(file_of(tmp_path, 2).read_bytes())
    with caplog.at_level(logging.WARNING, logger="rtpkv"):
        tier = tiers(tmp_path)
    assert path.name in caplog.text and not path.exists()
    assert tier.stats()["disk_corrupt_files"] == 1 and tier.stats()["disk_files"] == 1
    assert torch.equal(tier.load(meta(2)), payload(2))


def test_files_of_another_model_are_left_alone_and_counted(tmp_path, tiers):
    other = TierLayout("ef" * 32, 4, torch.float32, LAYOUT.shape)
    foreign = tmp_path / (meta(5).key.hex() + ".safetensors")
    foreign.write_bytes(encode_record(meta(5), payload(5), other))
    (tmp_path / "notes.txt").write_text("not a block")
    tier = tiers(tmp_path)
    assert tier.stats()["disk_foreign_files"] == 1 and tier.stats()["disk_files"] == 0
    assert tier.lookup([meta(5).key]) == 0                 # known at start not to be ours
    assert tier.load(meta(5)) is None
    assert tier.stats()["disk_foreign_files"] == 1         # counted once
    assert foreign.exists() and (tmp_path / "notes.txt").exists()
    assert tier.stats()["disk_corrupt_files"] == 0


def test_stale_temporaries_are_removed_fresh_ones_kept(tmp_path, tiers):
    stale, fresh = tmp_path / ".a.1.x.tmp", tmp_path / ".b.2.y.tmp"
    stale.write_bytes(b"half")
    fresh.write_bytes(b"half")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    tiers(tmp_path)
    assert not stale.exists() and fresh.exists()


def test_size_bound_evicts_lowest_priority_then_least_recently_used(tmp_path, tiers):
    probe = tiers(tmp_path / "probe")
    probe.store(meta(1), payload(1))
    size = probe.stats()["disk_bytes"]
    tier = tiers(tmp_path / "d", capacity=3 * size + size // 2)
    tier.store(meta(1, priority=80), payload(1))
    tier.store(meta(2), payload(2))
    tier.store(meta(3), payload(3))
    assert tier.lookup([meta(2).key]) == 1                 # 3 is now the least recently used
    tier.store(meta(4), payload(4))
    assert not file_of(tmp_path / "d", 3).exists()
    tier.store(meta(5), payload(5))
    assert not file_of(tmp_path / "d", 2).exists()
    s = tier.stats()
    assert s["disk_files"] == 3 and s["disk_evictions"] == 2 and s["disk_bytes"] <= 3 * size + size // 2
    assert {p.name for p in (tmp_path / "d").iterdir()} == {file_of(tmp_path, i).name for i in (1, 4, 5)}
    # the bound holds at start too: a smaller bound evicts the least valuable files
    tier.close()
    smaller = tiers(tmp_path / "d", capacity=size + size // 2)
    assert smaller.stats()["disk_files"] == 1 and file_of(tmp_path / "d", 1).exists()


def test_capacity_below_one_block_is_refused(tmp_path):
    with pytest.raises(ValueError, match="holds no block"):
        DiskTier(LAYOUT, tmp_path, 100)


def test_writer_thread_writes_in_the_background_and_serves_queued_blocks(tmp_path, tiers):
    tier = tiers(tmp_path, write_sync=False)
    source = payload(1)
    tier.store(meta(1), source)
    source.zero_()                                         # the caller reuses its memory
    assert tier.lookup([meta(1).key]) == 1                 # queued or written: either way a hit
    assert torch.equal(tier.load(meta(1)), payload(1))
    for i in range(2, 40):
        tier.store(meta(i), payload(i))
    tier.flush()
    s = tier.stats()
    assert s["disk_writes"] == 39 and s["disk_write_queue_depth"] == 0 and s["disk_files"] == 39
    assert len(list(tmp_path.glob("*.safetensors"))) == 39


def test_a_full_write_queue_drops_writes_and_counts_them(tmp_path, tiers):
    tier = tiers(tmp_path, write_sync=False, queue_size=1)
    release = threading.Event()
    write = tier._write
    tier._write = lambda item: (release.wait(10), write(item))   # a disk that stalls
    for i in range(6):
        tier.store(meta(i), payload(i))                    # never blocks the caller
    s = tier.stats()
    assert s["disk_writes_dropped"] >= 4 and 1 <= s["disk_write_queue_depth"] <= 2
    release.set()
    tier.flush()
    s = tier.stats()
    assert s["disk_writes"] + s["disk_writes_dropped"] == 6
    assert s["disk_files"] == s["disk_writes"] and s["disk_write_queue_depth"] == 0


def test_drop_removes_the_file(tmp_path, tiers):
    tier = tiers(tmp_path)
    tier.store(meta(1), payload(1))
    tier.drop(meta(1).key)
    assert not file_of(tmp_path, 1).exists() and tier.lookup([meta(1).key]) == 0


def test_a_file_another_process_removed_is_a_miss(tmp_path, tiers):
    tier = tiers(tmp_path)
    tier.store(meta(1), payload(1))
    file_of(tmp_path, 1).unlink()
    assert tier.load(meta(1)) is None
    assert tier.stats()["disk_files"] == 0 and tier.stats()["disk_corrupt_files"] == 0


def test_a_file_another_instance_wrote_later_is_found(tmp_path, tiers):
    reader = tiers(tmp_path)
    writer = tiers(tmp_path)
    writer.store(meta(1), payload(1))
    assert reader.lookup([meta(1).key]) == 1
    assert torch.equal(reader.load(meta(1)), payload(1))


WRITER = textwrap.dedent("""
    import sys, torch
    from rtpkv.cache.tiers import BlockMeta, TierLayout
    from rtpkv.cache.tiers.disk import DiskTier
    layout = TierLayout("ab" * 32, 4, torch.float32, (2, 2, 2, 4, 8))
    tier = DiskTier(layout, sys.argv[1], 1 << 30, write_sync=sys.argv[2] == "1")
    for round in range(3):
        for i in range(60):                      # both processes write the same 60 keys
            meta = BlockMeta(i.to_bytes(32, "little"), (i + 10_000).to_bytes(32, "little"),
                             (i, i + 1, i + 2, i + 3))
            tier.store(meta, torch.arange(256, dtype=torch.float32).reshape(layout.shape) + i)
            tier.lookup([meta.key])
            got = tier.load(meta)
            assert got is None or torch.equal(got, torch.arange(256.).reshape(layout.shape) + i)
            if round == 1 and i % 7 == 0:
                tier.drop(meta.key)              # deletes racing with the other's writes
    tier.close()
    tier.check_integrity()
    assert tier.stats()["disk_corrupt_files"] == 0, tier.stats()
""")


def test_two_processes_writing_one_directory_at_once(tmp_path, tiers):
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    directory = tmp_path / "cache"
    # one writes synchronously, the other on its writer thread
    procs = [subprocess.Popen([sys.executable, str(script), str(directory), sync],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for sync in "10"]
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out.decode()
    reader = tiers(directory)
    s = reader.stats()
    assert s["disk_corrupt_files"] == 0 and s["disk_foreign_files"] == 0
    assert not list(directory.glob("*.tmp"))
    assert s["disk_files"] == len(list(directory.glob("*.safetensors"))) > 0
    for i in range(60):
        got = reader.load(meta(i))
        assert got is None or torch.equal(got, payload(i))
