"""The KV cache: the paged pool, the prefix index, retention priorities and eviction, events,
the tiers below the device pool, and the manager that owns them all."""

from rtpkv.cache.block_pool import BlockPool
from rtpkv.cache.events import KVEventBuffer
from rtpkv.cache.manager import KVCacheManager, PinnedPrefix, PrefixMatch
from rtpkv.cache.prefix_index import PrefixIndex, sha256
from rtpkv.cache.retention import KvCacheRetentionConfig, TokenRangeRetentionConfig

__all__ = ["BlockPool", "KVCacheManager", "KVEventBuffer", "KvCacheRetentionConfig",
           "PinnedPrefix", "PrefixIndex", "PrefixMatch", "TokenRangeRetentionConfig", "sha256"]
