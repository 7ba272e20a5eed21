"""KV events on the wire: a real ZeroMQ SUB and DEALER read what a Pipeline publishes, decoded
with plain msgpack the way vllm-router's subscriber decodes vLLM's (tagged event maps inside a
positional batch), and a consumer rebuilds exactly the replica's cached set."""

from __future__ import annotations

import random
import socket
import struct
import threading
import time

import msgpack
import pytest
import zmq

from rtpkv.config import Settings
from rtpkv.errors import ConfigError
from rtpkv.fleet.publisher import END_SEQ
from rtpkv.fleet.view import ReplicaView
from rtpkv.cache.tenants import tenant_label
from rtpkv.fleet.wire import salted_token_ids, wire_hash
from rtpkv.model_factory import ModelConfig, ModelFactory
from rtpkv.pipeline import Pipeline
from server_helpers import free_port, wait_until

B = 4


@pytest.fixture(scope="module")
def model(checkpoints):
    return ModelFactory.from_huggingface(checkpoints("qwen2"), ModelConfig())


def endpoints() -> tuple[str, str]:
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


def run(pipeline: Pipeline, prompt, **config) -> dict:
    for res in pipeline(prompt, generate_config={"max_new_tokens": 2, "top_k": 1, **config}):
        pass
    return res.aux_info


def subscriber(topic: bytes) -> zmq.Socket:
    """A SUB socket for `topic` (to connect once the publisher is up)."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    return sub


def replay(ctx: zmq.Context, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """A replay request as vLLM's consumers send it: [b"", start_seq] from a DEALER."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    got = []
    while True:
        assert dealer.poll(10000), "no replay answer"
        empty, topic, seq, payload = dealer.recv_multipart()
        assert empty == b"" and topic == b"kv@"
        if seq == END_SEQ:
            assert payload == b""
            dealer.close()
            return got
        got.append((int.from_bytes(seq, "big"), payload))


def test_events_decode_as_vllm_consumers_decode_them(model):
    pub, rep = endpoints()
    ctx = zmq.Context.instance()
    sub = subscriber(b"kv@")
    with Pipeline(model, reuse_cache=True, seq_size_per_block=B, kv_events_endpoint=pub,
                  kv_events_replay_endpoint=rep, kv_events_topic="kv@") as pipeline:
        sub.connect(pub)
        prompt = list(range(10, 23))  # 13 tokens: 3 full blocks hittable once computed
        # PUB drops what is sent before the subscription is set up: retry until one arrives
        assert wait_until(lambda: run(pipeline, prompt) is not None and sub.poll(200), 20)
        stored: list = []
        while not stored:  # skip an idle heartbeat (the last batch again) if one comes first
            assert sub.poll(5000), "no batch with the prompt's blocks"
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv@" and len(seq) == 8
            ts, events, rank = msgpack.unpackb(payload, raw=False)
            assert isinstance(ts, float) and rank == 0
            stored = [e for e in events if e["type"] == "BlockStored"]
        chain = pipeline.engine.cache.index.root
        keys = []
        for i in range(3):
            chain = pipeline.engine.cache.index.key(chain, tuple(prompt[i * B:(i + 1) * B]))
            keys.append(wire_hash(chain))
        hashes = [h for e in stored for h in e["block_hashes"]]
        assert hashes[:3] == keys
        first = stored[0]
        assert first["parent_block_hash"] is None and first["token_ids"] == prompt[:B]
        assert first["block_size"] == B and first["medium"] == "GPU"
        assert first["lora_id"] is None and first["extra_keys"] is None
        assert [e["parent_block_hash"] for e in stored[1:3]] == keys[:2]

        # replay: every kept batch from the asked sequence number on, in order, then END_SEQ
        batches = replay(ctx, rep, 0)
        assert [s for s, _ in batches] == list(range(len(batches)))
        first_batch = msgpack.unpackb(batches[0][1], raw=False)
        assert first_batch[1] == [{"type": "AllBlocksCleared"}]
        assert any(p == payload for _, p in batches)
        assert [s for s, _ in replay(ctx, rep, 2)] == list(range(2, len(batches)))
    sub.close()


