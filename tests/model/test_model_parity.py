"""Each supported architecture matches transformers on the same weights: prefill logits within
1e-4 (float32) and 32 greedy tokens, token for token. With int8 weights (WEIGHT_TYPE=INT8) the
reference is transformers holding the same quantized weights: each linear layer's weight
replaced by `dequantize(quantize(w))`, the values the int8 kernel computes with. With int8
weights and activations (WEIGHT_TYPE=W8A8_INT8) every linear layer of transformers computes
`w8a8_linear.reference`, the kernel's bits in torch; there the logits' tolerance is 0.02: the
activation quantizer is a step function, so where a norm or a softmax differs from
transformers' by an ulp at a rounding boundary, one input moves by a whole step (1/127 of its
group's largest value), which moves these models' logits by up to about 0.01 (Qwen3's q/k norms
do it on one prompt position). So greedy tokens are compared up to the first step where
transformers' two best logits are within that tolerance, a tie it cannot order; there ours must
be one of the tied tokens (Gemma 3, whose norms and GeGLU run on the C kernels as the fused
decoder's do, meets one at its 30th token: 0.004 apart). With the int8
KV cache (KV_CACHE_DTYPE=int8) it is transformers with a cache that stores every new K and V as
`dequantize_rows(quantize_rows(x))`, the values the paged kernel reads; the tolerance is the same,
but a K/V value whose float32 rounding differs by an ulp at a rounding boundary of the
quantization could move by one step (the tests pass without allowance for that).

Mixtures of experts: transformers holds each layer's experts as stacked 3D weights, not linear
layers; in the int8 modes each expert's matrices are quantized as a linear layer's are (W8A8:
`W8A8Experts` computes them as the kernel does). The router stays float32 on both sides."""

import pytest
import torch
import transformers
from torch import nn

from transformers.cache_utils import DynamicCache

from rtpkv.kernels import AttentionBatch
from rtpkv.kernels.int8_linear import dequantize, quantize
from rtpkv.kernels.kv_quant import dequantize_rows, quantize_rows, row_width
from rtpkv.kernels.w8a8_linear import reference
from conftest import ARCHITECTURES, load, run
from rtpkv.pipeline import Pipeline

PROMPTS = ["hello, what's your name? tell me about the river city", "The cat sat on"]
MODES = {"float32": {}, "int8": {"weight_type": "INT8"}, "w8a8": {"weight_type": "W8A8_INT8"},
         "int8-kv": {"kv_cache_dtype": "int8"}}
ATOL = {"w8a8": 0.02}   # logits; 1e-4 for the other modes (see above)


class W8A8Reference(nn.Module):
    """A transformers linear layer computing as the W8A8 kernel does."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.q, self.scale = quantize(linear.weight)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x):
        return reference(x, self.q, self.scale, self.bias)


class Int8KVCache(DynamicCache):
    """transformers' cache holding K and V as the int8 KV cache gives them back."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return super().update(dequantize_rows(quantize_rows(key_states)),
                              dequantize_rows(quantize_rows(value_states)), layer_idx,
                              *args, **kwargs)


class W8A8Experts(nn.Module):
    """transformers' experts (stacked weights, its loop over experts) computing each expert's
    projections as the W8A8 kernel does."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.gate_up = [quantize(w) for w in experts.gate_up_proj]
        self.down = [quantize(w) for w in experts.down_proj]
        self.act = experts.act_fn

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x)
        for expert, (gate_up, down) in enumerate(zip(self.gate_up, self.down)):
            token, choice = torch.where(top_k_index == expert)
            if len(token):
                gate, up = reference(x[token], *gate_up, None).chunk(2, dim=-1)
                h = reference(self.act(gate) * up, *down, None)
                out.index_add_(0, token, (h * top_k_weights[token, choice, None]).to(x.dtype))
        return out


def _experts(hf):
    """(parent, name, experts) of every mixture-of-experts layer's stacked experts."""
    return [(parent, name, child) for parent in list(hf.modules())
            for name, child in parent.named_children() if hasattr(child, "gate_up_proj")]


def _cache(mode):
    """The cache transformers runs `mode` with (its `cache` argument; `past_key_values` is the
    deprecated name)."""
    return {"cache": Int8KVCache()} if mode == "int8-kv" else {}


def _hf(path, mode="float32"):
    """transformers on the checkpoint; for int8, every linear layer (the LM head too, untied
    from the embedding) holds its quantized weight; for w8a8, every one is a W8A8Reference."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if mode == "int8":
        for module in list(hf.modules()):
            if isinstance(module, nn.Linear):
                module.weight = nn.Parameter(dequantize(*quantize(module.weight)),
                                             requires_grad=False)
        for _, _, experts in _experts(hf):
            for stacked in (experts.gate_up_proj, experts.down_proj):
                stacked.data = torch.stack([dequantize(*quantize(w)) for w in stacked])
    if mode == "w8a8":
        for parent in list(hf.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, W8A8Reference(child))
        for parent, name, experts in _experts(hf):
            setattr(parent, name, W8A8Experts(experts))
    return hf


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_prefill_logits_match_transformers(checkpoints, arch, mode):
    path = checkpoints(arch)
    model = load(path, **MODES[mode])
    hf = _hf(path, mode)
    ids = model.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    n = ids.shape[1]
    kv_heads, head_dim = model.spec.num_kv_heads, model.spec.head_dim
    row = row_width(head_dim, model.kv_dtype)
    caches = [(torch.zeros(kv_heads * n, row, dtype=model.kv_dtype),
               torch.zeros(kv_heads * n, row, dtype=model.kv_dtype))
              for _ in range(model.spec.num_layers)]
    batch = AttentionBatch(positions=list(range(n)), row_seq=[0] * n, block_tables=[[0]],
                           query_start=[0],
                           query_len=[n], context_len=[n], block_size=n, num_blocks=1,
                           kv_heads=kv_heads)
    meta = model.module.attention_metadata(batch)
    with torch.inference_mode():
        ours = model.module.logits(model.module(ids[0], torch.arange(n), caches, meta))
        theirs = hf(ids, **_cache(mode)).logits[0]
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, atol=ATOL.get(mode, 1e-4), rtol=0)


def _first_tie(logits: tuple[torch.Tensor, ...], atol: float) -> int:
    """The first step whose two best logits are within `atol` (none: the number of steps)."""
    for step, row in enumerate(logits):
        best = row[0].topk(2).values
        if best[0] - best[1] <= atol:
            return step
    return len(logits)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_greedy_generation_matches_transformers(checkpoints, arch, mode):
    path = checkpoints(arch)
    model = load(path, kv_cache_max_tokens=4096, **MODES[mode])
    hf = _hf(path, mode)
    with Pipeline(model, model.tokenizer) as pipe:
        for prompt in PROMPTS:
            ids = model.tokenizer(prompt, return_tensors="pt").input_ids
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=32, min_new_tokens=32, output_logits=True,
                              return_dict_in_generate=True, **_cache(mode))
            expected = out.sequences[0, ids.shape[1]:].tolist()
            res = run(pipe, prompt, max_new_tokens=32, return_logits=True)
            tie = _first_tie(out.logits, ATOL.get(mode, 0.0))
            assert res.output_ids[:tie] == expected[:tie]
            if tie < len(expected):
                step = out.logits[tie][0]
                assert step[res.output_ids[tie]] >= step.max() - ATOL[mode]
            with torch.inference_mode():
                first = hf(ids, **_cache(mode)).logits[0, -1]
            torch.testing.assert_close(res.logits[0], first, atol=ATOL.get(mode, 1e-4), rtol=0)
