"""Tiny checkpoints for the demo, the tests and the benchmarks: random weights from a real
`transformers` config saved with `save_pretrained` (safetensors), and a sentencepiece tokenizer
trained on the spot on a generated corpus. Nothing is downloaded."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

from tqdm.auto import tqdm

from rtpkv.user_cache import user_cache_dir

_WORDS = (
    "hello what's your name how old are you the a an of to in is it that for on with as was "
    "at by from this be or not but have system assistant user helpful careful answer question "
    "model cache block reuse prompt token memory disk host remote engine request batch stream "
    "python code function return value error test check time fast slow first last next every "
    "day night city river mountain cat dog bird tree house book story world people program "
    "you're I we they he she good bad new old big small long short please thank tell me about"
).split()

QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2

ARCHITECTURE_CONFIGS = {
    "LlamaForCausalLM": "LlamaConfig",
    "MistralForCausalLM": "MistralConfig",
    "Qwen2ForCausalLM": "Qwen2Config",
    "Qwen3ForCausalLM": "Qwen3Config",
    "Gemma2ForCausalLM": "Gemma2Config",
    "Gemma3ForCausalLM": "Gemma3TextConfig",
    "Qwen3MoeForCausalLM": "Qwen3MoeConfig",
    "Qwen2MoeForCausalLM": "Qwen2MoeConfig",
    "MixtralForCausalLM": "MixtralConfig",
    "GptOssForCausalLM": "GptOssConfig",
    "Cohere2ForCausalLM": "Cohere2Config",
    "Qwen3NextForCausalLM": "Qwen3NextConfig",
    "Qwen3_5ForCausalLM": "Qwen3_5TextConfig",
    "GraniteMoeHybridForCausalLM": "GraniteMoeHybridConfig",
}

# architectures whose RMSNorm weights are offsets from 1 (zero at init): the tiny checkpoints
# draw them at random so that a norm computed as Llama's would differ
OFFSET_NORM_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Qwen3NextForCausalLM",
                             "Qwen3_5ForCausalLM")
# architectures whose norm weights transformers initialises at one: drawn around it so that a
# norm computed as another kind would differ
WIDE_NORM_ARCHITECTURES = ("Cohere2ForCausalLM",)
# architectures whose vectors transformers initialises at zero or near it (gpt-oss's attention
# sinks, router and expert biases): drawn wider so that each one moves the outputs
WIDE_VECTOR_ARCHITECTURES = ("GptOssForCausalLM",)


BYTE_LEVEL_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM",
                            "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM")


def _corpus(path: Path, lines: int, seed: int) -> None:
    rng = random.Random(seed)
    punct = [".", ",", "?", "!", ":", ""]
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(lines):
            n = rng.randint(4, 16)
            words = [rng.choice(_WORDS) for _ in range(n)]
            if rng.random() < 0.3:
                words.append(str(rng.randint(0, 999)))
            f.write(" ".join(words).capitalize() + rng.choice(punct) + "\n")


def train_tokenizer(out_dir: Path, vocab_size: int, seed: int = 0, byte_level: bool = False) -> None:
    """Train a tokenizer on a generated corpus and write it where AutoTokenizer finds it:
    a byte-fallback BPE sentencepiece `tokenizer.model` (Llama, Mistral), or a byte-level BPE
    `vocab.json` + `merges.txt` with Qwen's special tokens (`byte_level`, Qwen2/Qwen3)."""
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        _corpus(corpus, 4000, seed)
        if byte_level:
            from tokenizers import ByteLevelBPETokenizer

            bpe = ByteLevelBPETokenizer()
            bpe.train([str(corpus)], vocab_size=vocab_size, min_frequency=1, show_progress=False,
                      special_tokens=list(QWEN_SPECIAL_TOKENS))
            bpe.save_model(str(out_dir))
            tokenizer_config = {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None,
                                "eos_token": QWEN_SPECIAL_TOKENS[2],
                                "pad_token": QWEN_SPECIAL_TOKENS[0]}
        else:
            import sentencepiece as spm

            spm.SentencePieceTrainer.train(
                input=str(corpus), model_prefix=str(out_dir / "tokenizer"), vocab_size=vocab_size,
                model_type="bpe", hard_vocab_limit=False, byte_fallback=True,
                character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
                num_threads=1,
            )
            (out_dir / "tokenizer.vocab").unlink(missing_ok=True)
            tokenizer_config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True,
                                "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
                                "unk_token": "<unk>"}
    tokenizer_config["model_max_length"] = 1 << 20
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


