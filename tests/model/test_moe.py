"""The mixture-of-experts layer (model_factory/moe.py) on its own: what it reads from a config,
the names it maps, routing ties broken as transformers breaks them, and a token's output the
same bits whichever tokens share the forward. Parity with transformers end to end is in
test_model_parity.py, reuse and batching through pipelines in engine/test_batch_invariance.py."""

import pytest
import torch
import transformers

from conftest import HYBRID_ARCHITECTURES, load, needs_c_kernels
from rtpkv.errors import ConfigError
from rtpkv.model_factory.moe import MoeSpec, SparseMoe, checkpoint_name, checkpoint_tensors
from rtpkv.model_factory.spec import ModelSpec

QWEN_MOE = {"architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 32, "decoder_sparse_step": 2,
            "mlp_only_layers": [3]}


def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    moe = ModelSpec.from_config(QWEN_MOE).moe
    assert moe.sparse_layers == (1, 5)   # every second layer, but layer 3 is dense
    assert (moe.num_experts, moe.experts_per_token, moe.expert_intermediate_size,
            moe.shared_expert_intermediate_size, moe.normalize_top_k) == (8, 2, 16, 32, False)
    mixtral = ModelSpec.from_config({**QWEN_MOE, "architectures": ["MixtralForCausalLM"],
                                     "num_experts": None, "num_local_experts": 4}).moe
    assert mixtral.sparse_layers == tuple(range(6)) and mixtral.normalize_top_k
    assert mixtral.expert_intermediate_size == 64 and not mixtral.shared_expert_intermediate_size
    assert ModelSpec.from_config({**QWEN_MOE, "architectures": ["Qwen2ForCausalLM"]}).moe is None


@pytest.mark.parametrize("field,value,message", [
    ("num_experts_per_tok", 9, r"num_experts_per_tok=9 is invalid: accepted range is 1\.\.8"),
    ("num_experts_per_tok", 0, r"num_experts_per_tok=0 is invalid"),
    ("num_experts", 0, r"num_experts=0 is invalid"),
    ("decoder_sparse_step", -1, r"decoder_sparse_step=-1 is invalid"),
])
def test_bad_expert_counts_are_refused_by_name(field, value, message):
    with pytest.raises(ConfigError, match=message):
        ModelSpec.from_config({**QWEN_MOE, field: value})


def test_mixtral_names_map_onto_the_modules():
    name = "model.layers.3.block_sparse_moe.experts.12.w{}.weight"
    assert [checkpoint_name("MixtralForCausalLM", name.format(i)) for i in (1, 2, 3)] == [
        f"model.layers.3.mlp.experts.12.{p}_proj.weight" for p in ("gate", "down", "up")]
    assert (checkpoint_name("MixtralForCausalLM", "model.layers.0.block_sparse_moe.gate.weight")
            == "model.layers.0.mlp.gate.weight")
    kept = "model.layers.0.mlp.experts.1.w1.weight"   # not Mixtral: as it is
    assert checkpoint_name("Qwen3MoeForCausalLM", kept) == kept


def test_routing_ties_are_broken_as_transformers_breaks_them():
    """Experts with identical router rows tie on every token: torch.topk's choice, which
    transformers makes, is the one taken."""
    config = transformers.Qwen3MoeConfig(hidden_size=32, num_experts=6, num_experts_per_tok=3,
                                         moe_intermediate_size=16, norm_topk_prob=True)
    router = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(config)
    weight = torch.randn(6, 32)
    weight[4] = weight[1]
    weight[5] = weight[2] = weight[0]
    router.weight.data = weight
    spec = ModelSpec.from_config({**QWEN_MOE, "architectures": ["Qwen3MoeForCausalLM"],
                                  "hidden_size": 32, "num_experts": 6, "num_experts_per_tok": 3,
                                  "norm_topk_prob": True})
    layer = SparseMoe(32, spec.moe, lambda size: torch.nn.Identity())
    layer.gate.weight.data = weight
    x = torch.randn(50, 32)
    _, their_weights, their_experts = router(x)
    weights, experts = layer.route(x)
    assert torch.equal(experts, their_experts)
    torch.testing.assert_close(weights, their_weights, atol=1e-6, rtol=0)


