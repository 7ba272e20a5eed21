"""Prefix reuse on a linear-attention hybrid: an 8-turn chat on a Qwen3-Next-shaped model (three
Gated DeltaNet layers to one gated full-attention layer), or with `--hybrid granite` a Granite
4.0-H-shaped one (three Mamba2 layers to one attention layer; Mamba2 heads of 64, a state size
of 128), against a dense model of the same size (Qwen3: the same hidden size, layers, heads and
MLP, every layer attending).

    python benchmarks/linear_reuse.py [--hybrid qwen3_next|granite] [--hidden 512] [--layers 8]
                                      [--turns 8] [--turn 256] [--new 16] [--block 16]
                                      [--linear-step 4] [--experts 0]

Each turn appends `--turn` user tokens to the history, asks for `--new` greedy tokens and
appends them. Per turn and model: reuse_len with REUSE_CACHE=1, and TTFT with REUSE_CACHE=0 and
=1 (medians of `--runs` conversations, each on a fresh pipeline). The hybrid can reuse only up to
its last saved state (every LINEAR_STEP blocks of the conversation), the dense model up to its
last whole block, so per turn it recomputes up to LINEAR_STEP blocks more. "gain" is the share
of the TTFT that reuse saves over the turns after the first; the issue's goal is a hybrid gain of at least
0.7 times the dense one. State memory: one request's live state (every recurrent layer's conv
window and recurrent matrices) and the saved states the chat left in the pool, against the
dense model's K/V per token.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from common import bench_parser, random_ids, setup_threads, table, timed_request

from rtpkv import ModelConfig, ModelFactory, Pipeline
from rtpkv.model_factory.tiny import build_tiny_checkpoint


def checkpoints(root: Path, args) -> tuple[Path, Path]:
    """The hybrid (Qwen3-Next-shaped) and the dense model of the same size."""
    heads = max(2, args.hidden // 64)
    head_dim = args.hidden // heads
    common = dict(hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                  num_layers=args.layers, num_heads=heads, num_kv_heads=max(1, heads // 4),
                  max_position_embeddings=2 * args.turns * (args.turn + args.new) + 64,
                  vocab_size=8000, tokenizer_vocab_size=2000)
    moe = (dict(num_experts=args.experts, num_experts_per_tok=2,
                moe_intermediate_size=args.hidden, shared_expert_intermediate_size=args.hidden)
           if args.experts else dict(num_experts=0))
    if args.hybrid == "granite":
        kinds = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                 for i in range(args.layers)]
        hybrid = build_tiny_checkpoint(
            root / "hybrid", "GraniteMoeHybridForCausalLM", **common,
            config_overrides=dict(
                head_dim=head_dim, layer_types=kinds, shared_intermediate_size=args.hidden * 3,
                num_local_experts=args.experts, num_experts_per_tok=2,
                mamba_n_heads=max(1, 2 * args.hidden // 64), mamba_d_head="auto",
                mamba_d_state=128, mamba_n_groups=1, position_embedding_type="rope"))
    else:
        hybrid = build_tiny_checkpoint(
            root / "hybrid", "Qwen3NextForCausalLM", moe=moe, **common,
            config_overrides=dict(head_dim=head_dim, linear_num_key_heads=max(1, heads // 2),
                                  linear_num_value_heads=heads, linear_key_head_dim=head_dim,
                                  linear_value_head_dim=head_dim))
    dense = build_tiny_checkpoint(root / "dense", "Qwen3ForCausalLM", **common,
                                  config_overrides=dict(head_dim=head_dim))
    return hybrid, dense


def chat(path: Path, reuse: bool, args) -> tuple[list[float], list[int], Pipeline]:
    """One conversation on a fresh pipeline: each turn's TTFT and reuse_len (the pipeline is
    returned open, for its cache's figures)."""
    model = ModelFactory.from_huggingface(path, ModelConfig(
        seq_size_per_block=args.block, reuse_cache=reuse, linear_step=args.linear_step,
        kv_cache_mem_mb=512), show_progress=False)
    pipe = Pipeline(model, model.tokenizer)
    history: list[int] = []
    ttfts, reused = [], []
    for turn in range(args.turns):
        history += random_ids(args.turn, seed=900 + turn)
        ttft, _, res = timed_request(pipe, history, args.new)
        ttfts.append(ttft)
        reused.append(res.aux_info["reuse_len"])
        history += res.output_ids
    return ttfts, reused, pipe


