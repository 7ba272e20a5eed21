"""The KV cache: paged pool, prefix index, eviction policy, and the manager over them."""

from rtpkv.cache.block_pool import Block, BlockPool
from rtpkv.cache.eviction import EvictionPolicy, LRUEvictionPolicy
from rtpkv.cache.manager import KVCacheManager
from rtpkv.cache.prefix_index import PrefixIndex, sha256

__all__ = ["Block", "BlockPool", "EvictionPolicy", "KVCacheManager", "LRUEvictionPolicy",
           "PrefixIndex", "sha256"]
