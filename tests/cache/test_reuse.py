"""Block-level prefix reuse: rtp-llm's contract, never a changed output, always reported."""

import threading

import pytest
import torch
from conftest import idle_in_use, run

B2 = dict(reuse_cache=True, seq_size_per_block=2)


def expected_reuse(common: int, prompt_len: int, block: int) -> int:
    return min(common, prompt_len - 1) // block * block


def test_rtp_llm_engine_scenarios(make_pipeline):
    pipe = make_pipeline(**B2)
    first = run(pipe, [1, 2, 3, 4, 5, 6, 7], max_new_tokens=4)
    assert first.aux_info["reuse_len"] == 0
    assert run(pipe, [1, 2, 3, 4, 50, 60, 70], max_new_tokens=4).aux_info["reuse_len"] == 4
    assert run(pipe, [1, 2, 3, 4, 5, 6, 7], max_new_tokens=4).aux_info["reuse_len"] == 6
    # a prompt whose length is a multiple of B recomputes its whole last block
    run(pipe, [9, 8, 7, 6, 5, 4, 3, 2], max_new_tokens=2)
    again = run(pipe, [9, 8, 7, 6, 5, 4, 3, 2], max_new_tokens=2)
    assert again.aux_info["reuse_len"] == 6 and again.aux_info["local_reuse_len"] == 6


def test_seed_prompts_reuse_what_the_formula_predicts(make_pipeline):
    pipe = make_pipeline(reuse_cache=True, seq_size_per_block=4)
    a, b = "hello, what's your name", "hello, what's your name? how old are you?"
    ra = run(pipe, a, max_new_tokens=8)
    rb = run(pipe, b, max_new_tokens=8)
    ids_a = pipe.tokenizer(a).input_ids + ra.output_ids
    ids_b = pipe.tokenizer(b).input_ids
    common = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), min(len(ids_a), len(ids_b)))
    assert rb.aux_info["reuse_len"] == expected_reuse(common, len(ids_b), 4) > 0
    assert rb.aux_info["reuse_len"] % 4 == 0


def test_start_up_log_says_whether_reuse_is_on(make_pipeline, caplog):
    with caplog.at_level("INFO", logger="rtpkv"):
        make_pipeline(reuse_cache=True)
    assert "reuse_cache: True" in caplog.text


def test_reuse_is_off_by_default(make_pipeline, caplog):
    with caplog.at_level("INFO", logger="rtpkv"):
        pipe = make_pipeline(seq_size_per_block=2)
    assert "reuse_cache: False" in caplog.text
    run(pipe, [1, 2, 3, 4, 5, 6, 7], max_new_tokens=2)
    assert run(pipe, [1, 2, 3, 4, 5, 6, 7], max_new_tokens=2).aux_info["reuse_len"] == 0
    assert pipe.cache_stats()["queries"] == 0


def _conversation(pipe, turns=5, new=12, answer=6, **cfg):
    """Multi-turn chat: each turn appends the previous answer and new user tokens."""
    history, outs = [], []
    g = torch.Generator().manual_seed(3)
    for _ in range(turns):
        history += torch.randint(3, 1000, (new,), generator=g).tolist()
        res = run(pipe, history, max_new_tokens=answer, return_logits=True, **cfg)
        outs.append(res)
        history += res.output_ids
    return outs


@pytest.mark.parametrize("backend", ["auto", "flash-attn"])   # flash-attn: the CPU stand-in
def test_reuse_never_changes_output_multi_turn(make_pipeline, backend, request):
    if backend == "flash-attn":
        request.getfixturevalue("flash_attn_standin")
    plain = _conversation(make_pipeline(seq_size_per_block=4, rtpkv_attention=backend))
    reused = _conversation(make_pipeline(reuse_cache=True, seq_size_per_block=4,
                                         rtpkv_attention=backend))
    assert all(r.aux_info["reuse_len"] > 0 for r in reused[1:])
    assert all(p.aux_info["reuse_len"] == 0 for p in plain)
    for p, r in zip(plain, reused):
        assert p.output_ids == r.output_ids
        torch.testing.assert_close(p.logits, r.logits, atol=1e-4, rtol=0)


