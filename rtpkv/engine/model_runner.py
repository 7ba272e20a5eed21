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
        self.kv_heads = pool.kv.shape[2]
        self._k_buffer = pool.kv.new_empty(0)
        self._v_buffer = pool.kv.new_empty(0)

    def _buffers(self, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather buffers kept across steps, grown (never shrunk) to `numel` elements."""
        if self._k_buffer.numel() < numel:
            self._k_buffer = self.pool.kv.new_empty(numel)
            self._v_buffer = self.pool.kv.new_empty(numel)
        return self._k_buffer, self._v_buffer

    def _slot(self, table: list[int], position: int) -> int:
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def _blocks(self, table: list[int], length: int) -> torch.Tensor:
        """Head-major block rows of the blocks covering positions [0, length)."""
        blocks = torch.tensor(table[: -(-length // self.block_size)], device=self.device)
        return head_major_rows(blocks, self.kv_heads, self.pool.num_blocks)

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        """Forward the batch. Returns logits (n, vocab) and the chunks they belong to."""
        B = self.block_size
        decodes = [c for c in chunks if c.num_tokens == 1]
        prefills = [c for c in chunks if c.num_tokens > 1]
        ordered = decodes + prefills
        ids: list[int] = []
        positions: list[int] = []
        new_slots: list[int] = []
        meta = AttentionMetadata(write_rows=torch.empty(0), block_size=B, num_decodes=len(decodes))
        if decodes:
            ctx = [c.start + 1 for c in decodes]
            width = -(-max(ctx) // B)
            tables = [c.request.block_table[:width] for c in decodes]
            padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=self.device)
            meta.decode_blocks = head_major_rows(padded, self.kv_heads, self.pool.num_blocks)
            meta.decode_len = max(ctx)
            if min(ctx) != meta.decode_len:
                lengths = torch.tensor(ctx, device=self.device)
                mask = torch.arange(meta.decode_len, device=self.device)[None, :] < lengths[:, None]
                meta.decode_mask = mask[:, None, None, :]
            for c in decodes:
                ids.append(c.request.token_ids[c.start])
                positions.append(c.start)
                new_slots.append(self._slot(c.request.block_table, c.start))
        row = len(decodes)
        for c in prefills:
            start, end = c.start, c.start + c.num_tokens
            table = c.request.block_table
            ids.extend(c.request.token_ids[start:end])
            positions.extend(range(start, end))
            new_slots.extend(self._slot(table, p) for p in range(start, end))
            chunk = PrefillChunk(row, row + c.num_tokens)
            if start:
                blocks = self._blocks(table, end)
                q_pos = torch.arange(start, end, device=self.device)[:, None]
                k_pos = torch.arange(end, device=self.device)[None, :]
                chunk.ctx_blocks, chunk.mask = blocks, (k_pos <= q_pos)[None, None]
            meta.prefills.append(chunk)
            row += c.num_tokens
        meta.write_rows = head_major_rows(torch.tensor(new_slots, device=self.device),
                                          self.kv_heads, self.pool.num_slots)
        meta.k_buffer, meta.v_buffer = self._buffers(meta.gather_numel(self.pool.kv.shape[-1]))
        input_ids = torch.tensor(ids, device=self.device)
        hidden = self.module(input_ids, torch.tensor(positions, device=self.device),
                             self.kv_caches, meta)

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