def measure(path: Path, args) -> dict:
    off, on, reuse_len, state = [], [], None, None
    for _ in range(args.runs):
        ttfts, _, pipe = chat(path, False, args)
        pipe.stop()
        off.append(ttfts)
        ttfts, reuse_len, pipe = chat(path, True, args)
        on.append(ttfts)
        state = pipe.cache_stats().get("state_group")
        memory = pipe.engine.cache.memory
        kv_per_token = memory.nbytes / (memory.num_blocks * memory.block_size)
        pipe.stop()
    per_turn = lambda runs: [statistics.median(t) for t in zip(*runs)]   # noqa: E731
    return {"off": per_turn(off), "on": per_turn(on), "reuse_len": reuse_len, "state": state,
            "kv_per_token": kv_per_token}


def gain(result: dict) -> float:
    """The share of TTFT reuse saves over turns 2.. (the first turn has nothing to reuse)."""
    off, on = sum(result["off"][1:]), sum(result["on"][1:])
    return (off - on) / off if off else 0.0


def main() -> None:
    parser = bench_parser(__doc__, block=16)
    parser.add_argument("--hybrid", choices=("qwen3_next", "granite"), default="qwen3_next",
                        help="the recurrent layers: Gated DeltaNet (Qwen3-Next) or Mamba2 "
                             "(Granite 4.0-H)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--turn", type=int, default=256, help="user tokens per turn")
    parser.add_argument("--new", type=int, default=16, help="generated tokens per turn")
    parser.add_argument("--linear-step", type=int, default=4, help="LINEAR_STEP")
    parser.add_argument("--experts", type=int, default=0,
                        help="the hybrid's experts (0: a dense MLP, the dense model's size)")
    args = parser.parse_args()
    setup_threads()
    with tempfile.TemporaryDirectory() as tmp:
        hybrid_path, dense_path = checkpoints(Path(tmp), args)
        hybrid, dense = measure(hybrid_path, args), measure(dense_path, args)
    rows = [(turn + 1, hybrid["reuse_len"][turn], hybrid["off"][turn], hybrid["on"][turn],
             dense["reuse_len"][turn], dense["off"][turn], dense["on"][turn])
            for turn in range(args.turns)]
    print(f"{args.hybrid} hybrid; {args.turns} turns of {args.turn} user + {args.new} "
          "generated tokens, "
          f"hidden {args.hidden}, {args.layers} layers, SEQ_SIZE_PER_BLOCK={args.block}, "
          f"LINEAR_STEP={args.linear_step}, medians of {args.runs}")
    print(table(["turn", "hybrid reuse_len", "hybrid TTFT off (s)", "hybrid TTFT on (s)",
                 "dense reuse_len", "dense TTFT off (s)", "dense TTFT on (s)"], rows))
    g_hybrid, g_dense = gain(hybrid), gain(dense)
    print(f"TTFT saved by reuse, turns 2..{args.turns}: hybrid {g_hybrid:.1%}, dense "
          f"{g_dense:.1%}; hybrid / dense = {g_hybrid / g_dense if g_dense else 0.0:.2f} "
          "(goal: at least 0.70)")
    state = hybrid["state"]
    saved = state["checkpoints_cached"] + state["checkpoints_pinned"]
    print(table(["memory", "bytes"], [
        ("hybrid: one request's live state", state["bytes_per_state"]),
        (f"hybrid: saved states after the chat ({saved})", saved * state["bytes_per_state"]),
        ("hybrid: K/V per token (its attention layers)", round(hybrid["kv_per_token"])),
        ("dense: K/V per token (every layer)", round(dense["kv_per_token"]))]))


if __name__ == "__main__":
    main()
