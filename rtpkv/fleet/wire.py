"""vLLM's KV event wire format, encoded with msgpack (no vLLM or msgspec needed).

vLLM declares the batch as a msgspec struct with `array_like=True` (an array of its fields in
order) and each event as a struct with `tag=True` (a map whose "type" entry is the class name):

    [ts, [event, ...], data_parallel_rank]
    {"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size",
     "lora_id", "medium", "lora_name", "extra_keys"}
    {"type": "BlockRemoved", "block_hashes", "medium"}
    {"type": "AllBlocksCleared"}

which is what vllm-router's `kv_aware` subscriber decodes (it refuses array events: "KV event
must be a tagged map"). A block hash on the wire is an unsigned 63-bit int derived from rtpkv's
chained SHA-256 key (`wire_hash`): consumers use it to chain a block to its parent and to find
it again on removal, and index the block by its `token_ids` (vllm-router hashes each block's
tokens with SHA-256 and walks them as a chain from the root), so a router that tokenizes the
request with the same tokenizer and block size finds what a replica holds. The key carries the
model, the block size and the request's `cache_salt`, so tenants' blocks never share a hash; a
salted first block also carries the salt in `extra_keys`, as vLLM does.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import msgpack

# Where a block lives, in vLLM's `medium` names: the device pool is the engine's "GPU" (the
# tier a router credits fully, whatever the device), host memory "CPU", the disk tier "DISK".
MEDIUMS = {"device": "GPU", "memory": "CPU", "disk": "DISK"}


def wire_hash(key: bytes) -> int:
    """The block hash published for a chained key: its first 8 bytes, big-endian, shifted to 63
    bits so that signed (i64) and unsigned (u64) consumers read the same number."""
    return int.from_bytes(key[:8], "big") >> 1


Event = dict[str, Any]


def block_stored(hashes: Sequence[int], parent: Optional[int], token_ids: Sequence[int],
                 block_size: int, medium: str, extra_keys: Optional[list[Any]] = None) -> Event:
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent,
            "token_ids": list(token_ids), "block_size": block_size, "lora_id": None,
            "medium": medium, "lora_name": None, "extra_keys": extra_keys}


def block_removed(hashes: Sequence[int], medium: str) -> Event:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium}


def all_blocks_cleared() -> Event:
    return {"type": "AllBlocksCleared"}


def encode_batch(ts: float, events: Sequence[Event], data_parallel_rank: int = 0) -> bytes:
    return msgpack.packb([ts, list(events), data_parallel_rank], use_bin_type=True)


def decode_batch(payload: bytes) -> tuple[float, list[Event], Optional[int]]:
    """(ts, events, data_parallel_rank) of an encoded batch."""
    batch = msgpack.unpackb(payload, raw=False)
    return batch[0], batch[1], batch[2] if len(batch) > 2 else None