def test_blocks_are_reusable_while_their_request_runs(make_pipeline):
    pipe = make_pipeline(reuse_cache=True, seq_size_per_block=4)
    prompt = list(range(10, 30))
    stream = pipe(prompt, top_k=1, max_new_tokens=40, ignore_eos=True)
    first = next(stream)  # prompt prefilled, first token out; the request keeps running
    probe = run(pipe, prompt + first.output_ids, max_new_tokens=2)
    assert probe.aux_info["reuse_len"] == 20
    stream.close()  # a cancelled request's full blocks stay valid
    assert run(pipe, prompt + first.output_ids, max_new_tokens=2).output_ids == probe.output_ids


def test_generated_tokens_are_reusable_by_the_next_turn(make_pipeline):
    pipe = make_pipeline(reuse_cache=True, seq_size_per_block=4)
    prompt = list(range(10, 22))
    res = run(pipe, prompt, max_new_tokens=13)
    nxt = prompt + res.output_ids + [5, 6, 7]
    # 12 prompt + 13 generated = 25 tokens; the K/V of the last generated one is never written
    assert run(pipe, nxt, max_new_tokens=2).aux_info["reuse_len"] == 24


def test_hit_after_blocks_were_freed_and_revived(make_pipeline):
    pipe = make_pipeline(reuse_cache=True, seq_size_per_block=4)
    prompt = list(range(40, 61))
    base = run(pipe, prompt, max_new_tokens=6, return_logits=True)
    assert pipe.cache_stats()["blocks_in_use"] == 0 and pipe.cache_stats()["blocks_cached"] > 0
    revived = run(pipe, prompt, max_new_tokens=6, return_logits=True)
    assert revived.aux_info["reuse_len"] == 20
    assert revived.output_ids == base.output_ids
    torch.testing.assert_close(revived.logits, base.logits, atol=1e-4, rtol=0)


def test_outputs_equal_under_eviction_pressure(make_pipeline):
    # 64 blocks of 4 tokens: the working set below cycles the pool several times
    reused = make_pipeline(reuse_cache=True, seq_size_per_block=4, kv_cache_max_tokens=256)
    plain = make_pipeline(seq_size_per_block=4, kv_cache_max_tokens=256)
    g = torch.Generator().manual_seed(0)
    heads = [torch.randint(3, 1000, (40,), generator=g).tolist() for _ in range(6)]
    for i in range(24):
        prompt = heads[i % 6] + torch.randint(3, 1000, (5,), generator=g).tolist()
        a = run(reused, prompt, max_new_tokens=5, return_logits=True)
        b = run(plain, prompt, max_new_tokens=5, return_logits=True)
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(a.logits, b.logits, atol=1e-4, rtol=0)
        reused.check_integrity()
    stats = reused.cache_stats()
    assert stats["evictions"] > 64 and stats["hits"] > 0


def test_collision_costs_a_miss_not_a_wrong_answer(make_pipeline, monkeypatch):
    from rtpkv.cache import prefix_index

    monkeypatch.setattr(prefix_index, "sha256", lambda data: b"same")   # every key collides
    colliding = make_pipeline(reuse_cache=True, seq_size_per_block=4)
    plain = make_pipeline(seq_size_per_block=4)
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(3, 1000, (16,), generator=g).tolist()
    for i in range(6):
        prompt = (shared if i % 2 else []) + torch.randint(3, 1000, (12,), generator=g).tolist()
        a = run(colliding, prompt, max_new_tokens=6, return_logits=True)
        b = run(plain, prompt, max_new_tokens=6, return_logits=True)
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(a.logits, b.logits, atol=1e-4, rtol=0)
        colliding.check_integrity()
    # with every key equal only the most recently registered block is indexed: nothing reusable
    assert run(colliding, prompt, max_new_tokens=2).aux_info["reuse_len"] == 0


