"""ModelRunner: turns a step's scheduled chunks into one forward over the mixed batch.

Rows are laid out decode tokens first, then prefill chunks. The runner describes the batch once
(`AttentionBatch`: positions, each sequence's rows, context length and block table) and the
model's attention backend builds its own metadata from it, once per distinct layer window and
KV cache group (`CausalLM.attention_metadata`); a model's recurrent layers get each sequence's
rows and live state slot (`RecurrentBatch`). Logits are computed only for the last row of each
chunk that reaches the end of its sequence. A step whose rows are all decode tokens replays a
CUDA graph where the runner has them (cuda_graphs.DecodeGraphs).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

import torch

from rtpkv.cache import KVMemory
from rtpkv.cache.groups import KVGroup
from rtpkv.cache.state_group import StateGroup
from rtpkv.engine.cuda_graphs import DecodeGraphs, decode_graphs
from rtpkv.engine.scheduler import ScheduledChunk
from rtpkv.kernels import AttentionBatch
from rtpkv.model_factory.llama import CausalLM
from rtpkv.model_factory.recurrent import RecurrentBatch


class ModelRunner:
    def __init__(self, module: CausalLM, memory: KVMemory, window: Optional[int] = None,
                 max_decode_rows: int = 1, enforce_eager: bool = True,
                 groups: Sequence[KVGroup] = (), layer_slots: Optional[Sequence[int]] = None,
                 layer_groups: Sequence[int] = (), state_group: Optional[StateGroup] = None):
        """`max_decode_rows` (CONCURRENCY_LIMIT): the largest decode batch a CUDA graph is
        captured for; `enforce_eager` (ENFORCE_EAGER): no graphs. `groups`: the KV cache groups
        past group 0 have their own tables (groups.py); `layer_slots` and `layer_groups`: each
        attention layer's pool slot and group. `state_group`: a recurrent model's states (the
        live slots its layers advance, the checkpoints they write)."""
        self.module = module
        self.window = window          # tokens each query attends to (AttentionBatch.window)
        self.groups = tuple(groups)
        self.layer_groups = list(layer_groups)
        self.memory = memory
        self.state_group = state_group
        self.kv_caches = module.layer_caches(
            memory.layer_caches(layer_slots),
            state_group.states.tensors if state_group is not None else [])
        self.block_size = memory.block_size
        self.device = memory.kv.device
        self.kv_heads = memory.kv.shape[2]
        self.graphs: Optional[DecodeGraphs] = decode_graphs(
            module, self.kv_caches, max_decode_rows, self.block_size, memory.num_blocks,
            self.kv_heads, window, enforce_eager)

    @property
    def runs_bursts(self) -> bool:
        """Whether `run_burst` can run: the fused CPU decoder, no attention window (whose
        released blocks a burst's later steps would need tables without)."""
        return self.module.fused is not None and self.window is None

    def reserve_scratch(self, rows: int) -> None:
        """The calling thread's forward scratch for steps of up to `rows` tokens, mapped now
        (the fused decoder's; FusedDecoder.reserve)."""
        if self.module.fused is not None:
            self.module.fused.reserve(rows)

    def batch(self, chunks: list[ScheduledChunk]) -> tuple[list[int], AttentionBatch]:
        """Token ids and the attention backend's view of `chunks`, in this order."""
        B = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        row_seq: list[int] = []
        starts, lengths, contexts, tables = [], [], [], []
        for i, c in enumerate(chunks):
            start, n = c.start, c.num_tokens
            starts.append(len(ids))
            lengths.append(n)
            contexts.append(start + n)
            tables.append(c.request.block_table[: -(-(start + n) // B)])
            if n == 1:
                ids.append(c.request.token_ids[start])
                positions.append(start)
                row_seq.append(i)
            else:
                ids.extend(c.request.token_ids[start:start + n])
                positions.extend(range(start, start + n))
                row_seq.extend([i] * n)
        batch = AttentionBatch(
            positions=positions, row_seq=row_seq, block_tables=tables, query_start=starts,
            query_len=lengths, context_len=contexts, block_size=B,
            num_blocks=self.memory.num_blocks, kv_heads=self.kv_heads, window=self.window,
            device=self.device)
        return ids, batch

    def _layer_batches(self, chunks: list[ScheduledChunk], batch: AttentionBatch
                       ) -> Optional[list[AttentionBatch]]:
        """With KV cache groups, each attention layer's view of the batch: its group's block
        tables and window (group 0's is `batch`); None without groups."""
        if len(self.groups) < 2:
            return None
        ends = [-(-(c.start + c.num_tokens) // self.block_size) for c in chunks]
        per_group = [batch] + [
            replace(batch, window=group.window, block_tables=[
                c.request.group_tables[group.index - 1].block_table[:end]
                for c, end in zip(chunks, ends)])
            for group in self.groups[1:]]
        return [per_group[g] for g in self.layer_groups]

    def _recurrent_batch(self, chunks: list[ScheduledChunk], batch: AttentionBatch
                         ) -> Optional[RecurrentBatch]:
        """The recurrent layers' view of the batch: each chunk's rows, its request's live state
        slot and the checkpoints to write inside it; None for a model without recurrent
        layers."""
        group = self.state_group
        if group is None:
            return None
        return RecurrentBatch(batch.query_start, batch.query_len,
                              [c.request.state_slot for c in chunks],
                              [group.snapshots(c.request, c.start, c.num_tokens) for c in chunks])

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        """Forward the batch. Returns logits (n, vocab) and the chunks they belong to."""
        ordered = ([c for c in chunks if c.num_tokens == 1]
                   + [c for c in chunks if c.num_tokens > 1])
        if (self.graphs is not None and self.graphs.bucket(len(ordered)) is not None
                and all(c.num_tokens == 1 and c.start + 1 == c.request.num_tokens
                        and not c.request.prefill_only for c in ordered)):
            B = self.block_size
            tables = [c.request.block_table[: c.start // B + 1] for c in ordered]
            logits = self.graphs.run([c.request.token_ids[c.start] for c in ordered],
                                     [c.start for c in ordered], tables)
            return logits, ordered
        ids, batch = self.batch(ordered)
        meta = self.module.attention_metadata(batch, self._layer_batches(ordered, batch),
                                              self._recurrent_batch(ordered, batch))
        wanted, rows = [], []
        for c, row, n in zip(ordered, batch.query_start, batch.query_len):
            req = c.request
            if c.start + n == req.num_tokens and not req.prefill_only:
                wanted.append(c)
                rows.append(row + n - 1)
        logits = self.module.forward_logits(ids, batch.positions, self.kv_caches, meta, rows)
        return (logits if rows else torch.empty(0)), wanted

    @torch.inference_mode()
    def run_burst(self, chunks: list[ScheduledChunk], steps: int,
                  stops: list[list[int]]) -> list[list[int]]:
        """Up to `steps` greedy decode steps of `chunks` (one token each, none leaving the block
        its first step writes, so the first step's tables serve them all) in one call: each
        step's tokens, in chunk order (CausalLM.generate)."""
        ids, batch = self.batch(chunks)
        meta = self.module.attention_metadata(batch, self._layer_batches(chunks, batch))
        return self.module.generate(ids, batch.positions, self.kv_caches, meta, steps, stops)
