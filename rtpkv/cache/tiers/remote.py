"""RedisTier: KV blocks shared by every replica that points at one Redis server.

Each block is one Redis string under ``<prefix><chained key in hex>`` holding the record bytes of
`rtpkv.cache.tiers.record` (the disk tier's format: self-describing header, checksummed payload).
A record is written with a single ``SET`` (atomic: a reader sees all of it or nothing), so a key is
visible only when complete; a value that does not decode (truncated, bad checksum, garbage) is a
miss, is deleted and counted, and the block is computed again. A record of another model or
format is a miss, counted and left alone. The stored tokens, parent key and salt must equal the
request's, as for a device hit.

Nothing here may stall the engine: stores are copied and queued to a writer thread (dropped and
counted when the bounded queue is full); `prefetch` fetches a request's chain with one ``MGET`` on
a loader thread before the request is scheduled, and `lookup`/`load` then answer from memory.
Every network call has a timeout. A server that is down, refuses or times out turns the tier off
for a back-off period (logged once); the writer thread probes it and turns the tier back on when
it answers.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional, Sequence

import torch

from rtpkv.cache.tiers.base import BlockMeta, KVTier, TierLayout
from rtpkv.cache.tiers.record import (CorruptRecord, ForeignRecord, RecordMismatch, decode_record,
                                      encode_record)
from rtpkv.config import redact_url
from rtpkv.errors import ConfigError

log = logging.getLogger("rtpkv")

KEY_PREFIX = b"rtpkv:kv:"
ABSENT_MEMORY_S = 1.0   # how long a prefetch's "not there" answers `lookup` without asking again
PRESENT_MEMORY_S = 60.0  # how long a key known to be stored is not sent again
PRESENT_MEMORY_KEYS = 65536
_STOP = object()


def _connect(url: str, password: Optional[str], timeout_s: float):
    """A redis-py client that fails fast: one try per call, every socket call bounded."""
    try:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ImportError:
        raise ConfigError("ENABLE_REMOTE_CACHE=1 needs the Redis client: "
                          "pip install 'rtpkv[redis]'") from None
    return redis.Redis.from_url(
        url, password=password or None, socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0), retry_on_timeout=False,
        health_check_interval=0)


def _server_errors() -> tuple[type[BaseException], ...]:
    import redis

    return (redis.RedisError, OSError)


class RedisTier(KVTier):
    """The remote tier. `prefetch` a request's chain first; `lookup`/`load` then cost nothing."""

    name = "remote"
    write_through = True   # replicas share what is computed, not only what is evicted
    fetches_in_background = True

    def __init__(self, layout: TierLayout, url: str, *, password: Optional[str] = None,
                 ttl_s: int = 0, timeout_ms: int = 200, key_prefix: bytes = KEY_PREFIX,
                 queue_blocks: int = 64, prefetch_mb: float = 256.0, backoff_s: float = 0.5,
                 max_backoff_s: float = 8.0):
        self.layout = layout
        self.url = redact_url(url)
        self.ttl_s = ttl_s
        self.timeout_s = timeout_ms / 1000.0
        self.key_prefix = key_prefix
        self._client = _connect(url, password, self.timeout_s)
        self._errors = _server_errors()
        self._prefetch_limit = max(1, int(prefetch_mb * 2**20) // layout.nbytes)
        self._backoff_min, self._backoff_max = backoff_s, max_backoff_s
        self._lock = threading.Lock()
        self._up = True
        self._backoff = backoff_s
        self._retry_at = 0.0
        self._fetched: OrderedDict[bytes, tuple[BlockMeta, torch.Tensor]] = OrderedDict()
        self._absent: dict[bytes, float] = {}    # key -> until when a prefetch found it absent
        self._present: OrderedDict[bytes, float] = OrderedDict()  # key -> until when known stored
        self._present_s = min(PRESENT_MEMORY_S, ttl_s / 2) if ttl_s else PRESENT_MEMORY_S
        self._queue: "queue.Queue[Any]" = queue.Queue(maxsize=queue_blocks)
        self._pending = 0                         # queued or being written
        self._idle = threading.Condition(self._lock)
        self._closed = False
        self.counters = dict(hits=0, misses=0, stores=0, bytes_read=0, bytes_written=0,
                             errors=0, dropped=0, corrupt=0, foreign=0, mismatched=0,
                             prefetches=0, down_events=0, already_stored=0)
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="rtpkv-remote-load")
        self._writer = threading.Thread(target=self._write_loop, name="rtpkv-remote-store",
                                        daemon=True)
        self._writer.start()
        log.info("remote KV cache: %s (timeout %d ms, ttl %s)", self.url, timeout_ms,
                 f"{ttl_s} s" if ttl_s else "none")
        try:
            self._client.ping()
        except self._errors as exc:
            self._failed(exc, "start-up")

    # ------------------------------------------------------------------ state
    @property
    def up(self) -> bool:
        """False while the server is considered down (between a failure and a good probe)."""
        return self._up

    def redis_key(self, key: bytes) -> bytes:
        return self.key_prefix + key.hex().encode()

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self.counters[name] += delta

    def _failed(self, exc: BaseException, during: str) -> None:
        """A server error: count it; the first one after a good period turns the tier off."""
        with self._lock:
            self.counters["errors"] += 1
            if not self._up:
                return
            self._up = False
            self._present.clear()   # the server may come back empty
            self._backoff = self._backoff_min
            self._retry_at = time.monotonic() + self._backoff
            self.counters["down_events"] += 1
        log.warning("remote KV cache %s failed during %s (%s: %s); serving from local tiers, "
                    "retrying in the background", self.url, during, type(exc).__name__, exc)

    def _probe(self) -> None:
        """Writer thread, while down: PING once the back-off has passed; back up on an answer."""
        if time.monotonic() < self._retry_at:
            return
        try:
            self._client.ping()
        except self._errors:
            with self._lock:
                self.counters["errors"] += 1
                self._backoff = min(self._backoff * 2, self._backoff_max)
                self._retry_at = time.monotonic() + self._backoff
            return
        with self._lock:
            self._up = True
            self._absent.clear()
        log.warning("remote KV cache %s answers again; tier back on", self.url)

    # ------------------------------------------------------------------ reads
    def prefetch(self, metas: Sequence[BlockMeta]) -> "Future[int]":
        """Fetch a chain's blocks (one MGET) on the loader thread and keep the verified ones in
        memory for `lookup`/`load`. The future gives how many blocks, from the start, are ready;
        it never raises (a server error is a miss)."""
        metas = list(metas)[: self._prefetch_limit]
        if not metas or not self._up or self._closed:
            done: Future[int] = Future()
            done.set_result(0)
            return done
        self._count(prefetches=1)
        return self._loader.submit(self._fetch_chain, metas)

    def _fetch_chain(self, metas: list[BlockMeta]) -> int:
        with self._lock:
            start = 0
            while start < len(metas) and metas[start].key in self._fetched:
                start += 1
        if start == len(metas) or not self._up:
            return start
        try:
            values = self._client.mget([self.redis_key(m.key) for m in metas[start:]])
        except self._errors as exc:
            self._failed(exc, "prefetch")
            return start
        ready = start
        for meta, data in zip(metas[start:], values):
            payload = None if data is None else self._decode(meta, data)
            if payload is None:
                self._mark_absent(meta.key)
                break
            self._keep(meta, payload)
            ready += 1
        self._mark_present([m.key for m in metas[:ready]])
        return ready

    def _mark_present(self, keys: Sequence[bytes]) -> None:
        until = time.monotonic() + self._present_s
        with self._lock:
            for key in keys:
                self._present[key] = until
                self._present.move_to_end(key)
            while len(self._present) > PRESENT_MEMORY_KEYS:
                self._present.popitem(last=False)

    def _known_stored(self, key: bytes) -> bool:
        with self._lock:
            return self._present.get(key, 0.0) > time.monotonic()

    def _mark_absent(self, key: bytes) -> None:
        """Remember for a second that the chain breaks here, so `lookup` need not ask again."""
        now = time.monotonic()
        with self._lock:
            if len(self._absent) > 4096:
                self._absent = {k: t for k, t in self._absent.items() if t > now}
            self._absent[key] = now + ABSENT_MEMORY_S

    def _keep(self, meta: BlockMeta, payload: torch.Tensor) -> None:
        with self._lock:
            self._fetched[meta.key] = (meta, payload)
            self._fetched.move_to_end(meta.key)
            while len(self._fetched) > self._prefetch_limit:
                self._fetched.popitem(last=False)

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Blocks of the chain held, contiguous from the start: answered from prefetched blocks
        where a prefetch covered the chain, else with one pipelined EXISTS round trip."""
        now = time.monotonic()
        with self._lock:
            n = 0
            while n < len(keys) and keys[n] in self._fetched:
                n += 1
            if n == len(keys) or self._absent.get(keys[n], 0.0) > now or not self._up:
                return n
        try:
            pipe = self._client.pipeline(transaction=False)
            for key in keys[n:]:
                pipe.exists(self.redis_key(key))
            found = pipe.execute()
        except self._errors as exc:
            self._failed(exc, "lookup")
            return n
        for present in found:
            if not present:
                break
            n += 1
        return n

    def load(self, meta: BlockMeta) -> Optional[torch.Tensor]:
        """The block's payload, verified against `meta`; None on a miss (never raises)."""
        with self._lock:
            entry = self._fetched.pop(meta.key, None)
        if entry is not None and entry[0].same_block(meta):
            self._count(hits=1)
            return entry[1]
        if not self._up:
            self._count(misses=1)
            return None
        try:
            data = self._client.get(self.redis_key(meta.key))
        except self._errors as exc:
            self._failed(exc, "load")
            data = None
        payload = None if data is None else self._decode(meta, data)
        if payload is None:
            self._count(misses=1)
            return None
        self._mark_present([meta.key])
        self._count(hits=1)
        return payload

    def _decode(self, meta: BlockMeta, data: bytes) -> Optional[torch.Tensor]:
        """Verify a record fetched for `meta`: corrupt ones are deleted, foreign ones left."""
        try:
            _, payload = decode_record(data, self.layout, expect=meta)
        except CorruptRecord as exc:
            self._count(corrupt=1)
            log.warning("remote KV cache: record %s is corrupt (%s); deleted",
                        self.redis_key(meta.key).decode(), exc)
            self._delete(meta.key)
            return None
        except RecordMismatch:
            self._count(mismatched=1)
            return None
        except ForeignRecord:
            self._count(foreign=1)
            return None
        self._count(bytes_read=len(data))
        return payload

    def _delete(self, key: bytes) -> None:
        with self._lock:
            self._present.pop(key, None)
        try:
            self._client.delete(self.redis_key(key))
        except self._errors as exc:
            self._failed(exc, "delete")

    # ------------------------------------------------------------------ writes
    def store(self, meta: BlockMeta, payload: torch.Tensor) -> None:
        """Queue a copy of the block for the writer thread; dropped (counted) when the queue is
        full or the server is down."""
        self.layout.check_payload(payload)
        if not self._up or self._closed:
            self._count(dropped=1)
            return
        if self._known_stored(meta.key):
            self._count(already_stored=1)
            return
        self._enqueue(("set", meta, payload.detach().to("cpu", copy=True).contiguous()))

    def drop(self, key: bytes) -> None:
        with self._lock:
            self._fetched.pop(key, None)
            self._present.pop(key, None)
        if self._up and not self._closed:
            self._enqueue(("del", key))

    def _enqueue(self, item: tuple) -> None:
        with self._lock:
            self._pending += 1
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self._done(1, dropped=1)

    def _done(self, n: int, **deltas: int) -> None:
        with self._lock:
            self._pending -= n
            for name, delta in deltas.items():
                self.counters[name] += delta
            if not self._pending:
                self._idle.notify_all()

    def _write_loop(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=0.05 if not self._up else 0.5)
            except queue.Empty:
                item = None
            if not self._up:
                self._probe()
            if item is None:
                continue
            batch = [item]
            while len(batch) < 16:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = any(entry is _STOP for entry in batch)
            batch = [entry for entry in batch if entry is not _STOP]
            if batch:
                self._write(batch)
            if stop:
                return

    def _write(self, batch: list[tuple]) -> None:
        if not self._up:
            self._done(len(batch), dropped=len(batch))
            return
        written = stores = 0
        keys: dict[bytes, None] = {}   # set by this batch and not deleted after
        try:
            pipe = self._client.pipeline(transaction=False)
            for entry in batch:
                if entry[0] == "set":
                    record = encode_record(entry[1], entry[2], self.layout)
                    pipe.set(self.redis_key(entry[1].key), record, ex=self.ttl_s or None)
                    written += len(record)
                    stores += 1
                    keys[entry[1].key] = None
                else:
                    pipe.delete(self.redis_key(entry[1]))
                    keys.pop(entry[1], None)
            pipe.execute()
        except self._errors as exc:
            self._failed(exc, "store")
            self._done(len(batch), dropped=stores)
            return
        self._mark_present(list(keys))
        self._done(len(batch), stores=stores, bytes_written=written)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued store has been written or dropped; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    # ------------------------------------------------------------------ visibility, lifecycle
    def stats(self) -> dict[str, Any]:
        with self._lock:
            stats = {f"remote_{name}": value for name, value in self.counters.items()}
            stats["remote_up"] = self._up
            stats["remote_queue_depth"] = self._pending
            stats["remote_prefetched_blocks"] = len(self._fetched)
        return stats

    def check_integrity(self) -> None:
        with self._lock:
            assert self._pending >= 0, "remote store queue count went negative"
            assert len(self._fetched) <= self._prefetch_limit, "prefetched blocks over the bound"
            assert all(v >= 0 for v in self.counters.values()), "a remote counter went negative"
            for key, (meta, payload) in self._fetched.items():
                assert meta.key == key, "a prefetched block is filed under another key"
                assert tuple(payload.shape) == tuple(self.layout.shape), \
                    "a prefetched block has the wrong shape"
        assert self._closed or self._writer.is_alive(), "the remote writer thread died"

    def close(self) -> None:
        """Write what is queued (bounded by the timeouts), stop the threads, disconnect."""
        if self._closed:
            return
        self.flush(timeout=max(2.0, 10 * self.timeout_s))
        self._closed = True
        self._queue.put(_STOP)
        self._writer.join()
        self._loader.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            self._fetched.clear()
        self._client.close()