def test_cache_salt_keeps_tenants_apart_in_the_events(model):
    pub, rep = endpoints()
    with Pipeline(model, reuse_cache=True, seq_size_per_block=B, kv_events_endpoint=pub,
                  kv_events_replay_endpoint=rep) as pipeline:
        view = ReplicaView(pub, rep)
        prompt = list(range(40, 49))
        run(pipeline, prompt)
        run(pipeline, prompt, cache_salt="tenant-a")
        assert wait_until(lambda: view.poll(0.05) >= 0 and len(view.blocks["GPU"]) == 4, 10)
        # the same tokens under two salts: two distinct chains of two blocks each; the salted
        # chain's first block is announced with its ids folded by the salt's digest, so a
        # router that hashes the plain prompt finds only the unsalted chain
        firsts = [h for h in view.blocks["GPU"] if view.tokens[h] == prompt[:B]]
        folded = salted_token_ids(tenant_label(b"tenant-a"), prompt[:B])
        assert len(firsts) == 1 and min(folded) >= 2**30
        assert [h for h in view.blocks["GPU"] if view.tokens[h] == folded]
        view.close()


def raw_events(sub: zmq.Socket, stored_hashes: int, timeout_s: float = 10.0) -> list[bytes]:
    """The msgpack bytes of each event in the batches `sub` receives, until BlockStored events
    with `stored_hashes` hashes in all have come (a heartbeat repeats a batch: taken once)."""
    seen, events, hashes = set(), [], 0
    while hashes < stored_hashes:
        assert sub.poll(int(timeout_s * 1000)), f"{hashes} stored hashes of {stored_hashes}"
        _, seq, payload = sub.recv_multipart()
        if seq in seen:
            continue
        seen.add(seq)
        unpacker = msgpack.Unpacker(raw=False)
        unpacker.feed(payload)
        assert unpacker.read_array_header() == 3
        unpacker.skip()   # ts
        for _ in range(unpacker.read_array_header()):
            start = unpacker.tell()
            unpacker.skip()
            events.append(payload[start:unpacker.tell()])
            event = msgpack.unpackb(events[-1], raw=False)
            hashes += len(event[1]) if event[0] == "BlockStored" else 0
    return events


def test_the_array_layout_is_what_llm_d_decodes(model):
    """KV_EVENTS_LAYOUT=array: each event an array, its tag first and vLLM's fields at the
    positions llm-d's vllm_adapter.go reads them (1 hashes, 2 parent, 3 token_ids, 4 block size,
    6 medium, 8 extra_keys); hashes packed as 8-byte ints (it refuses shorter ones); the salt
    as its digest, the salted block's ids folded with it; ReplicaView reads this layout too."""
    pub, rep = endpoints()
    sub = subscriber(b"")
    with Pipeline(model, reuse_cache=True, seq_size_per_block=B, kv_events_endpoint=pub,
                  kv_events_replay_endpoint=rep, kv_events_layout="array") as pipeline:
        sub.connect(pub)
        view = ReplicaView(pub, rep)
        assert wait_until(lambda: sub.poll(200), 10)   # the subscription is up: a heartbeat
        prompt = list(range(60, 69))    # 2 full blocks
        run(pipeline, prompt)
        run(pipeline, prompt, cache_salt="tenant-ä")
        raw = [e for e in raw_events(sub, 4) if msgpack.unpackb(e, raw=False)[0] == "BlockStored"]
        stored = [msgpack.unpackb(e, raw=False) for e in raw]
        for event in stored:
            assert event[4] == B and event[5] is None and event[6] == "GPU" and event[7] is None
        first_salted = next(i for i, e in enumerate(stored) if e[8] is not None)
        plain, salted = stored[:first_salted], stored[first_salted:]   # the runs in order
        assert [t for e in plain for t in e[3]] == prompt[:2 * B] and plain[0][2] is None
        label = tenant_label("tenant-ä".encode())   # the salt's digest, never the salt
        assert [t for e in salted for t in e[3]] == \
            salted_token_ids(label, prompt[:B]) + prompt[B:2 * B]
        assert salted[0][8] == [[label]] + [None] * (len(salted[0][1]) - 1)
        assert "tenant-ä".encode() not in b"".join(raw)
        plain_hashes = [h for e in plain for h in e[1]]
        salted_hashes = [h for e in salted for h in e[1]]
        assert not set(plain_hashes) & set(salted_hashes)
        for event, decoded in zip(raw, stored):   # uint64 on the wire: 0xcf and 8 bytes
            assert all(b"\xcf" + h.to_bytes(8, "big") in event for h in decoded[1])
        assert wait_until(lambda: view.poll(0.05) >= 0 and len(view.blocks["GPU"]) == 4, 10)
        assert view.blocks["GPU"] == set(plain_hashes) | set(salted_hashes)
        view.close()
    sub.close()


