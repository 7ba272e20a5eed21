"""A recurrent model's saved states as a KV cache group (rtpkv/cache/state_group.py): reuse on
gives the bits of reuse off, alone the bits of batched, a checkpoint written inside a chunk the
bits of one written after one pass; a hit ends on the last saved boundary; checkpoints are
evicted by priority, salted, pinned by task prompts, announced as a "mamba" group's blocks, and
no checkpoint or live slot is left behind by a finished or cancelled request."""

import pytest
import torch

from conftest import chat_turns, random_prompt, run
from prometheus_client import generate_latest

from rtpkv.cache.prefix_index import KeyChain
from rtpkv.config import Settings
from rtpkv.errors import ConfigError
from rtpkv.server.metrics import ServerMetrics

B, STEP = 4, 2               # a checkpoint every 8 tokens
OPTIONS = dict(seq_size_per_block=B, linear_step=STEP, max_num_batched_tokens=16)


def _same(a, b):
    assert a.output_ids == b.output_ids
    assert torch.equal(a.logits, b.logits)


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_reuse_gives_the_bits_of_no_reuse_and_ends_on_the_last_saved_state(
        checkpoints, make_pipeline, arch):
    path = checkpoints(arch)
    plain = chat_turns(make_pipeline(path, **OPTIONS), 4)
    reused = chat_turns(make_pipeline(path, reuse_cache=True, **OPTIONS), 4)
    for (_, a), (_, b) in zip(plain, reused):
        _same(a, b)
    assert reused[0][1].aux_info["reuse_len"] == 0
    for (computed, _), (_, res) in zip(reused, reused[1:]):
        # the last boundary the previous turn saved: inside its answer (11 + 6 tokens: 16,
        # where its prompt's last is 8), or its prompt
        assert res.aux_info["reuse_len"] == computed // (B * STEP) * (B * STEP) > 0
        held = computed // B * B   # whole blocks the previous turn cached
        stop = "state" if held > res.aux_info["reuse_len"] else "partial_block"
        assert res.aux_info["reuse_stop"] == stop


def test_a_batch_with_hits_gives_the_bits_of_each_request_alone(checkpoints, make_pipeline):
    path = checkpoints("qwen3_5")
    shared = random_prompt(29, 7)
    prompts = [shared + random_prompt(n, 10 + n) for n in (3, 12, 21)]
    alone = make_pipeline(path, reuse_cache=True, **OPTIONS)
    run(alone, shared + [5], max_new_tokens=1)
    singles = [run(alone, p, max_new_tokens=6, return_logits=True) for p in prompts]
    together = make_pipeline(path, reuse_cache=True, **OPTIONS)
    run(together, shared + [5], max_new_tokens=1)
    streams = [together(p, top_k=1, ignore_eos=True, max_new_tokens=6, return_logits=True)
               for p in prompts]
    for single, stream in zip(singles, streams):
        res = list(stream)[-1]
        _same(single, res)
        assert res.aux_info["reuse_len"] == 24


