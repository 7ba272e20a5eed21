"""An `AttentionBatch` from block tables and (first position, tokens this step) per sequence,
rows in the ModelRunner's order: what the attention-backend tests feed every backend."""

from __future__ import annotations

from typing import Optional

from rtpkv.kernels import AttentionBatch


def attention_batch(tables: list[list[int]], seqs: list[tuple[int, int]], block_size: int,
                    num_blocks: int, kv_heads: int, window: Optional[int] = None) -> AttentionBatch:
    positions: list[int] = []
    row_seq: list[int] = []
    starts: list[int] = []
    for i, (start, n) in enumerate(seqs):
        starts.append(len(positions))
        positions += range(start, start + n)
        row_seq += [i] * n
    return AttentionBatch(
        positions=positions, row_seq=row_seq, block_tables=[list(t) for t in tables],
        query_start=starts, query_len=[n for _, n in seqs],
        context_len=[s + n for s, n in seqs], block_size=block_size, num_blocks=num_blocks,
        kv_heads=kv_heads, window=window)
