"""Granite 4.0-H, the Mamba2 hybrid (model_factory/granite.py, model_factory/mamba2.py; its
transformers parity and state slots are tests/model/test_linear_attention.py's, with every
recurrent hybrid): with state checkpoints (rtpkv/cache/state_group.py) reuse on gives the bits of reuse off, a hit ends on the
last saved boundary, a state saved inside a chunk has the bits of one pass; what its config must
hold is refused by name; no state slot nor checkpoint outlives its request."""

import pytest
import torch

from conftest import chat_turns, random_prompt, run, run_together
from rtpkv.cache.prefix_index import KeyChain
from rtpkv.errors import ConfigError
from rtpkv.kernels import mamba2
from rtpkv.model_factory.spec import ModelSpec

BASE = {"architectures": ["GraniteMoeHybridForCausalLM"], "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 64, "shared_intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "layer_types": ["mamba", "attention"], "mamba_n_heads": 4,
        "mamba_n_groups": 2, "mamba_d_state": 8, "num_local_experts": 0}
MOE = {**BASE, "num_local_experts": 4}


def test_config_is_read_as_transformers_reads_it():
    spec = ModelSpec.from_config({**BASE, "time_step_limit": [0.0, {"__float__": "Infinity"}]})
    assert spec.layer_types == ("linear_attention", "full_attention")   # the legacy names
    assert spec.intermediate_size == 48 and spec.moe is None
    assert (spec.mamba.heads, spec.mamba.head_dim, spec.mamba.dt_max) == (4, 16, float("inf"))
    moe = ModelSpec.from_config(MOE).moe   # two experts a token: transformers' default
    assert (moe.num_experts, moe.expert_intermediate_size, moe.shared_expert_intermediate_size,
            moe.softmax_after_top_k, moe.gated_shared_expert) == (4, 64, 48, True, False)


@pytest.mark.parametrize("field,value,message", [
    ("mamba_n_heads", 3, r"mamba_n_heads=3 is invalid: it must divide mamba_expand \* "
                         r"hidden_size \(64\)"),
    ("mamba_n_groups", 3, r"mamba_n_groups=3 is invalid: it must divide mamba_n_heads \(4\)"),
    ("mamba_d_head", 8, r"mamba_d_head=8 is invalid"),
    ("mamba_d_conv", 0, r"mamba_d_conv=0 is invalid: accepted range is 1\.\.64"),
    ("mamba_d_state", 0, r"mamba_d_state=0 is invalid: accepted values are 1 and above"),
    ("time_step_limit", [0.5, 0.1], r"time_step_limit=\[0.5, 0.1\] is invalid"),
    ("layer_types", ["mamba", "sliding_attention"], r"layer_types=.* is not supported"),
    ("position_embedding_type", "alibi", r"position_embedding_type='alibi' is not supported"),
    ("logits_scaling", 0, r"logits_scaling=0 is invalid"),
    ("num_experts_per_tok", 5, r"num_experts_per_tok=5 is invalid: accepted range is 1\.\.4"),
])
def test_bad_config_is_refused_by_name(field, value, message):
    with pytest.raises(ConfigError, match=message):
        ModelSpec.from_config({**MOE, field: value})


# State checkpoints (rtpkv/cache/state_group.py): a Mamba2 layer's saved states serve reuse
B, STEP = 4, 2               # a checkpoint every 8 tokens
CHECKPOINTED = dict(seq_size_per_block=B, linear_step=STEP, max_num_batched_tokens=16)


@pytest.mark.parametrize("arch", ["granite_hybrid", "granite_hybrid_dense"])
def test_reuse_from_saved_states_gives_the_bits_of_no_reuse(checkpoints, make_pipeline, arch):
    """A chat: each turn hits the last boundary the previous turn saved (inside its answer:
    states are saved as decode steps cross boundaries too), and its tokens and logits are the
    bits of a run without reuse."""
    path = checkpoints(arch)
    plain = chat_turns(make_pipeline(path, **CHECKPOINTED), 3)
    reused = chat_turns(make_pipeline(path, reuse_cache=True, **CHECKPOINTED), 3)
    for (_, a), (_, b) in zip(plain, reused):
        assert a.output_ids == b.output_ids and torch.equal(a.logits, b.logits)
    assert reused[0][1].aux_info["reuse_len"] == 0
    for (computed, _), (_, res) in zip(reused, reused[1:]):
        assert res.aux_info["reuse_len"] == computed // (B * STEP) * (B * STEP) > 0


def test_no_checkpoint_nor_slot_outlives_a_cancelled_request(checkpoints, make_pipeline):
    pipe = make_pipeline(checkpoints("granite_hybrid_dense"), reuse_cache=True,
                         concurrency_limit=2, **CHECKPOINTED)
    stream = pipe(random_prompt(40, 8), top_k=1, ignore_eos=True, max_new_tokens=200)
    next(iter(stream))
    stream.close()   # cancelled mid-decode, its prompt's states saved
    again = run(pipe, random_prompt(40, 8) + [7], max_new_tokens=2)
    assert again.aux_info["reuse_len"] == 40
    stats = pipe.cache_stats()["state_group"]
    assert stats["checkpoints_in_use"] == 0 and stats["live_slots_free"] == 2


