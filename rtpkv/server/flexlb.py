"""A worker as rtp-llm's FlexLB sees one: `/cache_status` and `/worker_status` in its shape.

FlexLB's master polls each worker (GET with query parameters, or POST with a JSON body) and
reads, per its `CacheStatus` and `WorkerStatusResponse`:

- `available_kv_cache`, `total_kv_cache` (tokens), `block_size`, `version` (changes whenever
  the set of cached blocks does; a poll that sends `latest_cache_version` equal to it gets no
  keys back), `cached_keys` (with `need_cache_keys`: one int64 per cached block) and
  `cache_key_size`;
- `/worker_status` adds the role (`PDFUSION`: prefill and decode in one), the free concurrency,
  running and waiting queue lengths, `iterate_count`, the DP/TP layout, `alive`, and the cache
  status above under `cache_status`.

FlexLB matches a request to a worker by hashing the request's token ids block by block and
looking the hashes up in each worker's `cached_keys`; its hash is vLLM's `sha256_cbor` with
`PYTHONHASHSEED=0` (each block: SHA-256 of the CBOR array [parent digest, token ids, None],
the chain starting from the digest of CBOR "0"; a key is the digest's low 64 bits, signed).
`cached_keys` here are those hashes of the device pool's blocks, so FlexLB finds rtpkv's
prefixes as it finds vLLM's. A block salted with a `cache_salt` (or below one) is left out:
the hash has no salt, and a request without that salt never reuses it.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Optional, Sequence

if TYPE_CHECKING:
    from rtpkv.pipeline import Pipeline

ROLE = "PDFUSION"   # FlexLB's RoleType for a worker that prefills and decodes


def _cbor_head(major: int, value: int) -> bytes:
    """A CBOR item's head: its major type and its argument, in the shortest form."""
    if value < 24:
        return bytes([major << 5 | value])
    for extra, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if value < 1 << (8 * size):
            return bytes([major << 5 | extra]) + value.to_bytes(size, "big")
    raise ValueError(f"CBOR argument {value} does not fit in 64 bits")


def _cbor_int(value: int) -> bytes:
    return _cbor_head(0, value) if value >= 0 else _cbor_head(1, -1 - value)


ROOT_DIGEST = hashlib.sha256(_cbor_head(3, 1) + b"0").digest()   # vLLM's NONE_HASH, seed "0"


def block_digest(parent: bytes, tokens: Sequence[int]) -> bytes:
    """vLLM's sha256_cbor of one block: the CBOR array [parent digest, tokens, None]."""
    body = (_cbor_head(4, 3) + _cbor_head(2, len(parent)) + parent
            + _cbor_head(4, len(tokens)) + b"".join(_cbor_int(t) for t in tokens) + b"\xf6")
    return hashlib.sha256(body).digest()


def cache_key(digest: bytes) -> int:
    """FlexLB's key of a block: the digest's low 64 bits as a signed long."""
    return int.from_bytes(digest[-8:], "big", signed=True)


def prompt_keys(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The keys FlexLB computes for a prompt: one per full block, chained from the root."""
    keys, digest = [], ROOT_DIGEST
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        digest = block_digest(digest, token_ids[start:start + block_size])
        keys.append(cache_key(digest))
    return keys


def cached_keys(blocks: Sequence[tuple[bytes, bytes, tuple[int, ...], bytes]],
                root: bytes) -> list[int]:
    """The FlexLB keys of the indexed blocks (key, parent key, tokens, extra; parents first)
    whose chain reaches the root unsalted: a block whose parent left the pool cannot be hashed
    (its prefix's tokens are gone) and no request could reuse it from the start anyway."""
    digests: dict[bytes, bytes] = {root: ROOT_DIGEST}
    keys = []
    for key, parent, tokens, extra in blocks:
        if extra or parent not in digests:
            continue
        digests[key] = block_digest(digests[parent], tokens)
        keys.append(cache_key(digests[key]))
    return keys


def _flag(value: Any) -> bool:
    return value is True or str(value).lower() in ("1", "true", "yes")


def cache_status(pipeline: "Pipeline", stats: dict[str, Any], params: dict[str, Any]
                 ) -> dict[str, Any]:
    """FlexLB's CacheStatus of this worker for a poll with `params` (`latest_cache_version`,
    default -1; `need_cache_keys`, default false)."""
    latest = int(params.get("latest_cache_version", -1))
    block = stats["block_size"]
    status: dict[str, Any] = {
        "available_kv_cache": (stats["blocks_free"] + stats["blocks_cached"]) * block,
        "total_kv_cache": stats["blocks_total"] * block, "block_size": block,
        "version": pipeline.engine.cache_version}
    if _flag(params.get("need_cache_keys", False)) and latest < status["version"]:
        # the blocks and the version read at once (the pool may change in between polls)
        status["version"], blocks = pipeline.engine.indexed_blocks()
        keys = cached_keys(blocks, pipeline.engine.root_key)
        status.update(cached_keys=keys, cache_key_size=len(keys))
    return status


def worker_status(pipeline: "Pipeline", stats: dict[str, Any], in_flight: int,
                  params: dict[str, Any]) -> dict[str, Any]:
    """FlexLB's WorkerStatusResponse of this worker."""
    cache = cache_status(pipeline, stats, params)
    # the HTTP routes' requests, or the engine's (a Dynamo worker's requests skip the routes)
    busy = max(in_flight, stats["requests_running"] + stats["requests_waiting"])
    return {"role": ROLE,
            "available_concurrency": max(0, pipeline.config.concurrency_limit - busy),
            "running_query_len": stats["requests_running"],
            "waiting_query_len": stats["requests_waiting"],
            "iterate_count": pipeline.engine.steps, "dpSize": 1, "tpSize": 1, "dpRank": 0,
            "alive": not pipeline.engine.stopped, "cache_status": cache,
            "available_kv_cache": cache["available_kv_cache"],
            "total_kv_cache": cache["total_kv_cache"], "version": cache["version"]}


def poll_params(query: dict[str, Any], body: Optional[dict[str, Any]]) -> dict[str, Any]:
    """A poll's parameters: the JSON body of a POST, else the query string (as rtp-llm's
    frontend reads them)."""
    return body if body is not None else dict(query)
