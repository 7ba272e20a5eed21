"""KV cache groups (rtpkv/cache/groups.py): layers of one kind share a block table over the one
pool; a sliding group keeps only its window's blocks; the prefix hit is what every group serves;
a block's key names its group; one-window models stay one group; and outputs never change."""

import pytest
import torch
from conftest import GEMMA_WINDOW as W, idle_in_use, run

from rtpkv.cache.groups import FULL_ATTENTION, SLIDING_WINDOW, KVGroup, kv_groups
from rtpkv.cache.sequence import RELEASED
from rtpkv.cache.prefix_index import KeyChain

B = 8


def _prompt(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 600, (n,), generator=g).tolist()


def test_layers_of_one_kind_share_groups_of_equal_size():
    gemma3 = [512] * 5 + [None]
    assert kv_groups(gemma3 * 3, None) == (
        KVGroup(0, None, (5, 11, 17)), KVGroup(1, 512, (0, 1, 2)), KVGroup(2, 512, (3, 4, 6)),
        KVGroup(3, 512, (7, 8, 9)), KVGroup(4, 512, (10, 12, 13)),
        KVGroup(5, 512, (14, 15, 16)))
    gemma2 = [4096, None] * 3
    assert [(g.kind, g.layers) for g in kv_groups(gemma2, None)] == [
        (FULL_ATTENTION, (1, 3, 5)), (SLIDING_WINDOW, (0, 2, 4))]
    uneven = kv_groups([64] * 5 + [None] * 2, None)
    assert [g.layers for g in uneven] == [(5, 6), (0, 1), (2, 3), (4,)]
    # one group: every layer alike, or the engine's window capping every layer
    assert kv_groups([None] * 4, None) == (KVGroup(0, None, (0, 1, 2, 3)),)
    assert kv_groups([64, None], 32) == (KVGroup(0, 32, (0, 1)),)


def test_a_hybrid_model_gets_groups_and_a_one_window_model_one(checkpoints, make_pipeline):
    gemma3 = make_pipeline(checkpoints("gemma3"), seq_size_per_block=B)
    cache = gemma3.engine.cache
    assert [(g.kind, g.window, g.layers) for g in cache.groups] == [
        (FULL_ATTENTION, None, (2,)), (SLIDING_WINDOW, W, (0,)), (SLIDING_WINDOW, W, (1,)),
        (SLIDING_WINDOW, W, (3,))]
    assert cache.memory.kv.shape[1] == 1                   # a block holds one layer's K/V
    assert gemma3.cache_stats()["kv_cache_groups"] == [
        {"kind": FULL_ATTENTION, "window": None, "layers": 1}] + [
        {"kind": SLIDING_WINDOW, "window": W, "layers": 1}] * 3
    llama = make_pipeline(seq_size_per_block=B)
    assert len(llama.engine.cache.groups) == 1 and llama.cache_stats()["kv_cache_groups"] == []
    assert llama.engine.cache.memory.kv.shape[1] == llama.model.spec.num_layers


def _held(pipe, ids, new, **config):
    """The most blocks the request held in each group between two engine steps, and its last
    response (recorded on the engine thread after each step's bookkeeping)."""
    scheduler, cache, most = pipe.engine.scheduler, pipe.engine.cache, {}
    postprocess = scheduler.postprocess

    def recording(*args):
        finished = postprocess(*args)
        for r in scheduler.running:
            for group, view in cache._views(r):
                held = sum(1 for b in view.block_table if b != RELEASED)
                most[group.index] = max(most.get(group.index, 0), held)
        return finished

    scheduler.postprocess = recording
    try:
        return most, run(pipe, ids, max_new_tokens=new, **config)
    finally:
        scheduler.postprocess = postprocess