def test_a_state_saved_inside_a_chunk_has_the_bits_of_one_pass(checkpoints, make_pipeline):
    path = checkpoints("granite_hybrid_dense")
    prompt = random_prompt(45, 9)
    saved = []
    for chunk in (16, 256):   # chunks of 16 tokens, then one pass
        pipe = make_pipeline(path, reuse_cache=True,
                             **{**CHECKPOINTED, "max_num_batched_tokens": chunk})
        run(pipe, prompt, max_new_tokens=1)
        cache = pipe.engine.cache
        chain = KeyChain(cache.index, prompt, b"", 0, root=cache.roots[0])
        blocks = {i: cache.state_group.pool.cached(chain.key(i)) for i in range(len(prompt) // B)}
        saved.append({i: [t.clone() for t in cache.state_group.states.read_slot(b.block_id)]
                      for i, b in blocks.items() if b is not None})
    chunked, whole = saved
    assert sorted(chunked) == sorted(whole) == [1, 3, 5, 7, 9]   # every STEP-th block
    for i in chunked:
        assert all(torch.equal(x, y) for x, y in zip(chunked[i], whole[i]))


def test_a_task_prompt_pins_the_state_at_its_end(checkpoints, make_pipeline):
    """MULTI_TASK_PROMPT: the Mamba2 states at the task prompt's last whole block are pinned
    (LINEAR_STEP or not) and serve its requests with the bits of the prompt computed in full."""
    path = checkpoints("granite_hybrid")
    system = "You are a helpful assistant: answer every question about the river city."
    pipe = make_pipeline(path, tasks=[{"task_id": "t", "prompt": system}], **CHECKPOINTED)
    plain = make_pipeline(path, **CHECKPOINTED)
    tok = pipe.tokenizer
    question = "what is the river called?"
    with_task = run(pipe, question, task_id="t", max_new_tokens=6, return_logits=True)
    concat = tok(system).input_ids + tok(question, add_special_tokens=False).input_ids
    alone = run(plain, concat, max_new_tokens=6, return_logits=True)
    assert with_task.output_ids == alone.output_ids
    assert torch.equal(with_task.logits, alone.logits)
    assert with_task.aux_info["reuse_len"] == len(tok(system).input_ids) // B * B > 0
    assert pipe.cache_stats()["state_group"]["checkpoints_pinned"] == 1


def test_the_torch_reference_keeps_reuse_and_batching_exact(checkpoints, make_pipeline,
                                                           monkeypatch):
    """Where the C kernels do not build, the Mamba2 layers run kernels/mamba2.py's torch
    reference: reuse on still gives the bits of reuse off, batched the bits of alone."""
    monkeypatch.setattr(mamba2, "_library", lambda: None)
    path = checkpoints("granite_hybrid_dense")
    plain = chat_turns(make_pipeline(path, **CHECKPOINTED), 2)
    reused = make_pipeline(path, reuse_cache=True, **CHECKPOINTED)
    for (_, a), (_, b) in zip(plain, chat_turns(reused, 2)):
        assert a.output_ids == b.output_ids and torch.equal(a.logits, b.logits)
    prompts = [random_prompt(13, 30), random_prompt(21, 31)]
    alone = [run(reused, p, max_new_tokens=4, return_logits=True) for p in prompts]
    for res, together in zip(alone, run_together(reused, prompts, max_new_tokens=4,
                                                 return_logits=True)):
        assert together.output_ids == res.output_ids
        assert torch.equal(together.logits, res.logits)


@pytest.mark.parametrize("mode", [dict(dtype="bfloat16"), dict(weight_type="INT8")])
def test_reuse_stays_exact_in_bfloat16_and_with_int8_weights(checkpoints, make_pipeline, mode):
    path = checkpoints("granite_hybrid")
    plain = chat_turns(make_pipeline(path, **mode, **CHECKPOINTED), 2)
    reused = chat_turns(make_pipeline(path, reuse_cache=True, **mode, **CHECKPOINTED), 2)
    for (_, a), (_, b) in zip(plain, reused):
        assert a.output_ids == b.output_ids and torch.equal(a.logits, b.logits)
    assert reused[-1][1].aux_info["reuse_len"] > 0


def test_a_batch_with_hits_gives_the_bits_of_each_request_alone(checkpoints, make_pipeline):
    path = checkpoints("granite_hybrid")
    shared = random_prompt(29, 7)
    prompts = [shared + random_prompt(n, 10 + n) for n in (3, 12, 21)]
    results = []
    for batched in (False, True):
        pipe = make_pipeline(path, reuse_cache=True, **CHECKPOINTED)
        run(pipe, shared + [5], max_new_tokens=1)   # saves the states after 8, 16 and 24 tokens
        if batched:
            results.append(run_together(pipe, prompts, max_new_tokens=6, return_logits=True))
        else:
            results.append([run(pipe, p, max_new_tokens=6, return_logits=True) for p in prompts])
    for alone, together in zip(*results):
        assert together.output_ids == alone.output_ids
        assert torch.equal(together.logits, alone.logits)
        assert together.aux_info["reuse_len"] == alone.aux_info["reuse_len"] == 24
