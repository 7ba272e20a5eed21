"""ConnectorTier: a user's KV connector (rtpkv/cache/connector.py, TensorRT-LLM's scheduler and
worker split) as one more tier below the device pool, so the tier ladder drives it like the
built-in tiers; and the loading of a connector class named by the configuration."""

from __future__ import annotations

import importlib
import itertools
import logging
from collections import deque
from typing import Any, Optional, Sequence

import torch

from rtpkv.cache.connector import (BlockTransfer, ConnectorContext, ConnectorRequest,
                                   ConnectorStep, KvCacheConnector)
from rtpkv.cache.tiers.base import BlockMeta, KVTier

log = logging.getLogger("rtpkv")


class ConnectorTier(KVTier):
    """A user connector seen as one more tier of the cache manager (see the module doc)."""

    name = "connector"
    write_through = True        # like the seed, every block is offered to the store as it fills

    def __init__(self, connector: KvCacheConnector, context: ConnectorContext):
        self.connector = connector
        self.context = context
        layout = context.layout
        self.staging = torch.zeros((context.num_staging_blocks, *layout.shape), dtype=layout.dtype)
        self._free: deque[int] = deque(range(context.num_staging_blocks))
        self._saving: dict[int, list[int]] = {}     # request id -> staging blocks still saving
        self._loaded: dict[bytes, int] = {}         # key -> staging block holding it
        # chains matched by the lookups of the walk under way (one per KV cache group), kept
        # until their load or the next walk
        self._matched: list[ConnectorRequest] = []
        self._ids = itertools.count(1)
        self._steps = itertools.count(1)
        self.counters = dict(lookup_blocks=0, lookup_hits=0, onboarded_blocks=0, saved_blocks=0,
                             errors=0, saves_dropped=0)
        connector.register_kv_caches(self.staging)

    # ------------------------------------------------------------------ KVTier
    def begin_walk(self) -> None:
        self._release_loaded()

    def lookup(self, keys: Sequence[bytes]) -> int:
        if self._loaded:   # a walk's lookups all come before its loads: a new walk
            self._release_loaded()
        request = ConnectorRequest(next(self._ids), list(keys))
        self.counters["lookup_blocks"] += len(keys)
        try:
            tokens, load_async = self.connector.get_num_new_matched_tokens(request, 0)
        except Exception:
            return self._failed("get_num_new_matched_tokens")
        if load_async:
            log.info("kv connector: asynchronous loads are done synchronously in rtpkv")
        B = self.context.layout.block_size
        if not isinstance(tokens, int) or tokens < 0 or tokens % B:
            log.warning("kv connector: get_num_new_matched_tokens returned %r tokens; a whole "
                        "number of %d-token blocks is needed, taken as a miss", tokens, B)
            return 0
        promised = sum(r.num_blocks for r in self._matched)
        found = max(0, min(tokens // B, len(keys), len(self._free) - promised))   # staging bounds a load
        request.block_keys = request.block_keys[:found]
        if found:
            self._matched.append(request)
        self.counters["lookup_hits"] += found
        return found

    def load(self, meta: BlockMeta) -> Optional[torch.Tensor]:
        if meta.key not in self._loaded and not self._load_matched(meta.key):
            return None
        block_id = self._loaded.pop(meta.key)
        payload = self.staging[block_id].clone()
        self._free.append(block_id)
        self.counters["onboarded_blocks"] += 1
        return payload

    def store(self, meta: BlockMeta, payload: torch.Tensor) -> None:
        self.context.layout.check_payload(payload)
        if not self._free:
            self._reap_saves()
        if not self._free:
            self.counters["saves_dropped"] += 1
            return
        block_id = self._free.popleft()
        self.staging[block_id].copy_(payload)
        request = ConnectorRequest(next(self._ids), [meta.key], [meta.tokens])
        step = ConnectorStep(next(self._steps),
                             save=[BlockTransfer(request.request_id, meta.key, block_id, meta.tokens)])
        try:
            self.connector.bind_connector_meta(self.connector.build_connector_meta(step))
            for layer in range(self.context.num_layers):
                self.connector.save_kv_layer(layer)
            self.connector.wait_for_save()
            still_saving = self.connector.request_finished(request, [block_id])
        except Exception:
            self._free.append(block_id)
            self._failed("save")
            return
        if still_saving:
            self._saving[request.request_id] = [block_id]
        else:
            self._free.append(block_id)
        self.counters["saved_blocks"] += 1

    def drop(self, key: bytes) -> None:
        """A connector's store is its own: rtpkv never deletes from it."""

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {
            "connector_lookup_blocks": c["lookup_blocks"],
            "connector_hits": c["lookup_hits"],
            "connector_onboarded_blocks": c["onboarded_blocks"],
            "connector_saved_blocks": c["saved_blocks"],
            "connector_saves_in_flight": sum(len(b) for b in self._saving.values()),
            "connector_saves_dropped": c["saves_dropped"],
            "connector_errors": c["errors"],
        }

    def check_integrity(self) -> None:
        """Every staging block is free, holds a loaded block, or is being saved — exactly once."""
        held = list(self._free) + list(self._loaded.values()) + \
            [b for blocks in self._saving.values() for b in blocks]
        assert sorted(held) == list(range(self.context.num_staging_blocks)), \
            "connector staging blocks leaked or double-booked"

    def close(self) -> None:
        self._release_loaded()
        close = getattr(self.connector, "close", None)
        if callable(close):
            try:
                close()
            except Exception:
                self._failed("close")

    # ------------------------------------------------------------------ internals
    def _load_matched(self, key: bytes) -> bool:
        """Run the load step for the chain a lookup of this admission matched with `key` in
        it, if any."""
        request = next((r for r in self._matched if key in r.block_keys), None)
        if request is None:
            return False
        self._matched.remove(request)
        block_ids = [self._free.popleft() for _ in request.block_keys]
        step = ConnectorStep(next(self._steps), load=[
            BlockTransfer(request.request_id, k, b) for k, b in zip(request.block_keys, block_ids)])
        try:
            self.connector.update_state_after_alloc(request, block_ids)
            self.connector.bind_connector_meta(self.connector.build_connector_meta(step))
            self.connector.start_load_kv()
            for layer in range(self.context.num_layers):
                self.connector.wait_for_layer_load(layer)
            self.connector.get_finished([], [request.request_id])
        except Exception:
            self._free.extend(block_ids)
            self._failed("load")
            return False
        self._loaded.update(zip(request.block_keys, block_ids))
        return True

    def _release_loaded(self) -> None:
        """Staged blocks the manager did not take (it stopped early) go back to the free list."""
        self._free.extend(self._loaded.values())
        self._loaded.clear()
        self._matched.clear()

    def _reap_saves(self) -> None:
        try:
            done, _ = self.connector.get_finished(list(self._saving), [])
        except Exception:
            self._failed("get_finished")
            return
        for request_id in done:
            self._free.extend(self._saving.pop(request_id, []))

    def _failed(self, what: str) -> int:
        log.exception("kv connector %s failed; treated as a miss", what)
        self.counters["errors"] += 1
        return 0


def load_connector_class(module: str, class_name: str) -> type:
    """Import ``module`` and return its ``class_name`` (ValueError naming the variable if not)."""
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise ValueError(f"KV_CONNECTOR_MODULE={module!r} cannot be imported: {exc}") from None
    cls = getattr(mod, class_name, None)
    if not isinstance(cls, type) or not issubclass(cls, KvCacheConnector):
        raise ValueError(f"KV_CONNECTOR_CLASS={class_name!r} is not a KvCacheConnector subclass "
                         f"in {module}")
    return cls


def make_connector_tier(spec: "type | KvCacheConnector", context: ConnectorContext) -> ConnectorTier:
    """A tier from ``ModelConfig(kv_connector=...)``: a KvCacheConnector class (built with
    `context`) or an instance."""
    if isinstance(spec, type) and issubclass(spec, KvCacheConnector):
        return ConnectorTier(spec(context), context)
    if isinstance(spec, KvCacheConnector):
        if spec.context is None:
            spec.context = context
        return ConnectorTier(spec, context)
    raise ValueError(f"kv_connector must be a KvCacheConnector subclass or instance, got {spec!r}")
