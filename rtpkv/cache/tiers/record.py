"""The block record: one KV block as self-describing, checksummed bytes (disk files, Redis values).

A record is a `safetensors` file holding one tensor, ``kv`` (the block's payload), whose string
metadata is the header:

====================  =====================================================================
``format``            ``rtpkv-kv-block`` (anything else is not a record of ours)
``version``           the record format version (`FORMAT_VERSION`)
``fingerprint``       the model fingerprint; with ``dtype``, ``shape`` and ``block_size``
                      it must equal the reading engine's `TierLayout`
``dtype``, ``shape``  the KV as the pool stores it: the model's dtype, or ``int8`` for the
                      int8 KV cache, whose rows are head_dim int8 values and their float32
                      scale (the last dimension is head_dim + 4; rtpkv.kernels.kv_quant)
``tokens``            the block's token ids, comma separated
``key``, ``parent_key``, ``extra``  hex
``priority``          retention priority when stored
``payload_sha256``    SHA-256 of the payload bytes
``header_sha256``     SHA-256 of all the fields above, so a flipped bit in the header is
                      recognised as corruption rather than taken for another model's record
====================  =====================================================================

Reading never unpickles anything: the bytes are parsed as JSON and raw tensor data only.
A record that fails its checksums or is cut short raises `CorruptRecord` (the store should drop
it); one of another format version, model or layout raises `ForeignRecord` (leave it alone);
one that is intact and ours but holds another block than the one expected raises
`RecordMismatch` (a kind of ForeignRecord: a miss, the record stays).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Optional

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from rtpkv.cache.tiers.base import BlockMeta, TierLayout

FORMAT = "rtpkv-kv-block"
FORMAT_VERSION = 1
TENSOR_NAME = "kv"
LENGTH_PREFIX = 8                 # safetensors: little-endian u64 header length, then the header
MAX_HEADER_BYTES = 1 << 24        # a larger announced header is corruption, not a record

# safetensors dtype names of the payload dtypes rtpkv runs with
_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int8: "I8"}
_HEADER_FIELDS = ("format", "version", "fingerprint", "dtype", "shape", "block_size", "tokens",
                  "key", "parent_key", "extra", "priority", "payload_sha256")


class RecordError(Exception):
    """A record that cannot be used; the message names what is wrong."""


class CorruptRecord(RecordError):
    """Checksum mismatch, truncation or undecodable bytes: drop the record."""


class ForeignRecord(RecordError):
    """Another format version, model fingerprint or layout: a miss; leave the record alone."""


class RecordMismatch(ForeignRecord):
    """An intact record of this model holding another block than the one expected: a miss."""


@dataclass(frozen=True)
class RecordHeader:
    """What the header alone says: the block, and the size the whole record must have."""

    meta: BlockMeta
    payload_sha256: str
    record_size: int


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _header_digest(fields: dict[str, str]) -> str:
    canonical = json.dumps([fields.get(name, "") for name in _HEADER_FIELDS], separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _payload_bytes(payload: torch.Tensor) -> bytes:
    return payload.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def encode_record(meta: BlockMeta, payload: torch.Tensor, layout: TierLayout) -> bytes:
    """The record of one block; `payload` must match `layout` (ValueError otherwise)."""
    layout.check_payload(payload)
    if len(meta.tokens) != layout.block_size:
        raise ValueError(f"a block holds {layout.block_size} tokens, got {len(meta.tokens)}")
    payload = payload.detach().to("cpu").contiguous()
    fields = {
        "format": FORMAT,
        "version": str(FORMAT_VERSION),
        "fingerprint": layout.fingerprint,
        "dtype": _dtype_name(layout.dtype),
        "shape": ",".join(map(str, layout.shape)),
        "block_size": str(layout.block_size),
        "tokens": ",".join(map(str, meta.tokens)),
        "key": meta.key.hex(),
        "parent_key": meta.parent_key.hex(),
        "extra": meta.extra.hex(),
        "priority": str(meta.priority),
        "payload_sha256": hashlib.sha256(_payload_bytes(payload)).hexdigest(),
    }
    fields["header_sha256"] = _header_digest(fields)
    return st_save({TENSOR_NAME: payload}, metadata=fields)


def header_length(prefix: bytes) -> int:
    """Bytes of the record's header after the 8-byte length prefix (CorruptRecord if absurd)."""
    if len(prefix) < LENGTH_PREFIX:
        raise CorruptRecord(f"record of {len(prefix)} bytes is shorter than its length prefix")
    (length,) = struct.unpack("<Q", prefix[:LENGTH_PREFIX])
    if not 0 < length <= MAX_HEADER_BYTES:
        raise CorruptRecord(f"record announces a header of {length} bytes")
    return length


