"""Shared fixtures: tiny checkpoints built once per session, pipelines that are always stopped
and integrity-checked, and a helper to run a prompt to completion."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from rtpkv.config import env_var_names
from rtpkv.model_factory import Model, ModelConfig, ModelFactory
from rtpkv.model_factory.tiny import build_tiny_checkpoint
from rtpkv.pipeline import Pipeline
from redis_server import RedisServer, RedisServerError

torch.set_num_threads(2)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

# Gemma's smallest window in the tests: prompts are checked shorter than, equal to and 3x it
GEMMA_WINDOW = 32

# Each architecture with the features its family brings: GQA everywhere, llama3 RoPE scaling,
# Qwen2's q/k/v bias, Qwen3's q/k norm, tied and untied embeddings; the mixtures of experts with
# a dense layer among sparse ones (Qwen's mlp_only_layers, decoder_sparse_step), renormalised
# top-k weights or not, Qwen2-MoE's gated shared expert, Mixtral's layout; Gemma 2's alternating
# sliding and full layers, query_pre_attn_scalar and both soft-caps; Gemma 3's five-to-one
# pattern (shortened), q/k norm, two RoPE tables (a local base, a linearly scaled global one) and
# a head_dim apart from hidden / heads; gpt-oss's alternating sliding and full layers with
# attention sinks, q/k/v/o biases, YaRN RoPE (scaled past 64 positions, its ramp untruncated)
# and its experts (biased router and projections, a SwiGLU clamp that bites at these sizes);
# Cohere2's sliding layers with (interleaved) RoPE around a full layer without, its parallel
# block, LayerNorm and logit scale.
GPT_OSS_YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 64,
                "rope_theta": 150000.0}
ARCHITECTURES = {
    "llama": dict(architecture="LlamaForCausalLM", rope_scaling=LLAMA3_ROPE),
    "mistral": dict(architecture="MistralForCausalLM", tie_word_embeddings=True),
    "qwen2": dict(architecture="Qwen2ForCausalLM"),
    "qwen3": dict(architecture="Qwen3ForCausalLM", tie_word_embeddings=True),
    "llama_linear_rope": dict(architecture="LlamaForCausalLM", num_kv_heads=4,
                              rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "qwen3_moe": dict(architecture="Qwen3MoeForCausalLM", num_layers=3, tie_word_embeddings=True,
                      moe=dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                               norm_topk_prob=True, mlp_only_layers=[1])),
    "qwen2_moe": dict(architecture="Qwen2MoeForCausalLM",
                      moe=dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                               shared_expert_intermediate_size=64, norm_topk_prob=False,
                               decoder_sparse_step=2)),
    "mixtral": dict(architecture="MixtralForCausalLM", intermediate_size=64,
                    moe=dict(num_local_experts=4, num_experts_per_tok=2)),
    "gemma2": dict(architecture="Gemma2ForCausalLM", sliding_window=GEMMA_WINDOW, num_layers=3,
                   config_overrides=dict(query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                                         final_logit_softcapping=8.0)),
    "gemma3": dict(architecture="Gemma3ForCausalLM", sliding_window=GEMMA_WINDOW, num_layers=4,
                   config_overrides=dict(
                       head_dim=32, query_pre_attn_scalar=32,
                       layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                    "sliding_attention"],
                       rope_parameters={
                           "full_attention": {"rope_type": "linear", "factor": 2.0,
                                              "rope_theta": 1_000_000.0},
                           "sliding_attention": {"rope_type": "default",
                                                 "rope_theta": 10_000.0}})),
    "gpt_oss": dict(architecture="GptOssForCausalLM", sliding_window=GEMMA_WINDOW, num_layers=2,
                    max_position_embeddings=256,
                    moe=dict(num_local_experts=4, num_experts_per_tok=2),
                    config_overrides=dict(swiglu_limit=1.0, rope_parameters=GPT_OSS_YARN)),
    "cohere2": dict(architecture="Cohere2ForCausalLM", sliding_window=GEMMA_WINDOW, num_layers=3,
                    config_overrides=dict(logit_scale=0.5, layer_types=[
                        "sliding_attention", "full_attention", "sliding_attention"])),
}


# The Gated DeltaNet hybrids (tests/model/test_linear_attention.py, tests/cache/
# test_state_checkpoints.py): three linear-attention layers before a gated full-attention one,
# GQA, partial RoPE, grouped value heads; Qwen3-Next's MLP a mixture with a shared expert and a
# dense layer among the sparse ones. Not in ARCHITECTURES: their layers are not all attention.
LINEAR_ATTENTION = dict(
    num_layers=4, num_heads=4, num_kv_heads=2,
    config_overrides=dict(head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                          linear_key_head_dim=16, linear_value_head_dim=16))
HYBRID_ARCHITECTURES = {
    "qwen3_next": dict(LINEAR_ATTENTION, architecture="Qwen3NextForCausalLM",
                       moe=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=48, norm_topk_prob=True,
                                mlp_only_layers=[1])),
    "qwen3_5": dict(LINEAR_ATTENTION, architecture="Qwen3_5ForCausalLM"),
    # Granite 4.0-H (tests/model/test_granite_hybrid.py): Mamba2 layers around an attention
    # layer, its four multipliers away from 1, a mixture of experts beside its shared MLP and
    # RoPE; or dense without RoPE (its published form); transformers' Mamba2 chunk shorter than
    # the prompts
    "granite_hybrid": dict(
        architecture="GraniteMoeHybridForCausalLM", num_layers=3,
        config_overrides=dict(
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            shared_intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
            mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2, mamba_d_state=16,
            mamba_chunk_size=16, position_embedding_type="rope", embedding_multiplier=2.0,
            residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=3.0)),
    "granite_hybrid_dense": dict(
        architecture="GraniteMoeHybridForCausalLM", num_layers=3,
        config_overrides=dict(
            layer_types=["linear_attention", "linear_attention", "full_attention"],
            shared_intermediate_size=96, num_local_experts=0, mamba_n_heads=8,
            mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=16)),
}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """Tests start from an environment that sets none of rtpkv's variables."""
    for name in env_var_names():
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def flash_attn_standin(monkeypatch):
    """tests/flash_attn_standin injected as `flash_attn`, float32 allowed (the real package
    refuses it; see that module): RTPKV_ATTENTION=flash-attn then runs on CPU."""
    import sys

    import flash_attn_standin as standin

    monkeypatch.setitem(sys.modules, "flash_attn", standin)
    monkeypatch.setattr(standin, "ALLOW_FP32", True)
    return standin


