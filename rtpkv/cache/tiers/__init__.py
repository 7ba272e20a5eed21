"""Tiers below the device KV pool (host memory, disk, remote), all behind one interface.

`base` defines the interface (`KVTier`) and what a block is (`BlockMeta`, `TierLayout`);
`record` is the byte format that the persistent tiers share.
"""

from rtpkv.cache.tiers.base import DEFAULT_PRIORITY, BlockMeta, KVTier, TierLayout
from rtpkv.cache.tiers.record import (CorruptRecord, ForeignRecord, RecordError, RecordMismatch,
                                      decode_record, encode_record)

__all__ = ["DEFAULT_PRIORITY", "BlockMeta", "CorruptRecord", "ForeignRecord", "KVTier",
           "RecordError", "RecordMismatch", "TierLayout", "decode_record", "encode_record"]
