"""Tiers below the device KV pool (host memory, disk, remote, a user connector), all behind one
interface, with one caller.

`base` defines the interface (`KVTier`) and what a block is (`BlockMeta`, `TierLayout`);
`ladder` is `TierLadder`, the only code that calls a tier; `record` is the byte format that the
persistent tiers share; `factory` builds the configured tiers.
"""

from rtpkv.cache.tiers.base import TIER_NAMES, BlockMeta, KVTier, TierLayout
from rtpkv.cache.tiers.record import (CorruptRecord, ForeignRecord, RecordError, RecordMismatch,
                                      decode_record, encode_record)

__all__ = ["TIER_NAMES", "BlockMeta", "CorruptRecord", "ForeignRecord", "KVTier",
           "RecordError", "RecordMismatch", "TierLayout", "decode_record", "encode_record"]
