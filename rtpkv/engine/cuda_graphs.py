"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A small model's decode step on a GPU is launch-bound: hundreds of kernel launches from Python,
each a few microseconds of work. A CUDA graph captured once replays them all in one launch. A
step whose every row is a decode token (one sequence each) runs padded up to the next bucket
(1, 2, 4, 8, ..., up to CONCURRENCY_LIMIT rounded up to a power of two): the padding rows are
one-token sequences at position 0 whose K/V slot is -1 (never written) and whose logits are
dropped. Each bucket's graph is captured the first time a batch of its size runs, over static
buffers: token ids, positions and the attention backend's metadata tensors (block tables
padded to the longest sequence the model accepts), into which every later step copies its
values before the replay. The sampler stays outside the graph (it runs each request's own
sampling settings on the host side).

Only a backend whose forward reads nothing but its metadata tensors (`graph_safe`: the Triton
one) is captured; the others decode eagerly, as does every step with ENFORCE_EAGER=1. How a
graph is captured is a parameter (`Capture`), so the bookkeeping runs on a CPU with a stand-in
that re-runs the eager model on the same static buffers.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from rtpkv.kernels import AttentionBatch
from rtpkv.model_factory.llama import CausalLM

log = logging.getLogger("rtpkv")

# capture(fn) -> (replay, output): `output` is fn's result as captured; each replay() recomputes
# it in place from the static inputs fn reads.
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]


class CudaGraphCapture:
    """Capture on the current CUDA device: fn runs once eagerly first (Triton compiles its
    kernels, allocators settle), then is captured; every bucket's graph shares one memory pool
    (only one replays at a time)."""

    def __init__(self) -> None:
        self.pool: Optional[tuple[int, int]] = None

    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = fn()
        self.pool = graph.pool()
        return graph.replay, output


def buckets(max_rows: int) -> list[int]:
    """1, 2, 4, ... up to the first power of two that holds `max_rows` rows."""
    sizes = [1]
    while sizes[-1] < max_rows:
        sizes.append(sizes[-1] * 2)
    return sizes


def copy_metadata(static: Any, step: Any) -> None:
    """Copy a step's attention metadata into a captured graph's, field by field: tensors in
    place (same shapes), other fields must be equal (a graph's launch parameters)."""
    for f in dataclasses.fields(static):
        held, new = getattr(static, f.name), getattr(step, f.name)
        if isinstance(held, torch.Tensor):
            if held.shape != new.shape:
                raise ValueError(f"metadata field {f.name}: shape {tuple(new.shape)}, the "
                                 f"captured graph's is {tuple(held.shape)}")
            held.copy_(new)
        elif held != new:
            raise ValueError(f"metadata field {f.name}: {new!r}, the captured graph's is {held!r}")


@dataclass
class _Graph:
    ids: torch.Tensor         # (bucket,) int64, static
    positions: torch.Tensor   # (bucket,) int64, static
    meta: Any                 # the backend's metadata; its tensors static
    logits: torch.Tensor      # (bucket, vocab) float32, written by each replay
    replay: Callable[[], None]