def test_a_subscriber_rebuilds_the_cached_set_after_evictions(model, tmp_path):
    """A small device pool, host tier and disk tier: blocks are evicted from all three,
    offloaded to host memory (BlockStored, medium CPU), handed to disk (DISK; the disk tier also
    takes every block as it fills) and onboarded back; the view from the events equals what the
    replica holds, in each medium."""
    pub, rep = endpoints()
    block_bytes = model.spec.num_layers * 2 * model.spec.num_kv_heads * B * model.spec.head_dim * 4
    rng = random.Random(0)
    prefixes = [[rng.randrange(5, 500) for _ in range(12)] for _ in range(6)]
    with Pipeline(model, reuse_cache=True, seq_size_per_block=B, kv_cache_max_tokens=96,
                  concurrency_limit=2, enable_memory_cache=True,
                  host_cache_size=10 * block_bytes, enable_memory_cache_disk=True,
                  memory_cache_disk_paths=str(tmp_path), write_cache_sync=True,
                  memory_cache_disk_size_mb=40 * block_bytes / 2**20, kv_events_endpoint=pub,
                  kv_events_replay_endpoint=rep, kv_events_buffer_steps=100000) as pipeline:
        view = ReplicaView(pub, rep)
        for i in range(40):
            run(pipeline, rng.choice(prefixes) + [rng.randrange(5, 500) for _ in range(9)])
        cache = pipeline.engine.cache
        stats = pipeline.cache_stats()
        assert stats["evictions"] > 0 and stats["memory_evictions"] > 0
        assert stats["disk_evictions"] > 0 and stats["memory_onboarded_blocks"] > 0
        tiers = {tier.name: tier for tier in cache.ladder.tiers}
        held = {"GPU": {wire_hash(k) for k, _ in cache.index.items()},
                "CPU": {wire_hash(k) for k in tiers["memory"]._slots},
                "DISK": {wire_hash(k) for k in tiers["disk"]._sizes}}
        assert all(held.values())

        def caught_up() -> bool:
            view.poll(0.05)
            return {m: view.blocks[m] for m in held} == held

        assert wait_until(caught_up, 15), {m: len(b) for m, b in view.blocks.items()}
        assert set(view.blocks) == set(held)
        # a consumer that joins now catches up from the replay socket alone
        late = ReplicaView(pub, rep)
        late.replay()
        assert {m: late.blocks[m] for m in held} == held
        late.close()
        view.close()


def test_a_restarted_replica_announces_the_records_its_disk_tier_holds(model, tmp_path):
    """Records written before a restart are indexed before the publisher starts; they are
    announced (BlockStored, medium DISK, parents first) right after AllBlocksCleared, so a
    router that joins from the replay socket knows them, and a request then served from disk
    is stored on the device (GPU) as usual."""
    rng = random.Random(1)
    prompts = [[rng.randrange(5, 500) for _ in range(3 * B + 1)] for _ in range(3)]
    disk = dict(enable_memory_cache_disk=True, memory_cache_disk_paths=str(tmp_path),
                write_cache_sync=True)
    with Pipeline(model, reuse_cache=True, seq_size_per_block=B, **disk) as first_life:
        for prompt in prompts:
            run(first_life, prompt)
    pub, rep = endpoints()
    with Pipeline(model, reuse_cache=True, seq_size_per_block=B, kv_events_endpoint=pub,
                  kv_events_replay_endpoint=rep, kv_events_topic="kv@", **disk) as pipeline:
        tier = next(t for t in pipeline.engine.cache.ladder.tiers if t.name == "disk")
        on_disk = {wire_hash(k) for k in tier._sizes}
        assert len(on_disk) >= 3 * 3
        late = ReplicaView(pub, rep, topic="kv@")
        late.replay()
        assert late.blocks["DISK"] == on_disk and not late.blocks["GPU"]
        batches = [msgpack.unpackb(p, raw=False)[1] for _, p in replay(zmq.Context.instance(),
                                                                      rep, 0)]
        assert batches[0] == [{"type": "AllBlocksCleared"}]
        seen: set = set()
        for event in (e for batch in batches for e in batch if e["type"] == "BlockStored"):
            parent = event["parent_block_hash"]
            assert parent is None or parent in seen, "a child announced before its parent"
            seen.update(event["block_hashes"])
        assert run(pipeline, prompts[0][:3 * B] + [7])["disk_reuse_len"] == 3 * B

        def onboarded() -> bool:
            late.poll(0.05)
            return {wire_hash(k) for k, _ in pipeline.engine.cache.index.items()} \
                <= late.blocks["GPU"] and late.blocks["DISK"] == on_disk
        assert wait_until(onboarded, 10)
        late.close()


