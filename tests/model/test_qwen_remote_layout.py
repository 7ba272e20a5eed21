"""QWenLMHeadModel (Qwen-7B-Chat's remote-code checkpoint layout) loads without remote code; its
reference is the equivalent Qwen2 model (the same weights under Qwen2's names, checked against
transformers), token for token; its tiktoken tokenizer is checked against tiktoken itself."""

import base64
import json

import pytest
import torch
import transformers
from conftest import load, run
from safetensors.torch import load_file, save_file

from rtpkv.errors import ConfigError
from rtpkv.model_factory.qwen_tokenizer import PATTERN, SPECIAL_TOKENS, VOCAB_FILE
from rtpkv.model_factory.spec import ModelSpec
from rtpkv.model_factory.tiny import build_tiny_checkpoint

SEQ_LENGTH = 512


def _qwen_config(qwen2: dict) -> dict:
    rope = qwen2.get("rope_parameters") or {}
    return {
        "architectures": ["QWenLMHeadModel"], "model_type": "qwen",
        "vocab_size": qwen2["vocab_size"], "hidden_size": qwen2["hidden_size"],
        "intermediate_size": 2 * qwen2["intermediate_size"],
        "num_hidden_layers": qwen2["num_hidden_layers"],
        "num_attention_heads": qwen2["num_attention_heads"], "kv_channels": qwen2["head_dim"],
        "layer_norm_epsilon": qwen2["rms_norm_eps"], "max_position_embeddings": 1024,
        "seq_length": SEQ_LENGTH, "rotary_emb_base": rope.get("rope_theta", 10000.0),
        "rotary_pct": 1.0, "no_bias": True, "use_dynamic_ntk": True, "use_logn_attn": True,
        "tie_word_embeddings": False, "bf16": False, "fp16": False, "fp32": False,
    }


def _qwen_tensors(state: dict, layers: int) -> dict:
    """Qwen2's tensors under QWen's names (q, k and v stacked into c_attn)."""
    out = {"transformer.wte.weight": state["model.embed_tokens.weight"],
           "transformer.ln_f.weight": state["model.norm.weight"],
           "lm_head.weight": state["lm_head.weight"]}
    for i in range(layers):
        old, new = f"model.layers.{i}.", f"transformer.h.{i}."
        for kind in ("weight", "bias"):
            out[f"{new}attn.c_attn.{kind}"] = torch.cat(
                [state[f"{old}self_attn.{p}_proj.{kind}"] for p in "qkv"])
        out[new + "attn.c_proj.weight"] = state[old + "self_attn.o_proj.weight"]
        out[new + "ln_1.weight"] = state[old + "input_layernorm.weight"]
        out[new + "ln_2.weight"] = state[old + "post_attention_layernorm.weight"]
        out[new + "mlp.w1.weight"] = state[old + "mlp.up_proj.weight"]
        out[new + "mlp.w2.weight"] = state[old + "mlp.gate_proj.weight"]
        out[new + "mlp.c_proj.weight"] = state[old + "mlp.down_proj.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def _tiktoken_file(qwen2_dir, path) -> None:
    """qwen.tiktoken from the Qwen2 checkpoint's byte-level BPE: its tokens' bytes, ranked in
    their id order, special tokens left out (QWen numbers those after the ranks)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    decoder = {c: b for b, c in bytes_to_unicode().items()}
    vocab = json.loads((qwen2_dir / "vocab.json").read_text())
    tokens = sorted((i, t) for t, i in vocab.items() if not t.startswith("<|"))
    lines = [base64.b64encode(bytes(decoder[c] for c in t)).decode() + f" {rank}"
             for rank, (_, t) in enumerate(tokens)]
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(the Qwen2 checkpoint, the same weights in QWen's layout with a qwen.tiktoken)."""
    qwen2 = build_tiny_checkpoint(tmp_path_factory.mktemp("qwen2-mha"), "Qwen2ForCausalLM",
                                  num_kv_heads=4)
    cfg = json.loads((qwen2 / "config.json").read_text())
    out = tmp_path_factory.mktemp("qwen-remote")
    (out / "config.json").write_text(json.dumps(_qwen_config(cfg)))
    save_file(_qwen_tensors(load_file(qwen2 / "model.safetensors"), cfg["num_hidden_layers"]),
              out / "model.safetensors")
    _tiktoken_file(qwen2, out / VOCAB_FILE)
    return qwen2, out


def _prompt(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 600, (n,), generator=g).tolist()


def test_the_qwen_layout_gives_the_qwen2_models_tokens_and_logits(pair, make_pipeline):
    """Alone, batched and with reuse: the QWen checkpoint gives the bits of the Qwen2 one,
    whose greedy tokens are transformers'."""
    qwen2, remote = pair
    ours = make_pipeline(remote, reuse_cache=True, seq_size_per_block=8)
    reference = make_pipeline(qwen2, seq_size_per_block=8)
    assert ours.model.spec.architecture == "QWenLMHeadModel"
    hf = transformers.AutoModelForCausalLM.from_pretrained(qwen2, dtype=torch.float32).eval()
    prompts = [_prompt(n, seed=n) for n in (9, 40)]
    for ids in prompts:
        want = run(reference, ids, max_new_tokens=20, return_logits=True)
        x = torch.tensor([ids])
        with torch.inference_mode():
            hf_tokens = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                    max_new_tokens=20, min_new_tokens=20)[0, len(ids):].tolist()
        assert want.output_ids == hf_tokens
        for _ in range(2):   # the second run reuses the first's blocks
            got = run(ours, ids, max_new_tokens=20, return_logits=True)
            assert got.output_ids == want.output_ids
            assert torch.equal(got.logits, want.logits)
        assert got.aux_info["reuse_len"] == (len(ids) - 1) // 8 * 8
    config = dict(top_k=1, ignore_eos=True, max_new_tokens=20)
    streams = [ours(ids, generate_config=config) for ids in prompts]
    for ids, stream in zip(prompts, streams):
        last = list(stream)[-1]
        assert last.output_ids == run(reference, ids, max_new_tokens=20).output_ids


