"""NUM_SCHEDULER_STEPS: several greedy decode steps in one call of the fused CPU decoder change
when tokens reach a stream, never which tokens, nor what the cache holds afterwards."""

from __future__ import annotations

import pytest
import torch

from conftest import run
from rtpkv.errors import ConfigError
from rtpkv.model_factory import ModelConfig


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (n,), generator=g).tolist()


def _bursts(pipe) -> int:
    """Engine steps that shared a call with the step before (logged one entry per step)."""
    return pipe.engine.steps - pipe.engine.calls


def _outputs(make_pipeline, steps: int, prompts, **config):
    pipe = make_pipeline(num_scheduler_steps=steps, reuse_cache=True)
    assert pipe.model.module.fused is not None   # the path under test runs
    outs = [run(pipe, p, **config).output_ids for p in prompts]
    return pipe, outs


@pytest.mark.parametrize("steps", [2, 8, 64])
def test_bursts_give_the_tokens_of_single_steps(make_pipeline, steps):
    prompts = [_ids(70, 1), _ids(5, 2), _ids(130, 3)]
    _, ref = _outputs(make_pipeline, 1, prompts, max_new_tokens=37)
    pipe, got = _outputs(make_pipeline, steps, prompts, max_new_tokens=37)
    assert got == ref
    assert all(len(o) == 37 for o in got)
    assert _bursts(pipe) > 0


def test_a_batch_in_bursts_matches_each_request_alone(make_pipeline):
    prompts = [_ids(40 + 17 * i, 10 + i) for i in range(4)]
    _, alone = _outputs(make_pipeline, 1, prompts, max_new_tokens=24)
    pipe = make_pipeline(num_scheduler_steps=8, reuse_cache=True)
    streams = [pipe(p, generate_config={"top_k": 1, "ignore_eos": True,
                                        "max_new_tokens": 12 + 4 * i})
               for i, p in enumerate(prompts)]
    outs = [list(s)[-1].output_ids for s in streams]
    assert outs == [a[:12 + 4 * i] for i, a in enumerate(alone)]
    assert _bursts(pipe) > 0


def test_eos_inside_a_burst_ends_the_request_there(make_pipeline):
    """The 6th greedy token made an EOS: the burst's later steps are dropped, the output ends
    at it exactly as without bursts, and every block comes back."""
    prompt = _ids(50, 4)
    _, (free_run,) = _outputs(make_pipeline, 1, [prompt], max_new_tokens=30)
    eos = free_run[5]
    outs = []
    for steps in (1, 16):
        pipe = make_pipeline(num_scheduler_steps=steps, reuse_cache=True)
        pipe.eos_token_ids = frozenset({eos})  # pretend that token is EOS
        outs.append(run(pipe, prompt, max_new_tokens=30, ignore_eos=False).output_ids)
        if steps > 1:
            assert _bursts(pipe) > 0 and pipe.engine.steps < 30
    assert outs[0] == outs[1] == free_run[:free_run.index(eos) + 1]


def test_multi_token_stop_word_inside_a_burst(make_pipeline):
    prompt = _ids(33, 5)
    _, (free_run,) = _outputs(make_pipeline, 1, [prompt], max_new_tokens=30)
    stop = free_run[9:11]
    outs = [run(make_pipeline(num_scheduler_steps=steps), prompt, max_new_tokens=30,
                stop_words_list=[stop]).output_ids for steps in (1, 8)]
    assert outs[0] == outs[1]
    assert len(outs[0]) < 30


# the modes the fused decoder runs: float32 weights, int8, w8a8; float32 or int8 KV
FUSED_MODES = {"float32": {}, "int8": dict(weight_type="INT8"),
               "w8a8": dict(weight_type="W8A8_INT8"), "int8-kv": dict(kv_cache_dtype="int8")}


@pytest.mark.parametrize("mode", FUSED_MODES)
def test_what_a_burst_caches_is_what_single_steps_cache(make_pipeline, mode):
    """A second request over the first one's prompt and output reuses the blocks the burst
    wrote; run one step a call (it asks for logits), its tokens and logits are bit for bit those
    it gets over blocks that single steps wrote."""
    prompt = _ids(60, 6)
    results = []
    for steps in (1, 8):
        pipe = make_pipeline(num_scheduler_steps=steps, reuse_cache=True, **FUSED_MODES[mode])
        assert pipe.model.module.fused is not None
        first = run(pipe, prompt, max_new_tokens=70).output_ids
        second = run(pipe, prompt + first + _ids(3, 7), max_new_tokens=10, return_logits=True)
        results.append((first, second.output_ids, second.aux_info["reuse_len"], second.logits))
        assert (_bursts(pipe) > 0) == (steps > 1)
    assert results[0][:3] == results[1][:3]
    assert results[1][2] >= 128
    assert torch.equal(results[0][3], results[1][3])


def test_sampling_and_logits_requests_run_one_step_a_call(make_pipeline):
    pipe = make_pipeline(num_scheduler_steps=8)
    run(pipe, _ids(20, 8), max_new_tokens=10, return_logits=True)
    run(pipe, _ids(20, 8), max_new_tokens=10, top_k=5, random_seed=1)
    run(pipe, _ids(20, 8), max_new_tokens=10, min_new_tokens=10, ignore_eos=False)
    assert _bursts(pipe) == 0


def test_a_pool_too_full_to_grow_falls_back_to_single_steps(make_pipeline):
    """Blocks for a whole burst are taken up front; where they are not free, the step runs
    alone rather than pausing anyone, and the tokens do not change. Two requests of 12 blocks
    at most share a pool of 16 (MAX_UTILIZATION admits both)."""
    prompts = [_ids(50, 9), _ids(50, 10)]
    _, alone = _outputs(make_pipeline, 1, prompts, max_new_tokens=40)
    pipe = make_pipeline(num_scheduler_steps=64, kv_cache_max_tokens=128, seq_size_per_block=8,
                         capacity_scheduler_policy="MAX_UTILIZATION")
    refused = []
    reserve = pipe.engine.scheduler.reserve_ahead

    def recording(chunks, steps):
        ok = reserve(chunks, steps)
        refused.append(not ok)
        return ok

    pipe.engine.scheduler.reserve_ahead = recording
    streams = [pipe(p, generate_config={"top_k": 1, "ignore_eos": True, "max_new_tokens": 40})
               for p in prompts]
    assert [list(s)[-1].output_ids for s in streams] == alone
    assert any(refused)


def test_num_scheduler_steps_is_validated(monkeypatch):
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        ModelConfig(num_scheduler_steps=0)
    from rtpkv.config import Settings
    monkeypatch.setenv("NUM_SCHEDULER_STEPS", "65")
    with pytest.raises(ConfigError, match="NUM_SCHEDULER_STEPS='65' is invalid"):
        Settings.from_env()
