"""RoPE types beyond the default one (model_factory/spec.py's ROPE_TYPES): YaRN on Qwen2 and
Qwen3 (its interpolation ramp and the attention factor on the cos/sin tables, from `factor` or
from `mscale`), dynamic NTK on Llama (the identity up to max_position_embeddings, which caps
max_seq_len): greedy tokens and every step's logits equal transformers' (float32) across the
scaled positions. A RoPE type rtpkv does not compute is refused by name, with the list."""

import pytest
import torch
import transformers
from conftest import load, random_prompt, run

from rtpkv.errors import ConfigError
from rtpkv.model_factory.spec import ROPE_TYPES, ModelSpec
from rtpkv.model_factory.tiny import build_tiny_checkpoint

NEW = 16
CASES = {
    # the transformers 4 layout ("type"), original_max_position_embeddings at the top level
    "qwen2-yarn": dict(architecture="Qwen2ForCausalLM", max_position_embeddings=256,
                       rope_scaling={"type": "yarn", "factor": 4.0},
                       config_overrides=dict(original_max_position_embeddings=64)),
    "qwen3-yarn-mscale": dict(architecture="Qwen3ForCausalLM", max_position_embeddings=256,
                              rope_scaling={"rope_type": "yarn", "factor": 8.0, "mscale": 1.0,
                                            "mscale_all_dim": 0.5, "beta_fast": 16.0,
                                            "original_max_position_embeddings": 32}),
    "llama-dynamic": dict(architecture="LlamaForCausalLM", max_position_embeddings=128,
                          rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rope_types_match_transformers(tmp_path, make_pipeline, case):
    """A prompt inside the original context and one past it (up to max_position_embeddings),
    alone and with reuse of the first's prefix."""
    path = build_tiny_checkpoint(tmp_path, **CASES[case])
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pipe = make_pipeline(path, seq_size_per_block=8, reuse_cache=True)
    limit = CASES[case]["max_position_embeddings"]
    short = random_prompt(24, seed=1)
    for ids in (short, short + random_prompt(limit - NEW - 24, seed=2)):
        x = torch.tensor([ids])
        with torch.inference_mode():
            out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                              max_new_tokens=NEW, min_new_tokens=NEW, output_logits=True,
                              return_dict_in_generate=True)
        res = run(pipe, ids, max_new_tokens=NEW, return_logits=True)
        assert res.output_ids == out.sequences[0, len(ids):].tolist()
        torch.testing.assert_close(res.logits, torch.cat(out.logits), atol=1e-4, rtol=0)
    assert res.aux_info["reuse_len"] == 24 // 8 * 8


def test_yarn_attention_factor_is_transformers():
    spec = ModelSpec.from_config({**_QWEN2, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                            "original_max_position_embeddings": 64}})
    assert spec.rope_attention_factor() == pytest.approx(0.1 * torch.log(torch.tensor(4.0)) + 1)
    assert ModelSpec.from_config(_QWEN2).rope_attention_factor() == 1.0


def test_dynamic_ntk_caps_max_seq_len_at_max_position_embeddings(tmp_path):
    path = build_tiny_checkpoint(tmp_path, **CASES["llama-dynamic"])
    with pytest.raises(ConfigError, match=r"max_seq_len=129 is invalid: this checkpoint accepts "
                                          r"at most 128 tokens"):
        load(path, max_seq_len=129)


_QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
          "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "max_position_embeddings": 256}


@pytest.mark.parametrize("rope,message", [
    ({"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4},
     "rope type 'longrope' is not supported"),
    ({"type": "proportional", "factor": 2.0}, "rope type 'proportional' is not supported"),
    ({"rope_type": "yarn", "factor": 2.0, "partial_rotary_factor": 0.5},
     "rope partial_rotary_factor=0.5 is not supported"),
])
def test_unsupported_rope_is_refused_by_name(rope, message):
    with pytest.raises(ConfigError, match=message) as error:
        ModelSpec.from_config({**_QWEN2, "rope_scaling": rope})
    if "type" in message:
        assert f"(supported: {', '.join(ROPE_TYPES)})" in str(error.value)


GPT_OSS_20B = {   # openai/gpt-oss-20b's config.json, abridged
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
    "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "intermediate_size": 2880,
    "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
    "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32,
    "rms_norm_eps": 1e-05, "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "vocab_size": 201088,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "quantization_config": {"quant_method": "mxfp4"},
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn",
                     "truncate": False},
}


def test_a_real_gpt_oss_config_reads_as_transformers_reads_it():
    """Its windows, sinks, biases and experts; its YaRN frequencies and attention factor equal
    transformers' own computation on the same config."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    spec = ModelSpec.from_config(GPT_OSS_20B)
    assert spec.layer_windows == (128, None) * 12 and spec.attention_sinks
    assert spec.qkv_bias and spec.o_proj_bias and not spec.tie_word_embeddings
    moe = spec.moe
    assert (moe.num_experts, moe.experts_per_token, moe.expert_intermediate_size) == (32, 4, 2880)
    assert moe.swiglu_limit == 7.0 and moe.swiglu_alpha == 1.702
    config = transformers.GptOssConfig(**{k: v for k, v in GPT_OSS_20B.items()
                                          if k not in ("architectures", "quantization_config")})
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    assert torch.equal(spec.inv_freq(), inv_freq)
    assert spec.rope_attention_factor() == factor
