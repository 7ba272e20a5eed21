"""The disk tier against a hostile or failing directory: FIFOs, symlinks and oversized files
under block names are never read; a read-only disk never kills the writer or fails a store,
and the tier recovers with the disk; WRITE_CACHE_SYNC writes are fsynced."""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import tracemalloc

import pytest

from rtpkv.cache.tiers import disk as disk_module
from rtpkv.cache.tiers.disk import DiskTier
from test_tier_disk import BIG, LAYOUT, file_of, meta, payload


def within(seconds: float, fn, *args):
    """fn(*args) in a thread; fails the test (instead of hanging it) if it blocks."""
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(value=fn(*args)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn.__name__} blocked for more than {seconds} s"
    return result["value"]


@pytest.fixture
def unblock():
    """Opens every FIFO made by the test for writing at the end, so a reader left blocked on
    one (the bug) is released instead of hanging the session."""
    fifos = []
    yield fifos.append
    for path in fifos:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        except OSError:
            pass


def test_a_fifo_named_like_a_block_blocks_neither_start_nor_load(tmp_path, unblock):
    os.mkfifo(file_of(tmp_path, 1))
    unblock(file_of(tmp_path, 1))
    tier = within(10, DiskTier, LAYOUT, tmp_path, BIG, True)
    tier.store(meta(2), payload(2))
    file_of(tmp_path, 2).unlink()
    os.mkfifo(file_of(tmp_path, 2))                       # swapped in after indexing
    unblock(file_of(tmp_path, 2))
    assert within(10, tier.load, meta(2)) is None
    assert within(10, tier.lookup, [meta(1).key]) == 0
    assert stat.S_ISFIFO(os.lstat(file_of(tmp_path, 1)).st_mode)   # left alone
    assert tier.stats()["disk_foreign_files"] == 2
    tier.close()
    tier.check_integrity()


def test_a_symlink_out_of_the_directory_is_never_followed(tmp_path):
    outside, shared = tmp_path / "outside", tmp_path / "shared"
    writer = DiskTier(LAYOUT, outside, BIG, write_sync=True)
    writer.store(meta(3), payload(3))                       # a valid record, outside
    writer.close()
    tier = DiskTier(LAYOUT, shared, BIG, write_sync=True)
    file_of(shared, 3).symlink_to(file_of(outside, 3))     # planted after start
    assert tier.lookup([meta(3).key]) == 0
    assert tier.load(meta(3)) is None
    file_of(shared, 4).symlink_to("/dev/zero")
    assert tier.lookup([meta(4).key]) == 0
    assert tier.load(meta(4)) is None
    tier.close()
    restarted = DiskTier(LAYOUT, shared, BIG, write_sync=True)   # present at start
    assert restarted.stats()["disk_files"] == 0
    assert restarted.lookup([meta(3).key]) == 0 and restarted.load(meta(3)) is None
    assert file_of(outside, 3).exists()                     # the target is untouched
    restarted.close()


def test_an_oversized_file_is_refused_before_reading_it(tmp_path):
    tier = DiskTier(LAYOUT, tmp_path, BIG, write_sync=True)
    tier.store(meta(5), payload(5))
    with open(file_of(tmp_path, 5), "r+b") as f:
        f.truncate(64 << 20)                                # sparse: costs no disk
    tracemalloc.start()
    try:
        assert tier.load(meta(5)) is None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"read {peak} bytes of a file whose size already says it is no record"
    assert tier.stats()["disk_corrupt_files"] == 1
    tier.close()


@pytest.fixture
def read_only_disk(monkeypatch):
    """Writes and removals of temporaries fail with EROFS, as on a disk remounted read-only;
    calling the fixture's result makes the disk writable again."""
    real_unlink = os.unlink

    def refuse_open(path, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    def refuse_unlink(path, *args, **kwargs):
        if str(path).endswith(".tmp"):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(disk_module, "open", refuse_open, raising=False)
    monkeypatch.setattr(os, "unlink", refuse_unlink)

    def recover():
        monkeypatch.delattr(disk_module, "open")
        monkeypatch.setattr(os, "unlink", real_unlink)

    return recover


def test_a_read_only_disk_is_counted_logged_once_and_recovered_from(tmp_path, read_only_disk,
                                                                    caplog):
    tier = DiskTier(LAYOUT, tmp_path, BIG, write_sync=False)
    with caplog.at_level(logging.WARNING, logger="rtpkv"):
        for i in range(40):
            tier.store(meta(i), payload(i))
        within(30, tier.flush)                              # a dead writer never drains
    assert tier._writer.is_alive()
    s = tier.stats()
    assert s["disk_write_errors"] == 40 and s["disk_write_queue_depth"] == 0
    assert len([r for r in caplog.records if "writing" in r.getMessage()]) == 1
    read_only_disk()
    tier.store(meta(100), payload(100))
    within(30, tier.flush)
    assert tier.stats()["disk_writes"] == 1 and tier.lookup([meta(100).key]) == 1
    tier.close()
    tier.check_integrity()


def test_a_read_only_disk_never_fails_a_synchronous_store(tmp_path, read_only_disk):
    tier = DiskTier(LAYOUT, tmp_path, BIG, write_sync=True)
    tier.store(meta(1), payload(1))                        # must not raise
    assert tier.stats()["disk_write_errors"] == 1
    read_only_disk()
    tier.store(meta(2), payload(2))
    assert tier.stats()["disk_writes"] == 1
    tier.close()


def test_write_cache_sync_fsyncs_the_file_and_the_directory(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        info = os.fstat(fd)
        synced.append((stat.S_IFMT(info.st_mode), info.st_ino))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    tier = DiskTier(LAYOUT, tmp_path, BIG, write_sync=True)
    tier.store(meta(1), payload(1))
    assert (stat.S_IFREG, os.stat(file_of(tmp_path, 1)).st_ino) in synced
    assert (stat.S_IFDIR, os.stat(tmp_path).st_ino) in synced
    synced.clear()
    background = DiskTier(LAYOUT, tmp_path / "bg", BIG, write_sync=False)
    background.store(meta(2), payload(2))
    background.close()
    assert synced == []                                     # documented: not fsynced
    tier.close()
