"""NUM_SCHEDULER_STEPS: several greedy decode steps in one call of the fused CPU decoder change
when tokens reach a stream, never which tokens, nor what the cache holds afterwards."""

from __future__ import annotations

import pytest
import torch

from conftest import idle_in_use, needs_c_kernels, run
from rtpkv.errors import ConfigError
from rtpkv.model_factory import ModelConfig

pytestmark = needs_c_kernels


@pytest.fixture(autouse=True)
def fused_path(monkeypatch):
    """The fused decoder needs every linear layer on the C kernels: float32 models ask for the
    avx2 path by name instead of relying on what `auto` picks on this host."""
    monkeypatch.setenv("RTPKV_LINEAR", "avx2")

# the modes the fused decoder runs: float32 weights, int8, w8a8; float32 or int8 KV
FUSED_MODES = {"float32": {}, "int8": dict(weight_type="INT8"),
               "w8a8": dict(weight_type="W8A8_INT8"), "int8-kv": dict(kv_cache_dtype="int8")}


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (n,), generator=g).tolist()


SHARED: dict[int, int] = {}   # id(runner) -> steps that shared a model call with the one before


@pytest.fixture(autouse=True)
def count_bursts(monkeypatch):
    """Counts, per runner, the steps each burst's call ran beyond its first."""
    from rtpkv.engine.model_runner import ModelRunner

    run_burst = ModelRunner.run_burst

    def counted(self, *args, **kwargs):
        tokens = run_burst(self, *args, **kwargs)
        SHARED[id(self)] = SHARED.get(id(self), 0) + max(0, len(tokens) - 1)
        return tokens

    monkeypatch.setattr(ModelRunner, "run_burst", counted)
    SHARED.clear()


def _bursts(pipe) -> int:
    """Engine steps that shared a model call with the step before."""
    return SHARED.get(id(pipe.engine.runner), 0)


def _outputs(make_pipeline, steps: int, prompts, max_new_tokens: int, **options):
    pipe = make_pipeline(num_scheduler_steps=steps, reuse_cache=True, **options)
    assert pipe.model.module.fused is not None   # the path under test runs
    outs = [run(pipe, p, max_new_tokens=max_new_tokens).output_ids for p in prompts]
    return pipe, outs


@pytest.mark.parametrize("steps", [2, 8, 64])
def test_bursts_give_the_tokens_of_single_steps(make_pipeline, steps):
    prompts = [_ids(70, 1), _ids(5, 2), _ids(130, 3)]
    _, ref = _outputs(make_pipeline, 1, prompts, max_new_tokens=37)
    pipe, got = _outputs(make_pipeline, steps, prompts, max_new_tokens=37)
    assert got == ref
    assert all(len(o) == 37 for o in got)
    assert _bursts(pipe) > 0


@pytest.mark.parametrize("arch,options", [("qwen3_moe", {}), ("qwen2_moe", {"weight_type": "INT8"}),
                                          ("mixtral", {"kv_cache_dtype": "int8"}), ("gpt_oss", {}),
                                          ("gpt_oss", {"weight_type": "W8A8_INT8"})])
def test_mixtures_of_experts_run_in_bursts(make_pipeline, checkpoints, arch, options):
    """The fused decoder's sparse layers (one C call each, router included; gpt-oss's with its
    attention sinks): bursts give each request's tokens alone, batched."""
    prompts = [_ids(30 + 19 * i, 20 + i) for i in range(3)]
    path = checkpoints(arch)
    _, alone = _outputs(make_pipeline, 1, prompts, max_new_tokens=16, path=path, **options)
    pipe = make_pipeline(path, num_scheduler_steps=8, reuse_cache=True, **options)
    assert pipe.model.module.fused is not None
    streams = [pipe(p, generate_config={"top_k": 1, "ignore_eos": True, "max_new_tokens": 16})
               for p in prompts]
    assert [list(s)[-1].output_ids for s in streams] == alone
    assert _bursts(pipe) > 0


@pytest.mark.parametrize("mode", FUSED_MODES)
def test_a_batch_in_bursts_matches_each_request_alone(make_pipeline, mode):
    prompts = [_ids(40 + 17 * i, 10 + i) for i in range(4)]
    _, alone = _outputs(make_pipeline, 1, prompts, max_new_tokens=24, **FUSED_MODES[mode])
    pipe = make_pipeline(num_scheduler_steps=8, reuse_cache=True, **FUSED_MODES[mode])
    streams = [pipe(p, generate_config={"top_k": 1, "ignore_eos": True,
                                        "max_new_tokens": 12 + 4 * i})
               for i, p in enumerate(prompts)]
    outs = [list(s)[-1].output_ids for s in streams]
    assert outs == [a[:12 + 4 * i] for i, a in enumerate(alone)]
    assert _bursts(pipe) > 0


