"""ReplicaView: what one replica caches, rebuilt from its KV events the way a router does.

It subscribes to the replica's PUB socket and, to start from the beginning or to fill a gap in
the sequence numbers, asks the replay socket for the batches it missed; every batch is applied
once, in sequence order. `blocks[medium]` is then the set of block hashes the replica holds in
that medium ("GPU": its device pool, "CPU": host memory, "DISK": its disk tier).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Optional

import zmq

from rtpkv.fleet import wire
from rtpkv.fleet.publisher import END_SEQ


class ReplicaView:
    def __init__(self, endpoint: str, replay_endpoint: Optional[str] = None, topic: str = ""):
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self.next_seq = 0
        self.blocks: defaultdict[str, set[int]] = defaultdict(set)
        self.tokens: dict[int, list[int]] = {}   # hash -> the block's token ids

    def apply(self, payload: bytes) -> None:
        _, events, _ = wire.decode_batch(payload)
        for event in events:
            kind = event["type"]
            if kind == "BlockStored":
                size = event["block_size"]
                for i, h in enumerate(event["block_hashes"]):
                    self.blocks[event["medium"]].add(h)
                    self.tokens[h] = event["token_ids"][i * size:(i + 1) * size]
            elif kind == "BlockRemoved":
                self.blocks[event["medium"]].difference_update(event["block_hashes"])
            elif kind == "AllBlocksCleared":
                self.blocks.clear()

    def replay(self, timeout: float = 10.0) -> None:
        """Fetch and apply every kept batch from `next_seq` on."""
        if self._replay_endpoint is None:
            raise ValueError("this view has no replay endpoint")
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self._replay_endpoint)
        try:
            dealer.send_multipart((b"", self.next_seq.to_bytes(8, "big")))
            deadline = time.monotonic() + timeout
            while True:
                if not dealer.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                    raise TimeoutError(f"no replay answer from {self._replay_endpoint}")
                *_, seq, payload = dealer.recv_multipart()   # [b"", topic, seq, payload]
                if seq == END_SEQ:
                    return
                self._take(int.from_bytes(seq, "big"), payload)
        finally:
            dealer.close(linger=0)

    def poll(self, timeout: float = 0.0) -> int:
        """Apply the batches that arrived (waiting up to `timeout` for the first); a gap in the
        sequence is filled from the replay socket. Returns the batches applied."""
        applied = 0
        wait_ms = int(timeout * 1000)
        while self._sub.poll(wait_ms):
            wait_ms = 0
            _, seq_bytes, payload = self._sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self.next_seq and self._replay_endpoint is not None:
                self.replay()
            applied += self._take(seq, payload)
        return applied

    def _take(self, seq: int, payload: bytes) -> int:
        if seq < self.next_seq:
            return 0            # seen already (a replay and the live stream overlap)
        self.apply(payload)
        self.next_seq = seq + 1
        return 1

    def close(self) -> None:
        self._sub.close(linger=0)