def build_tiny_checkpoint(out_dir: os.PathLike, architecture: str = "LlamaForCausalLM", *,
                          vocab_size: int = 1024, hidden_size: int = 64,
                          intermediate_size: int = 128, num_layers: int = 2, num_heads: int = 4,
                          num_kv_heads: int = 2, max_position_embeddings: int = 1024,
                          tie_word_embeddings: bool = False,
                          rope_scaling: Optional[dict[str, Any]] = None,
                          tokenizer_vocab_size: int = 600, seed: int = 0,
                          dtype: str = "float32", sliding_window: Optional[int] = None,
                          moe: Optional[dict[str, Any]] = None,
                          config_overrides: Optional[dict[str, Any]] = None) -> Path:
    """Write a random-initialised checkpoint of `architecture` with its tokenizer to out_dir.
    `sliding_window`: Mistral's window (default: max_position_embeddings, i.e. none in effect);
    for Qwen2 it turns use_sliding_window on in every layer; Gemma's, gpt-oss's and Cohere2's
    sliding layers (their `layer_types`) take it. `moe`: a mixture of experts' config fields
    (num_experts, num_experts_per_tok, moe_intermediate_size, ...; Mixtral's experts take
    `intermediate_size`), given to its config class as they are. `config_overrides`: further
    fields of the transformers config (Gemma's layer_types, query_pre_attn_scalar, soft-caps,
    RoPE parameters, head_dim)."""
    import torch
    import transformers

    if architecture not in ARCHITECTURE_CONFIGS:
        raise ValueError(f"architecture {architecture!r} unknown; "
                         f"known: {', '.join(ARCHITECTURE_CONFIGS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config_cls = getattr(transformers, ARCHITECTURE_CONFIGS[architecture])
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings, eos_token_id=2,
        bos_token_id=None if architecture in BYTE_LEVEL_ARCHITECTURES else 1,
        head_dim=hidden_size // num_heads,
    )
    if rope_scaling:
        kwargs["rope_scaling"] = rope_scaling
    kwargs.update(moe or {})
    if architecture == "MistralForCausalLM":
        kwargs["sliding_window"] = sliding_window or max_position_embeddings
    elif architecture in OFFSET_NORM_ARCHITECTURES:
        kwargs["sliding_window"] = sliding_window
    elif architecture in ("GptOssForCausalLM", "Cohere2ForCausalLM"):
        if sliding_window is not None:   # its config's default: 128
            kwargs["sliding_window"] = sliding_window
    elif sliding_window is not None:
        if architecture != "Qwen2ForCausalLM":
            raise ValueError(f"sliding_window: {architecture} has no sliding-window attention "
                             "(Mistral, Qwen2 and Gemma do)")
        kwargs.update(sliding_window=sliding_window, use_sliding_window=True, max_window_layers=0)
    kwargs.update(config_overrides or {})
    config = config_cls(**kwargs)
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    # A wider init than the default 0.02 makes random models produce varied, non-degenerate
    # greedy text, which makes token-for-token comparisons meaningful.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:   # matrices, and the experts' stacked matrices
                param.normal_(0.0, 0.08 if "embed" not in name else 1.0)
            elif "linear_attn.norm" in name:   # Gated DeltaNet's gated norm: a plain weight
                param.normal_(1.0, 0.2)
            elif "norm" in name and architecture in OFFSET_NORM_ARCHITECTURES:
                param.normal_(0.0, 0.2)
            elif "norm" in name and architecture in WIDE_NORM_ARCHITECTURES:
                param.normal_(1.0, 0.2)
            elif "norm" not in name and architecture in WIDE_VECTOR_ARCHITECTURES:
                param.normal_(0.0, 1.0 if "sinks" in name else 0.1)
    model.save_pretrained(out, safe_serialization=True)
    train_tokenizer(out, min(tokenizer_vocab_size, vocab_size), seed,
                    byte_level=architecture in BYTE_LEVEL_ARCHITECTURES)
    return out


# The demo model's vocabulary is exactly the tokenizer's, so every generated id decodes to text.
DEMO_CHECKPOINT = dict(architecture="LlamaForCausalLM", vocab_size=2000, hidden_size=256,
                       intermediate_size=704, num_layers=4, num_heads=8, num_kv_heads=4,
                       max_position_embeddings=2048, tokenizer_vocab_size=2000)


def model_or_demo(model: Optional[str]) -> str:
    """`model`, or without one the tiny demo checkpoint (built once): what `rtpkv demo`,
    `rtpkv fleet` and the examples run when given no model."""
    return model or str(cached_tiny_checkpoint("demo", **DEMO_CHECKPOINT))


def cached_tiny_checkpoint(name: str = "demo", cache_dir: Optional[os.PathLike] = None,
                           show_progress: bool = True, **kwargs: Any) -> Path:
    """Build once into the user's cache dir (keyed by the arguments) and reuse afterwards."""
    root = Path(cache_dir) if cache_dir else user_cache_dir()
    key = hashlib.sha256(json.dumps(kwargs, sort_keys=True, default=str).encode()).hexdigest()[:12]
    target = root / f"{name}-{key}"
    if (target / "config.json").exists():  # the directory appears whole (os.replace)
        return target
    root.mkdir(parents=True, exist_ok=True)
    with tqdm(total=1, desc=f"Building tiny checkpoint {target.name}", disable=not show_progress) as bar:
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=".build-"))
        build_tiny_checkpoint(tmp, **kwargs)
        try:
            os.replace(tmp, target)
        except OSError:  # another process finished the same build first
            shutil.rmtree(tmp, ignore_errors=True)
        bar.update(1)
    return target
