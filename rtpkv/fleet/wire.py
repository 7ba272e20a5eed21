"""vLLM's KV event wire format, encoded with msgpack (no vLLM or msgspec needed).

vLLM declares the batch as a msgspec struct with `array_like=True` (an array of its fields in
order) and each event as a tagged struct; the events come in two layouts (KV_EVENTS_LAYOUT,
validated by rtpkv.config), because the consumers disagree:

    [ts, [event, ...], data_parallel_rank]
    "map":   {"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids",
              "block_size", "lora_id", "medium", "lora_name", "extra_keys"}
             {"type": "BlockRemoved", "block_hashes", "medium"}
             {"type": "AllBlocksCleared"}
    "array": ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
              medium, lora_name, extra_keys]
             ["BlockRemoved", block_hashes, medium]
             ["AllBlocksCleared"]

vllm-router's `kv_aware` subscriber decodes only maps ("KV event must be a tagged map"); llm-d's
precise prefix scorer decodes only arrays (the tag first, the fields in vLLM's order: its
`vllm_adapter.go`); NVIDIA Dynamo's relay reads either.

A block hash on the wire is a positive 63-bit int derived from rtpkv's chained SHA-256 key
(`wire_hash`): consumers use it to chain a block to its parent and to find it again on
removal, and index the block by its `token_ids` (vllm-router hashes each block's tokens with
SHA-256, llm-d with FNV-64a over CBOR, Dynamo with XXH3, each chaining them from the root), so a
router that tokenizes the request with the same tokenizer and block size finds what a replica
holds, and no hash seed is shared. The key carries the model, the block size and the request's
`cache_salt`, so tenants' blocks never share a hash.

A salted block is the tenant's own, and no router may credit it to a request of another tenant
with the same text, nor learn the salt: the first block of a salted chain (the one whose key
takes the salt) carries in `extra_keys` the salt's digest (`tenant_label`, as /cache_status
names tenants), never the salt, and its `token_ids` folded with that digest
(`salted_token_ids`): each id t becomes 2**30 + (BLAKE2b-32 of t keyed by the digest) mod 2**30,
an id no tokenizer gives, so a router that hashes a request's plain token ids never matches it,
nor any block chained below it. A consumer that knows a request's salt folds the first block
of its tokens the same way to find the tenant's blocks.
"""

from __future__ import annotations

import hashlib
from typing import Any, Optional, Sequence

import msgpack

# Where a block lives, in vLLM's `medium` names: the device pool is the engine's "GPU" (the
# tier a router credits fully, whatever the device), host memory "CPU", the disk tier "DISK".
MEDIUMS = {"device": "GPU", "memory": "CPU", "disk": "DISK"}
# The namings consumers read (KV_EVENTS_MEDIUMS): "disk" as above (vllm-router, llm-d);
# "storage", vLLM's current name for its storage tier; "tiers", the names every Dynamo release
# maps to its host-pinned and disk tiers (older ones take "CPU" and "DISK" for the device's,
# crediting a host or disk block as if it were on the device).
MEDIUM_NAMES = {"disk": MEDIUMS, "storage": {**MEDIUMS, "disk": "STORAGE"},
                "tiers": {"device": "GPU", "memory": "CPU_TIER1", "disk": "CPU_TIER2"}}


# Each event's fields after its tag, in vLLM's order: the "array" layout's positions.
FIELDS = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                          "lora_id", "medium", "lora_name", "extra_keys"),
          "BlockRemoved": ("block_hashes", "medium"),
          "AllBlocksCleared": ()}
# vLLM's KV cache group fields, after those: only on the events of a model with several groups
# (rtpkv/cache/groups.py); a one-group model's events stay as they were
GROUP_FIELDS = {"BlockStored": ("group_idx", "kv_cache_spec_kind",
                                "kv_cache_spec_sliding_window"),
                "BlockRemoved": ("group_idx",), "AllBlocksCleared": ()}


def wire_hash(key: bytes) -> int:
    """The block hash published for a chained key: its first 8 bytes, big-endian, with the top
    bit cleared and the next one set, so that signed (i64) and unsigned (u64) consumers read the
    same number and msgpack always packs it in 8 bytes (llm-d refuses hashes packed shorter)."""
    return int.from_bytes(key[:8], "big") >> 2 | 1 << 62


SALTED_ID_BASE = 2**30   # folded ids lie in [2**30, 2**31): above any vocabulary, int32-safe


def salted_token_ids(label: str, token_ids: Sequence[int]) -> list[int]:
    """The ids published for the first block of a chain salted with the salt whose digest is
    `label`: unmatchable by a request's plain ids, distinct per tenant."""
    key = label.encode()
    return [SALTED_ID_BASE + int.from_bytes(hashlib.blake2b(
        t.to_bytes(8, "big"), key=key, digest_size=4).digest(), "big") % SALTED_ID_BASE
        for t in token_ids]


Event = dict[str, Any]


def block_stored(hashes: Sequence[int], parent: Optional[int], token_ids: Sequence[int],
                 block_size: int, medium: str, extra_keys: Optional[list[Any]] = None,
                 group: Optional[dict[str, Any]] = None) -> Event:
    """`group`: the KV cache group's fields (GROUP_FIELDS), for a model with several."""
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent,
            "token_ids": list(token_ids), "block_size": block_size, "lora_id": None,
            "medium": medium, "lora_name": None, "extra_keys": extra_keys, **(group or {})}


def block_removed(hashes: Sequence[int], medium: str, group_idx: Optional[int] = None) -> Event:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium,
            **({} if group_idx is None else {"group_idx": group_idx})}


def all_blocks_cleared() -> Event:
    return {"type": "AllBlocksCleared"}


def encode_batch(ts: float, events: Sequence[Event], data_parallel_rank: int = 0,
                 layout: str = "map") -> bytes:
    """The msgpack batch of `events` (maps as built above) in `layout`."""
    if layout == "array":
        events = [[e["type"], *(e[f] for f in FIELDS[e["type"]]),
                   *(e[f] for f in GROUP_FIELDS[e["type"]] if f in e)] for e in events]
    return msgpack.packb([ts, list(events), data_parallel_rank], use_bin_type=True)


def decode_batch(payload: bytes) -> tuple[float, list[Event], Optional[int]]:
    """(ts, events as maps, data_parallel_rank) of an encoded batch, in either layout."""
    batch = msgpack.unpackb(payload, raw=False)
    events = [e if isinstance(e, dict) else
              {"type": e[0], **dict(zip(FIELDS[e[0]] + GROUP_FIELDS[e[0]], e[1:]))}
              for e in batch[1]]
    return batch[0], events, batch[2] if len(batch) > 2 else None
