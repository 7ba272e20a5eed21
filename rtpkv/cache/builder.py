"""build_cache: the cache the configuration asks for, and how many blocks its pool gets.

Pool sizing lives here for both devices. CUDA follows TensorRT-LLM's rule: the pool takes
`kv_cache_free_gpu_mem_fraction` (KV_CACHE_FREE_GPU_MEM_FRACTION, 0.9) of the memory free once
the weights are loaded, and KV_CACHE_MAX_TOKENS caps it: the smaller wins (rtp-llm's seed 001);
KV_CACHE_MEM_MB, when given, is one more cap. The CPU takes KV_CACHE_MEM_MB and
KV_CACHE_MAX_TOKENS (the smaller wins when both are set), else a fixed fraction of available
memory. With no cap given, neither pool is larger than CONCURRENCY_LIMIT sequences of
max_seq_len need. Token counts are tokens of every layer: with KV cache groups
(rtpkv/cache/groups.py), that many tokens' blocks in each group.

A recurrent model (rtpkv/cache/state_group.py) splits the same memory between KV blocks and
saved states, one state per LINEAR_STEP blocks: a block is counted as its K/V plus that share of
a state. Its live states (one per CONCURRENCY_LIMIT request) come on top, as activations do.
The host and disk tiers' bounds are split between blocks and saved states the same way
(`_state_share`; the states' tiers: tiers/factory.py's `build_state_tiers`).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Optional, Sequence

from rtpkv.cache.events import KVEventBuffer
from rtpkv.cache.groups import KVGroup, kv_groups, model_root_name, slots
from rtpkv.cache.kv_memory import KVMemory
from rtpkv.cache.manager import KVCacheManager
from rtpkv.cache.prefix_index import PrefixIndex
from rtpkv.cache.state_group import StateGroup
from rtpkv.cache.tenants import TenantQuotas
from rtpkv.cache.tiers.factory import build_state_tiers, build_tiers
from rtpkv.errors import ConfigError
from rtpkv.model_factory.recurrent import StatePool
from rtpkv.torch_threads import serial_torch

if TYPE_CHECKING:
    from rtpkv.config import RuntimeConfig
    from rtpkv.model_factory.factory import Model

log = logging.getLogger("rtpkv")

DEFAULT_CPU_MEMORY_FRACTION = 0.10   # of available host memory, when KV_CACHE_MEM_MB is unset


def build_cache(model: "Model", config: "RuntimeConfig",
                window: Optional[int]) -> KVCacheManager:
    """The cache the configuration asks for: the pool sized by `pool_blocks`, the KV memory,
    the event buffer, the tiers and the tenants' quotas."""
    spec, B = model.spec, config.seq_size_per_block
    specs = model.module.state_specs
    partial = config.enable_partial_reuse
    if specs and partial:
        log.info("partial reuse off: a recurrent model resumes only where a state was saved "
                 "(whole blocks)")
        partial = False
    groups = kv_groups(spec.layer_windows, window)
    state_share = _state_share(model, config, groups, StatePool.slot_bytes(specs))
    tiers = build_tiers(config, model, B, slots(groups), 1.0 - state_share)
    state_tiers = build_state_tiers(config, model, B, specs, state_share) if specs else []
    if specs and tiers and len(groups) > 1:
        log.info("a recurrent model with several KV cache groups takes device hits only: "
                 "its tier hits are not used")
    num_blocks = pool_blocks(model, config, groups, StatePool.slot_bytes(specs))
    events = KVEventBuffer(config.kv_cache_event_buffer_max_size)
    with serial_torch():
        memory = KVMemory(slots(groups), num_blocks, B, spec.num_kv_heads, spec.head_dim,
                          model.kv_dtype, model.device)
    root = model_root_name(model.fingerprint, spec.layer_windows, window)
    state_group = None
    if specs:
        checkpoints = max(1, num_blocks // config.linear_step)
        state_group = StateGroup(specs, checkpoints, config.concurrency_limit,
                                 config.linear_step, B, PrefixIndex(root, B), events,
                                 len(groups), model.device, state_tiers,
                                 config.secondary_offload_min_priority)
        log.info("recurrent states: %d saved (a state every %d blocks, LINEAR_STEP) and %d live, "
                 "%.2f MiB each", checkpoints, config.linear_step, config.concurrency_limit,
                 state_group.states.bytes_per_slot / 2**20)
    cache = KVCacheManager(num_blocks, B, PrefixIndex(root, B), memory=memory,
                           reuse_enabled=config.reuse_cache,
                           partial_reuse=partial,
                           events=events,
                           tiers=tiers,
                           offload_min_priority=config.secondary_offload_min_priority,
                           window=window, ghosts=config.kv_cache_ghost_blocks,
                           quota=TenantQuotas.from_config(config), groups=groups,
                           state_group=state_group)
    if len(groups) > 1:
        log.info("KV cache groups: %s (%d layers a block)", ", ".join(
            f"{g.kind}{'' if g.window is None else f' {g.window}'} layers "
            f"{list(g.layers)}" for g in groups), slots(groups))
    log.info("reuse_cache: %s, partial reuse: %s", config.reuse_cache, partial)
    log.info("KV pool: %d blocks of %d tokens (%.1f MiB%s)", num_blocks, B,
             memory.nbytes / 2**20, ", int8 with a float32 scale per token and head"
             if memory.int8 else "")
    return cache


def _state_share(model: "Model", config: "RuntimeConfig", groups: Sequence[KVGroup],
                 state_bytes: int) -> float:
    """The part of the host and disk tiers' bounds a recurrent model's saved states get: as
    in the device pool, a state per LINEAR_STEP blocks (0 without states)."""
    if not state_bytes:
        return 0.0
    spec, B = model.spec, config.seq_size_per_block
    block = KVMemory.bytes_per_block(slots(groups) if groups else spec.num_layers, B,
                                     spec.num_kv_heads, spec.head_dim, model.kv_dtype)
    state = state_bytes / config.linear_step
    return state / (block + state)


def pool_blocks(model: "Model", config: "RuntimeConfig",
                groups: Sequence[KVGroup] = (), state_bytes: int = 0) -> int:
    """Blocks in the pool, each holding `slots(groups)` layers (every layer without groups)
    and, for a recurrent model, its share of a saved state of `state_bytes` (one per
    LINEAR_STEP blocks).
    CUDA: `gpu_pool_blocks` over the device's free memory. CPU: from kv_cache_mem_mb and
    kv_cache_max_tokens (the smaller wins when both are set), else a fixed fraction of available
    memory, never above what concurrency_limit sequences of max_seq_len could use."""
    spec, B = model.spec, config.seq_size_per_block
    layers = slots(groups) if groups else spec.num_layers
    share = max(1, len(groups))
    per_block = KVMemory.bytes_per_block(layers, B, spec.num_kv_heads, spec.head_dim,
                                         model.kv_dtype)
    per_block += state_bytes // config.linear_step
    if model.device.type == "cuda":
        import torch

        return gpu_pool_blocks(torch.cuda.mem_get_info(model.device)[0], per_block, config,
                               share)
    limits = []
    if config.kv_cache_mem_mb:
        limits.append(int(config.kv_cache_mem_mb * 2**20) // per_block)
    if config.kv_cache_max_tokens:
        limits.append(config.kv_cache_max_tokens // B * share)
    if not limits:
        useful = config.concurrency_limit * -(-config.max_seq_len // B) * share
        limits = [min(_available_bytes() // per_block, useful)]
    return max(1, min(limits))


def gpu_pool_blocks(free_bytes: int, bytes_per_block: int, config: "RuntimeConfig",
                    share: int = 1) -> int:
    """Blocks for a CUDA pool when `free_bytes` of device memory are free; ConfigError when the
    fraction of it holds no block. `share`: the KV cache groups a token's K/V is spread over,
    which the token counts are multiplied by."""
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


def _available_bytes() -> int:
    pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(pages * DEFAULT_CPU_MEMORY_FRACTION)
