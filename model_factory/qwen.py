"""QWenLMHeadModel (Qwen-7B / Qwen-7B-Chat, the first Qwen: remote code in its checkpoint) read
as the Qwen2 layers it is: the same RMSNorms, q/k/v bias without an o bias, SwiGLU and RoPE, under
other names. Its config becomes the equivalent Qwen2 fields and its tensors the Qwen2 names, so
no transformers remote code runs; the reference is the Qwen2 model holding the same weights.

Names: `transformer.wte` -> embed_tokens, `transformer.h.N.ln_1` / `ln_2` -> the input and
post-attention norms, `attn.c_attn` (q, k and v stacked) -> q/k/v_proj, `attn.c_proj` -> o_proj,
`mlp.w2` -> gate_proj (its output goes through SiLU), `mlp.w1` -> up_proj, `mlp.c_proj` ->
down_proj, `transformer.ln_f` -> norm; QWen's `intermediate_size` counts w1 and w2 together.

`use_dynamic_ntk` and `use_logn_attn` change nothing up to `seq_length` tokens and are not
implemented past it: where either is on, the checkpoint accepts at most `seq_length` tokens.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Iterator

import torch

from rtpkv.errors import ConfigError

ARCHITECTURE = "QWenLMHeadModel"

_LAYER = re.compile(r"^transformer\.h\.(\d+)\.(.+)$")
_LAYER_NAMES = {
    "ln_1.weight": "input_layernorm.weight",
    "ln_2.weight": "post_attention_layernorm.weight",
    "attn.c_proj.weight": "self_attn.o_proj.weight",
    "attn.c_proj.bias": "self_attn.o_proj.bias",
    "mlp.w1.weight": "mlp.up_proj.weight",
    "mlp.w2.weight": "mlp.gate_proj.weight",
    "mlp.c_proj.weight": "mlp.down_proj.weight",
}
_NAMES = {"transformer.wte.weight": "model.embed_tokens.weight",
          "transformer.ln_f.weight": "model.norm.weight", "lm_head.weight": "lm_head.weight"}


def qwen2_config(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """The Qwen2 config fields of a QWenLMHeadModel config (architecture kept)."""
    pct = float(cfg.get("rotary_pct", 1.0))
    if pct != 1.0:
        raise ConfigError(f"{source}: rotary_pct={pct} is not supported (1.0: RoPE over the "
                          "whole head)")
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    seq_length = int(cfg.get("seq_length", 2048))
    limit = int(cfg.get("max_position_embeddings", seq_length))
    if cfg.get("use_dynamic_ntk") or cfg.get("use_logn_attn"):
        limit = min(limit, seq_length)   # both are the identity up to seq_length
    dtype = next((name for flag, name in (("bf16", "bfloat16"), ("fp16", "float16"),
                                          ("fp32", "float32")) if cfg.get(flag)),
                 cfg.get("torch_dtype"))
    return {
        "architectures": [ARCHITECTURE],
        "vocab_size": int(cfg["vocab_size"]),
        "hidden_size": hidden,
        "intermediate_size": int(cfg["intermediate_size"]) // 2,
        "num_hidden_layers": int(cfg["num_hidden_layers"]),
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": int(cfg.get("kv_channels") or hidden // heads),
        "rms_norm_eps": float(cfg.get("layer_norm_epsilon", 1e-6)),
        "max_position_embeddings": limit,
        "rope_theta": float(cfg.get("rotary_emb_base", 10000.0)),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "attention_bias": not cfg.get("no_bias", True),   # c_proj's; c_attn always has one
        "torch_dtype": dtype,
    }


def qwen2_tensors(tensors: Iterable[tuple[str, torch.Tensor]], q_size: int, kv_size: int
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """A QWen checkpoint's tensors under the Qwen2 names; c_attn split into q, k and v (rows
    of `q_size`, `kv_size`, `kv_size`). Names it does not know pass unchanged (the loader
    reports what is missing)."""
    for name, tensor in tensors:
        match = _LAYER.match(name)
        if match is None:
            yield _NAMES.get(name, name), tensor
            continue
        prefix, rest = f"model.layers.{match[1]}.", match[2]
        if rest in ("attn.c_attn.weight", "attn.c_attn.bias"):
            kind = rest.rsplit(".", 1)[1]
            q, k, v = tensor.split([q_size, kv_size, kv_size], dim=0)
            for proj, part in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                yield f"{prefix}self_attn.{proj}.{kind}", part
        else:
            yield prefix + _LAYER_NAMES.get(rest, rest), tensor
