"""Scheduler without a model: the token budget, admission under each capacity policy,
preemption, and the bookkeeping after a step (postprocess), on a bare KVCacheManager."""

from __future__ import annotations

from rtpkv.cache import KVCacheManager, PrefixIndex
from rtpkv.config import resolve
from rtpkv.engine.request import FinishReason, Request
from rtpkv.engine.scheduler import Scheduler
from rtpkv.generate_config import GenerateConfig

B = 4


def scheduler(num_blocks=32, reuse=True, **options) -> Scheduler:
    config = resolve().replace(seq_size_per_block=B, reuse_cache=reuse, **options)
    cache = KVCacheManager(num_blocks, B, PrefixIndex("unit", B), reuse_enabled=reuse)
    return Scheduler(config, cache)


def request(prompt, max_new=4, **cfg) -> Request:
    return Request(list(prompt), GenerateConfig(**cfg), max_new_tokens=max_new,
                   eos_token_ids=frozenset({2}))


def step(sched: Scheduler, token=7):
    """Schedule, 'run' (every chunk that reaches the end of its sequence samples `token`) and
    postprocess; returns (chunks, finished)."""
    chunks = sched.schedule()
    sampled = [c for c in chunks if c.start + c.num_tokens == c.request.num_tokens]
    finished = sched.postprocess(chunks, sampled, [token] * len(sampled))
    sched.cache.check_integrity(sched.running)
    return chunks, finished


def test_decodes_go_first_and_the_budget_holds():
    sched = scheduler(max_num_batched_tokens=16)
    short = request(range(10, 14), max_new=8)
    sched.add(short)
    step(sched)
    assert short.is_decoding
    long = request(range(100, 140))
    sched.add(long)
    chunks, _ = step(sched)
    assert [(c.request, c.num_tokens, c.is_decode) for c in chunks] == [(short, 1, True),
                                                                        (long, 15, False)]
    chunks, _ = step(sched)
    assert sum(c.num_tokens for c in chunks) == 16 and chunks[0].is_decode


def test_guaranteed_no_evict_reserves_max_new_tokens():
    sched = scheduler(num_blocks=7)
    a, b = request(range(10, 18), max_new=8), request(range(20, 28), max_new=8)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert sched.running == [a] and sched.waiting[0] is b, "b would not fit a's reservation"
    while a in sched.running:
        step(sched)
    assert a.finish_reason == FinishReason.LENGTH and a.num_output == 8
    step(sched)
    assert sched.running == [b]


def test_max_utilization_pauses_the_latest_admitted():
    sched = scheduler(num_blocks=6, capacity_scheduler_policy="MAX_UTILIZATION")
    a, b = request(range(10, 18), max_new=8), request(range(20, 28), max_new=8)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert sched.running == [a, b]
    for _ in range(8):
        step(sched)
    assert b.num_preemptions > 0 and a.num_preemptions == 0
    while sched.has_work():
        step(sched)
    assert a.num_output == b.num_output == 8
    assert sched.cache.stats()["blocks_in_use"] == 0


def test_postprocess_stops_once_min_new_tokens_are_out():
    sched = scheduler()
    req = request(range(10, 15), max_new=10, min_new_tokens=3, stop_words_list=[[7, 7]])
    sched.add(req)
    step(sched)          # 1st token: 7
    assert req.finish_reason is None
    _, finished = step(sched)   # 2nd: 7 7 is a stop word, but min_new_tokens=3 holds it
    assert not finished
    _, finished = step(sched)   # 3rd: 7 7 again, and now it may end
    assert finished == [req] and req.finish_reason == FinishReason.STOP and req.num_output == 3


def test_postprocess_finishes_on_eos_unless_ignored():
    sched = scheduler()
    eos, ignoring = request(range(10, 15)), request(range(20, 25), ignore_eos=True)
    sched.add(eos)
    sched.add(ignoring)
    _, finished = step(sched, token=2)
    assert finished == [eos] and eos.finish_reason == FinishReason.EOS
    while sched.has_work():
        step(sched, token=2)
    assert ignoring.finish_reason == FinishReason.LENGTH and ignoring.num_output == 4


def test_postprocess_commits_filled_blocks_for_the_next_request():
    sched = scheduler()
    first = request(range(10, 19), max_new=4)
    sched.add(first)
    while sched.has_work():
        step(sched)
    second = request(list(range(10, 19)) + [7, 7, 7, 1])
    sched.add(second)
    step(sched)
    # 9 prompt + 4 generated tokens, 12 of them computed: two prompt blocks and the block
    # that the answer filled
    assert second.local_reuse_len == 12


def test_a_stop_word_must_lie_in_the_output_not_straddle_the_prompt():
    sched = scheduler()
    req = request([10, 11, 7], max_new=3, stop_words_list=[[7, 7]])
    sched.add(req)
    _, finished = step(sched)   # prompt ends in 7, output starts with 7: no stop yet
    assert not finished
    _, finished = step(sched)   # 7 7 inside the output
    assert finished == [req] and req.finish_reason == FinishReason.STOP