TRITON_MODULES = ("rtpkv.kernels.triton_ops", "rtpkv.kernels.triton_attention")


def _fresh_triton_modules(monkeypatch, interpret: bool):
    """rtpkv's Triton kernel modules imported afresh with TRITON_INTERPRET set or not (Triton
    reads it when a kernel is defined), dropped again after the test so that the next test
    imports its own. Skips, with the reason, where triton does not import."""
    import importlib
    import sys

    from rtpkv import kernels
    from rtpkv.kernels import triton_support

    why = triton_support.import_error()
    if why:
        pytest.skip(why)
    if interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for name in TRITON_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
        monkeypatch.delattr(kernels, name.rsplit(".", 1)[1], raising=False)
    yield tuple(importlib.import_module(name) for name in TRITON_MODULES)
    for name in TRITON_MODULES:
        sys.modules.pop(name, None)
        kernels.__dict__.pop(name.rsplit(".", 1)[1], None)


@pytest.fixture
def triton_interpreter(monkeypatch):
    """rtpkv's Triton kernels run by Triton's interpreter on CPU tensors (TRITON_INTERPRET=1).
    Yields (triton_ops, triton_attention)."""
    yield from _fresh_triton_modules(monkeypatch, interpret=True)


@pytest.fixture
def triton_compiled(monkeypatch):
    """rtpkv's Triton kernels as Triton compiles them for a GPU (no interpreter). Yields
    (triton_ops, triton_attention)."""
    yield from _fresh_triton_modules(monkeypatch, interpret=False)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_tiny_checkpoint(tmp_path_factory.mktemp(name),
                                                **{**ARCHITECTURES, **HYBRID_ARCHITECTURES}[name])
        return built[name]

    return get


def c_kernels_missing() -> str | None:
    """Why this host cannot run the project's C kernels (None where it can): the CPU flags it
    lacks, or no working C compiler."""
    from rtpkv.kernels import cpu_build, fp32_linear

    if not cpu_build.available_isas():
        return "this CPU lacks AVX2 or FMA, which the C kernels need"
    if not fp32_linear.available():
        return "the C kernels do not build here (no C compiler, or the build failed)"
    return None


needs_c_kernels = pytest.mark.skipif(c_kernels_missing() is not None,
                                     reason=c_kernels_missing() or "")


