"""The Redis tier against a real redis-server: round trips, verification, faults.

Every test uses a private server on a loopback port (tests/redis_server.py); a server that
cannot be started fails the test."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import redis
import torch
from redis_server import RedisServer, SilentServer, free_port

from rtpkv.cache.prefix_index import PrefixIndex
from rtpkv.cache.tiers.base import BlockMeta, TierLayout
from rtpkv.cache.tiers.record import encode_record
from rtpkv.cache.tiers.remote import RedisTier
from rtpkv.config import Settings
from rtpkv.errors import ConfigError

B = 4
LAYOUT = TierLayout(fingerprint="ab" * 16, block_size=B, dtype=torch.float32, shape=(2, 2, 2, B, 8))
OTHER_MODEL = TierLayout(fingerprint="cd" * 16, block_size=B, dtype=torch.float32,
                         shape=(2, 2, 2, B, 8))


def chain(tokens: list[int], salt: bytes = b"", layout: TierLayout = LAYOUT) -> list[BlockMeta]:
    """The BlockMetas of `tokens`' full blocks, keyed like the engine keys them."""
    index = PrefixIndex(layout.fingerprint, B)
    metas, parent = [], index.root
    for i in range(len(tokens) // B):
        block = tuple(tokens[i * B:(i + 1) * B])
        extra = salt if i == 0 else b""
        key = index.key(parent, block, extra)
        metas.append(BlockMeta(key=key, parent_key=parent, tokens=block, extra=extra))
        parent = key
    return metas


def payload(seed: int) -> torch.Tensor:
    return torch.randn(LAYOUT.shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def make_tier():
    """make_tier(url, **options) -> a RedisTier, integrity-checked and closed after the test."""
    made: list[RedisTier] = []

    def make(url: str, **options) -> RedisTier:
        options.setdefault("backoff_s", 0.05)
        options.setdefault("max_backoff_s", 0.2)
        tier = RedisTier(LAYOUT, url, **options)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.check_integrity()
        tier.close()


def raw(url: str) -> redis.Redis:
    return redis.Redis.from_url(url)


def stored(tier: RedisTier, metas: list[BlockMeta]) -> list[torch.Tensor]:
    payloads = [payload(i) for i in range(len(metas))]
    for meta, data in zip(metas, payloads):
        tier.store(meta, data)
    assert tier.flush(5.0)
    return payloads


# ---------------------------------------------------------------------------- round trips
def test_store_lookup_load_round_trip(redis_url, make_tier):
    tier = make_tier(redis_url)
    metas = chain(list(range(100, 116)))
    payloads = stored(tier, metas[:3])
    assert tier.lookup([m.key for m in metas]) == 3
    for meta, data in zip(metas[:3], payloads):
        assert torch.equal(tier.load(meta), data)
    assert tier.load(metas[3]) is None
    stats = tier.stats()
    assert stats["remote_up"] is True
    assert (stats["remote_stores"], stats["remote_hits"], stats["remote_misses"]) == (3, 3, 1)
    record_bytes = len(encode_record(metas[0], payloads[0], LAYOUT))
    assert stats["remote_bytes_written"] == stats["remote_bytes_read"] == 3 * record_bytes
    keys = sorted(raw(redis_url).keys("*"))
    assert keys == sorted(b"rtpkv:kv:" + m.key.hex().encode() for m in metas[:3])


def test_a_block_known_to_be_stored_is_not_sent_again(redis_url, make_tier):
    tier = make_tier(redis_url)
    metas = chain(list(range(12)))
    stored(tier, metas)
    stored(tier, metas)
    stats = tier.stats()
    assert stats["remote_stores"] == 3 and stats["remote_already_stored"] == 3
    reader = make_tier(redis_url)                # another replica: what it loads it knows
    assert reader.prefetch(metas).result(5) == 3
    stored(reader, metas)
    assert reader.stats()["remote_stores"] == 0
    raw(redis_url).delete(tier.redis_key(metas[0].key))
    tier.drop(metas[1].key)                      # forgotten, and deleted on the server
    assert tier.flush(5.0)
    assert raw(redis_url).dbsize() == 1


def test_store_copies_the_payload_before_returning(redis_url, make_tier):
    tier = make_tier(redis_url)
    meta = chain(list(range(8)))[0]
    data = payload(1)
    expected = data.clone()
    tier.store(meta, data)
    data.zero_()                      # the caller reuses the memory at once
    assert tier.flush(5.0)
    assert torch.equal(tier.load(meta), expected)


def test_lookup_counts_contiguous_blocks_only(redis_url, make_tier):
    tier = make_tier(redis_url)
    metas = chain(list(range(16)))
    stored(tier, [metas[0], metas[2], metas[3]])
    assert tier.lookup([m.key for m in metas]) == 1
    assert tier.lookup([m.key for m in metas[2:]]) == 2
    assert tier.lookup([]) == 0


def test_lookup_of_a_chain_is_one_round_trip(redis_url, make_tier, monkeypatch):
    tier = make_tier(redis_url)
    metas = chain(list(range(64)))
    stored(tier, metas[:10])
    sends = []
    original = redis.connection.AbstractConnection.send_packed_command
    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command",
                        lambda self, *a, **k: (sends.append(1), original(self, *a, **k))[1])
    assert tier.lookup([m.key for m in metas]) == 10
    assert len(sends) == 1
    sends.clear()
    assert tier.prefetch(metas).result(5) == 10
    assert len(sends) == 1


def test_salt_and_model_are_in_the_key(redis_url, make_tier):
    tier = make_tier(redis_url)
    tokens = list(range(12))
    stored(tier, chain(tokens))
    assert tier.lookup([m.key for m in chain(tokens)]) == 3
    assert tier.lookup([m.key for m in chain(tokens, salt=b"tenant-b")]) == 0
    assert tier.lookup([m.key for m in chain(tokens, layout=OTHER_MODEL)]) == 0


def test_ttl(redis_url, make_tier):
    client = raw(redis_url)
    metas = chain(list(range(8)))
    forever = make_tier(redis_url)
    stored(forever, metas[:1])
    assert client.ttl(forever.redis_key(metas[0].key)) == -1
    expiring = make_tier(redis_url, ttl_s=30)
    stored(expiring, metas[1:2])
    assert 0 < client.ttl(expiring.redis_key(metas[1].key)) <= 30


def test_close_writes_what_is_queued(redis_url, make_tier):
    tier = make_tier(redis_url)
    metas = chain(list(range(40)))
    for i, meta in enumerate(metas):
        tier.store(meta, payload(i))
    tier.close()
    assert raw(redis_url).dbsize() == len(metas)


# ---------------------------------------------------------------------------- prefetch
def test_prefetch_serves_lookup_and_load_from_memory(redis_url, make_tier):
    tier = make_tier(redis_url)
    metas = chain(list(range(20)))
    payloads = stored(tier, metas[:4])
    future = tier.prefetch(metas)
    assert future.result(5) == 4
    assert tier.stats()["remote_prefetched_blocks"] == 4
    raw(redis_url).flushall()          # from now on only what was prefetched can answer
    assert tier.lookup([m.key for m in metas]) == 4
    for meta, data in zip(metas[:4], payloads):
        assert torch.equal(tier.load(meta), data)
    assert tier.stats()["remote_prefetched_blocks"] == 0
    assert tier.load(metas[0]) is None  # a prefetched block is handed out once


def test_prefetch_of_an_absent_chain_and_the_bound(redis_url, make_tier):
    block_mb = LAYOUT.dtype.itemsize * torch.Size(LAYOUT.shape).numel() / 2**20
    tier = make_tier(redis_url, prefetch_mb=2.5 * block_mb)
    metas = chain(list(range(20)))
    assert tier.prefetch(metas).result(5) == 0
    assert tier.lookup([m.key for m in metas]) == 0
    stored(tier, metas)
    assert tier.prefetch(metas).result(5) == 2   # at most the bound, from the chain's start
    assert tier.stats()["remote_prefetched_blocks"] == 2


# ---------------------------------------------------------------------------- bad records
def test_half_written_record_is_a_miss_and_deleted(redis_url, make_tier, caplog):
    tier = make_tier(redis_url)
    metas = chain(list(range(8)))
    record = encode_record(metas[0], payload(0), LAYOUT)
    client = raw(redis_url)
    client.set(tier.redis_key(metas[0].key), record[: len(record) // 2])
    client.set(tier.redis_key(metas[1].key), record[:10])
    assert tier.lookup([m.key for m in metas]) == 2    # EXISTS cannot tell; load verifies
    with caplog.at_level(logging.WARNING, logger="rtpkv"):
        assert tier.load(metas[0]) is None
        assert tier.prefetch(metas[1:]).result(5) == 0
    assert client.dbsize() == 0
    assert tier.stats()["remote_corrupt"] == 2
    assert "corrupt" in caplog.text


def test_corrupted_payload_is_a_miss_and_deleted(redis_url, make_tier):
    tier = make_tier(redis_url)
    meta = chain(list(range(8)))[0]
    record = bytearray(encode_record(meta, payload(0), LAYOUT))
    record[-3] ^= 0xFF                                  # inside the tensor bytes
    client = raw(redis_url)
    client.set(tier.redis_key(meta.key), bytes(record))
    assert tier.load(meta) is None
    assert not client.exists(tier.redis_key(meta.key))
    assert tier.stats()["remote_corrupt"] == 1
    assert tier.stats()["remote_hits"] == 0


def test_garbage_value_is_a_miss_and_deleted(redis_url, make_tier):
    tier = make_tier(redis_url)
    meta = chain(list(range(8)))[0]
    client = raw(redis_url)
    client.set(tier.redis_key(meta.key), b"\x00" * 64)
    assert tier.prefetch([meta]).result(5) == 0
    assert tier.load(meta) is None
    assert not client.exists(tier.redis_key(meta.key))


def test_record_of_another_model_is_a_miss_left_alone(redis_url, make_tier):
    tier = make_tier(redis_url)
    meta = chain(list(range(8)))[0]
    client = raw(redis_url)
    client.set(tier.redis_key(meta.key), encode_record(meta, payload(0), OTHER_MODEL))
    assert tier.load(meta) is None
    assert tier.prefetch([meta]).result(5) == 0
    assert client.exists(tier.redis_key(meta.key))
    assert tier.stats()["remote_foreign"] == 2
    assert tier.stats()["remote_corrupt"] == 0


def test_record_of_other_tokens_under_the_key_is_a_miss(redis_url, make_tier):
    tier = make_tier(redis_url)
    meta = chain(list(range(8)))[0]
    impostor = BlockMeta(key=meta.key, parent_key=meta.parent_key, tokens=(9, 9, 9, 9))
    raw(redis_url).set(tier.redis_key(meta.key), encode_record(impostor, payload(0), LAYOUT))
    assert tier.load(meta) is None
    assert tier.stats()["remote_mismatched"] == 1


# ---------------------------------------------------------------------------- queue bound
def test_full_store_queue_drops_and_counts(redis_url, make_tier, monkeypatch):
    tier = make_tier(redis_url, queue_blocks=2)
    gate = threading.Event()
    write = tier._write
    monkeypatch.setattr(tier, "_write", lambda batch: (gate.wait(10), write(batch))[1])
    metas = chain(list(range(40)))
    t0 = time.monotonic()
    for i, meta in enumerate(metas):
        tier.store(meta, payload(i))
    assert time.monotonic() - t0 < 2.0                  # store never waits for the server
    gate.set()
    assert tier.flush(5.0)
    stats = tier.stats()
    # at most: the writer's batch (one item + the 2 queued when it drained) and 2 queued after
    assert stats["remote_dropped"] >= len(metas) - 5
    assert stats["remote_stores"] + stats["remote_dropped"] == len(metas)
    assert raw(redis_url).dbsize() == stats["remote_stores"]


# ---------------------------------------------------------------------------- faults
def test_server_killed_mid_run_then_restarted(own_redis, make_tier, caplog):
    tier = make_tier(own_redis.url)
    metas = chain(list(range(200)))
    errors: list[BaseException] = []
    stop = threading.Event()

    def worker(offset: int) -> None:
        try:
            i = 0
            while not stop.is_set():
                part = metas[(offset + i) % 40:][:5]
                for j, meta in enumerate(part):
                    tier.store(meta, payload(j))
                tier.lookup([m.key for m in part])
                tier.prefetch(part).result(5)
                for meta in part:
                    got = tier.load(meta)
                    assert got is None or got.shape == LAYOUT.shape
                i += 1
        except BaseException as exc:  # noqa: BLE001 - the test reports any escape
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k * 7,), daemon=True) for k in range(4)]
    with caplog.at_level(logging.WARNING, logger="rtpkv"):
        for t in threads:
            t.start()
        try:
            time.sleep(0.5)
            own_redis.kill()
            _wait_for(lambda: not tier.up, "the tier to notice the server is down")
            time.sleep(0.5)                              # the workers keep hammering it
            assert caplog.text.count("failed during") == 1, caplog.text
            down = tier.stats()
            assert down["remote_up"] is False and down["remote_errors"] >= 1
            own_redis.start()                            # the same port
            _wait_for(lambda: tier.up, "the tier to come back after the restart")
            time.sleep(0.3)
        finally:
            stop.set()
            for t in threads:
                t.join(10)
    assert not errors, errors
    assert "answers again" in caplog.text
    meta = chain(list(range(1000, 1004)))[0]
    tier.store(meta, payload(7))
    assert tier.flush(5.0)
    assert torch.equal(tier.load(meta), payload(7))