class DecodeGraphs:
    """The captured decode graphs of one model and KV pool; see the module docstring."""

    def __init__(self, module: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 max_rows: int, block_size: int, num_blocks: int, kv_heads: int,
                 window: Optional[int], capture: Capture):
        if not getattr(module.attention, "graph_safe", False):
            raise ValueError(f"CUDA graphs need a graph-safe attention backend (triton), not "
                             f"{module.attention.name}")
        self.module = module
        self.kv_caches = kv_caches
        self.buckets = buckets(max_rows)
        self.block_size, self.num_blocks, self.kv_heads = block_size, num_blocks, kv_heads
        self.window = window
        self.table_width = -(-module.cos.shape[0] // block_size)   # the longest sequence's
        self.device = module.cos.device
        self.capture = capture
        self.graphs: dict[int, _Graph] = {}

    def bucket(self, rows: int) -> Optional[int]:
        """The captured size a batch of `rows` decode rows runs at; None: more than the largest
        (it runs eagerly)."""
        return next((b for b in self.buckets if b >= rows), None)

    def padded(self, ids: list[int], positions: list[int], tables: list[list[int]],
               bucket: int) -> tuple[list[int], AttentionBatch]:
        """Ids and the AttentionBatch of `bucket` one-token rows: the step's, then padding
        rows (token 0 at position 0, table of block 0, slot -1); tables padded to the width."""
        pad = bucket - len(ids)
        width = self.table_width
        if any(len(t) > width for t in tables):
            raise ValueError(f"a block table is longer than {width} blocks")
        batch = AttentionBatch(
            positions=positions + [0] * pad, row_seq=list(range(bucket)),
            block_tables=[t + [0] * (width - len(t)) for t in tables] + [[0] * width] * pad,
            query_start=list(range(bucket)), query_len=[1] * bucket,
            context_len=[p + 1 for p in positions] + [1] * pad, block_size=self.block_size,
            num_blocks=self.num_blocks, kv_heads=self.kv_heads, window=self.window,
            device=self.device, padding=pad)
        return ids + [0] * pad, batch

    def run(self, ids: list[int], positions: list[int], tables: list[list[int]]) -> torch.Tensor:
        """The float32 logits (n, vocab) of a decode step of n = len(ids) one-token rows (token
        ids[i] at positions[i] of a sequence with block table tables[i]), from the graph of its
        bucket, captured on first use."""
        n = len(ids)
        bucket = self.bucket(n)
        if not n or bucket is None or not len(positions) == len(tables) == n:
            raise ValueError(f"a graph runs 1 to {self.buckets[-1]} decode rows with one "
                             f"position and table each: {n} ids, {len(positions)} positions, "
                             f"{len(tables)} tables")
        self.module.check_ids(ids, positions)
        ids, batch = self.padded(ids, positions, tables, bucket)
        meta = self.module.attention.build(batch)
        graph = self.graphs.get(bucket)
        if graph is None:
            graph = self.graphs[bucket] = self._capture(ids, batch.positions, meta)
            log.info("CUDA graph captured for decode batches of %d rows", bucket)
        else:
            graph.ids.copy_(torch.tensor(ids, device=self.device))
            graph.positions.copy_(torch.tensor(batch.positions, device=self.device))
            copy_metadata(graph.meta, meta)
        graph.replay()
        return graph.logits[:n].clone()

    def _capture(self, ids: list[int], positions: list[int], meta: Any) -> _Graph:
        static_ids = torch.tensor(ids, device=self.device)
        static_positions = torch.tensor(positions, device=self.device)

        layers = [meta] * len(self.kv_caches)   # one window for every layer (decode_graphs)

        def step() -> torch.Tensor:
            hidden = self.module.hidden_states(static_ids, static_positions, self.kv_caches,
                                               layers)
            return self.module.logits(hidden)

        replay, logits = self.capture(step)
        return _Graph(static_ids, static_positions, meta, logits, replay)


def decode_graphs(module: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                  max_rows: int, block_size: int, num_blocks: int, kv_heads: int,
                  window: Optional[int], enforce_eager: bool) -> Optional[DecodeGraphs]:
    """The decode graphs where they run (a CUDA model on a graph-safe backend, ENFORCE_EAGER
    not set), else None; the choice is logged on CUDA."""
    if module.cos.device.type != "cuda":
        return None
    if enforce_eager:
        log.info("ENFORCE_EAGER=1: decode steps run eagerly (no CUDA graphs)")
        return None
    if not getattr(module.attention, "graph_safe", False):
        log.info("CUDA graphs need RTPKV_ATTENTION=triton: decode steps run eagerly on %s",
                 module.attention.name)
        return None
    if module.state_specs:
        log.info("CUDA graphs capture attention only: a model with recurrent layers runs its "
                 "decode steps eagerly")
        return None
    if len({layer.attention.window for layer in module.plan.layers}) > 1:
        log.info("CUDA graphs capture one attention window: a model whose layers attend over "
                 "several (model_factory/plan.py) runs its decode steps eagerly")
        return None
    log.info("CUDA graphs: decode batches of up to %d rows replay a graph per bucket",
             buckets(max_rows)[-1])
    return DecodeGraphs(module, kv_caches, max_rows, block_size, num_blocks, kv_heads, window,
                        CudaGraphCapture())
