"""The KV connector API: plug your own KV store (a file system, an object store, another
engine's cache) under rtpkv's device pool.

The shape is TensorRT-LLM's (`KvCacheConnectorScheduler` / `KvCacheConnectorWorker`): a
scheduler side that decides *what* moves — how many of a request's next tokens the store can
provide, which blocks to load and save in a step, as metadata — and a worker side that moves the
bytes, told about the KV memory once and then called around the forward pass layer by layer.

One mechanism, not two
----------------------
A connector is not a second path into the engine. `ConnectorTier` (rtpkv/cache/tiers/connector.py)
adapts it to `KVTier`, the interface the tier ladder already walks for its host-memory and disk
tiers. So a connector gets
the manager's behaviour for free: it is asked after the device index (and after the built-in
tiers), hits continue the chain, blocks evicted from the device are offered to it, per-request
switches and retention priorities apply, a failure is a miss, and its counters appear in
`cache_stats()`. The direction is tier <- connector (not connector <- tier) because the tier
interface is the smaller one: every connector step has a tier call that drives it, while a
connector-shaped disk tier would need the scheduler/worker ceremony for a file read.

The price of the adapter is a staging buffer: the worker side's "KV caches" are
`num_staging_blocks` block-major slots in host memory, ``kv[block_id]`` of shape
``TierLayout.shape`` (exactly what TensorRT-LLM's example indexes), rather than the device pool
itself; the manager copies staged blocks into and out of the device pool.

How the steps map
-----------------
=============================  =====================================================
ladder calls the tier          the adapter calls the connector
=============================  =====================================================
start-up                       ``register_kv_caches(staging)``
``lookup(keys)``               ``get_num_new_matched_tokens(request, 0)``
first ``load`` of that chain   ``update_state_after_alloc(request, block_ids)``,
                               ``build_connector_meta(step)`` -> ``bind_connector_meta``,
                               ``start_load_kv()``, ``wait_for_layer_load(layer)`` for
                               every layer, ``get_finished([], [request_id])``
``store(meta, payload)``       ``build_connector_meta(step)`` -> ``bind_connector_meta``,
                               ``save_kv_layer(layer)`` for every layer,
                               ``wait_for_save()``, ``request_finished(request, block_ids)``
                               (True = saving goes on: the staging block stays held until
                               ``get_finished`` names the request as done saving)
=============================  =====================================================

Blocks are named by `ConnectorRequest.block_keys`: the chained SHA-256 keys, which cover the
model fingerprint, the block size, the cache salt and every token up to the block's end, and
are equal in every process. Key your store by them (TensorRT-LLM's example hashes one block's
tokens with Python's per-process `hash`, which gives the wrong K/V after another prefix).

Loads are synchronous: ``get_num_new_matched_tokens`` returning ``load_async=True`` is logged
and the tokens are loaded synchronously all the same. Any exception a connector raises is
logged with its traceback and counted; the request sees a miss (its blocks are computed) and the
engine goes on.

Configure with ``KV_CONNECTOR_MODULE`` + ``KV_CONNECTOR_CLASS`` (the class is constructed with a
`ConnectorContext`) or ``ModelConfig(kv_connector=<class or instance>)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from rtpkv.cache.tiers.base import TierLayout


@dataclass(frozen=True)
class ConnectorContext:
    """What a connector is built with (TensorRT-LLM passes its llm_args)."""

    layout: TierLayout          # fingerprint, block size, payload dtype and shape
    num_layers: int
    num_staging_blocks: int


@dataclass
class ConnectorRequest:
    """The part of a request a connector sees: its blocks, named by chained key."""

    request_id: int
    block_keys: list[bytes]
    block_tokens: list[tuple[int, ...]] = field(default_factory=list)  # known when saving

    @property
    def num_blocks(self) -> int:
        return len(self.block_keys)


@dataclass(frozen=True)
class BlockTransfer:
    """One block to move between a staging slot and the store."""

    request_id: int
    key: bytes
    block_id: int                       # index into the registered staging tensor
    tokens: tuple[int, ...] = ()        # given for saves


@dataclass
class ConnectorStep:
    """What the scheduler side turns into metadata for the worker side (SchedulerOutput)."""

    step: int
    load: list[BlockTransfer] = field(default_factory=list)
    save: list[BlockTransfer] = field(default_factory=list)


class KvCacheConnectorScheduler(ABC):
    """Decides what moves. Runs where the scheduler runs; sees no tensors."""

    def __init__(self, context: Optional[ConnectorContext] = None):
        self.context = context  # an instance made before the engine gets it from the engine

    @abstractmethod
    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """How many tokens after `num_computed_tokens` the store holds (whole blocks, from the
        start of ``request.block_keys``), and whether they would load asynchronously."""

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: list[int]) -> None:
        """The staging blocks that will receive the matched blocks, in chain order."""

    def build_connector_meta(self, step: ConnectorStep) -> Any:
        """The metadata the worker side acts on in this step (default: the step itself)."""
        return step

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> bool:
        """The request's blocks leave; True when the worker still saves them asynchronously
        (their staging blocks are then held until `get_finished` reports the request)."""
        return False


class KvCacheConnectorWorker(ABC):
    """Moves the bytes. Runs where the KV memory is."""

    def __init__(self, context: Optional[ConnectorContext] = None):
        self.context = context
        self._metadata: Any = None

    @abstractmethod
    def register_kv_caches(self, kv_cache_tensor: torch.Tensor) -> None:
        """The KV memory, once: ``kv_cache_tensor[block_id]`` is one block (TierLayout.shape)."""

    def bind_connector_meta(self, metadata: Any) -> None:
        self._metadata = metadata

    @abstractmethod
    def start_load_kv(self) -> None:
        """Begin filling the step's load blocks."""

    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Return once layer `layer_idx` of the load blocks is filled."""

    def save_kv_layer(self, layer_idx: int) -> None:
        """Layer `layer_idx` of the save blocks is final; a worker may start saving it."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Return once the step's saves are done (or safely under way, see request_finished)."""

    def get_finished(self, finished_gen_req_ids: list[int],
                     started_loading_req_ids: list[int]) -> tuple[list[int], list[int]]:
        """(requests done saving, requests done loading) among those given."""
        return [], []


class KvCacheConnector(KvCacheConnectorScheduler, KvCacheConnectorWorker, ABC):
    """Both sides in one class: what ``KV_CONNECTOR_CLASS`` names."""

    def __init__(self, context: Optional[ConnectorContext] = None):
        KvCacheConnectorScheduler.__init__(self, context)
        KvCacheConnectorWorker.__init__(self, context)