def test_salts_isolate_tenants(make_pipeline):
    pipe = make_pipeline(reuse_cache=True, seq_size_per_block=4)
    prompt = list(range(100, 120))
    run(pipe, prompt, max_new_tokens=2, cache_salt="tenant-a")
    assert run(pipe, prompt, max_new_tokens=2, cache_salt="tenant-b").aux_info["reuse_len"] == 0
    assert run(pipe, prompt, max_new_tokens=2).aux_info["reuse_len"] == 0
    assert run(pipe, prompt, max_new_tokens=2, cache_salt="tenant-a").aux_info["reuse_len"] == 16


def test_per_request_switch(make_pipeline):
    pipe = make_pipeline(reuse_cache=True, seq_size_per_block=4)
    prompt = list(range(200, 220))
    run(pipe, prompt, max_new_tokens=2, reuse_cache=False)
    assert pipe.cache_stats()["blocks_cached"] == 0, "a reuse_cache=False request inserted blocks"
    run(pipe, prompt, max_new_tokens=2)
    assert run(pipe, prompt, max_new_tokens=2, reuse_cache=False).aux_info["reuse_len"] == 0
    assert run(pipe, prompt, max_new_tokens=2).aux_info["reuse_len"] == 16


def test_cache_stats_are_token_weighted(make_pipeline):
    pipe = make_pipeline(reuse_cache=True, seq_size_per_block=4)
    stats = pipe.cache_stats()
    assert stats["queries"] == stats["hits"] == 0 and stats["hit_rate"] == 0.0
    run(pipe, list(range(300, 321)), max_new_tokens=2)
    run(pipe, list(range(300, 321)), max_new_tokens=2)
    stats = pipe.cache_stats()
    assert stats["queries"] == 42 and stats["hits"] == 20
    assert stats["hit_rate"] == pytest.approx(20 / 42)
    assert stats["blocks_free"] + stats["blocks_cached"] + stats["blocks_in_use"] == stats["blocks_total"]


def test_no_leak_after_200_mixed_requests(make_pipeline):
    pipe = make_pipeline(reuse_cache=True, seq_size_per_block=4, kv_cache_max_tokens=1024)
    g = torch.Generator().manual_seed(5)
    heads = [torch.randint(3, 1000, (20,), generator=g).tolist() for _ in range(4)]
    errors = []

    def worker(seed):
        local = torch.Generator().manual_seed(seed)
        for i in range(50):
            prompt = heads[i % 4] + torch.randint(3, 1000, (int(torch.randint(1, 12, (1,), generator=local)),),
                                                  generator=local).tolist()
            kind = i % 5
            try:
                if kind == 0:  # cancelled mid-stream
                    stream = pipe(prompt, top_k=1, max_new_tokens=30, ignore_eos=True)
                    next(stream)
                    stream.close()
                elif kind == 1:
                    run(pipe, prompt, max_new_tokens=4, reuse_cache=False)
                elif kind == 2:
                    run(pipe, prompt, max_new_tokens=6, cache_salt=f"s{seed}")
                else:
                    run(pipe, prompt, max_new_tokens=int(torch.randint(1, 8, (1,), generator=local)))
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    pipe.engine.step()  # let the last cancellations be reaped
    pipe.check_integrity()
    assert idle_in_use(pipe) == 0


def test_eviction_order_lru_tail_first(make_pipeline):
    pipe = make_pipeline(reuse_cache=True, seq_size_per_block=4, kv_cache_max_tokens=64)  # 16 blocks
    a, b = list(range(500, 517)), list(range(600, 617))  # 4 full prompt blocks each
    run(pipe, a, max_new_tokens=1)
    run(pipe, b, max_new_tokens=1)
    run(pipe, a, max_new_tokens=1)  # a is now more recent than b
    # 41 fresh tokens need 11 blocks: the 8 free ones, then 3 evicted from b's tail
    run(pipe, list(range(700, 741)), max_new_tokens=1)
    stats = pipe.cache_stats()
    assert stats["evictions"] > 0
    # b lost its tail first and kept its head; a, more recently used, kept everything
    assert run(pipe, a, max_new_tokens=1).aux_info["reuse_len"] == 16
    rb = run(pipe, b, max_new_tokens=1).aux_info["reuse_len"]
    assert 0 < rb < 16