def test_gpt_oss_routing_is_transformers_router():
    """gpt-oss: a biased router, the top-k logits' softmax."""
    config = transformers.GptOssConfig(hidden_size=32, num_local_experts=6, num_experts_per_tok=3)
    router = transformers.models.gpt_oss.modeling_gpt_oss.GptOssTopKRouter(config)
    router.weight.data, router.bias.data = torch.randn(6, 32), torch.randn(6)
    spec = ModelSpec.from_config({**QWEN_MOE, "architectures": ["GptOssForCausalLM"],
                                  "hidden_size": 32, "num_local_experts": 6, "num_experts": None,
                                  "num_experts_per_tok": 3, "intermediate_size": 16})
    moe = spec.moe
    assert (moe.activation, moe.swiglu_alpha, moe.swiglu_limit) == ("clamped_swiglu", 1.702, 7.0)
    assert moe.sparse_layers == tuple(range(6)) and moe.expert_bias and moe.router_bias
    layer = SparseMoe(32, moe, lambda size: torch.nn.Identity())
    layer.gate.weight.data, layer.gate.bias.data = router.weight.data, router.bias.data
    x = torch.randn(50, 32)
    _, their_weights, their_experts = router(x)
    weights, experts = layer.route(x)
    assert torch.equal(experts, their_experts)
    torch.testing.assert_close(weights, their_weights, atol=1e-6, rtol=0)


def test_gpt_oss_stacked_experts_split_into_linear_layers():
    """(experts, in, out) stacks with gate and up interleaved become each expert's (out, in)
    gate, up and down projections; the router becomes `gate`."""
    gate_up = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4)   # inter 2
    down = torch.arange(2 * 2 * 3, dtype=torch.float32).view(2, 2, 3)
    split = dict(checkpoint_tensors("GptOssForCausalLM", [
        ("model.layers.0.mlp.experts.gate_up_proj", gate_up),
        ("model.layers.0.mlp.experts.gate_up_proj_bias", torch.tensor([[1., 2, 3, 4]] * 2)),
        ("model.layers.0.mlp.experts.down_proj", down),
        ("model.layers.0.mlp.router.bias", torch.zeros(2))]))
    prefix = "model.layers.0.mlp."
    assert torch.equal(split[prefix + "experts.1.gate_proj.weight"], gate_up[1][:, ::2].t())
    assert torch.equal(split[prefix + "experts.1.up_proj.weight"], gate_up[1][:, 1::2].t())
    assert split[prefix + "experts.0.up_proj.bias"].tolist() == [2, 4]
    assert torch.equal(split[prefix + "experts.0.down_proj.weight"], down[0].t())
    assert prefix + "gate.bias" in split


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral", "gpt_oss"])
@pytest.mark.parametrize("options", [{}, {"weight_type": "INT8"}, {"weight_type": "W8A8_INT8"},
                                     {"weight_type": "BF16"}, {"dtype": "bfloat16"}])
def test_a_tokens_output_does_not_depend_on_the_others(checkpoints, arch, options):
    """Each token alone, and in a forward of 70 tokens in another order, gives the same bits."""
    module = load(checkpoints(arch), **options).module
    layer = next(layer.mlp for layer in module.model.layers if isinstance(layer.mlp, SparseMoe))
    dtype = module.model.embed_tokens.weight.dtype
    x = torch.randn(70, module.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    x = x.to(dtype)
    with torch.inference_mode():
        together = layer(x)
        order = torch.randperm(70, generator=torch.Generator().manual_seed(1))
        shuffled = layer(x[order])
        alone = torch.cat([layer(x[i:i + 1]) for i in range(70)])
    assert len(set(layer.route(x)[1].flatten().tolist())) == len(layer.experts)   # all used
    assert torch.equal(together, alone)
    assert torch.equal(together[order], shuffled)


@needs_c_kernels
@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral", "qwen3_moe", "gpt_oss",
                                  "granite_hybrid"])
@pytest.mark.parametrize("options", [{}, {"weight_type": "INT8"}, {"weight_type": "W8A8_INT8"},
                                     {"weight_type": "BF16"}])
def test_the_layers_c_call_matches_the_torch_loop(checkpoints, monkeypatch, arch, options):
    """Router, routing, experts and shared expert in C (gpt-oss's biased router, softmax after
    the top-k, biased experts and clamped SwiGLU; Granite's softmax after the top-k and ungated
    shared expert): the torch path's experts and order, the softmax's last bit libm's rather
    than torch's."""
    monkeypatch.setenv("RTPKV_LINEAR", "avx2")
    module = load(checkpoints(arch), **options).module
    layers = [layer.mlp for layer in module.model.layers if isinstance(layer.mlp, SparseMoe)]
    assert all(layer.kernel is not None for layer in layers)
    x = torch.randn(45, module.spec.hidden_size, generator=torch.Generator().manual_seed(2))
    for layer in layers:
        with torch.inference_mode():
            fused = layer(x)
            kernel, layer.kernel = layer.kernel, None
            loop = layer(x)
            layer.kernel = kernel
        torch.testing.assert_close(fused, loop, rtol=1e-5, atol=1e-6)


