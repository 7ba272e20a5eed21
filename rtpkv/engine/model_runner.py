"""ModelRunner: turns a step's scheduled chunks into one forward over the mixed batch.

Rows are laid out decode tokens first (one query each, attended in one batched call), then
prefill chunks. Slot indices come from each request's block table; logits are computed only for
the last row of each chunk that reaches the end of its sequence.
"""

from __future__ import annotations

import torch

from rtpkv.cache import BlockPool
from rtpkv.engine.scheduler import ScheduledChunk
from rtpkv.kernels import AttentionMetadata, PrefillChunk
from rtpkv.kernels.kv_store import head_major_rows
from rtpkv.model_factory.llama import CausalLM


class ModelRunner:
    def __init__(self, module: CausalLM, pool: BlockPool):
        self.module = module
        self.pool = pool
        self.kv_caches = pool.layer_caches()
        self.block_size = pool.block_size
        self.device = pool.kv.device
        self._offsets = torch.arange(self.block_size, device=self.device)
        self.kv_heads = pool.kv.shape[2]

    def _slots(self, table: list[int], length: int) -> torch.Tensor:
        """Slots of positions [0, length) of a sequence with this block table."""
        blocks = torch.tensor(table[: -(-length // self.block_size)], device=self.device)
        return (blocks[:, None] * self.block_size + self._offsets).flatten()[:length]

    def _rows(self, slots: torch.Tensor) -> torch.Tensor:
        return head_major_rows(slots, self.kv_heads, self.pool.num_slots)

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        """Forward the batch. Returns logits (n, vocab) and the chunks they belong to."""
        decodes = [c for c in chunks if c.num_tokens == 1]
        prefills = [c for c in chunks if c.num_tokens > 1]
        ordered = decodes + prefills
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        new_slots: list[torch.Tensor] = []
        meta = AttentionMetadata(write_rows=torch.empty(0), num_decodes=len(decodes))
        if decodes:
            ctx = [c.start + 1 for c in decodes]
            width = max(ctx)
            slots = torch.zeros((len(decodes), width), dtype=torch.long, device=self.device)
            for row, (c, n) in enumerate(zip(decodes, ctx)):
                slots[row, :n] = self._slots(c.request.block_table, n)
            meta.decode_rows = self._rows(slots)
            if min(ctx) != width:
                lengths = torch.tensor(ctx, device=self.device)
                mask = torch.arange(width, device=self.device)[None, :] < lengths[:, None]
                meta.decode_mask = mask[:, None, None, :]
            ids.extend(c.request.token_ids[c.start] for c in decodes)
            positions.append(torch.tensor([c.start for c in decodes], device=self.device))
            new_slots.append(slots[torch.arange(len(decodes)), torch.tensor(ctx) - 1])
        row = len(decodes)
        for c in prefills:
            start, end = c.start, c.start + c.num_tokens
            ids.extend(c.request.token_ids[start:end])
            positions.append(torch.arange(start, end, device=self.device))
            ctx_slots = self._slots(c.request.block_table, end)
            new_slots.append(ctx_slots[start:])
            chunk = PrefillChunk(row, row + c.num_tokens)
            if start:
                q_pos = torch.arange(start, end, device=self.device)[:, None]
                k_pos = torch.arange(end, device=self.device)[None, :]
                chunk.ctx_rows, chunk.mask = self._rows(ctx_slots), (k_pos <= q_pos)[None, None]
            meta.prefills.append(chunk)
            row += c.num_tokens
        meta.write_rows = self._rows(torch.cat(new_slots))
        input_ids = torch.tensor(ids, device=self.device)
        hidden = self.module(input_ids, torch.cat(positions), self.kv_caches, meta)

        wanted, rows, end_row = [], [], 0
        for c in ordered:
            end_row += c.num_tokens
            req = c.request
            if c.start + c.num_tokens == req.num_tokens and not req.prefill_only:
                wanted.append(c)
                rows.append(end_row - 1)
        if not rows:
            return torch.empty(0), wanted
        return self.module.logits(hidden[torch.tensor(rows, device=self.device)]), wanted