def test_refused_connection_turns_the_tier_off_and_logs_once(make_tier, caplog):
    url = f"redis://127.0.0.1:{free_port()}/0"          # nothing listens there
    with caplog.at_level(logging.WARNING, logger="rtpkv"):
        tier = make_tier(url)
        metas = chain(list(range(16)))
        for _ in range(20):
            assert tier.lookup([m.key for m in metas]) == 0
            assert tier.load(metas[0]) is None
            tier.store(metas[0], payload(0))
            assert tier.prefetch(metas).result(5) == 0
    assert caplog.text.count("failed during") == 1
    stats = tier.stats()
    assert stats["remote_up"] is False
    assert stats["remote_errors"] >= 1 and stats["remote_dropped"] >= 19


def test_server_that_never_answers_is_bounded_by_the_timeout(make_tier):
    silent = SilentServer()
    try:
        tier = make_tier(silent.url, timeout_ms=200)
        metas = chain(list(range(16)))
        t0 = time.monotonic()
        assert tier.lookup([m.key for m in metas]) == 0
        assert time.monotonic() - t0 < 1.5
        assert not tier.up
        t0 = time.monotonic()
        assert tier.load(metas[0]) is None
        assert tier.prefetch(metas).result(2) == 0
        tier.store(metas[0], payload(0))
        assert time.monotonic() - t0 < 0.5               # down: nothing waits on the server
        t0 = time.monotonic()
        tier.close()
        assert time.monotonic() - t0 < 3.0
        assert tier.stats()["remote_errors"] >= 1
    finally:
        silent.close()


