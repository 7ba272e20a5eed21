"""build_tiers: the tiers below the device pool that the configuration asks for, in lookup order
(host memory, disk, Redis, then a user connector), each logged with its size at start-up.

Host memory: ``host_cache_size`` bytes (TensorRT-LLM's name, set in ModelConfig; wins) or
``MEMORY_CACHE_SIZE_MB`` when ``ENABLE_MEMORY_CACHE=1`` (rtp-llm's names); 0 or disabled means
no tier. Disk: ``ENABLE_MEMORY_CACHE_DISK=1`` with ``MEMORY_CACHE_DISK_PATHS`` (one directory)
and ``MEMORY_CACHE_DISK_SIZE_MB``; ``WRITE_CACHE_SYNC=1`` writes synchronously. Blocks the host
tier evicts go to the disk tier when both are on. Connector: ``KV_CONNECTOR_MODULE`` +
``KV_CONNECTOR_CLASS``, or ``kv_connector`` (a class or an instance) in ModelConfig.
Redis: ``ENABLE_REMOTE_CACHE=1`` with ``REMOTE_CACHE_URL`` (rtpkv.cache.tiers.remote).

A recurrent model's saved states (rtpkv/cache/state_group.py) ride tiers of their own, built
from the same settings (`build_state_tiers`): a record is one state (`state_tier_layout`), the
host and disk bounds are split between KV blocks and states as the device pool splits its
memory (`share`), the disk keeps them in a ``states`` subdirectory, Redis under its own key
prefix, and the connector is built a second time with the state layout.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any, Optional, Sequence

import torch

from rtpkv.cache.connector import ConnectorContext
from rtpkv.cache.tiers.connector import load_connector_class, make_connector_tier
from rtpkv.cache.tiers.base import KVTier, TierLayout
from rtpkv.cache.tiers.disk import DiskTier
from rtpkv.cache.tiers.host import HostTier
from rtpkv.errors import ConfigError
from rtpkv.kernels.kv_quant import row_width
from rtpkv.model_factory.recurrent import StatePool, StateSpec

log = logging.getLogger("rtpkv")

MIB = 2 ** 20
CONNECTOR_STAGING_BLOCKS = 64
STATE_NAMESPACE = "states"      # the state tiers' disk subdirectory and Redis key prefix part


def tier_layout(model: Any, block_size: int, layers: Optional[int] = None) -> TierLayout:
    """The payload every tier of this engine stores: one pool block's K and V, as the pool
    holds them (int8 rows with their scales for the int8 cache): every layer's, or with KV
    cache groups the `layers` a block holds (one group's)."""
    spec = model.spec
    return TierLayout(fingerprint=model.fingerprint, block_size=block_size, dtype=model.kv_dtype,
                      shape=(2, layers or spec.num_kv_layers, spec.num_kv_heads, block_size,
                             row_width(spec.head_dim, model.kv_dtype)))


def state_tier_layout(model: Any, block_size: int,
                      specs: Sequence[Sequence[StateSpec]]) -> TierLayout:
    """The payload of a state record: one saved state of every recurrent layer, as raw bytes
    (int8). Its fingerprint names the model, the state group and every state tensor's name,
    shape and dtype, so a record of another layout is foreign (a miss), never misread."""
    described = ";".join(f"{spec.name}:{tuple(spec.shape)}:{spec.dtype}"
                         for layer in specs for spec in layer)
    digest = hashlib.sha256(described.encode()).hexdigest()[:16]
    return TierLayout(fingerprint=f"{model.fingerprint}-{STATE_NAMESPACE}-{digest}",
                      block_size=block_size, dtype=torch.int8,
                      shape=(StatePool.slot_bytes(specs),))


def host_cache_bytes(config: Any) -> int:
    if config.host_cache_size is not None:
        return config.host_cache_size
    return int(config.memory_cache_size_mb * MIB) if config.enable_memory_cache else 0


def build_tiers(config: Any, model: Any, block_size: int,
                layers: Optional[int] = None, share: float = 1.0) -> list[KVTier]:
    """The configured tiers, for pool blocks of `layers` layers (default: every layer), with
    `share` of the host and disk bounds; ConfigError naming the setting when one is unusable."""
    return _build(config, model, tier_layout(model, block_size, layers), share, "")


def build_state_tiers(config: Any, model: Any, block_size: int,
                      specs: Sequence[Sequence[StateSpec]], share: float) -> list[KVTier]:
    """The tiers of a recurrent model's saved states (`state_tier_layout` records), with
    `share` of the host and disk bounds; a host share too small for one state gives no host
    tier for states (logged)."""
    return _build(config, model, state_tier_layout(model, block_size, specs), share,
                  STATE_NAMESPACE)


def _build(config: Any, model: Any, layout: TierLayout, share: float,
           namespace: str) -> list[KVTier]:
    what = "state" if namespace else "KV"
    disk = _disk_tier(config, layout, share, namespace)
    tiers: list[KVTier] = []
    host_bytes = int(host_cache_bytes(config) * share)
    if namespace and host_bytes < layout.nbytes:
        if host_bytes:
            log.info("host memory state tier: none (its share, %d bytes, holds no state of %d)",
                     host_bytes, layout.nbytes)
        host_bytes = 0
    if config.enable_memory_cache and host_bytes == 0 and not namespace:
        log.warning("ENABLE_MEMORY_CACHE=1 but MEMORY_CACHE_SIZE_MB is 0: no host memory tier")
    if host_bytes:
        if host_bytes < layout.nbytes:
            given = (f"host_cache_size={config.host_cache_size!r}" if config.host_cache_size is not None
                     else f"MEMORY_CACHE_SIZE_MB={config.memory_cache_size_mb!r}")
            raise ConfigError(f"{given} is invalid: it holds no KV block (one block takes "
                              f"{layout.nbytes} bytes = {layout.nbytes / MIB:.3f} MiB)")
        host = HostTier(layout, host_bytes, model.device)
        tiers.append(host)
        log.info("host memory %s tier: %d blocks of %d tokens (%.1f MiB)%s", what,
                 host.num_blocks, layout.block_size, host.num_blocks * layout.nbytes / MIB,
                 ", pinned, side-stream copies" if host.cuda else "")
    if disk is not None:
        tiers.append(disk)
    if config.enable_remote_cache:
        if not config.remote_cache_url:
            raise ConfigError("ENABLE_REMOTE_CACHE=1 needs REMOTE_CACHE_URL "
                              "(redis://host:port/db, or rediss:// for TLS)")
        from rtpkv.cache.tiers.remote import RedisTier  # needs the optional redis client

        prefix = {"key_prefix": f"rtpkv:{namespace}:".encode()} if namespace else {}
        tiers.append(RedisTier(layout, config.remote_cache_url, **prefix,
                               password=config.remote_cache_password,
                               ttl_s=config.remote_cache_ttl_s,
                               timeout_ms=config.remote_cache_timeout_ms))
    connector = _connector_tier(config, layout, namespace)
    if connector is not None:
        tiers.append(connector)
    if tiers and not namespace:
        log.info("offload to tiers: blocks of retention priority >= %d",
                 config.secondary_offload_min_priority)
    return tiers


def _disk_tier(config: Any, layout: TierLayout, share: float, namespace: str):
    if not config.enable_memory_cache_disk:
        return None
    paths = [p.strip() for p in (config.memory_cache_disk_paths or "").split(",") if p.strip()]
    if len(paths) != 1:
        raise ConfigError(f"MEMORY_CACHE_DISK_PATHS={config.memory_cache_disk_paths!r} is invalid: "
                          "ENABLE_MEMORY_CACHE_DISK=1 needs exactly one directory")
    capacity = int(config.memory_cache_disk_size_mb * MIB * share)
    directory = os.path.join(paths[0], namespace) if namespace else paths[0]
    try:
        disk = DiskTier(layout, directory, capacity, write_sync=config.write_cache_sync)
    except ValueError as exc:
        if namespace:
            log.info("disk state tier: none (its share of MEMORY_CACHE_DISK_SIZE_MB: %s)", exc)
            return None
        raise ConfigError(f"MEMORY_CACHE_DISK_SIZE_MB={config.memory_cache_disk_size_mb!r} is "
                          f"invalid: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"MEMORY_CACHE_DISK_PATHS={paths[0]!r} is invalid: {exc}") from None
    stats = disk.stats()
    log.info("disk %s tier: %s, %d files (%.1f MiB) found, bound %.1f MiB (about %d blocks), "
             "%s writes; %d foreign and %d corrupt files found",
             "state" if namespace else "KV", directory, stats["disk_files"],
             stats["disk_bytes"] / MIB, capacity / MIB, capacity // disk.record_bytes,
             "synchronous" if config.write_cache_sync else "background",
             stats["disk_foreign_files"], stats["disk_corrupt_files"])
    return disk


def _connector_tier(config: Any, layout: TierLayout, namespace: str):
    module, class_name = config.kv_connector_module, config.kv_connector_class
    spec = config.kv_connector
    if (module is None) != (class_name is None):
        missing = "KV_CONNECTOR_CLASS" if class_name is None else "KV_CONNECTOR_MODULE"
        raise ConfigError(f"{missing} is missing: KV_CONNECTOR_MODULE and KV_CONNECTOR_CLASS "
                          "go together")
    if spec is None and module is not None:
        try:
            spec = load_connector_class(module, class_name)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if spec is None:
        return None
    if namespace and not isinstance(spec, type):
        log.info("KV connector state tier: none (kv_connector is an instance, which holds the "
                 "KV blocks' staging; give a class to keep states there too)")
        return None
    layers = layout.shape[1] if len(layout.shape) > 1 else 1    # a state record: one "layer"
    context = ConnectorContext(layout=layout, num_layers=layers,
                               num_staging_blocks=CONNECTOR_STAGING_BLOCKS)
    try:
        tier = make_connector_tier(spec, context)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    log.info("%s connector tier: %s", "state" if namespace else "KV",
             type(tier.connector).__qualname__)
    return tier