def test_endpoints_are_validated_with_the_variable_name(monkeypatch):
    monkeypatch.setenv("KV_EVENTS_ENDPOINT", "udp://127.0.0.1:5557")
    with pytest.raises(ConfigError,
                       match="KV_EVENTS_ENDPOINT='udp://127.0.0.1:5557'.*tcp://HOST:PORT"):
        Settings.from_env()
    monkeypatch.setenv("KV_EVENTS_ENDPOINT", "tcp://*:5557")
    monkeypatch.setenv("KV_EVENTS_REPLAY_ENDPOINT", "tcp://127.0.0.1:70000")
    with pytest.raises(ConfigError, match="KV_EVENTS_REPLAY_ENDPOINT.*PORT 1 to 65535"):
        Settings.from_env()


def test_wire_hashes_are_positive_int64_packed_in_8_bytes():
    """Whatever the key's first bytes (all zero, all one), the hash is in [2**62, 2**63): a
    positive int64 that msgpack packs as uint64 (0xcf and 8 bytes), which llm-d requires."""
    for key in (bytes(32), b"\xff" * 32, b"\x00\x00\x00\x01" + bytes(28)):
        h = wire_hash(key)
        assert 1 << 62 <= h < 1 << 63
        assert msgpack.packb(h) == b"\xcf" + h.to_bytes(8, "big")
    assert wire_hash(bytes(32)) != wire_hash(b"\x00\x00\x00\x00\x00\x00\x00\x04" + bytes(24))


def test_an_event_that_fails_to_translate_is_logged_and_the_next_ones_still_go_out(
        model, caplog):
    pub, rep = endpoints()
    with Pipeline(model, reuse_cache=True, seq_size_per_block=B, kv_events_endpoint=pub,
                  kv_events_replay_endpoint=rep) as pipeline:
        publisher = pipeline.kv_event_publisher
        to_wire, calls = publisher.to_wire, []

        def first_one_fails(event):
            calls.append(event)
            if len(calls) == 1:
                raise ValueError("a bad event")
            return to_wire(event)

        publisher.to_wire = first_one_fails
        view = ReplicaView(pub, rep)
        run(pipeline, list(range(80, 89)))    # its stored event fails
        assert wait_until(lambda: calls, 10)
        run(pipeline, list(range(90, 99)))
        assert wait_until(lambda: view.poll(0.05) >= 0 and any(
            view.tokens[h] == list(range(90, 90 + B)) for h in view.blocks["GPU"]), 10)
        assert publisher._thread.is_alive()
        assert "could not be translated" in caplog.text
        view.close()


def test_the_layout_is_validated_with_the_variable_name(monkeypatch):
    monkeypatch.setenv("KV_EVENTS_LAYOUT", "ARRAY")
    assert Settings.from_env().kv_events_layout == "array"
    monkeypatch.setenv("KV_EVENTS_LAYOUT", "list")
    with pytest.raises(ConfigError, match="KV_EVENTS_LAYOUT.*map, array"):
        Settings.from_env()


def test_an_endpoint_in_use_is_refused_by_name_and_the_engine_stops(model):
    pub, rep = endpoints()
    def engines() -> int:
        return sum(t.name == "rtpkv-engine" for t in threading.enumerate())

    with Pipeline(model, reuse_cache=True, kv_events_endpoint=pub):
        running = engines()
        with pytest.raises(OSError, match=f"KV events: cannot open {pub}"):
            Pipeline(model, reuse_cache=True, kv_events_endpoint=pub,
                     kv_events_replay_endpoint=rep)
        assert wait_until(lambda: engines() == running, 10), "the refused engine still runs"
    # the replay endpoint of the refused pipeline was released with it
    with Pipeline(model, reuse_cache=True, kv_events_endpoint=pub,
                  kv_events_replay_endpoint=rep) as again:
        assert again.kv_event_publisher.replay_endpoint == rep