@pytest.mark.parametrize("reuse", [False, True])
def test_sliding_groups_hold_only_their_windows_blocks(checkpoints, make_pipeline,
                                                      make_one_table_pipeline, reuse):
    """A 120-token prompt and 100 new tokens: the full group holds every block, each sliding
    group the window's W / B blocks and the one being filled; the outputs are those of the
    model served with one table."""
    path = checkpoints("gemma3")
    pipe = make_pipeline(path, seq_size_per_block=B, reuse_cache=reuse, max_num_batched_tokens=B)
    one_table = make_one_table_pipeline(path, seq_size_per_block=B, reuse_cache=True,
                                        max_num_batched_tokens=B)
    assert len(one_table.engine.cache.groups) == 1
    ids = _prompt(120, seed=4)
    most, res = _held(pipe, ids, 100, return_logits=True)
    assert most[0] == -(-(120 + 100 - 2) // B)   # up to the step before the last
    assert [most[g] for g in (1, 2, 3)] == [W // B + 1] * 3
    ref = run(one_table, ids, max_new_tokens=100, return_logits=True)
    assert res.output_ids == ref.output_ids
    torch.testing.assert_close(res.logits, ref.logits, atol=1e-5, rtol=0)
    assert idle_in_use(pipe) == 0


def test_groups_fit_more_requests_in_the_same_memory(checkpoints, make_pipeline,
                                                     make_one_table_pipeline):
    """The memory of 20 blocks of all four layers (80 one-layer blocks with groups): a
    120-token request needs 15 blocks in the full group and at most cdiv(W + 8 - 1, B) + 1 = 6
    in each sliding group, 33 in all, so two run side by side; with one table it
    needs 15 of the 20 and they run one after the other. Same tokens either way."""
    path = checkpoints("gemma3")
    options = dict(seq_size_per_block=B, kv_cache_max_tokens=20 * B, max_num_batched_tokens=B)
    grouped = make_pipeline(path, **options)
    one_table = make_one_table_pipeline(path, **options)
    assert grouped.engine.cache.num_blocks == 20 * 4 and one_table.engine.cache.num_blocks == 20
    assert grouped.engine.cache.memory.nbytes == one_table.engine.cache.memory.nbytes
    assert grouped.engine.cache.blocks_held_at_most(120, B) == 15 + 3 * 6
    prompts = [_prompt(60, seed=s) for s in (1, 2)]
    config = dict(top_k=1, ignore_eos=True, max_new_tokens=60)
    outputs = []
    for pipe, together in ((grouped, 2), (one_table, 1)):
        streams = [pipe(ids, generate_config=config) for ids in prompts]
        results = [list(s)[-1] for s in streams]
        assert all(r.aux_info["num_preemptions"] == 0 for r in results)
        assert max(len(s) for s in pipe.engine.step_log) == together
        outputs.append([r.output_ids for r in results])
    assert outputs[0] == outputs[1]


def test_reuse_is_what_every_group_serves(checkpoints, make_pipeline):
    """A conversation past 3x the window: each turn reuses every block of the last (every
    group serves them), with recomputation's tokens and logits; the keys of one position
    differ between groups (a key names its group)."""
    path = checkpoints("gemma3")
    reused = make_pipeline(path, seq_size_per_block=B, reuse_cache=True,
                           max_num_batched_tokens=40)
    plain = make_pipeline(path, seq_size_per_block=B, max_num_batched_tokens=40)
    history, computed = _prompt(50, seed=8), 0
    for turn in range(3):
        a = run(reused, history, max_new_tokens=10, return_logits=True)
        b = run(plain, history, max_new_tokens=10, return_logits=True)
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(a.logits, b.logits, atol=1e-4, rtol=0)
        # every full block the last turn computed (its prompt and all but its last token)
        assert a.aux_info["reuse_len"] == min(computed, len(history) - 1) // B * B
        computed = len(history) + 10 - 1
        history = history + a.output_ids + _prompt(7, seed=turn)
    assert len(history) > 3 * W
    cache = reused.engine.cache
    chains = [KeyChain(cache.index, history, b"", 0, root=root) for root in cache.roots]
    assert len({c.key(0) for c in chains}) == len(cache.groups)


def test_reuse_stops_where_a_sliding_group_lost_its_window(checkpoints, make_pipeline):
    """Evict a sliding group's blocks inside the last window of a cached prompt while the full
    group keeps its chain: the hit shortens to what every group serves ('window'), exactly."""
    path = checkpoints("gemma3")
    pipe = make_pipeline(path, seq_size_per_block=B, reuse_cache=True)
    plain = make_pipeline(path, seq_size_per_block=B)
    ids = _prompt(100, seed=11)
    run(pipe, ids, max_new_tokens=2)
    cache = pipe.engine.cache
    chain = KeyChain(cache.index, ids, b"", 0, root=cache.roots[1])   # a sliding group's
    victim = cache.pool.cached(chain.key(10))   # inside the last window of 99 tokens
    assert victim is not None and victim.ref_count == 0
    cache.pool.policy.remove(victim)
    cache.pool._unindex(victim)
    cache.pool._put_free(victim)
    again = run(pipe, ids, max_new_tokens=6, return_logits=True)
    ref = run(plain, ids, max_new_tokens=6, return_logits=True)
    assert again.aux_info["reuse_len"] == 10 * B   # the window of a hit at block 10 is whole
    assert again.aux_info["reuse_stop"] == "window"
    assert again.output_ids == ref.output_ids
    torch.testing.assert_close(again.logits, ref.logits, atol=1e-4, rtol=0)


def test_task_prompts_pin_every_group(checkpoints, make_pipeline):
    """A task prompt longer than 3x the window is pinned in every group (a sliding group's too:
    requests after it attend its last window), and a request after it gives the outputs of the
    whole prompt computed without reuse."""
    path = checkpoints("gemma3")
    system = " ".join(["the cat sat on the river bank and told a long story"] * 12)
    pipe = make_pipeline(path, seq_size_per_block=B, reuse_cache=True,
                         tasks=[{"task_id": "t", "prompt": system}])
    plain = make_pipeline(path, seq_size_per_block=B)
    tok = pipe.model.tokenizer
    task = tok(system).input_ids
    assert len(task) > 3 * W
    groups = len(pipe.engine.cache.groups)
    assert pipe.cache_stats()["blocks_pinned"] == len(task) // B * groups
    question = "how old are you? tell me about the city"
    got = run(pipe, question, task_id="t", max_new_tokens=8, return_logits=True)
    concat = task + tok(question, add_special_tokens=False).input_ids
    want = run(plain, concat, max_new_tokens=8, return_logits=True)
    assert got.aux_info["reuse_len"] == len(task) // B * B
    assert got.output_ids == want.output_ids
    torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=0)


def test_events_carry_the_groups_fields(checkpoints, make_pipeline):
    """Each stored and removed event names its block's group as vLLM does (group_idx,
    kv_cache_spec_kind, kv_cache_spec_sliding_window), on the wire too, where a group's first
    block has no parent; a one-group model's events have no group fields."""
    from rtpkv.fleet import wire
    from rtpkv.fleet.publisher import KVEventPublisher

    pipe = make_pipeline(checkpoints("gemma3"), seq_size_per_block=B, reuse_cache=True,
                         kv_cache_event_buffer_max_size=10000)
    run(pipe, _prompt(60, seed=31), max_new_tokens=2)
    stored = [e for e in pipe.engine.events.drain() if e["type"] == "stored"]
    per_group = {}
    for e in stored:
        per_group.setdefault(e["group_idx"], []).append(e)
    assert sorted(per_group) == [0, 1, 2, 3] and all(len(v) == 7 for v in per_group.values())
    assert {(e["kv_cache_spec_kind"], e["kv_cache_spec_sliding_window"]) for e in stored} == {
        (FULL_ATTENTION, None), (SLIDING_WINDOW, W)}
    publisher = KVEventPublisher(pipe.engine.events, B, pipe.engine.cache.index.root,
                                 "inproc://kv-groups-events")
    try:
        firsts = [publisher.to_wire(v[0]) for v in per_group.values()]
    finally:
        publisher.stop()
    assert all(f["parent_block_hash"] is None for f in firsts)
    assert [f["group_idx"] for f in firsts] == [0, 1, 2, 3]
    for layout in ("map", "array"):
        _, decoded, _ = wire.decode_batch(wire.encode_batch(0.0, firsts, layout=layout))
        assert decoded == firsts
    removed = wire.block_removed([1], "GPU", 2)
    _, decoded, _ = wire.decode_batch(wire.encode_batch(0.0, [removed], layout="array"))
    assert decoded == [removed]
    llama = make_pipeline(seq_size_per_block=B, reuse_cache=True,
                          kv_cache_event_buffer_max_size=100)
    run(llama, _prompt(20, seed=32), max_new_tokens=2)
    assert all("group_idx" not in e for e in llama.engine.events.drain())
