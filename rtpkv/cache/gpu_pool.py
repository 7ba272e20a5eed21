"""How many KV blocks a pool on a CUDA device gets.

TensorRT-LLM's rule: the pool takes `kv_cache_free_gpu_mem_fraction` (KV_CACHE_FREE_GPU_MEM_FRACTION,
0.9) of the memory free once the weights are loaded, and KV_CACHE_MAX_TOKENS caps it: the smaller
wins (rtp-llm's seed 001). KV_CACHE_MEM_MB, when given, is one more cap. With neither cap given,
the pool is also never larger than CONCURRENCY_LIMIT sequences of max_seq_len need. A function of
its own so that whichever component sizes the pool can call it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rtpkv.errors import ConfigError

if TYPE_CHECKING:
    from rtpkv.config import RuntimeConfig


def gpu_pool_blocks(free_bytes: int, bytes_per_block: int, config: RuntimeConfig,
                    share: int = 1) -> int:
    """Blocks for a CUDA pool when `free_bytes` of device memory are free; ConfigError when the
    fraction of it holds no block. `share`: the KV cache groups a token's K/V is spread over
    (rtpkv/cache/groups.py), which the token counts are multiplied by."""
    B, fraction = config.seq_size_per_block, config.kv_cache_free_gpu_mem_fraction
    by_memory = int(free_bytes * fraction) // bytes_per_block
    if by_memory < 1:
        raise ConfigError(
            f"KV_CACHE_FREE_GPU_MEM_FRACTION={fraction} of the {free_bytes / 2**20:.0f} MiB free "
            f"on the device holds no KV block ({bytes_per_block} bytes each): raise it or free "
            "device memory")
    limits = [by_memory]
    if config.kv_cache_max_tokens:
        limits.append(config.kv_cache_max_tokens // B * share)
    if config.kv_cache_mem_mb:
        limits.append(int(config.kv_cache_mem_mb * 2**20) // bytes_per_block)
    if len(limits) == 1:
        limits.append(config.concurrency_limit * -(-config.max_seq_len // B) * share)
    return max(1, min(limits))