def decode_header(data: bytes, layout: TierLayout) -> RecordHeader:
    """Parse and verify the header at the start of `data` (the payload need not be there).

    Raises CorruptRecord for a damaged header and ForeignRecord for a record this engine cannot
    use (another format version, model fingerprint, dtype, shape or block size)."""
    length = header_length(data)
    if len(data) < LENGTH_PREFIX + length:
        raise CorruptRecord(f"record truncated inside its header ({len(data)} bytes)")
    try:
        header = json.loads(data[LENGTH_PREFIX:LENGTH_PREFIX + length])
        fields = header["__metadata__"]
        entry = header[TENSOR_NAME]
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptRecord(f"record header does not decode: {exc!r}") from None
    if not isinstance(fields, dict) or fields.get("format") != FORMAT:
        raise ForeignRecord(f"not a {FORMAT} record")
    if fields.get("version") != str(FORMAT_VERSION):
        raise ForeignRecord(f"record format version {fields.get('version')!r}, "
                            f"this engine reads {FORMAT_VERSION}")
    if fields.get("header_sha256") != _header_digest(fields):
        raise CorruptRecord("record header checksum mismatch")
    expected = {"fingerprint": layout.fingerprint, "dtype": _dtype_name(layout.dtype),
                "shape": ",".join(map(str, layout.shape)), "block_size": str(layout.block_size)}
    for name, value in expected.items():
        if fields[name] != value:
            raise ForeignRecord(f"record {name} {fields[name]!r} differs from this engine's {value!r}")
    try:
        tokens = tuple(int(t) for t in fields["tokens"].split(",")) if fields["tokens"] else ()
        meta = BlockMeta(key=bytes.fromhex(fields["key"]),
                         parent_key=bytes.fromhex(fields["parent_key"]),
                         tokens=tokens, extra=bytes.fromhex(fields["extra"]),
                         priority=int(fields["priority"]))
        begin, end = entry["data_offsets"]
        st_dtype, st_shape = entry["dtype"], tuple(entry["shape"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptRecord(f"record header fields do not decode: {exc!r}") from None
    if (st_dtype != _ST_DTYPES.get(layout.dtype) or st_shape != layout.shape
            or (begin, end) != (0, layout.nbytes) or len(tokens) != layout.block_size):
        raise CorruptRecord("record tensor entry contradicts its header")
    return RecordHeader(meta=meta, payload_sha256=fields["payload_sha256"],
                        record_size=LENGTH_PREFIX + length + layout.nbytes)


def decode_record(data: bytes, layout: TierLayout,
                  expect: Optional[BlockMeta] = None) -> tuple[BlockMeta, torch.Tensor]:
    """The block and its payload (a CPU tensor of `layout.shape` and `layout.dtype`).

    With `expect`, the record must hold that very block (key, parent key, tokens, extra) or
    RecordMismatch is raised. Raises CorruptRecord / ForeignRecord as `decode_header` does, and
    CorruptRecord for a truncated, overlong or altered payload."""
    header = decode_header(data, layout)
    if len(data) != header.record_size:
        raise CorruptRecord(f"record of {len(data)} bytes, its header says {header.record_size}")
    if hashlib.sha256(memoryview(data)[header.record_size - layout.nbytes:]).hexdigest() \
            != header.payload_sha256:
        raise CorruptRecord("record payload checksum mismatch")
    if expect is not None and not header.meta.same_block(expect):
        raise RecordMismatch("record holds another block than the one looked up")
    try:
        payload = st_load(bytes(data))[TENSOR_NAME]
    except Exception as exc:  # safetensors raises its own error types for malformed input
        raise CorruptRecord(f"record payload does not decode: {exc!r}") from None
    return header.meta, payload