# every expert of 4 chosen for every token: Mixtral; gpt-oss with its clamp biting at limit 1;
# Granite 4.0-H with its ungated shared expert
EVERY_EXPERT = dict(moe=dict(num_local_experts=4, num_experts_per_tok=4))
EVERY_EXPERT_CHECKPOINTS = {
    "mixtral": dict(architecture="MixtralForCausalLM", intermediate_size=64, **EVERY_EXPERT),
    "gpt_oss": dict(architecture="GptOssForCausalLM", intermediate_size=64, sliding_window=32,
                    config_overrides=dict(swiglu_limit=1.0), **EVERY_EXPERT),
    "granite_hybrid": dict(HYBRID_ARCHITECTURES["granite_hybrid"], config_overrides=dict(
        HYBRID_ARCHITECTURES["granite_hybrid"]["config_overrides"], num_experts_per_tok=4))}


@needs_c_kernels
@pytest.mark.parametrize("arch", list(EVERY_EXPERT_CHECKPOINTS))
@pytest.mark.parametrize("options", [{}, {"weight_type": "BF16"}, {"weight_type": "INT8"},
                                     {"weight_type": "W8A8_INT8"}])
@pytest.mark.parametrize("rows", [1, 2, 45])
def test_the_c_experts_give_the_bits_of_the_torch_loop(tmp_path, monkeypatch, arch, options,
                                                       rows):
    """A zero router (and router bias) and top_k = num_experts: every expert chosen at weight
    1/4 exactly, so no softmax bit nor tie can differ, and the C call's experts (on every weight
    type's kernel all gate_up projections in one parallel region, then all down projections;
    experts of many rows on the prefill tiles; gpt-oss's expert biases and clamped SwiGLU,
    Granite's ungated shared expert) give the loop's bits."""
    from rtpkv.model_factory.tiny import build_tiny_checkpoint

    monkeypatch.setenv("RTPKV_LINEAR", "avx2")
    path = build_tiny_checkpoint(tmp_path, **EVERY_EXPERT_CHECKPOINTS[arch])
    module = load(path, **options).module
    x = torch.randn(rows, module.spec.hidden_size, generator=torch.Generator().manual_seed(5))
    for layer in (layer.mlp for layer in module.model.layers):
        layer.gate.packed.zero_()
        if layer.gate.bias is not None:
            layer.gate.bias.zero_()
        with torch.inference_mode():
            fused = layer(x)
            kernel, layer.kernel = layer.kernel, None
            loop = layer(x)
            layer.kernel = kernel
        assert kernel is not None and torch.equal(fused, loop)


@needs_c_kernels
@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
def test_the_c_routing_breaks_ties_to_the_lower_expert(checkpoints, monkeypatch, tmp_path, arch):
    """Experts with identical router rows (and biases) tie on every token: the C call takes the
    lower indices among them (torch.topk's choice there is its sort's, unspecified), the same
    for a token alone or in any batch; ranked by probability (Mixtral) or by logit (gpt-oss)."""
    import shutil

    monkeypatch.setenv("RTPKV_LINEAR", "avx2")
    path = checkpoints(arch)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for layer in hf.model.layers:
        router = getattr(layer.mlp, "gate", None) or layer.mlp.router
        for param in (router.weight, getattr(router, "bias", None)):
            if param is not None:
                param.data[3] = param.data[1] = param.data[0]
    hf.save_pretrained(tmp_path)
    for name in path.iterdir():
        if name.name.startswith("tokenizer"):
            shutil.copy(name, tmp_path / name.name)
    module = load(tmp_path).module
    x = torch.randn(30, module.spec.hidden_size, generator=torch.Generator().manual_seed(4))
    for layer in (layer.mlp for layer in module.model.layers):
        assert layer.kernel is not None
        with torch.inference_mode():
            fused = layer(x)
            scores = layer.gate(x)
            if not layer.softmax_after_top_k:
                scores = torch.softmax(scores, dim=-1)
            weights, experts = torch.sort(scores, dim=-1, descending=True, stable=True)
            weights, experts = weights[:, :layer.top_k], experts[:, :layer.top_k]
            if layer.softmax_after_top_k:
                weights = torch.softmax(weights, dim=-1)
            else:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            assert (experts[:, :2] == torch.tensor([0, 1])).all(dim=-1).any()   # a tie taken
            flat = experts.flatten()
            order = torch.argsort(flat, stable=True)
            counts = torch.bincount(flat, minlength=len(layer.experts)).tolist()
            expected = layer._experts(x, counts, order // layer.top_k, weights.flatten()[order])
        torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-6)
        assert torch.equal(fused[7:8], layer(x[7:8]))


