"""Continuous batching under the capacity and context-chunking policies, preemption,
cancellation, timeouts and refusal — asserted on tokens and on the engine's step log."""

import threading
import time

import pytest
import torch

from conftest import idle_in_use, run
from rtpkv.errors import CapacityError, RequestTimeoutError
from rtpkv.text_stream import StopCheck


def _prompts(n, seed=0, lo=20, hi=60):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (int(torch.randint(lo, hi, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


def _from_threads(pipe, prompts, threads=8, **cfg):
    results, errors = {}, []

    def worker(idx):
        for i in idx:
            try:
                results[i] = run(pipe, prompts[i], **cfg)
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)

    pool = [threading.Thread(target=worker, args=(range(t, len(prompts), threads),))
            for t in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert not errors, errors
    return results


@pytest.mark.parametrize("policy,reuse", [("GUARANTEED_NO_EVICT", True), ("MAX_UTILIZATION", True),
                                          ("MAX_UTILIZATION", False), ("STATIC_BATCH", False)])
def test_64_requests_from_8_threads_on_a_small_pool(make_pipeline, policy, reuse):
    prompts = _prompts(64)
    alone = make_pipeline(seq_size_per_block=4)
    expected = [run(alone, p, max_new_tokens=16).output_ids for p in prompts]
    # 96 blocks of 4 tokens: room for ~5 of these requests at once
    pipe = make_pipeline(seq_size_per_block=4, kv_cache_max_tokens=384, reuse_cache=reuse,
                         capacity_scheduler_policy=policy, max_num_batched_tokens=96)
    results = _from_threads(pipe, prompts, max_new_tokens=16)
    assert [results[i].output_ids for i in range(64)] == expected
    preempted = sum(r.aux_info["num_preemptions"] for r in results.values())
    if policy == "MAX_UTILIZATION":
        assert preempted > 0, "the pool was meant to force pausing"
    else:
        assert preempted == 0
    assert max(r.aux_info["wait_time"] for r in results.values()) > 0
    pipe.check_integrity()
    assert idle_in_use(pipe) == 0


def test_static_batch_admits_only_into_an_empty_engine(make_pipeline):
    pipe = make_pipeline(seq_size_per_block=4, capacity_scheduler_policy="static_batch")
    _from_threads(pipe, _prompts(12, seed=1), threads=4, max_new_tokens=6)
    batches: list[set[int]] = []
    for step in pipe.engine.step_log:
        ids = {rid for rid, _, _ in step}
        if batches and ids & batches[-1]:
            assert ids <= batches[-1], "a request joined a batch that was still running"
        else:
            batches.append(ids)
    assert len(batches) >= 2 and sum(len(b) for b in batches) == 12


def _submit_two_and_log(pipe):
    a, b = _prompts(2, seed=4, lo=200, hi=201)
    with pipe.engine.lock:  # both queued before the first step
        sa = pipe(a, top_k=1, max_new_tokens=2, ignore_eos=True)
        sb = pipe(b, top_k=1, max_new_tokens=2, ignore_eos=True)
    list(sa), list(sb)
    steps = [s for s in pipe.engine.step_log if any(kind == "prefill" for _, _, kind in s)]
    return [[(rid, n) for rid, n, kind in s if kind == "prefill"] for s in steps]


def test_equal_progress_interleaves_first_come_first_served_does_not(make_pipeline):
    fcfs = _submit_two_and_log(make_pipeline(seq_size_per_block=16, max_num_batched_tokens=64))
    ids = sorted({rid for step in fcfs for rid, _ in step})
    first, second = ids
    # FCFS: every chunk of the first prompt comes before any chunk of the second
    order = [rid for step in fcfs for rid, _ in step]
    assert max(i for i, r in enumerate(order) if r == first) < order.index(second)
    assert all(len(step) == 1 for step in fcfs[:3])
    equal = _submit_two_and_log(make_pipeline(seq_size_per_block=16, max_num_batched_tokens=64,
                                              context_chunking_policy="EQUAL_PROGRESS"))
    # EQUAL_PROGRESS: the two prompts advance together, 32 tokens each per step
    assert all(len(step) == 2 and [n for _, n in step] == [32, 32] for step in equal[:6])


def test_chunked_prefill_never_stalls_running_decodes(make_pipeline):
    pipe = make_pipeline(seq_size_per_block=16, max_num_batched_tokens=32)
    short = pipe([5, 6, 7, 8], top_k=1, max_new_tokens=30, ignore_eos=True)
    next(short)  # decoding now
    long = pipe(_prompts(1, seed=9, lo=300, hi=301)[0], top_k=1, max_new_tokens=2)
    list(long), list(short)
    mixed = [s for s in pipe.engine.step_log
             if any(k == "decode" for _, _, k in s) and any(k == "prefill" for _, _, k in s)]
    assert mixed and all(sum(n for _, n, _ in s) <= 32 for s in pipe.engine.step_log)


def test_outputs_equal_with_chunked_prefill(make_pipeline):
    prompt = _prompts(1, seed=11, lo=150, hi=151)[0]
    whole = run(make_pipeline(seq_size_per_block=8), prompt, max_new_tokens=8, return_logits=True)
    chunked = run(make_pipeline(seq_size_per_block=8, max_num_batched_tokens=24), prompt,
                  max_new_tokens=8, return_logits=True)
    assert whole.output_ids == chunked.output_ids
    torch.testing.assert_close(whole.logits, chunked.logits, atol=1e-4, rtol=0)


def test_cancellation_mid_stream_frees_blocks(make_pipeline):
    pipe = make_pipeline(seq_size_per_block=4)
    stream = pipe(list(range(10, 50)), top_k=1, max_new_tokens=100, ignore_eos=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    deadline = time.monotonic() + 5
    while pipe.cache_stats()["blocks_in_use"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pipe.cache_stats()["blocks_in_use"] == 0
    pipe.check_integrity()


def test_dropped_generator_cancels(make_pipeline):
    pipe = make_pipeline(seq_size_per_block=4)
    stream = pipe(list(range(10, 50)), top_k=1, max_new_tokens=100, ignore_eos=True)
    next(stream)
    del stream
    deadline = time.monotonic() + 5
    while pipe.cache_stats()["blocks_in_use"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pipe.cache_stats()["blocks_in_use"] == 0


def test_stream_dropped_before_iterating_cancels(make_pipeline):
    pipe = make_pipeline(seq_size_per_block=4)
    stream = pipe(list(range(10, 50)), top_k=1, max_new_tokens=400, ignore_eos=True)
    del stream
    deadline = time.monotonic() + 5
    while pipe.cache_stats()["requests_running"] + pipe.cache_stats()["requests_waiting"] \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = pipe.cache_stats()
    assert stats["requests_running"] == 0 and stats["blocks_in_use"] == 0
    assert pipe.engine.steps < 400, "the dropped request ran to completion"


def test_request_that_can_never_fit_is_refused_at_once(make_pipeline):
    pipe = make_pipeline(seq_size_per_block=4, kv_cache_max_tokens=64)  # 16 blocks
    with pytest.raises(CapacityError, match=r"needs 25 KV blocks.*pool has 16 usable blocks"):
        pipe(list(range(10, 60)), max_new_tokens=50)
    assert run(pipe, list(range(10, 30)), max_new_tokens=4).finished


def test_concurrency_limit_and_timeout(make_pipeline):
    pipe = make_pipeline(seq_size_per_block=4, concurrency_limit=2)
    streams = [pipe(list(range(10 + i, 30 + i)), top_k=1, max_new_tokens=20, ignore_eos=True)
               for i in range(5)]
    for s in streams:
        list(s)
    assert max(len(step) for step in pipe.engine.step_log) <= 2
    slow = pipe(list(range(10, 30)), top_k=1, max_new_tokens=200, ignore_eos=True, timeout_ms=30)
    with pytest.raises(RequestTimeoutError, match="timeout_ms=30"):
        list(slow)
    assert run(pipe, [5, 6, 7], max_new_tokens=3).finished
    assert idle_in_use(pipe) == 0


def test_failing_request_does_not_disturb_others(make_pipeline, monkeypatch):
    def broken(self, ids):
        raise ValueError("stop-word check exploded")

    monkeypatch.setattr(StopCheck, "__call__", broken)
    pipe = make_pipeline(seq_size_per_block=4)
    good = pipe(list(range(10, 30)), top_k=1, max_new_tokens=20, ignore_eos=True)
    bad = pipe(list(range(40, 60)), top_k=1, max_new_tokens=20, ignore_eos=True,
               stop_words_str=["zzz"])
    with pytest.raises(ValueError, match="exploded"):
        list(bad)
    assert len(list(good)[-1].output_ids) == 20
    assert idle_in_use(pipe) == 0


def test_lpm_admits_the_longest_cached_prefix_first(make_pipeline):
    pipe = make_pipeline(seq_size_per_block=4, reuse_cache=True, schedule_policy="lpm",
                         concurrency_limit=1)
    cached = list(range(100, 140))
    run(pipe, cached, max_new_tokens=1)
    with pipe.engine.lock:  # queue all three before the engine looks
        cold = pipe(list(range(300, 340)), top_k=1, max_new_tokens=1)
        other = pipe(list(range(400, 440)), top_k=1, max_new_tokens=1)
        warm = pipe(cached + [7, 8], top_k=1, max_new_tokens=1)
    w, c, o = list(warm)[-1], list(cold)[-1], list(other)[-1]
    assert w.aux_info["reuse_len"] == 40
    assert w.aux_info["wait_time"] < min(c.aux_info["wait_time"], o.aux_info["wait_time"])
