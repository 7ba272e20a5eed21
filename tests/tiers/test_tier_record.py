"""The shared block record: round trip, and every way a record is refused."""

from __future__ import annotations

import json
import re
import struct

import pytest
import torch

from rtpkv.cache.tiers import (BlockMeta, CorruptRecord, ForeignRecord, RecordMismatch, TierLayout,
                               decode_record, encode_record)
from rtpkv.cache.tiers.record import decode_header

LAYOUT = TierLayout(fingerprint="ab" * 32, block_size=4, dtype=torch.float32, shape=(2, 3, 2, 4, 8))
META = BlockMeta(key=b"k" * 32, parent_key=b"p" * 32, tokens=(5, 6, 7, 8), extra=b"salt", priority=70)


def payload(layout: TierLayout = LAYOUT, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layout.shape, generator=g).to(layout.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip(dtype):
    layout = TierLayout("cd" * 32, 4, dtype, (2, 3, 2, 4, 8))
    kv = payload(layout)
    meta, out = decode_record(encode_record(META, kv, layout), layout, expect=META)
    assert meta == META
    assert out.dtype == dtype and out.device.type == "cpu"
    assert torch.equal(out, kv)


def test_header_alone_is_enough_to_index():
    data = encode_record(META, payload(), LAYOUT)
    length = struct.unpack("<Q", data[:8])[0]
    header = decode_header(data[:8 + length], LAYOUT)
    assert header.meta == META and header.record_size == len(data)


def test_every_flipped_bit_region_is_corrupt():
    data = encode_record(META, payload(), LAYOUT)
    length = struct.unpack("<Q", data[:8])[0]
    # a byte in the payload, the last payload byte, and bytes inside the header's metadata values
    text = data[8:8 + length].decode()
    positions = [8 + length + 17, len(data) - 1,
                 8 + text.index("7,8") , 8 + text.index('"priority":"70"') + 12]
    for pos in positions:
        broken = bytearray(data)
        broken[pos] ^= 0x01
        with pytest.raises(CorruptRecord):
            decode_record(bytes(broken), LAYOUT)


@pytest.mark.parametrize("cut", [0, 3, 8, 20, -1, -100])
def test_truncation_is_corrupt(cut):
    data = encode_record(META, payload(), LAYOUT)
    with pytest.raises(CorruptRecord):
        decode_record(data[:cut], LAYOUT)


def test_trailing_bytes_are_corrupt():
    with pytest.raises(CorruptRecord):
        decode_record(encode_record(META, payload(), LAYOUT) + b"\0", LAYOUT)


def test_garbage_is_corrupt():
    with pytest.raises(CorruptRecord):
        decode_record(b"\xff" * 64, LAYOUT)
    with pytest.raises(CorruptRecord):
        decode_record(struct.pack("<Q", 5) + b"{oops", LAYOUT)


@pytest.mark.parametrize("other", [
    TierLayout("ef" * 32, 4, torch.float32, (2, 3, 2, 4, 8)),        # another model
    TierLayout("ab" * 32, 4, torch.float16, (2, 3, 2, 4, 8)),        # another dtype
    TierLayout("ab" * 32, 4, torch.float32, (2, 2, 2, 4, 8)),        # another shape
])
def test_other_layout_is_foreign(other):
    data = encode_record(META, payload(), LAYOUT)
    with pytest.raises(ForeignRecord) as info:
        decode_record(data, other)
    assert not isinstance(info.value, RecordMismatch)


def _rewrite_metadata(data: bytes, **changes: str) -> bytes:
    """Re-encode a record's header with fields changed (keeping the payload bytes)."""
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + length])
    header["__metadata__"].update(changes)
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data[8 + length:]


def test_other_format_version_is_foreign():
    data = _rewrite_metadata(encode_record(META, payload(), LAYOUT), version="2")
    with pytest.raises(ForeignRecord, match="version"):
        decode_record(data, LAYOUT)


def test_other_format_is_foreign():
    data = _rewrite_metadata(encode_record(META, payload(), LAYOUT), format="something-else")
    with pytest.raises(ForeignRecord):
        decode_record(data, LAYOUT)


def test_header_edited_without_its_checksum_is_corrupt():
    data = _rewrite_metadata(encode_record(META, payload(), LAYOUT), fingerprint="ef" * 32)
    with pytest.raises(CorruptRecord, match="header checksum"):
        decode_record(data, LAYOUT)


@pytest.mark.parametrize("field,value", [
    ("tokens", (5, 6, 7, 9)),
    ("parent_key", b"q" * 32),
    ("extra", b""),
    ("key", b"x" * 32),
])
def test_another_block_than_expected_is_a_mismatch(field, value):
    data = encode_record(META, payload(), LAYOUT)
    expect = BlockMeta(**{**META.__dict__, field: value})
    with pytest.raises(RecordMismatch):
        decode_record(data, LAYOUT, expect=expect)


def test_priority_is_not_part_of_identity():
    data = encode_record(META, payload(), LAYOUT)
    meta, _ = decode_record(data, LAYOUT, expect=BlockMeta(**{**META.__dict__, "priority": 1}))
    assert meta.priority == 70


def test_encode_refuses_a_payload_of_another_layout():
    with pytest.raises(ValueError, match="layout"):
        encode_record(META, torch.zeros(2, 3, 2, 4, 7), LAYOUT)
    with pytest.raises(ValueError, match="tokens"):
        encode_record(BlockMeta(b"k", b"p", (1, 2)), payload(), LAYOUT)


def test_no_pickle_or_torch_load_in_the_cache_path():
    from pathlib import Path

    import rtpkv.cache
    forbidden = re.compile(r"\bimport pickle|\bpickle\.|torch\.load\(|torch\.save\(|import dill")
    sources = sorted(Path(rtpkv.cache.__file__).parent.rglob("*.py"))
    assert sources
    offenders = [str(p) for p in sources if forbidden.search(p.read_text())]
    assert offenders == []