@pytest.fixture(scope="session")
def llama_path(checkpoints) -> Path:
    return checkpoints("llama")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A private redis-server on a free loopback port for the whole session. A test that needs
    it fails (never skips) when it cannot be started."""
    try:
        server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    except RedisServerError as exc:
        pytest.fail(str(exc))
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    """The session server's URL, emptied for this test."""
    if not redis_server.ping():  # a test killed it: bring it back
        redis_server.start()
    import redis

    with redis.Redis.from_url(redis_server.url) as client:
        client.flushall()
    return redis_server.url


@pytest.fixture
def own_redis(tmp_path):
    """A redis-server for this test alone (tests that kill and restart it)."""
    (tmp_path / "redis").mkdir()
    try:
        server = RedisServer(tmp_path / "redis").start()
    except RedisServerError as exc:
        pytest.fail(str(exc))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def hf(llama_path):
    """The Llama test checkpoint in transformers, the reference every cache path is held to."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()


def hf_reference(hf, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and the logits of each generated position."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=n, min_new_tokens=n)[0, len(prompt):].tolist()
        logits = hf(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:len(prompt) - 1 + n]
    return out, logits


def load(path: Path, **config: Any) -> Model:
    return ModelFactory.from_huggingface(path, ModelConfig(**config), show_progress=False)


@pytest.fixture
def make_pipeline(llama_path):
    """make_pipeline(path=None, tasks=None, **options) -> a Pipeline that is
    integrity-checked and stopped after the test."""
    made: list[Pipeline] = []

    def make(path: Path | None = None, **options: Any) -> Pipeline:
        extra = {k: options.pop(k) for k in ("tasks",) if k in options}
        options.setdefault("kv_cache_max_tokens", 8192)
        model = load(path or llama_path, **options)
        pipe = Pipeline(model, model.tokenizer, **extra)
        made.append(pipe)
        return pipe

    yield make
    for pipe in made:
        if not pipe.engine.stopped:
            pipe.check_integrity()
        pipe.stop()


@pytest.fixture
def make_one_table_pipeline(make_pipeline):
    """make_one_table_pipeline(path, **options): a pipeline whose model is one KV cache group
    whatever its layers' windows (one table holding every layer's blocks, each layer attending
    over its own window): the reference KV cache groups are checked against."""
    from rtpkv.cache import builder
    from rtpkv.cache.groups import KVGroup

    def make(path: Path, **options: Any) -> Pipeline:
        grouped = builder.kv_groups
        builder.kv_groups = lambda windows, window: (KVGroup(0, window, tuple(range(len(windows)))),)
        try:
            return make_pipeline(path, **options)
        finally:
            builder.kv_groups = grouped

    return make


def use_attention(backend: str, monkeypatch, request) -> None:
    """RTPKV_ATTENTION=backend for this test; "flash-attn" runs the CPU stand-in."""
    if backend == "flash-attn":
        request.getfixturevalue("flash_attn_standin")
    monkeypatch.setenv("RTPKV_ATTENTION", backend)


def random_prompt(n: int, seed: int = 0) -> list[int]:
    """n token ids in [3, 600), seeded: ids every test checkpoint's vocabulary holds."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 600, (n,), generator=g).tolist()


def chat_turns(pipe: Pipeline, turns: int, seed: int = 3) -> list[tuple[int, Any]]:
    """A greedy chat of `turns` turns, each 11 new prompt tokens after the previous answer:
    (tokens computed, response) per turn: the prompt and every new token but the last."""
    history, outs = [], []
    for turn in range(turns):
        history += random_prompt(11, seed + turn)
        res = run(pipe, history, max_new_tokens=7, return_logits=True)
        outs.append((len(history) + 6, res))
        history += res.output_ids
    return outs


def run(pipe: Pipeline, prompt, **config: Any):
    """Run to completion; returns the last response."""
    config.setdefault("top_k", 1)
    config.setdefault("ignore_eos", True)
    res = None
    for res in pipe(prompt, generate_config=config):
        pass
    assert res is not None and res.finished
    return res


def run_together(pipe: Pipeline, prompts, **config: Any) -> list:
    """Every prompt submitted before any is read, so they share the engine's steps; the last
    response of each (greedy, EOS ignored, as `run`)."""
    config.setdefault("top_k", 1)
    config.setdefault("ignore_eos", True)
    streams = [pipe(p, **config) for p in prompts]
    return [list(stream)[-1] for stream in streams]


def idle_in_use(pipe: Pipeline) -> int:
    """Blocks in use that are not pinned: must be 0 once every request has ended."""
    stats = pipe.cache_stats()
    return stats["blocks_in_use"] - stats["blocks_pinned"]
