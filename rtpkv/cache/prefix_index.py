"""PrefixIndex: chained block keys, the map from key to cached block.

Hashing scheme
--------------
A block's key is ``H(parent_key || len(extra) || extra || tokens)`` where ``H`` is SHA-256,
``tokens`` are the block's ``B`` token ids as little-endian int32, and ``extra`` holds extra key
material. The first block's parent is the root key ``H("rtpkv-kv-v1" || model fingerprint || B)``,
where the model fingerprint covers the architecture, a full SHA-256 of the weight files and the
dtype. Keys are therefore equal in every process, restart and replica serving the same model,
and differ between models and block sizes. Python's ``hash`` is never used: it is salted per
process.

The extra bytes are the request's ``cache_salt`` on the first block the request owns, empty on
every other block (`KeyChain.extra`, the one place the rule is written). The first block a
request owns is block 0, or, for a request that starts from a pinned task prompt, the block right
after the task's pinned blocks: task prompts are shared by every tenant (they are configured by
the operator, not sent by a tenant), and every key after them chains through the salted one, so
two salts never share a block the request computed, on the device or in any tier.

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
    def __init__(self, fingerprint: str, block_size: int, hash_fn: Optional[HashFn] = None):
        self.hash_fn = hash_fn or sha256   # looked up here: a test may make keys collide
        self.block_size = block_size
        self.root = self.hash_fn(b"rtpkv-kv-v1" + fingerprint.encode() + struct.pack("<I", block_size))
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


class KeyChain:
    """The chained keys of one sequence's full blocks, each hashed once: the sequence's token
    list only grows, so a key computed once stays valid (lookups of a waiting request, its
    admission, its commits and a re-admission after preemption all read the same chain)."""

    def __init__(self, index: PrefixIndex, token_ids: list[int], salt: bytes, salt_block: int,
                 task: bool = False, root: Optional[bytes] = None):
        """`root`: the key block 0 chains from (a KV cache group's, groups.py); the index's
        by default."""
        self.index = index
        self.root = index.root if root is None else root
        self.token_ids = token_ids          # the sequence's own list: it grows as tokens arrive
        self.salt = salt
        self.salt_block = salt_block        # the first block the sequence owns
        self.task = task                    # a task prompt being computed: it owns no block
        self._keys: list[bytes] = []

    def extra(self, i: int) -> bytes:
        """Extra key material of block i: the salt on the first block the sequence owns."""
        return self.salt if i == self.salt_block else b""

    def tenant(self, i: int) -> Optional[bytes]:
        """Whose block i is: the salt its key chains through (b"": requests without a salt),
        or None for a task prompt's blocks, which are nobody's (every tenant shares them):
        what a per-tenant quota counts."""
        return self.salt if i >= self.salt_block and not self.task else None

    def tokens(self, i: int) -> tuple[int, ...]:
        B = self.index.block_size
        return tuple(self.token_ids[i * B:(i + 1) * B])

    def key(self, i: int) -> bytes:
        """The key of full block i (blocks 0..i are hashed on first use)."""
        keys = self._keys
        while len(keys) <= i:
            j = len(keys)
            keys.append(self.index.key(keys[-1] if keys else self.root, self.tokens(j),
                                       self.extra(j)))
        return keys[i]

    def parent(self, i: int) -> bytes:
        """The key block i chains from: the previous block's, or the root for block 0."""
        return self.key(i - 1) if i else self.root
