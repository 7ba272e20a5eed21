"""The CUDA pool size (rtpkv.cache.builder): KV_CACHE_FREE_GPU_MEM_FRACTION of the free device
memory, capped by KV_CACHE_MAX_TOKENS and KV_CACHE_MEM_MB, the smallest winning. Pure
arithmetic, so it runs on CPU CI; the GPU tests size a real pool with it."""

import pytest

from rtpkv.cache.builder import gpu_pool_blocks
from rtpkv.config import RuntimeConfig, Settings
from rtpkv.errors import ConfigError

GIB, PER_BLOCK = 2**30, 2**20     # 1 MiB blocks of 64 tokens


def _config(**given):
    return RuntimeConfig(max_seq_len=4096, **given)


def test_fraction_of_free_memory_by_default():
    assert gpu_pool_blocks(10 * GIB, PER_BLOCK, _config(concurrency_limit=1000)) == 9216


def test_the_smaller_of_fraction_and_max_tokens_wins():
    assert gpu_pool_blocks(10 * GIB, PER_BLOCK, _config(kv_cache_max_tokens=6400)) == 100
    assert gpu_pool_blocks(GIB, PER_BLOCK, _config(kv_cache_max_tokens=10**7)) == 921
    assert gpu_pool_blocks(GIB, PER_BLOCK, _config(kv_cache_free_gpu_mem_fraction=0.5,
                                                   kv_cache_max_tokens=10**7)) == 512
    assert gpu_pool_blocks(10 * GIB, PER_BLOCK, _config(kv_cache_mem_mb=300)) == 300
    # KV cache groups: a token's K/V spread over 4 groups' blocks (rtpkv/cache/groups.py)
    assert gpu_pool_blocks(10 * GIB, PER_BLOCK, _config(kv_cache_max_tokens=6400), share=4) == 400


def test_without_caps_never_more_than_the_sequences_need():
    # 32 sequences of 4096 tokens: 32 * 64 blocks
    assert gpu_pool_blocks(100 * GIB, PER_BLOCK, _config()) == 2048


def test_no_block_fits_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"KV_CACHE_FREE_GPU_MEM_FRACTION=0.9 of the 1 MiB free "
                                          r"on the device holds no KV block"):
        gpu_pool_blocks(2**20, PER_BLOCK, _config())


@pytest.mark.parametrize("value", ["0", "1.5", "half"])
def test_fraction_is_validated(monkeypatch, value):
    monkeypatch.setenv("KV_CACHE_FREE_GPU_MEM_FRACTION", value)
    with pytest.raises(ConfigError, match=f"KV_CACHE_FREE_GPU_MEM_FRACTION='{value}' is invalid"):
        Settings.from_env()
