"""Models whose layers attend over different windows (Gemma 2, Gemma 3, gpt-oss with its
attention sinks, Cohere2, Qwen2 with full and sliding layers) run each layer's own window: greedy tokens and every step's logits equal
transformers' (float32) at prompts shorter than, equal to and 3x the smallest window, alone and
batched, and prefix reuse gives recomputation's outputs."""

import json

import pytest
import torch
import transformers
from conftest import (GEMMA_WINDOW as W, idle_in_use, load, needs_c_kernels, random_prompt, run,
                      use_attention)

from rtpkv.model_factory.tiny import build_tiny_checkpoint

LENGTHS = (W // 2, W, 3 * W)
NEW = 24   # decodes: the shortest prompt's queries pass the window too
# Gemma 2 soft-caps attention logits, which the torch and cpu-paged backends do; gpt-oss's
# sinks are added by the torch and cpu-paged backends; flash-attn: the CPU stand-in (conftest)
CASES = [("gemma2", "torch"), pytest.param("gemma2", "cpu-paged", marks=needs_c_kernels),
         ("gemma3", "torch"), pytest.param("gemma3", "cpu-paged", marks=needs_c_kernels),
         ("gemma3", "flash-attn"),
         ("gpt_oss", "torch"), pytest.param("gpt_oss", "cpu-paged", marks=needs_c_kernels),
         ("cohere2", "torch"), pytest.param("cohere2", "cpu-paged", marks=needs_c_kernels)]


def _hf_generate(hf, ids, new=NEW):
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                          max_new_tokens=new, min_new_tokens=new, output_logits=True,
                          return_dict_in_generate=True)
    return out.sequences[0, len(ids):].tolist(), torch.cat(out.logits)