def test_dynamic_ntk_and_logn_cap_the_length_at_seq_length(pair):
    """Both are the identity up to seq_length and are not implemented past it."""
    _, remote = pair
    model = load(remote)
    assert model.spec.max_position_embeddings == SEQ_LENGTH
    assert model.config.max_seq_len == SEQ_LENGTH
    cfg = json.loads((remote / "config.json").read_text())
    cfg.update(use_dynamic_ntk=False, use_logn_attn=False)
    assert ModelSpec.from_config(cfg).max_position_embeddings == 1024
    with pytest.raises(ConfigError, match=r"rotary_pct=0.5 is not supported"):
        ModelSpec.from_config(dict(cfg, rotary_pct=0.5))


def test_the_tiktoken_tokenizer_is_qwens(pair):
    """Encodings equal tiktoken's over the same ranks, pattern and special tokens (what QWen's
    remote tokenizer runs), decoding inverts them, the special tokens take QWen's ids after
    the ranks, and <|endoftext|> and <|im_end|> end a generation."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    _, remote = pair
    model = load(remote)
    tokenizer = model.tokenizer
    ranks = load_tiktoken_bpe(str(remote / VOCAB_FILE))
    special = {t: len(ranks) + i for i, t in enumerate(SPECIAL_TOKENS)}
    reference = tiktoken.Encoding("qwen-test", pat_str=PATTERN, mergeable_ranks=ranks,
                                  special_tokens=special)
    texts = ["hello, what's your name? tell me about the river city 2024!",
             "<|im_start|>user\nhow old are you?<|im_end|>\n<|im_start|>assistant\n",
             "  spaces\tand\nnew lines 12345 caf\u00e9 \u4f60\u597d <|extra_7|>"]
    for text in texts:
        ids = tokenizer(text).input_ids
        assert ids == reference.encode(text, allowed_special="all")
        assert tokenizer.decode(ids) == text
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        len(ranks), len(ranks) + 1, len(ranks) + 2]
    assert set(model.spec.eos_token_ids) == {len(ranks), len(ranks) + 2}
    from rtpkv.chat import render_chat

    chat = render_chat(tokenizer, [{"role": "user", "content": "how old are you?"}])
    assert chat[0] == len(ranks) + 1 and chat.count(len(ranks) + 2) == 1   # ChatML turns
    assert tokenizer.decode(chat).endswith("<|im_end|>\n<|im_start|>assistant\n")
