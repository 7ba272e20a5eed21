"""pipeline.prewarm: a prefix computed and cached without generating, under the same task_id,
cache_salt and retention config as a request; the count it answers is what a request extending
the prefix then reuses. Every pipeline is integrity-checked by make_pipeline."""

from __future__ import annotations

import pytest
import torch
from conftest import idle_in_use, run

from rtpkv.errors import RequestError

B = 4
ON = dict(reuse_cache=True, seq_size_per_block=B)
PREFIX = list(range(100, 114))            # 14 tokens: 3 whole blocks and 2 more
QUESTION = [40, 41, 42, 43, 44]


@pytest.mark.parametrize("partial", [False, True])
def test_prewarm_then_request_reuses_what_prewarm_reported(make_pipeline, partial):
    pipe = make_pipeline(**ON, enable_partial_reuse=partial)
    plain = make_pipeline(seq_size_per_block=B)
    cached = pipe.prewarm(PREFIX)
    assert cached == (14 if partial else 12)
    assert idle_in_use(pipe) == 0 and pipe.cache_stats()["queries"] == 14
    res = run(pipe, PREFIX + QUESTION, max_new_tokens=4, return_logits=True)
    assert res.aux_info["reuse_len"] == cached
    ref = run(plain, PREFIX + QUESTION, max_new_tokens=4, return_logits=True)
    assert res.output_ids == ref.output_ids and torch.equal(res.logits, ref.logits)
    assert pipe.prewarm(PREFIX) == cached        # already cached: the last token is computed


def test_prewarm_is_salted_like_a_request(make_pipeline):
    pipe = make_pipeline(**ON)
    assert pipe.prewarm(PREFIX, cache_salt="a") == 12
    assert run(pipe, PREFIX + QUESTION, max_new_tokens=2, cache_salt="a").aux_info["reuse_len"] == 12
    assert run(pipe, PREFIX + QUESTION, max_new_tokens=2, cache_salt="b").aux_info["reuse_len"] == 0
    assert run(pipe, PREFIX + QUESTION, max_new_tokens=2).aux_info["reuse_len"] == 0


def test_prewarm_after_a_task_prompt_and_with_a_retention_priority(make_pipeline):
    pipe = make_pipeline(**ON)
    pipe.add_task("t", list(range(200, 208)))              # 2 pinned blocks
    retention = {"token_range_retention_configs": [{"token_start": 0, "token_end": 100,
                                                    "priority": 90}]}
    cached = pipe.prewarm(PREFIX, task_id="t", kv_cache_retention_config=retention)
    assert cached == 20                                      # 8 task + 12 own tokens
    assert pipe.cache_stats()["blocks_cached_by_priority"][90] == 3
    res = run(pipe, PREFIX + QUESTION, max_new_tokens=2, task_id="t")
    assert res.aux_info["reuse_len"] == cached


def test_prewarm_is_refused_when_reuse_is_off(make_pipeline):
    with pytest.raises(RequestError, match="REUSE_CACHE"):
        make_pipeline(seq_size_per_block=B).prewarm(PREFIX)
    with pytest.raises(RequestError, match="reuse_cache false"):
        make_pipeline(**ON).prewarm(PREFIX, reuse_cache=False)


def test_prewarm_under_an_attention_window_holds_what_a_request_holds(make_pipeline):
    """A prewarm pins nothing, so it releases what falls out of the window as a request does:
    a prompt a request can run in a small pool under a window, prewarm can too (it used to
    keep every block and wait forever for more than the pool has)."""
    small = dict(max_attention_window=6, max_seq_len=256, kv_cache_max_tokens=24,
                 max_num_batched_tokens=4)                       # 6 blocks
    pipe = make_pipeline(**ON, **small)
    prompt = list(range(30, 70))                                 # 40 tokens: 10 blocks
    run(pipe, prompt, max_new_tokens=1)                          # a request fits
    cached = pipe.prewarm(prompt, timeout_ms=20000)
    assert idle_in_use(pipe) == 0
    assert run(pipe, prompt + [7], max_new_tokens=1).aux_info["reuse_len"] == cached