@pytest.mark.parametrize("mode", FUSED_MODES)
def test_eos_inside_a_burst_ends_the_request_there(make_pipeline, mode):
    """The 6th greedy token made an EOS: the burst's later steps are dropped, the output ends
    at it exactly as without bursts, and every block comes back."""
    prompt = _ids(50, 4)
    _, (free_run,) = _outputs(make_pipeline, 1, [prompt], max_new_tokens=30, **FUSED_MODES[mode])
    eos = free_run[5]
    outs = []
    for steps in (1, 16):
        pipe = make_pipeline(num_scheduler_steps=steps, reuse_cache=True, **FUSED_MODES[mode])
        pipe.eos_token_ids = frozenset({eos})  # pretend that token is EOS
        outs.append(run(pipe, prompt, max_new_tokens=30, ignore_eos=False).output_ids)
        assert (_bursts(pipe) > 0) == (steps > 1)
        assert idle_in_use(pipe) == 0
    assert outs[0] == outs[1] == free_run[:free_run.index(eos) + 1]


@pytest.mark.parametrize("length", [1, 2])
def test_stop_words_inside_a_burst(make_pipeline, length):
    """A one-token stop word also ends the C loop early (its burst runs fewer steps than it
    was given); a longer one is found afterwards, in the steps the burst ran in full."""
    prompt = _ids(33, 5)
    _, (free_run,) = _outputs(make_pipeline, 1, [prompt], max_new_tokens=30)
    stop = free_run[9:9 + length]
    outs, bursts = [], []
    for steps in (1, 8):
        pipe = make_pipeline(num_scheduler_steps=steps)
        burst = pipe.engine.runner.run_burst

        def recording(chunks, n, stops, burst=burst):
            tokens = burst(chunks, n, stops)
            bursts.append((n, len(tokens)))
            return tokens

        pipe.engine.runner.run_burst = recording
        outs.append(run(pipe, prompt, max_new_tokens=30, stop_words_list=[stop]).output_ids)
        assert (_bursts(pipe) > 0) == (steps > 1)
    assert outs[0] == outs[1]
    assert outs[0][-length:] == stop and len(outs[0]) < 30
    assert any(ran < asked for asked, ran in bursts) == (length == 1)


def test_a_burst_stops_at_the_end_of_the_block_it_writes(make_pipeline):
    """So it never takes a block single steps would not hold yet."""
    pipe = make_pipeline(num_scheduler_steps=64, seq_size_per_block=8)
    seen = []
    burst = pipe.engine.runner.run_burst

    def recording(chunks, steps, stops):
        seen.append([(c.start, steps) for c in chunks])
        return burst(chunks, steps, stops)

    pipe.engine.runner.run_burst = recording
    run(pipe, _ids(21, 11), max_new_tokens=40)
    assert seen and all(start % 8 + steps <= 8 for call in seen for start, steps in call)
    assert max(steps for call in seen for _, steps in call) == 8


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


def _events(pipe) -> list[tuple]:
    return [(e["type"], tuple(e.get("block_hashes", ()))) for e in pipe.kv_cache_events()]


@pytest.mark.parametrize("policy", ["GUARANTEED_NO_EVICT", "MAX_UTILIZATION"])
def test_a_small_pool_keeps_what_single_steps_keep(make_pipeline, policy):
    """With a pool of 16 blocks of 8, a cached request and one that ends at an early EOS: the
    KV events, and what a rerun of the first reuses, are those of single steps."""
    a, b = _ids(64, 1), _ids(40, 2)
    (free,) = _outputs(make_pipeline, 1, [b], max_new_tokens=10)[1]
    results = []
    for steps in (1, 64):
        pipe = make_pipeline(num_scheduler_steps=steps, reuse_cache=True, kv_cache_max_tokens=128,
                             seq_size_per_block=8, kv_cache_event_buffer_max_size=1000,
                             capacity_scheduler_policy=policy)
        first = run(pipe, a, max_new_tokens=2).output_ids
        pipe.eos_token_ids = frozenset({free[2]})
        out = run(pipe, b, max_new_tokens=60, ignore_eos=False).output_ids
        events = _events(pipe)
        again = run(pipe, a, max_new_tokens=1)
        results.append((first, out, events, again.aux_info["reuse_len"], _events(pipe)))
        assert (_bursts(pipe) > 0) == (steps > 1)
    assert results[0] == results[1]


def test_partial_reuse_over_a_burst_written_tail(make_pipeline):
    """A request that ended inside a burst leaves its partly filled last block as a tail; a
    later request copying it gets the tokens and logits it gets after single steps."""
    prompt = _ids(45, 12)
    results = []
    for steps in (1, 16):
        pipe = make_pipeline(num_scheduler_steps=steps, reuse_cache=True,
                             enable_partial_reuse=True, seq_size_per_block=16)
        first = run(pipe, prompt, max_new_tokens=11).output_ids
        second = run(pipe, prompt + first[:5] + _ids(4, 13), max_new_tokens=6, return_logits=True)
        results.append((first, second.output_ids, second.aux_info["reuse_len"], second.logits))
    assert results[0][:3] == results[1][:3] and results[1][2] > 48
    assert torch.equal(results[0][3], results[1][3])


