"""KVEventPublisher: the engine's KV cache events on a ZeroMQ PUB socket, as vLLM publishes
them, so the consumers of vLLM's events read an rtpkv replica unchanged (vllm-router's
`kv_aware` is tested against it).

Each message is three frames: the topic, an 8-byte big-endian sequence number (0, 1, 2, ... per
batch), and a msgpack `KVEventBatch` (`rtpkv.fleet.wire`) with its events in `layout`: "map"
(vllm-router, Dynamo) or "array" (llm-d, Dynamo). The last `buffer_steps` batches are
kept; a ROUTER socket (optional) answers a replay request `[identity, b"", start_seq]` with every
kept batch from `start_seq` on, each as `[identity, b"", topic, seq, payload]`, then
`[identity, b"", topic, -1 (8 bytes, signed), b""]` — how a consumer that joined late or saw a
gap in the sequence numbers catches up. The topic frame is there because vllm-router's
subscriber reads a replay reply as `[empty, topic, seq, payload]` (seq second from last) and
drops shorter ones; a consumer that takes the last two frames reads both layouts.

Both sockets bind (the routers connect to the replica): `tcp://*:5557` on every interface,
`tcp://127.0.0.1:5557` on loopback only (vLLM would connect out to an explicit host; rtpkv has
no use for that side). The first batch is `AllBlocksCleared`: a consumer that knew a previous
life of this replica forgets its blocks.

While no event comes, the last batch is sent again every HEARTBEAT_S under its own sequence
number. A consumer that is up to date ignores it (it has that number); one that connected after
the replica went quiet learns from it that it is behind and replays — vllm-router only replays
when a live batch shows a gap, so without this a router started next to an idle replica would
know none of its blocks until the replica's next event.

The engine thread only appends each event to a queue (the listener); a background thread turns
them into batches, encodes, sends and serves replays, so publishing costs the engine one queue
append per event.

The PUB socket is an XPUB: it publishes the same way, and also tells the publisher when a
consumer subscribes (`add_subscribe_listener`). A consumer without a replay socket (Dynamo's
relay, which subscribes only once its worker has started) misses what was published before;
a listener can then announce the replica's current contents again.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any, Callable, Optional

import zmq

from rtpkv.cache.events import KVEventBuffer
from rtpkv.fleet import wire
from rtpkv.log_limit import RateLimitedLog

log = logging.getLogger("rtpkv")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
POLL_S = 0.05   # how long the publisher thread waits for an event before it checks replays
HEARTBEAT_S = 1.0   # while idle, the last batch is sent again this often (see the docstring)


class KVEventPublisher:
    def __init__(self, events: KVEventBuffer, block_size: int, root_key: bytes, endpoint: str,
                 replay_endpoint: Optional[str] = None, topic: str = "",
                 buffer_steps: int = 10000, hwm: int = 100000, layout: str = "map",
                 mediums: str = "disk", salt_prefix: str = ""):
        self.layout = layout
        self.mediums = wire.MEDIUM_NAMES[mediums]
        self.salt_prefix = salt_prefix   # tags a salt for a consumer that wants it tagged
        self.block_size = block_size
        self.root_key = root_key
        self.topic = topic.encode()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._queue: "queue.SimpleQueue[dict[str, Any]]" = queue.SimpleQueue()
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)   # every subscription, not only the first
        self._subscribe_listeners: list[Callable[[], None]] = []
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: Optional[zmq.Socket] = None
        try:
            self._pub.bind(endpoint)
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise OSError(f"KV events: cannot open {endpoint} / {replay_endpoint}: {exc}") from exc
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
        self.replay_endpoint = (self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
                                if self._replay is not None else None)
        self._events = events
        self._failed = RateLimitedLog(log, logging.ERROR)
        self._stopping = threading.Event()
        self._send([wire.all_blocks_cleared()])
        events.add_listener(self._queue.put)
        self._thread = threading.Thread(target=self._run, name="rtpkv-kv-events", daemon=True)
        self._thread.start()
        log.info("KV events: publishing on %s (replay: %s, topic %r, %s layout)", self.endpoint,
                 self.replay_endpoint, topic, layout)

    @classmethod
    def from_config(cls, config: Any, events: KVEventBuffer, block_size: int,
                    root_key: bytes) -> "KVEventPublisher":
        return cls(events, block_size, root_key, config.kv_events_endpoint,
                   config.kv_events_replay_endpoint, config.kv_events_topic,
                   config.kv_events_buffer_steps, layout=config.kv_events_layout,
                   mediums=config.kv_events_mediums, salt_prefix=config.kv_events_salt_prefix)

    def add_subscribe_listener(self, listener: Callable[[], None]) -> None:
        """Call `listener` (on the publisher's thread: it must only hand off) each time a
        consumer subscribes to this publisher's topic."""
        self._subscribe_listeners.append(listener)

    # ------------------------------------------------------------------ translation
    def to_wire(self, event: dict[str, Any]) -> Optional[wire.Event]:
        """The vLLM event for one of the buffer's events (None for `updated`: vLLM has none)."""
        medium = self.mediums.get(event["tier"], event["tier"].upper())
        if event["type"] == "stored":
            parent = bytes.fromhex(event["parent_hash"])
            # the salt as the request gave it (its UTF-8 bytes are the key's extra), as vLLM
            # publishes a cache_salt (bytes that are not UTF-8, from a corrupt disk record's
            # header, raise: _translated drops that event and logs it)
            salt = bytes.fromhex(event.get("extra", "")).decode()
            tokens = [t for block in event["token_ids"] for t in block]
            return wire.block_stored(
                [wire.wire_hash(bytes.fromhex(h)) for h in event["block_hashes"]],
                None if parent == self.root_key else wire.wire_hash(parent), tokens,
                self.block_size, medium,
                [[self.salt_prefix + salt]] + [None] * (len(event["block_hashes"]) - 1)
                if salt else None)
        if event["type"] == "removed":
            return wire.block_removed([wire.wire_hash(bytes.fromhex(h))
                                       for h in event["block_hashes"]], medium)
        return None

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            while self._pub.poll(0):
                self._take_subscription(self._pub.recv())
            try:
                first = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                if self._stopping.is_set():
                    return
                if time.monotonic() - self._last_send >= HEARTBEAT_S:
                    seq, payload = self.buffer[-1]
                    self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
                    self._last_send = time.monotonic()
                continue
            batch = [first]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            events = [e for e in map(self._translated, batch) if e is not None]
            if events:
                self._send(events)

    def _translated(self, event: dict[str, Any]) -> Optional[wire.Event]:
        """to_wire, or None (logged, at most once a minute) for an event it fails on: the
        thread must outlive one bad event, or every later event is lost with it."""
        try:
            return self.to_wire(event)
        except Exception:
            self._failed("KV events: an event could not be translated and was not published",
                         exc_info=True)
            return None

    def _send(self, events: list[wire.Event]) -> None:
        payload = wire.encode_batch(time.time(), events, layout=self.layout)
        seq = self._seq.to_bytes(8, "big")
        self._pub.send_multipart((self.topic, seq, payload))
        self._last_send = time.monotonic()
        self.buffer.append((self._seq, payload))
        self._seq += 1

    def _take_subscription(self, message: bytes) -> None:
        """XPUB's subscription message: 1 then the topic (0 then the topic: unsubscribed)."""
        if message[:1] == b"\x01" and self.topic.startswith(message[1:]):
            for listener in list(self._subscribe_listeners):
                listener()

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: ignoring a malformed replay request of %d frames", len(frames))
            return
        identity, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self.buffer):
            if seq >= first:
                self._replay.send_multipart((identity, b"", self.topic, seq.to_bytes(8, "big"),
                                             payload))
        self._replay.send_multipart((identity, b"", self.topic, END_SEQ, b""))

    # ------------------------------------------------------------------ stop
    def stop(self, timeout: float = 5.0) -> None:
        """Publish what is queued, then close the sockets (idempotent)."""
        if self._stopping.is_set():
            return
        self._events.remove_listener(self._queue.put)
        self._stopping.set()
        self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