def _saved(pipe, prompt):
    """The saved states of `prompt`'s boundaries, by block index: each a list of tensors."""
    cache = pipe.engine.cache
    group = cache.state_group
    out = {}
    chain = KeyChain(cache.index, prompt, b"", 0, root=cache.roots[0])
    for i in range(len(prompt) // B):
        block = group.pool.cached(chain.key(i))
        if block is not None:
            out[i] = [t.clone() for t in group.states.read_slot(block.block_id)]
    return out


def test_a_state_saved_inside_a_chunk_has_the_bits_of_one_pass(checkpoints, make_pipeline):
    path = checkpoints("qwen3_next")
    prompt = random_prompt(45, 9)
    chunked = make_pipeline(path, reuse_cache=True, **OPTIONS)             # 16-token chunks
    whole = make_pipeline(path, reuse_cache=True,
                          **{**OPTIONS, "max_num_batched_tokens": 256})   # one pass
    run(chunked, prompt, max_new_tokens=1)
    run(whole, prompt, max_new_tokens=1)
    a, b = _saved(chunked, prompt), _saved(whole, prompt)
    assert sorted(a) == sorted(b) == [1, 3, 5, 7, 9]   # every STEP-th block of the prompt
    for i in a:
        assert all(torch.equal(x, y) for x, y in zip(a[i], b[i]))


def test_checkpoints_are_evicted_and_nothing_leaks(checkpoints, make_pipeline):
    path = checkpoints("qwen3_5")
    small = dict(OPTIONS, kv_cache_max_tokens=160, concurrency_limit=2)   # 40 blocks, 20 states
    pipe = make_pipeline(path, reuse_cache=True, **small)
    plain = make_pipeline(path, **small)
    for seed in range(8):
        prompt = random_prompt(37, 20 + seed)
        _same(run(pipe, prompt, max_new_tokens=3, return_logits=True),
              run(plain, prompt, max_new_tokens=3, return_logits=True))
    stream = pipe(random_prompt(60, 40), top_k=1, ignore_eos=True, max_new_tokens=100)
    next(iter(stream))
    stream.close()
    run(pipe, random_prompt(9, 41), max_new_tokens=2)
    stats = pipe.cache_stats()["state_group"]
    assert stats["checkpoints"] == 20 and stats["evictions"] > 0
    assert stats["checkpoints_in_use"] == 0 and stats["live_slots_free"] == 2
    # the newest prompt's saved state still hits
    again = run(pipe, random_prompt(37, 27), max_new_tokens=3)
    assert again.aux_info["reuse_len"] == 32


def test_a_salt_shares_no_state(checkpoints, make_pipeline):
    pipe = make_pipeline(checkpoints("qwen3_5"), reuse_cache=True, **OPTIONS)
    prompt = random_prompt(30, 50)
    run(pipe, prompt, max_new_tokens=2, cache_salt="a")
    assert run(pipe, prompt, max_new_tokens=2, cache_salt="b").aux_info["reuse_len"] == 0
    assert run(pipe, prompt, max_new_tokens=2, cache_salt="a").aux_info["reuse_len"] == 24


def test_a_task_prompt_pins_the_state_at_its_end(checkpoints, make_pipeline):
    path = checkpoints("qwen3_next")
    system = "You are a helpful assistant: answer every question about the river city."
    pipe = make_pipeline(path, tasks=[{"task_id": "t", "prompt": system}],
                         **OPTIONS)   # reuse off: the pin still serves
    plain = make_pipeline(path, **OPTIONS)
    tok = pipe.tokenizer
    question = "what is the river called?"
    with_task = run(pipe, question, task_id="t", max_new_tokens=6, return_logits=True)
    concat = tok(system).input_ids + tok(question, add_special_tokens=False).input_ids
    _same(with_task, run(plain, concat, max_new_tokens=6, return_logits=True))
    # the pinned state sits at the task prompt's last whole block, LINEAR_STEP or not
    assert with_task.aux_info["reuse_len"] == len(tok(system).input_ids) // B * B > 0
    assert pipe.cache_stats()["state_group"]["checkpoints_pinned"] == 1


def test_saved_states_are_events_of_a_mamba_group(checkpoints, make_pipeline):
    pipe = make_pipeline(checkpoints("qwen3_5"), reuse_cache=True,
                         kv_cache_event_buffer_max_size=1000, **OPTIONS)
    run(pipe, random_prompt(20, 70), max_new_tokens=1)
    stored = [e for e in pipe.engine.events.drain() if e["type"] == "stored"]
    states = [e for e in stored if e["kv_cache_spec_kind"] == "mamba"]
    blocks = [e for e in stored if e["kv_cache_spec_kind"] == "full_attention"]
    assert len(blocks) == 5 and len(states) == 2   # 20 tokens: 5 blocks, states after 8, 16
    assert {e["group_idx"] for e in states} == {1} and {e["group_idx"] for e in blocks} == {0}
    # a state is keyed like the attention block its prefix ends on
    assert [e["block_hashes"] for e in states] == [blocks[1]["block_hashes"],
                                                   blocks[3]["block_hashes"]]
    # announced again for a late subscriber: each in its own group
    pipe.engine.announce_contents()
    again = [e for e in pipe.engine.events.drain() if e["type"] == "stored"]
    assert sorted(e["group_idx"] for e in again) == [0] * 5 + [1] * 2


def test_linear_step_is_checked_and_named(monkeypatch):
    monkeypatch.setenv("LINEAR_STEP", "0")
    with pytest.raises(ConfigError, match=r"LINEAR_STEP='0' is invalid: accepted range is "
                                          r"1\.\.4096"):
        Settings.from_env()


def test_a_host_tier_hit_is_cut_back_to_the_last_saved_state_on_the_device(checkpoints,
                                                                          make_pipeline):
    """A prefix whose blocks were offloaded to host memory while its saved states stayed on
    the device is onboarded up to the last of them, and answers as without reuse (states
    through the tiers: tests/cache/test_state_tiers.py)."""
    path = checkpoints("qwen3_5")
    tiered = dict(OPTIONS, kv_cache_max_tokens=64, enable_memory_cache=True,
                  memory_cache_size_mb=4)
    pipe = make_pipeline(path, reuse_cache=True, **tiered)
    plain = make_pipeline(path, **OPTIONS)
    prompt = random_prompt(35, 80)             # 8 whole blocks, states after blocks 1, 3, 5, 7
    run(pipe, prompt, max_new_tokens=1)
    for seed in range(3):                # blocks without states, taking the pool's 16 blocks
        run(pipe, random_prompt(50, 81 + seed), max_new_tokens=1, reuse_cache=False)
    again = prompt + random_prompt(6, 90)
    res = run(pipe, again, max_new_tokens=4, return_logits=True)
    _same(res, run(plain, again, max_new_tokens=4, return_logits=True))
    assert res.aux_info["reuse_len"] == 32
    assert res.aux_info["memory_reuse_len"] + res.aux_info["local_reuse_len"] == 32
    assert res.aux_info["memory_reuse_len"] > 0


@pytest.mark.parametrize("mode", [dict(dtype="bfloat16"), dict(weight_type="INT8")])
def test_reuse_stays_exact_in_bfloat16_and_with_int8_weights(checkpoints, make_pipeline, mode):
    path = checkpoints("qwen3_next")
    plain = chat_turns(make_pipeline(path, **mode, **OPTIONS), turns=3)
    reused = chat_turns(make_pipeline(path, reuse_cache=True, **mode, **OPTIONS), turns=3)
    for (_, a), (_, b) in zip(plain, reused):
        _same(a, b)
    assert reused[-1][1].aux_info["reuse_len"] > 0


def test_paused_requests_resume_from_their_saved_states(checkpoints, make_pipeline):
    """MAX_UTILIZATION on a small pool pauses requests (their live slots and planned states
    given back) and resumes them from what they saved: the answers of each request alone."""
    path = checkpoints("qwen3_5")
    shared = random_prompt(20, 100)
    prompts = [shared + random_prompt(9, 101 + i) for i in range(6)]
    alone = make_pipeline(path, **OPTIONS)
    expected = [run(alone, p, max_new_tokens=24, return_logits=True) for p in prompts]
    pipe = make_pipeline(path, reuse_cache=True, capacity_scheduler_policy="MAX_UTILIZATION",
                         **dict(OPTIONS, kv_cache_max_tokens=96, concurrency_limit=4))
    streams = [pipe(p, top_k=1, ignore_eos=True, max_new_tokens=24, return_logits=True)
               for p in prompts]
    results = [list(s)[-1] for s in streams]
    for want, got in zip(expected, results):
        _same(want, got)
    assert sum(r.aux_info["num_preemptions"] for r in results) > 0
    stats = pipe.cache_stats()["state_group"]
    assert stats["checkpoints_in_use"] == 0 and stats["live_slots_free"] == 4


def test_saved_states_are_on_metrics(checkpoints, make_pipeline):
    pipe = make_pipeline(checkpoints("qwen3_5"), reuse_cache=True, **OPTIONS)
    run(pipe, random_prompt(20, 110), max_new_tokens=1)
    metrics = ServerMetrics(pipe.cache_stats, lambda: 0, "m")
    text = generate_latest(metrics.registry).decode()
    assert 'rtpkv_recurrent_states{state="cached"} 2.0' in text
    assert "rtpkv_recurrent_live_slots_free" in text and "rtpkv_recurrent_state_bytes" in text