def test_a_cancel_during_a_burst_drops_its_steps(make_pipeline):
    """A cancel that lands while a burst computes is seen before its first step is emitted:
    the stream ends there, the request's blocks come back, the other request goes on."""
    pipe = make_pipeline(num_scheduler_steps=8, seq_size_per_block=64)
    prompts = [_ids(30, 14), _ids(30, 15)]
    (_, alone) = _outputs(make_pipeline, 1, prompts, max_new_tokens=40)
    burst = pipe.engine.runner.run_burst
    calls = []

    def cancelling(chunks, steps, stops):
        calls.append(steps)
        if len(calls) == 2:
            chunks[0].request.cancelled = True   # as Engine.abort marks it, from another thread
        return burst(chunks, steps, stops)

    pipe.engine.runner.run_burst = cancelling
    streams = [pipe(p, generate_config={"top_k": 1, "ignore_eos": True, "max_new_tokens": 40})
               for p in prompts]
    outs = [[r.output_ids for r in s] for s in streams]
    assert calls[:2] == [8, 8]
    cancelled = outs[0][-1]
    assert len(cancelled) < 40 and cancelled == alone[0][:len(cancelled)]
    assert outs[1][-1] == alone[1]
    assert idle_in_use(pipe) == 0


def test_requests_with_a_deadline_run_one_step_a_call(make_pipeline):
    pipe = make_pipeline(num_scheduler_steps=8)
    ref = run(make_pipeline(), _ids(20, 16), max_new_tokens=20).output_ids
    assert run(pipe, _ids(20, 16), max_new_tokens=20, timeout_ms=60_000).output_ids == ref
    assert _bursts(pipe) == 0


def test_generate_refuses_steps_past_a_block_table(make_pipeline):
    """The C loop writes each step's K/V through the block table: a burst reaching past a
    row's table would write into another sequence's block, so it is refused first."""
    from rtpkv.kernels import AttentionBatch

    pipe = make_pipeline(seq_size_per_block=8)
    module, runner = pipe.model.module, pipe.engine.runner
    batch = AttentionBatch(positions=[6, 3], row_seq=[0, 1], block_tables=[[5], [7]],
                           query_start=[0, 1], query_len=[1, 1], context_len=[7, 4],
                           block_size=8, num_blocks=runner.memory.num_blocks,
                           kv_heads=runner.kv_heads)
    meta = module.attention_metadata(batch)
    with pytest.raises(IndexError, match="row 0: 4 steps from position 6 pass the end"):
        module.generate([1, 2], [6, 3], runner.kv_caches, meta, 4, [[], []])
    assert len(module.generate([1, 2], [6, 3], runner.kv_caches, meta, 2, [[], []])) == 2


def test_num_scheduler_steps_is_validated(monkeypatch):
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        ModelConfig(num_scheduler_steps=0)
    from rtpkv.config import Settings
    monkeypatch.setenv("NUM_SCHEDULER_STEPS", "65")
    with pytest.raises(ConfigError, match="NUM_SCHEDULER_STEPS='65' is invalid"):
        Settings.from_env()


GEMMA_MODES = {"float32": {}, "int8": dict(weight_type="INT8"),
               "w8a8-int8-kv": dict(weight_type="W8A8_INT8", kv_cache_dtype="int8")}


@pytest.mark.parametrize("mode", GEMMA_MODES)
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_runs_in_bursts(make_pipeline, checkpoints, arch, mode):
    """Gemma's plans on the fused decoder (Gemma 2's soft-caps: the burst's arg-max is over the
    soft-capped logits, as single steps sample), its sliding layers in a KV cache group of their own
    (their own block tables, releasing blocks that leave the window): at prompts shorter than,
    equal to and 3x the window, bursts give each request's single-step tokens, batched as
    alone, and a rerun over a prompt and its output reuses blocks and gives the tokens of a
    pipeline without reuse."""
    from conftest import GEMMA_WINDOW

    prompts = [_ids(n, 30 + n) for n in (GEMMA_WINDOW - 12, GEMMA_WINDOW, 3 * GEMMA_WINDOW)]
    options = dict(path=checkpoints(arch), seq_size_per_block=8, **GEMMA_MODES[mode])
    _, alone = _outputs(make_pipeline, 1, prompts, max_new_tokens=40, **options)
    pipe = make_pipeline(num_scheduler_steps=8, reuse_cache=True, **options)
    assert pipe.model.module.fused is not None and len(pipe.engine.runner.groups) > 1
    streams = [pipe(p, generate_config={"top_k": 1, "ignore_eos": True, "max_new_tokens": 40})
               for p in prompts]
    assert [list(s)[-1].output_ids for s in streams] == alone
    assert _bursts(pipe) > 0
    longer = prompts[2] + alone[2]
    again = run(pipe, longer, max_new_tokens=12)
    fresh = make_pipeline(num_scheduler_steps=8, reuse_cache=False, **options)
    assert again.aux_info["reuse_len"] > 0
    assert again.output_ids == run(fresh, longer, max_new_tokens=12).output_ids
