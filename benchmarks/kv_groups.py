"""What KV cache groups buy: how many requests of a long context a pool of the same bytes runs at
once, on a Gemma-3-shaped model (five sliding layers to one full, rtpkv/cache/groups.py) and on
the same weights with full attention in every layer. Not a timing: counts only.

    python benchmarks/kv_groups.py [--context 4096] [--window 512] [--block 16] [--budget 256]
                                   [--requests 24] [--full-requests 4]

The pool holds `--full-requests` requests of `--context` tokens with full attention everywhere
(KV_CACHE_MEM_MB is set to that); `--requests` requests of `--context` tokens (the prompt and
8 new tokens, distinct prompts) are submitted at once, prefilled `--budget` tokens a step with
CONTEXT_CHUNKING_POLICY=EQUAL_PROGRESS (which admits every request the pool can hold, not only
one prompt's worth of the budget at a time), and the most admitted at once (holding their blocks in the pool: the scheduler's running set) is
counted. The bound: a sliding group holds at most
cdiv(W + budget - 1, B) + 1 blocks where a full one holds cdiv(context, B), so with five
sliding layers to one full the ratio is at most 6 / (1 + 5 * (W + budget) / context): 3.69x at
4,096 tokens and a 512-token window however small the budget (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from common import bench_parser, random_ids, setup_threads, table

from rtpkv import ModelConfig, ModelFactory, Pipeline
from rtpkv.cache.kv_memory import KVMemory
from rtpkv.model_factory.tiny import build_tiny_checkpoint

NEW = 8
LAYER_TYPES = (["sliding_attention"] * 5 + ["full_attention"]) * 3   # 18 layers, as gemma-3-270m


def checkpoints(root: Path, context: int, window: int) -> tuple[Path, Path]:
    """The Gemma-3-shaped checkpoint, and a copy of its weights with every layer full."""
    hybrid = build_tiny_checkpoint(
        root / "hybrid", "Gemma3ForCausalLM", num_layers=len(LAYER_TYPES), num_kv_heads=1,
        sliding_window=window, max_position_embeddings=2 * context,
        config_overrides=dict(head_dim=32, layer_types=LAYER_TYPES))
    full = root / "full"
    full.mkdir()
    for f in hybrid.iterdir():
        (full / f.name).symlink_to(f)
    (full / "config.json").unlink()
    cfg = json.loads((hybrid / "config.json").read_text())
    cfg["layer_types"] = ["full_attention"] * len(LAYER_TYPES)
    (full / "config.json").write_text(json.dumps(cfg))
    return hybrid, full


def most_at_once(path: Path, mem_mb: float, args) -> tuple[int, int, int]:
    """(blocks in the pool, KV cache groups, the most requests admitted at once)."""
    model = ModelFactory.from_huggingface(path, ModelConfig(
        seq_size_per_block=args.block, kv_cache_mem_mb=mem_mb,
        max_num_batched_tokens=args.budget, max_seq_len=2 * args.context,
        context_chunking_policy="EQUAL_PROGRESS"), show_progress=False)
    with Pipeline(model, model.tokenizer) as pipe:
        scheduler, most = pipe.engine.scheduler, [0]
        postprocess = scheduler.postprocess

        def counting(*step):   # on the engine thread, after each step's bookkeeping
            most[0] = max(most[0], len(scheduler.running))
            return postprocess(*step)

        scheduler.postprocess = counting
        streams = [pipe(random_ids(args.context - NEW, seed=700 + i, vocab=1000),
                        generate_config=dict(top_k=1, ignore_eos=True, max_new_tokens=NEW))
                   for i in range(args.requests)]
        for stream in streams:
            list(stream)
        return pipe.engine.cache.num_blocks, len(pipe.engine.cache.groups), most[0]


def main() -> None:
    parser = bench_parser(__doc__, block=16)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--full-requests", type=int, default=4)
    args = parser.parse_args()
    setup_threads()
    with tempfile.TemporaryDirectory() as tmp:
        hybrid, full = checkpoints(Path(tmp), args.context, args.window)
        per_block = KVMemory.bytes_per_block(len(LAYER_TYPES), args.block, 1, 32, torch.float32)
        mem_mb = args.full_requests * -(-args.context // args.block) * per_block / 2**20
        rows = []
        for name, path in (("full attention everywhere", full), ("Gemma 3 pattern", hybrid)):
            rows.append((name, *most_at_once(path, mem_mb, args)))
    print(f"{args.context}-token requests, window {args.window}, SEQ_SIZE_PER_BLOCK="
          f"{args.block}, MAX_NUM_BATCHED_TOKENS={args.budget}, KV_CACHE_MEM_MB={mem_mb:.3f}")
    print(table(["model", "pool (blocks)", "KV cache groups", "most requests admitted at once"], rows))
    print(f"ratio: {rows[1][3] / rows[0][3]:.2f}x")


if __name__ == "__main__":
    main()
