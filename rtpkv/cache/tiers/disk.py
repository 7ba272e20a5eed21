"""DiskTier: KV blocks persisted as files, so a restarted engine (or another process serving the
same model) starts with a warm cache.

One block is one file, ``<chained key hex>.safetensors``, holding a `record` (a checksummed,
self-describing safetensors file; never a pickle). Because the chained key covers the model
fingerprint, the block size, the salt and every token before the block, another model or tenant
can never hit a file, and the tokens stored in the record are compared with the request's on load.

Writes go to a unique temporary name in the same directory and are renamed into place, so a
reader, in this process or another, sees a file complete or not at all. By default they run on a
writer thread behind a bounded queue (a full queue drops the write and counts it: the engine
never waits for the disk); ``write_sync=True`` (``WRITE_CACHE_SYNC=1``) writes before returning.

The directory may be shared, so nothing in it is trusted: only regular files are opened (never
through a symlink, never a FIFO or device: those are left alone and counted as foreign), and a
file's size is checked before a byte of it is read: larger than any record of this layout can
be, it is never read; smaller than this layout's records it may still be another layout's (the
int8 KV cache's records are about a quarter of float32's), so its header decides.

A failing disk (read-only, full) never fails a request or kills the writer thread: each failed
write is counted (`disk_write_errors`) and logged at most once a minute with a count, and the
next write tries again, so the tier recovers when the disk does. With ``write_sync=True`` a
write is durable when `store` returns: the file and the directory are fsynced. Background
writes are not fsynced (the page cache flushes them; a power loss may lose the newest blocks,
which are then recomputed).

At start the directory is re-indexed from the records' headers only. Files of another model or
format version are left alone and counted; corrupt, truncated or unreadable ones are removed with
a warning naming the file, and so are those found corrupt on load (a miss: the block is
recomputed). The tier keeps the files it knows within ``capacity_bytes``, evicting the lowest
priority, least recently used first. Processes sharing a directory each bound what they know;
a file another process removed is simply a miss.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import re
import stat
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from rtpkv.cache.block import DEFAULT_PRIORITY, parents_first
from rtpkv.cache.tiers.base import BlockMeta, KVTier, TierLayout
from rtpkv.cache.tiers.order import EvictionOrder
from rtpkv.cache.tiers.record import (LENGTH_PREFIX, MAX_HEADER_BYTES, CorruptRecord, ForeignRecord,
                                      RecordMismatch, decode_header, decode_record, encode_record,
                                      header_length)
from rtpkv.log_limit import RateLimitedLog

log = logging.getLogger("rtpkv")

SUFFIX = ".safetensors"
TEMP_SUFFIX = ".tmp"
STALE_TEMP_SECONDS = 600          # a temporary file this old belongs to a writer that died
_NAME = re.compile(r"^[0-9a-f]{64}\.safetensors$")
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) \
    | getattr(os, "O_CLOEXEC", 0)


class NotABlockFile(OSError):
    """A directory entry named like a block file that is not a regular file (a FIFO, device,
    symlink, directory): never read."""


@dataclass
class _Pending:
    meta: BlockMeta
    payload: torch.Tensor


class DiskTier(KVTier):
    name = "disk"
    takes_evictions = True   # host memory's evictions land here
    write_through = True

    def __init__(self, layout: TierLayout, directory: str | os.PathLike, capacity_bytes: int,
                 write_sync: bool = False, queue_size: int = 1024):
        self.layout = layout
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.write_sync = write_sync
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._sizes: dict[bytes, int] = {}
        self._order = EvictionOrder()
        self._bytes = 0
        self._pending: dict[bytes, _Pending] = {}
        self._foreign: set[bytes] = set()          # keys whose file is another model's record
        self.counters = dict(lookup_blocks=0, lookup_hits=0, onboarded_blocks=0, onboarded_bytes=0,
                             writes=0, write_bytes=0, writes_dropped=0, write_errors=0,
                             corrupt_files=0, foreign_files=0, mismatches=0, evictions=0)
        probe = encode_record(BlockMeta(b"\0" * 32, b"\0" * 32, (0,) * layout.block_size),
                              torch.zeros(layout.shape, dtype=layout.dtype), layout)
        self.record_bytes = len(probe)
        self.max_record_bytes = LENGTH_PREFIX + MAX_HEADER_BYTES + layout.nbytes
        self._write_failed = RateLimitedLog(log)
        if capacity_bytes < self.record_bytes:
            raise ValueError(f"disk cache size {capacity_bytes} bytes holds no block: one block "
                             f"file takes {self.record_bytes} bytes")
        self._reindex()
        self._queue: queue.Queue[Optional[_Pending]] = queue.Queue(maxsize=queue_size)
        self._writer: Optional[threading.Thread] = None
        if not write_sync:
            self._writer = threading.Thread(target=self._write_loop, name="rtpkv-disk-writer",
                                            daemon=True)
            self._writer.start()

    # ------------------------------------------------------------------ KVTier
    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._sizes or key in self._pending

    def lookup(self, keys: Sequence[bytes]) -> int:
        found = 0
        for key in keys:
            with self._lock:
                known = key in self._sizes or key in self._pending
                if key in self._order:
                    self._order.touch(key)      # in chain order, as the host tier does
            if not known and not self._adopt(key):
                break
            found += 1
        with self._lock:
            self.counters["lookup_blocks"] += len(keys)
            self.counters["lookup_hits"] += found
        return found

    def load(self, meta: BlockMeta) -> Optional[torch.Tensor]:
        with self._lock:
            pending = self._pending.get(meta.key)
        if pending is not None:                     # queued, not yet on disk
            if not pending.meta.same_block(meta):
                return self._count_mismatch()
            return self._hit(meta.key, pending.payload.clone())
        if meta.key in self._foreign:
            return None
        path = self._path(meta.key)
        try:
            data = self._read(path)
        except FileNotFoundError:                   # another process evicted it
            self._forget(meta.key)
            return None
        except NotABlockFile as exc:
            return self._not_a_block(path, meta.key, exc)
        except CorruptRecord as exc:
            return self._corrupt(path, meta.key, str(exc))
        except OSError as exc:
            return self._corrupt(path, meta.key, f"unreadable: {exc}")
        try:
            _, payload = decode_record(data, self.layout, expect=meta)
        except CorruptRecord as exc:
            return self._corrupt(path, meta.key, str(exc))
        except RecordMismatch:
            return self._count_mismatch()
        except ForeignRecord as exc:
            log.warning("disk cache: %s is not a block of this model (%s); left alone", path, exc)
            with self._lock:
                self.counters["foreign_files"] += 1
                self._foreign.add(meta.key)
            self._forget(meta.key)
            return None
        return self._hit(meta.key, payload, len(data))

    def store(self, meta: BlockMeta, payload: torch.Tensor) -> None:
        self.layout.check_payload(payload)
        with self._lock:
            if meta.key in self._pending:
                return
            if meta.key in self._sizes:             # already on disk: the newest priority wins
                self._order.add(meta.key, meta.priority)
                return
            item = _Pending(meta, payload.detach().to("cpu", copy=True))
            if self.write_sync:
                self._pending[meta.key] = item
        if self.write_sync:
            self._write(item)
            return
        with self._lock:
            self._pending[meta.key] = item
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            with self._lock:
                del self._pending[meta.key]
                self.counters["writes_dropped"] += 1

    def drop(self, key: bytes) -> None:
        self._forget(key)
        self._path(key).unlink(missing_ok=True)

    def residency_stats(self) -> Optional[dict[str, Any]]:
        with self._lock:
            return self._order.residency.stats()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            c = self.counters
            return {
                "disk_files": len(self._sizes),
                "disk_bytes": self._bytes,
                "disk_bytes_total": self.capacity_bytes,
                "disk_lookup_blocks": c["lookup_blocks"],
                "disk_hits": c["lookup_hits"],
                "disk_hit_rate": c["lookup_hits"] / c["lookup_blocks"] if c["lookup_blocks"] else 0.0,
                "disk_onboarded_blocks": c["onboarded_blocks"],
                "disk_onboarded_bytes": c["onboarded_bytes"],
                "disk_writes": c["writes"],
                "disk_write_bytes": c["write_bytes"],
                "disk_write_queue_depth": len(self._pending) if not self.write_sync else 0,
                "disk_writes_dropped": c["writes_dropped"],
                "disk_write_errors": c["write_errors"],
                "disk_corrupt_files": c["corrupt_files"],
                "disk_foreign_files": c["foreign_files"],
                "disk_mismatches": c["mismatches"],
                "disk_evictions": c["evictions"],
            }

    def check_integrity(self) -> None:
        """The byte count equals the sum of the indexed files' sizes and stays within the bound;
        the eviction order lists exactly the indexed files."""
        with self._lock:
            self._order.check()
            assert self._bytes == sum(self._sizes.values()), "disk byte count drifted"
            assert self._bytes <= self.capacity_bytes, \
                f"disk tier holds {self._bytes} bytes over its bound {self.capacity_bytes}"
            assert set(self._order) == set(self._sizes), "disk eviction order and index differ"

    def flush(self) -> None:
        """Wait until every queued write is on disk."""
        if self._writer is not None:
            self._queue.join()

    def close(self) -> None:
        if self._writer is not None and self._writer.is_alive():
            self.flush()
            self._queue.put(None)
            self._writer.join()

    # ------------------------------------------------------------------ writing
    def announce(self) -> None:
        """The records indexed now, as stored events (parents before children), each while it
        is still indexed: a router learns what a restarted replica holds on disk. A record gone
        or changed since it was indexed is left to the next lookup."""
        if self.events is None:
            return
        with self._lock:
            keys = list(self._sizes)
        metas: dict[bytes, BlockMeta] = {}
        for key in keys:
            try:
                metas[key] = self._read_header(self._path(key))[0].meta
            except (OSError, CorruptRecord, ForeignRecord):
                continue
        for meta in parents_first(metas.values()):
            with self._lock:
                if meta.key in self._sizes:
                    self.events.stored([meta.key], meta.parent_key, [meta.tokens], meta.priority,
                                       tier=self.name, extra=meta.extra)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(item)
            finally:
                self._queue.task_done()

    def _write(self, item: _Pending) -> None:
        """Write one block; any failure is counted and logged (rate-limited), never raised: the
        writer thread and the engine step go on, and the next write tries again."""
        key = item.meta.key
        path = self._path(key)
        temp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}{TEMP_SUFFIX}")
        try:
            data = encode_record(item.meta, item.payload, self.layout)
            with open(temp, "wb") as f:
                f.write(data)
                if self.write_sync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(temp, path)
            if self.write_sync:
                self._fsync_directory()
        except Exception as exc:
            with self._lock:
                self._pending.pop(key, None)
                self.counters["write_errors"] += 1
                errors = self.counters["write_errors"]
            self._write_failed("disk cache: writing %s failed: %s (%d write errors so far)",
                               path, exc, errors)
            try:
                temp.unlink(missing_ok=True)
            except OSError:                         # a read-only disk refuses this too
                pass
            return
        with self._lock:
            self._pending.pop(key, None)
            self._foreign.discard(key)
            self._index(key, len(data), item.meta.priority)
            if self.events is not None:
                meta = item.meta
                self.events.stored([key], meta.parent_key, [meta.tokens], meta.priority,
                                   tier=self.name, extra=meta.extra)
            self.counters["writes"] += 1
            self.counters["write_bytes"] += len(data)
            victims = self._make_room(keep=key)
        self._unlink(victims)

    # ------------------------------------------------------------------ index
    def _reindex(self) -> None:
        """Index the records already in the directory from their headers, oldest first."""
        found = []
        now = time.time()
        for entry in os.scandir(self.directory):
            path = Path(entry.path)
            if entry.name.endswith(TEMP_SUFFIX):
                try:
                    if now - entry.stat().st_mtime > STALE_TEMP_SECONDS:
                        path.unlink(missing_ok=True)
                except OSError:
                    pass
                continue
            if not _NAME.match(entry.name):
                continue
            try:
                header, size, mtime = self._read_header(path)
            except NotABlockFile as exc:
                self._not_a_block(path, bytes.fromhex(entry.name[:-len(SUFFIX)]), exc)
                continue
            except ForeignRecord as exc:
                log.info("disk cache: %s left alone: %s", path, exc)
                self.counters["foreign_files"] += 1
                self._foreign.add(bytes.fromhex(entry.name[:-len(SUFFIX)]))
                continue
            except CorruptRecord as exc:
                self._corrupt(path, None, str(exc))
                continue
            except FileNotFoundError:
                continue
            except OSError as exc:
                self._corrupt(path, None, f"unreadable: {exc}")
                continue
            found.append((mtime, header.meta, size))
        for _, meta, size in sorted(found, key=lambda f: f[0]):
            self._index(meta.key, size, meta.priority)
        self._unlink(self._make_room())

    def _open(self, path: Path) -> tuple[Any, os.stat_result]:
        """Open a block file for reading: a regular file, not through a symlink, without
        blocking (a FIFO), of a size a record can have (one of a smaller layout included: its
        header tells foreign from corrupt). Raises NotABlockFile, CorruptRecord or OSError."""
        fd = os.open(path, _OPEN_FLAGS)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise NotABlockFile(f"not a regular file (mode {stat.filemode(info.st_mode)})")
            if not LENGTH_PREFIX < info.st_size <= self.max_record_bytes:
                raise CorruptRecord(f"file of {info.st_size} bytes; a record of this model "
                                    f"takes {self.record_bytes} to {self.max_record_bytes}")
            return os.fdopen(fd, "rb"), info
        except BaseException:
            os.close(fd)
            raise

    def _read(self, path: Path) -> bytes:
        """The whole file, bounded by the size checked at open."""
        try:
            f, info = self._open(path)
        except OSError as exc:
            if exc.errno == errno.ELOOP:            # O_NOFOLLOW met a symlink
                raise NotABlockFile("a symbolic link") from None
            raise
        with f:
            return f.read(info.st_size)

    def _read_header(self, path: Path):
        try:
            f, info = self._open(path)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise NotABlockFile("a symbolic link") from None
            raise
        with f:
            prefix = f.read(LENGTH_PREFIX)
            prefix += f.read(header_length(prefix))
        header = decode_header(prefix, self.layout)
        if header.meta.key.hex() + SUFFIX != path.name:
            raise CorruptRecord("the record's key differs from its file name")
        if info.st_size != header.record_size:
            raise CorruptRecord(f"file of {info.st_size} bytes, its header says {header.record_size}")
        return header, info.st_size, info.st_mtime

    def _fsync_directory(self) -> None:
        """Make the rename durable (POSIX: the directory entry lives in the directory)."""
        fd = os.open(self.directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _adopt(self, key: bytes) -> bool:
        """Index a file another process wrote since this one started (its size from stat)."""
        if key in self._foreign:
            return False
        try:
            info = self._path(key).lstat()
        except OSError:
            return False
        size = info.st_size
        if not stat.S_ISREG(info.st_mode) or size > self.max_record_bytes:
            return False                            # never a record of ours
        with self._lock:
            if key not in self._sizes:
                self._index(key, size, DEFAULT_PRIORITY)
            victims = self._make_room(keep=key)
        self._unlink(victims)
        return True

    def _index(self, key: bytes, size: int, priority: int) -> None:
        self._bytes += size - self._sizes.get(key, 0)
        self._sizes[key] = size
        self._order.add(key, priority)

    def _forget(self, key: bytes) -> None:
        with self._lock:
            if key in self._sizes:
                self._bytes -= self._sizes.pop(key)
                self._order.remove(key)
                if self.events is not None:
                    self.events.removed([key], tier=self.name)

    def _make_room(self, keep: Optional[bytes] = None) -> list[bytes]:
        """Drop the least valuable files from the index until it fits (lock held); returns the
        keys whose files the caller unlinks outside the lock."""
        victims = []
        kept = keep is not None and keep in self._order
        if kept:                                    # never the file just written or adopted
            priority = self._order.priority(keep)
            self._order.remove(keep)
        while self._bytes > self.capacity_bytes and len(self._order):
            key = self._order.victim()
            self._order.evicted(key)
            self._bytes -= self._sizes.pop(key)
            self._order.remove(key)
            self.counters["evictions"] += 1
            victims.append(key)
            if self.events is not None:
                self.events.removed([key], tier=self.name)
        if kept:
            self._order.add(keep, priority)
        return victims

    def _unlink(self, keys: list[bytes]) -> None:
        for key in keys:
            self._path(key).unlink(missing_ok=True)

    # ------------------------------------------------------------------ outcomes
    def _hit(self, key: bytes, payload: torch.Tensor, nbytes: int = 0) -> torch.Tensor:
        with self._lock:
            self.counters["onboarded_blocks"] += 1
            self.counters["onboarded_bytes"] += nbytes or self.record_bytes
        return payload

    def _count_mismatch(self) -> None:
        with self._lock:
            self.counters["mismatches"] += 1
        return None

    def _not_a_block(self, path: Path, key: bytes, exc: OSError) -> None:
        """Something else under a block's name: left alone, never opened again."""
        log.warning("disk cache: %s left alone: %s", path, exc)
        with self._lock:
            self.counters["foreign_files"] += 1
            self._foreign.add(key)
        self._forget(key)
        return None

    def _corrupt(self, path: Path, key: Optional[bytes], reason: str) -> None:
        log.warning("disk cache: removing %s: %s", path, reason)
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("disk cache: could not remove %s: %s", path, exc)
        if key is not None:
            self._forget(key)
        with self._lock:
            self.counters["corrupt_files"] += 1
        return None

    def _path(self, key: bytes) -> Path:
        return self.directory / (key.hex() + SUFFIX)
