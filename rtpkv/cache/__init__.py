"""The KV cache: block state (`BlockPool`), the request-level API over it (`KVCacheManager`),
the paged KV tensor (`KVMemory`), the prefix index and its key scheme, retention priorities and
eviction, events, and the tiers below the device pool (`tiers/`, called only by `TierLadder`)."""

from rtpkv.cache.block_pool import BlockPool
from rtpkv.cache.events import KVEventBuffer
from rtpkv.cache.kv_memory import KVMemory
from rtpkv.cache.manager import KVCacheManager, PrefixMatch
from rtpkv.cache.prefix_index import KeyChain, PrefixIndex, sha256
from rtpkv.cache.retention import KvCacheRetentionConfig, TokenRangeRetentionConfig
from rtpkv.cache.sequence import RELEASED, PinnedPrefix

__all__ = ["BlockPool", "KVCacheManager", "KVEventBuffer", "KVMemory", "KeyChain",
           "KvCacheRetentionConfig", "PinnedPrefix", "PrefixIndex", "PrefixMatch", "RELEASED",
           "TokenRangeRetentionConfig", "sha256"]
