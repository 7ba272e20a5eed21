"""Each supported architecture matches transformers on the same weights: prefill logits within
1e-4 (float32) and 32 greedy tokens, token for token."""

import pytest
import torch
import transformers

from rtpkv.kernels import AttentionBatch
from conftest import ARCHITECTURES, load, run
from rtpkv.pipeline import Pipeline

PROMPTS = ["hello, what's your name? tell me about the river city", "The cat sat on"]



def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_prefill_logits_match_transformers(checkpoints, arch):
    path = checkpoints(arch)
    model = load(path)
    hf = _hf(path)
    ids = model.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    n = ids.shape[1]
    kv_heads, head_dim = model.spec.num_kv_heads, model.spec.head_dim
    caches = [(torch.zeros(kv_heads * n, head_dim), torch.zeros(kv_heads * n, head_dim))
              for _ in range(model.spec.num_layers)]
    batch = AttentionBatch(positions=torch.arange(n), row_seq=torch.zeros(n, dtype=torch.long),
                           block_tables=torch.zeros((1, 1), dtype=torch.long), query_start=[0],
                           query_len=[n], context_len=[n], block_size=n, num_blocks=1,
                           kv_heads=kv_heads)
    meta = model.module.attention.build(batch)
    with torch.inference_mode():
        ours = model.module.logits(model.module(ids[0], torch.arange(n), caches, meta))
        theirs = hf(ids).logits[0]
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_greedy_generation_matches_transformers(checkpoints, arch):
    path = checkpoints(arch)
    model = load(path, kv_cache_max_tokens=4096)
    hf = _hf(path)
    with Pipeline(model, model.tokenizer) as pipe:
        for prompt in PROMPTS:
            ids = model.tokenizer(prompt, return_tensors="pt").input_ids
            expected = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=32, min_new_tokens=32)[0, ids.shape[1]:].tolist()
            res = run(pipe, prompt, max_new_tokens=32, return_logits=True)
            assert res.output_ids == expected
            with torch.inference_mode():
                first = hf(ids).logits[0, -1]
            torch.testing.assert_close(res.logits[0], first, atol=1e-4, rtol=0)