@pytest.mark.parametrize("env,options", [({"RTPKV_LINEAR": "onednn"}, {}),
                                         ({}, {"dtype": "bfloat16"})])
def test_experts_off_the_c_kernels_run_in_torch(checkpoints, monkeypatch, env, options):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    module = load(checkpoints("mixtral"), **options).module
    assert all(layer.mlp.kernel is None for layer in module.model.layers)


def test_a_sharded_checkpoint_loads_as_the_whole_one(checkpoints, tmp_path):
    """Mixtral's experts spread over many safetensors shards give the same logits."""
    import shutil

    path = checkpoints("mixtral")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.save_pretrained(tmp_path, max_shard_size="200KB")
    for name in path.iterdir():
        if name.name.startswith("tokenizer"):
            shutil.copy(name, tmp_path / name.name)
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 3
    ids = [5, 9, 14, 3, 22, 8, 40]
    logits = []
    for directory in (path, tmp_path):
        module = load(directory).module
        with torch.inference_mode():
            logits.append(module.logits(_prefill(module, ids)))
    assert torch.equal(*logits)


def _prefill(module, ids):
    """The final hidden states of `ids` from an empty cache of one block."""
    from rtpkv.kernels import AttentionBatch

    n, spec = len(ids), module.spec
    caches = [(torch.zeros(spec.num_kv_heads * n, spec.head_dim),
               torch.zeros(spec.num_kv_heads * n, spec.head_dim)) for _ in range(spec.num_layers)]
    batch = AttentionBatch(positions=list(range(n)), row_seq=[0] * n, block_tables=[[0]],
                           query_start=[0], query_len=[n], context_len=[n], block_size=n,
                           num_blocks=1, kv_heads=spec.num_kv_heads)
    return module(torch.tensor(ids), torch.arange(n), caches, module.attention_metadata(batch))


def test_gpt_oss_mxfp4_experts_dequantize_as_transformers_does():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 134, (3, 8, 2), generator=g, dtype=torch.uint8)
    stacked = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)   # (3, in, out)
    split = dict(checkpoint_tensors("GptOssForCausalLM", [
        ("model.layers.1.mlp.experts.down_proj_scales", scales),   # either half first
        ("model.layers.1.mlp.experts.down_proj_blocks", blocks)]))
    for expert in range(3):
        assert torch.equal(split[f"model.layers.1.mlp.experts.{expert}.down_proj.weight"],
                           stacked[expert].t())
    with pytest.raises(ValueError, match=r"MXFP4 expert weights without their other half: "
                                         r"\['model.layers.0.mlp.experts.gate_up_proj_blocks'\]"):
        list(checkpoint_tensors("GptOssForCausalLM",
                                [("model.layers.0.mlp.experts.gate_up_proj_blocks", blocks)]))


def test_a_gpt_oss_mxfp4_checkpoint_loads_as_its_dequantized_weights(checkpoints, tmp_path):
    """The tiny gpt-oss checkpoint with its experts' matrices replaced by random MXFP4 blocks
    and scales, as published checkpoints hold them, gives the logits of the same checkpoint
    holding transformers' dequantization of them (that one is held to transformers in
    test_model_parity.py)."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    path = checkpoints("gpt_oss")
    state = load_file(path / "model.safetensors")
    packed, plain = dict(state), dict(state)
    g = torch.Generator().manual_seed(4)
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = state[name].shape
        blocks = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), generator=g,
                               dtype=torch.uint8)
        scales = torch.randint(118, 125, (experts, outputs, inputs // 32), generator=g,
                               dtype=torch.uint8)
        del packed[name]
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        plain[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    logits = []
    for directory, tensors in ((tmp_path / "mxfp4", packed), (tmp_path / "plain", plain)):
        shutil.copytree(path, directory)
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
        module = load(directory).module
        with torch.inference_mode():
            logits.append(module.logits(_prefill(module, [5, 9, 14, 3, 22, 8, 40])))
    assert torch.equal(*logits)
