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

The sockets face whoever can reach their ports, so what a peer can make the replica do is
bounded: both set ZMQ_MAXMSGSIZE (a larger frame, or a frame header declaring one, disconnects
the peer before anything is allocated for it); the PUB side is an XPUB in manual mode, so a
subscription reaches libzmq's subscription trie only when it is a prefix of the topic (a longer
or different one could never match a message: it is dropped, not stored); each turn of the
thread reads at most REPLAY_REQUESTS_PER_TURN replay requests (and a bounded number of frames)
before it publishes what the engine queued, so a flood of requests delays the events by one
turn, not by its length; malformed requests and refused subscriptions are dropped with one log
line a minute (RateLimitedLog). The events ports are for the routers only: bind them to a
private interface (docs/USAGE.md, "KV events sockets").

The PUB socket is an XPUB: it publishes the same way, and also tells the publisher when a
consumer subscribes (`add_subscribe_listener`, called for each subscription it applies). A consumer without a replay socket (Dynamo's
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
from rtpkv.cache.tenants import tenant_label
from rtpkv.fleet import wire
from rtpkv.log_limit import RateLimitedLog

log = logging.getLogger("rtpkv")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
POLL_S = 0.05   # how long the publisher thread waits for an event before it checks replays
HEARTBEAT_S = 1.0   # while idle, the last batch is sent again this often (see the docstring)
# Room for a peer's handshake (its READY command: socket type and an identity of up to 255
# bytes), which passes through the same size check as its messages.
HANDSHAKE_BYTES = 512
REQUEST_FRAMES = 3              # a replay request: [identity, b"", 8-byte start_seq]
REPLAY_REQUESTS_PER_TURN = 8    # replay requests served before the thread publishes again
FRAMES_PER_TURN = 64 * REQUEST_FRAMES   # frames read from the replay socket per turn
SUBSCRIPTIONS_PER_TURN = 4096   # subscription messages read from the XPUB socket per turn


class KVEventPublisher:
    def __init__(self, events: KVEventBuffer, block_size: int, root_key: bytes, endpoint: str,
                 replay_endpoint: Optional[str] = None, topic: str = "",
                 buffer_steps: int = 10000, hwm: int = 100000, layout: str = "map",
                 mediums: str = "disk"):
        self.layout = layout
        self.mediums = wire.MEDIUM_NAMES[mediums]
        self.block_size = block_size
        self.root_key = root_key
        self.group_roots = events.group_roots   # KV cache groups' roots: first blocks too
        self.topic = topic.encode()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._queue: "queue.SimpleQueue[dict[str, Any]]" = queue.SimpleQueue()
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._subscribe_listeners: list[Callable[[], None]] = []
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.XPUB_MANUAL, 1)   # subscriptions are checked here first
        # a subscription frame is its flag byte and its prefix (or, from ZMTP 3.1 peers, a
        # SUBSCRIBE command: 10 bytes and the prefix); none longer than the topic can match
        self._pub.setsockopt(zmq.MAXMSGSIZE, HANDSHAKE_BYTES + len(self.topic))
        self._replay: Optional[zmq.Socket] = None
        self._request: list[bytes] = []     # the replay request being read, frame by frame
        self._request_frames = 0            # its frames so far (those past 3 are not kept)
        self._bad_subscription = RateLimitedLog(log, logging.WARNING)
        self._bad_request = RateLimitedLog(log, logging.WARNING)
        try:
            self._pub.bind(endpoint)
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.MAXMSGSIZE, HANDSHAKE_BYTES)
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
                   mediums=config.kv_events_mediums)

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
            # the salt (the key's extra, on the first block of a salted chain) never goes out:
            # its digest does, and that block's ids folded with it (rtpkv.fleet.wire)
            salt = bytes.fromhex(event.get("extra", ""))
            blocks = [list(block) for block in event["token_ids"]]
            label = tenant_label(salt) if salt else None
            if label is not None:
                blocks[0] = wire.salted_token_ids(label, blocks[0])
            first = parent == self.root_key or parent in self.group_roots
            group = {f: event[f] for f in wire.GROUP_FIELDS["BlockStored"] if f in event}
            return wire.block_stored(
                [wire.wire_hash(bytes.fromhex(h)) for h in event["block_hashes"]],
                None if first else wire.wire_hash(parent),
                [t for block in blocks for t in block], self.block_size, medium,
                [[label]] + [None] * (len(blocks) - 1) if label else None, group)
        if event["type"] == "removed":
            return wire.block_removed([wire.wire_hash(bytes.fromhex(h))
                                       for h in event["block_hashes"]], medium,
                                      event.get("group_idx"))
        return None

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        while True:
            behind = self._read_subscriptions()
            if self._replay is not None:
                behind = self._serve_replays() or behind
            try:   # a socket with more to read is served again right after this turn's events
                first = self._queue.get(timeout=0 if behind else POLL_S)
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

    def _read_subscriptions(self) -> bool:
        """Take the (un)subscriptions peers sent, at most SUBSCRIPTIONS_PER_TURN: a prefix of
        the topic is applied (manual mode: to the peer that sent it), anything else dropped.
        Returns whether more are waiting."""
        for _ in range(SUBSCRIPTIONS_PER_TURN):
            try:
                msg = self._pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return False
            flag, prefix = msg[:1], msg[1:]
            if flag in (b"\x00", b"\x01") and self.topic.startswith(prefix):
                self._pub.setsockopt(zmq.SUBSCRIBE if flag == b"\x01" else zmq.UNSUBSCRIBE,
                                     prefix)
                if flag == b"\x01":
                    for listener in list(self._subscribe_listeners):
                        listener()
            else:
                self._bad_subscription("KV events: dropped a subscription message of %d "
                                       "bytes that is no prefix of the topic %r", len(msg),
                                       self.topic.decode())
        return True

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

    def _serve_replays(self) -> bool:
        """Read the replay socket frame by frame, at most FRAMES_PER_TURN frames and
        REPLAY_REQUESTS_PER_TURN requests (valid or not) a turn; answer each valid request.
        A request's frames past the third are counted, not kept. Returns whether more are
        waiting."""
        requests = 0
        for _ in range(FRAMES_PER_TURN):
            if requests == REPLAY_REQUESTS_PER_TURN:
                return True
            try:
                frame = self._replay.recv(zmq.NOBLOCK)
            except zmq.Again:
                return False
            self._request_frames += 1
            if self._request_frames <= REQUEST_FRAMES:
                self._request.append(frame)
            if self._replay.getsockopt(zmq.RCVMORE):
                continue
            frames, count = self._request, self._request_frames
            self._request, self._request_frames = [], 0
            requests += 1
            if count == REQUEST_FRAMES and frames[1] == b"" and len(frames[2]) == 8:
                self._answer(frames[0], int.from_bytes(frames[2], "big"))
            else:
                self._bad_request("KV events: dropped a malformed replay request of %d frames "
                              "(expected [b'', 8-byte start_seq])", count - 1)
        return True

    def _answer(self, identity: bytes, first: int) -> None:
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