def test_prefetch_from_a_hung_server_does_not_block_the_caller(make_tier):
    silent = SilentServer()
    try:
        tier = make_tier(silent.url, timeout_ms=300)
        metas = chain(list(range(16)))
        t0 = time.monotonic()
        future = tier.prefetch(metas)
        assert time.monotonic() - t0 < 0.1               # the loader thread waits, not us
        assert future.result(3) == 0
    finally:
        silent.close()


def test_password_from_the_url_or_the_option(tmp_path, make_tier):
    with RedisServer(tmp_path, args=["--requirepass", "s3cret"]) as server:
        metas = chain(list(range(8)))
        with_option = make_tier(server.url, password="s3cret")
        stored(with_option, metas[:1])
        in_url = make_tier(f"redis://:s3cret@127.0.0.1:{server.port}/0")
        assert in_url.lookup([metas[0].key]) == 1
        assert "s3cret" not in in_url.url
        wrong = make_tier(server.url, password="wrong")
        assert wrong.lookup([metas[0].key]) == 0
        assert not wrong.up


def _wait_for(condition, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


# ---------------------------------------------------------------------------- configuration
def test_remote_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv("ENABLE_REMOTE_CACHE", "1")
    monkeypatch.setenv("REMOTE_CACHE_URL", "rediss://127.0.0.1:6380/2")
    monkeypatch.setenv("REMOTE_CACHE_TTL_S", "3600")
    monkeypatch.setenv("REMOTE_CACHE_TIMEOUT_MS", "50")
    monkeypatch.setenv("REMOTE_CACHE_PASSWORD", "pw")
    s = Settings.from_env()
    assert (s.enable_remote_cache, s.remote_cache_url, s.remote_cache_ttl_s,
            s.remote_cache_timeout_ms, s.remote_cache_password) == (
        True, "rediss://127.0.0.1:6380/2", 3600, 50, "pw")
    assert "pw" not in repr(s)


@pytest.mark.parametrize("name, value, words", [
    ("REMOTE_CACHE_URL", "http://127.0.0.1:6379", "scheme must be redis or rediss"),
    ("REMOTE_CACHE_URL", "redis://127.0.0.1:99999/0", "port"),
    ("REMOTE_CACHE_URL", "redis://127.0.0.1:6379/x", "database"),
    ("REMOTE_CACHE_URL", "redis:///0", "no host"),
    ("REMOTE_CACHE_TTL_S", "-1", "greater than or equal to 0"),
    ("REMOTE_CACHE_TIMEOUT_MS", "0", "greater than or equal to 1"),
    ("ENABLE_REMOTE_CACHE", "maybe", "1/0, true/false"),
])
def test_bad_remote_settings_are_named(monkeypatch, name, value, words):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=name) as info:
        Settings.from_env()
    assert words in str(info.value)


def test_bad_url_error_hides_the_password(monkeypatch):
    monkeypatch.setenv("REMOTE_CACHE_URL", "http://:hunter2@127.0.0.1:6379/0")
    with pytest.raises(ConfigError) as info:
        Settings.from_env()
    assert "hunter2" not in str(info.value) and "***" in str(info.value)


def test_enabled_without_a_url_is_refused(make_pipeline):
    with pytest.raises(ConfigError, match="ENABLE_REMOTE_CACHE=1 needs REMOTE_CACHE_URL"):
        make_pipeline(enable_remote_cache=True)