def _run_together(pipe, prompts, **config):
    """Every prompt submitted before any is read, so they share steps; the last responses."""
    config = dict(top_k=1, ignore_eos=True, **config)
    streams = [pipe(ids, generate_config=config) for ids in prompts]
    results = []
    for stream in streams:
        res = None
        for res in stream:
            pass
        results.append(res)
    return results


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch,backend", CASES)
def test_layer_windows_match_transformers(checkpoints, make_pipeline, monkeypatch, request, arch,
                                          backend):
    """Prefilled in chunks of 40 (windows across chunk boundaries) and whole, alone and the
    three prompts batched."""
    use_attention(backend, monkeypatch, request)
    path = checkpoints(arch)
    hf = _hf(path)
    chunked = make_pipeline(path, seq_size_per_block=8, max_num_batched_tokens=40)
    whole = make_pipeline(path, seq_size_per_block=8)
    assert chunked.model.module.attention.name == backend   # the fused decoder may run on it
    if arch == "cohere2":   # LayerNorm, parallel block: not in decoder.c
        assert chunked.model.module.fused is None
    windows = {layer.attention.window for layer in chunked.model.module.plan.layers}
    assert windows == {None, W}
    assert chunked.cache_stats()["attention_window"] is None   # full layers keep every block
    prompts = [random_prompt(n, seed=n) for n in LENGTHS]
    expected = [_hf_generate(hf, ids) for ids in prompts]
    for pipe in (chunked, whole):
        for ids, (tokens, logits) in zip(prompts, expected):
            res = run(pipe, ids, max_new_tokens=NEW, return_logits=True)
            assert res.output_ids == tokens
            torch.testing.assert_close(res.logits, logits, atol=1e-4, rtol=0)
    batched = _run_together(chunked, prompts, max_new_tokens=NEW, return_logits=True)
    assert max(len(step) for step in chunked.engine.step_log) >= 2   # they shared steps
    for res, (tokens, logits) in zip(batched, expected):
        assert res.output_ids == tokens
        torch.testing.assert_close(res.logits, logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch,backend", CASES)
def test_reuse_across_windows_equals_recomputation(checkpoints, make_pipeline, monkeypatch,
                                                   request, arch, backend):
    """A conversation that grows past 3x the window, each turn twice, with reuse and without:
    the same tokens and logits (bit for bit on the batch-invariant CPU kernel), each turn
    reusing every full block of the last; then the turns batched."""
    use_attention(backend, monkeypatch, request)
    path = checkpoints(arch)
    reused = make_pipeline(path, seq_size_per_block=8, reuse_cache=True,
                           max_num_batched_tokens=40)
    plain = make_pipeline(path, seq_size_per_block=8, max_num_batched_tokens=40)
    history, turns = random_prompt(W // 2 + 3, seed=5), []
    for turn in range(3):
        for again in range(2):
            a = run(reused, history, max_new_tokens=12, return_logits=True)
            b = run(plain, history, max_new_tokens=12, return_logits=True)
            assert a.output_ids == b.output_ids
            torch.testing.assert_close(a.logits, b.logits, atol=1e-4, rtol=0)
            if backend == "cpu-paged":
                assert torch.equal(a.logits, b.logits)
            if again:
                assert a.aux_info["reuse_len"] == (len(history) - 1) // 8 * 8
            reused.check_integrity()
        turns.append(history)
        history = history + a.output_ids + random_prompt(W + 5, seed=turn)
    assert len(history) > 3 * W
    together = _run_together(reused, turns + [history], max_new_tokens=12, return_logits=True)
    alone = [run(plain, ids, max_new_tokens=12, return_logits=True) for ids in turns + [history]]
    for a, b in zip(together, alone):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(a.logits, b.logits, atol=1e-4, rtol=0)
    assert idle_in_use(reused) == 0


@needs_c_kernels   # reads the CPU paged kernel's per-layer metadata
def test_max_attention_window_caps_every_layer(checkpoints, make_pipeline):
    """MAX_ATTENTION_WINDOW under a Gemma model's own windows: every layer attends at most
    that many tokens (the sliding layers' smaller window stays), and the cache releases the
    blocks behind it."""
    path = checkpoints("gemma3")
    pipe = make_pipeline(path, seq_size_per_block=8, max_attention_window=2 * W)
    module = pipe.model.module
    assert pipe.cache_stats()["attention_window"] == 2 * W
    from rtpkv.kernels import AttentionBatch

    batch = AttentionBatch(positions=[0], row_seq=[0], block_tables=[[0]], query_start=[0],
                           query_len=[1], context_len=[1], block_size=8, num_blocks=1,
                           kv_heads=module.spec.num_kv_heads, window=2 * W)
    metas = module.attention_metadata(batch)
    kinds = [layer.attention.window for layer in module.plan.layers]
    assert [m.window for m in metas] == [W if k == W else 2 * W for k in kinds]
    assert len({id(m) for m in metas}) == 2   # one build per distinct window
    res = run(pipe, random_prompt(3 * W, seed=1), max_new_tokens=8)
    assert res.finished and idle_in_use(pipe) == 0


def test_qwen2_with_full_and_sliding_layers_matches_transformers_past_the_window(tmp_path,
                                                                                 make_pipeline):
    """Qwen2's first max_window_layers attend fully and the rest slide: each layer keeps its own
    window, so max_seq_len is no longer capped at the window."""
    path = build_tiny_checkpoint(tmp_path, "Qwen2ForCausalLM", sliding_window=W)
    cfg = path / "config.json"
    data = json.loads(cfg.read_text())
    data["max_window_layers"], data["layer_types"] = 1, ["full_attention", "sliding_attention"]
    cfg.write_text(json.dumps(data))
    model = load(path)
    assert model.spec.layer_windows == (None, W) and model.config.max_seq_len == 1024
    pipe = make_pipeline(path, seq_size_per_block=8, max_num_batched_tokens=40)
    ids = random_prompt(3 * W, seed=3)
    tokens, logits = _hf_generate(_hf(path), ids)
    res = run(pipe, ids, max_new_tokens=NEW, return_logits=True)
    assert res.output_ids == tokens
    torch.testing.assert_close(res.logits, logits, atol=1e-4, rtol=0)


GEMMA3_270M = {   # google/gemma-3-270m's config.json (transformers 4 layout), abridged
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 640, "intermediate_size": 2048,
    "max_position_embeddings": 32768, "num_attention_heads": 4, "num_hidden_layers": 18,
    "num_key_value_heads": 1, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000.0, "rope_scaling": None, "rope_theta": 1000000.0,
    "sliding_window": 512, "vocab_size": 262144, "attn_logit_softcapping": None,
    "final_logit_softcapping": None, "eos_token_id": 1, "bos_token_id": 2,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
}


def test_a_real_gemma3_config_reads_as_transformers_reads_it():
    from rtpkv.model_factory.plan import GLOBAL_ROPE, LOCAL_ROPE, model_plan
    from rtpkv.model_factory.spec import ModelSpec

    spec = ModelSpec.from_config(GEMMA3_270M)
    assert spec.tie_word_embeddings and spec.qk_norm and spec.model_window is None
    assert spec.layer_windows == ((512,) * 5 + (None,)) * 3
    plan = model_plan(spec)
    assert plan.ropes[GLOBAL_ROPE]["rope_theta"] == 1e6
    assert plan.ropes[LOCAL_ROPE]["rope_theta"] == 1e4
    assert [layer.attention.rope for layer in plan.layers[:6]] == [LOCAL_ROPE] * 5 + [GLOBAL_ROPE]
    assert plan.layers[0].attention.scale == 256 ** -0.5 and plan.embedding_scale == 640 ** 0.5
    assert plan.final_softcap is None and not plan.softcapped_attention
    unpatterned = dict(GEMMA3_270M, sliding_window_pattern=3)
    del unpatterned["layer_types"]   # the pattern transformers falls back on
    assert ModelSpec.from_config(unpatterned).layer_windows == (512, 512, None) * 6


COMMAND_R7B = {   # CohereForAI/c4ai-command-r7b-12-2024's config.json, abridged
    "architectures": ["Cohere2ForCausalLM"], "model_type": "cohere2", "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
    "num_hidden_layers": 32, "layer_norm_eps": 1e-05, "logit_scale": 0.25,
    "max_position_embeddings": 132096, "rope_theta": 50000, "sliding_window": 4096,
    "sliding_window_pattern": 4, "vocab_size": 256000, "hidden_act": "silu",
}


def test_a_cohere2_config_reads_as_transformers_reads_it():
    from rtpkv.model_factory.plan import GLOBAL_ROPE, model_plan
    from rtpkv.model_factory.spec import ModelSpec

    spec = ModelSpec.from_config(COMMAND_R7B)
    assert spec.tie_word_embeddings and spec.rms_norm_eps == 1e-5 and spec.logit_scale == 0.25
    assert spec.layer_windows == ((4096,) * 3 + (None,)) * 8
    plan = model_plan(spec)
    assert [layer.attention.rope for layer in plan.layers[:4]] == [GLOBAL_ROPE] * 3 + [None]
    assert all(layer.parallel and layer.norm.centered for layer in plan.layers)
    assert plan.logit_scale == 0.25 and plan.ropes[GLOBAL_ROPE]["rope_theta"] == 50000


@pytest.mark.parametrize("change,message", [
    (dict(layer_types=["sliding_attention"] * 17), r"layer_types=.* one entry per layer \(18\)"),
    (dict(layer_types=["chunked_attention"] * 18), r"layer_types=.* each one of full_attention"),
    (dict(hidden_activation="gelu"), r"hidden_activation='gelu' is not supported for "
                                     r"Gemma3ForCausalLM \(supported: gelu_pytorch_tanh\)"),
    (dict(use_bidirectional_attention=True), r"use_bidirectional_attention=true"),
    (dict(final_logit_softcapping=-1.0), r"final_logit_softcapping=-1.0 is invalid"),
    (dict(rope_scaling={"rope_type": "longrope", "factor": 4.0}),
     r"rope_parameters.full_attention type 'longrope' is not supported"),
])
def test_unsupported_gemma_configs_are_refused_by_field(change, message):
    from rtpkv.errors import ConfigError
    from rtpkv.model_factory.spec import ModelSpec

    with pytest.raises(ConfigError, match=message):
        ModelSpec.from_config(dict(GEMMA3_270M, **change))


@pytest.mark.parametrize("backend", ["flash-attn", "triton"])
def test_attention_sinks_on_another_backend_are_refused_by_name(checkpoints, monkeypatch,
                                                                request, backend):
    use_attention(backend, monkeypatch, request)
    with pytest.raises(ValueError, match=rf"RTPKV_ATTENTION={backend} does not add attention "
                                         r"sinks \(gpt-oss's per-head softmax logits\): use "
                                         r"cpu-paged, torch or auto"):
        load(checkpoints("gpt_oss"))


@pytest.mark.parametrize("backend", ["flash-attn"])
def test_softcapped_attention_on_another_backend_is_refused_by_name(checkpoints, monkeypatch,
                                                                   request, backend):
    use_attention(backend, monkeypatch, request)
    with pytest.raises(ValueError, match=rf"RTPKV_ATTENTION={backend} does not soft-cap "
                                         r"attention logits \(attn_logit_softcapping"):
        load(checkpoints("gemma2"))


@pytest.mark.parametrize("arch", ["gpt_oss", "gemma2"])
def test_the_torch_backends_batched_path_matches_transformers(checkpoints, make_pipeline,
                                                              monkeypatch, request, arch):
    """The torch backend's path of CUDA (decodes attended together under a mask, each prefill
    chunk in one call), run here on the CPU: gpt-oss's sinks and Gemma 2's soft-cap there too,
    alone and batched."""
    use_attention("torch", monkeypatch, request)
    path = checkpoints(arch)
    pipe = make_pipeline(path, seq_size_per_block=8, max_num_batched_tokens=40)
    pipe.model.module.attention.per_row = False
    prompts = [random_prompt(n, seed=n) for n in LENGTHS]
    hf = _hf(path)
    expected = [_hf_generate(hf, ids) for ids in prompts]
    batched = _run_together(pipe, prompts, max_new_tokens=NEW, return_logits=True)
    for res, (tokens, logits) in zip(batched, expected):
        assert res.output_ids == tokens
        torch.testing.assert_close(res.logits, logits, atol=1e-4, rtol=0)