def published_blocks(sub: zmq.Socket, tokens: list[int], timeout_s: float = 10.0) -> bool:
    """Whether `sub` receives a BlockStored of `tokens` (as its first block) in time."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if not sub.poll(int(left * 1000)):
            break
        _, _, payload = sub.recv_multipart()
        if any(e.get("type") == "BlockStored" and e["token_ids"][:B] == tokens[:B]
               for e in msgpack.unpackb(payload, raw=False)[1]):
            return True
    return False


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed during the handshake")
        data += chunk
    return data


def zmtp_subscriber(endpoint: str) -> socket.socket:
    """A raw ZMTP 3.0 SUB peer past its handshake, to send frames libzmq would not (a
    libzmq SUB holding a 4 MiB subscription crashes its own process when it closes)."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(b"\xff" + bytes(8) + b"\x7f")
    _recv_exactly(sock, 10)
    sock.sendall(b"\x03\x00" + b"NULL".ljust(20, b"\x00") + bytes(32))
    _recv_exactly(sock, 54)
    ready = b"\x05READY\x0bSocket-Type" + struct.pack(">I", 3) + b"SUB"
    sock.sendall(b"\x04" + bytes([len(ready)]) + ready)
    _, size = _recv_exactly(sock, 2)
    _recv_exactly(sock, size)
    return sock


def closed_by_peer(sock: socket.socket, frame: bytes, timeout_s: float = 10.0) -> bool:
    """Send `frame`; whether the other side then closes the connection."""
    sock.settimeout(timeout_s)
    try:
        sock.sendall(frame)
        while sock.recv(65536):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False
    finally:
        sock.close()


def test_a_subscription_longer_than_the_topic_never_reaches_the_publisher(model, caplog):
    """A frame header declaring a 16 GiB subscription, and a 4 MiB subscription sent whole:
    their peers are disconnected at the header (ZMQ_MAXMSGSIZE), nothing allocated for them;
    a short subscription that is no prefix of the topic is dropped (logged once); a
    subscriber of the topic beside them gets every event."""
    pub, rep = endpoints()
    with Pipeline(model, reuse_cache=True, seq_size_per_block=B, kv_events_endpoint=pub,
                  kv_events_replay_endpoint=rep, kv_events_topic="kv@") as pipeline:
        declared = zmtp_subscriber(pub)
        assert closed_by_peer(declared, b"\x02" + struct.pack(">Q", 16 << 30) + b"\x01kv@"), \
            "a 16 GiB subscription header kept its connection"
        huge = b"\x01kv@" + b"x" * (4 << 20)
        assert closed_by_peer(zmtp_subscriber(pub), b"\x02" + struct.pack(">Q", len(huge)) + huge)
        stray = subscriber(b"kv@" + b"y" * 16)
        stray.connect(pub)
        good = subscriber(b"kv@")
        good.connect(pub)
        assert wait_until(lambda: good.poll(200), 10)    # subscribed: a heartbeat came
        prompt = list(range(120, 129))
        run(pipeline, prompt)
        assert published_blocks(good, prompt)
        assert not stray.poll(100)
        assert wait_until(lambda: "no prefix of the topic" in caplog.text, 5)
        stray.close()
        good.close()


def test_a_replay_flood_delays_the_events_by_a_turn_and_logs_a_line(model, caplog):
    """Malformed one-frame requests sent as fast as the socket takes them: an event the engine
    makes during the flood is published while the flood goes on, a valid request sent after
    the flood is answered, and the malformed requests are logged once, not once each."""
    pub, rep = endpoints()
    ctx = zmq.Context.instance()
    sub = subscriber(b"")
    with Pipeline(model, reuse_cache=True, seq_size_per_block=B, kv_events_endpoint=pub,
                  kv_events_replay_endpoint=rep) as pipeline:
        sub.connect(pub)
        assert wait_until(lambda: sub.poll(200), 10)
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(rep)
        sent, stop = [0], threading.Event()

        def flood() -> None:   # the socket blocks at its high-water mark: paced by the reader
            while not stop.is_set() and sent[0] < 5_000_000:
                dealer.send(b"x")
                sent[0] += 1
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])

        flooder = threading.Thread(target=flood)
        flooder.start()
        try:
            assert wait_until(lambda: sent[0] > 20_000, 30)
            prompt = list(range(140, 149))
            run(pipeline, prompt)
            assert published_blocks(sub, prompt), "no event during the flood"
            assert flooder.is_alive(), "the flood ended before the event was published"
        finally:
            stop.set()
            flooder.join(60)
        assert dealer.poll(60000), "no answer to the valid request after the flood"
        frames = dealer.recv_multipart()
        assert frames[:2] == [b"", b""] and int.from_bytes(frames[2], "big") == 0
        dealer.close()
    sub.close()
    lines = [r for r in caplog.records if "malformed replay request" in r.getMessage()]
    assert 1 <= len(lines) <= 2 and sent[0] > 20_000, (len(lines), sent[0])
