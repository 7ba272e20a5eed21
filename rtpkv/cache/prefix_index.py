"""PrefixIndex: chained block keys, the map from key to cached block.

Hashing scheme
--------------
A block's key is ``H(parent_key || len(extra) || extra || tokens)`` where ``H`` is SHA-256,
``tokens`` are the block's ``B`` token ids as little-endian int32, and ``extra`` holds extra key
material (the request's ``cache_salt`` on the first block only; empty otherwise). The first
block's parent is the root key ``H("rtpkv-kv-v1" || model fingerprint || B)``, where the model
fingerprint covers the architecture, the weights' identity digest and the dtype. Keys are
therefore equal in every process, restart and replica serving the same model, and differ
between models, block sizes and salts. Python's ``hash`` is never used: it is salted per process.

A key only finds a candidate. A hit also requires the candidate block to hold exactly the same
tokens and extra bytes and to have been computed after the block matched just before it (its
``parent_serial``); so a hash collision, or a stale block whose parent was evicted and
recomputed, costs a miss, never a wrong reuse.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Callable, Optional, Sequence

HashFn = Callable[[bytes], bytes]


def sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


class PrefixIndex:
    def __init__(self, fingerprint: str, block_size: int, hash_fn: HashFn = sha256):
        self.hash_fn = hash_fn
        self.block_size = block_size
        self.root = hash_fn(b"rtpkv-kv-v1" + fingerprint.encode() + struct.pack("<I", block_size))
        self._blocks: dict[bytes, int] = {}

    def key(self, parent_key: bytes, tokens: Sequence[int], extra: bytes = b"") -> bytes:
        payload = struct.pack(f"<I{len(tokens)}i", len(extra), *tokens)
        return self.hash_fn(parent_key + payload[:4] + extra + payload[4:])

    def get(self, key: bytes) -> Optional[int]:
        return self._blocks.get(key)

    def insert(self, key: bytes, block_id: int) -> None:
        self._blocks[key] = block_id

    def remove(self, key: bytes) -> None:
        del self._blocks[key]

    def items(self):
        return self._blocks.items()

    def __len__(self) -> int:
        return len(self._blocks)
