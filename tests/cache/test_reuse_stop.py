"""Why reuse stopped where it did: aux_info["reuse_stop"] per request, cache_stats()["reuse_stops"]
in aggregate, the bounded ghost list of evicted keys and its ghost hits. Each reason is produced
here by a scenario that would give another reason if the check were wrong, and none of them
tells a tenant anything about another tenant's cache."""

from __future__ import annotations

from conftest import run

from rtpkv.cache.ghost_list import GhostList

B = 4
ON = dict(reuse_cache=True, seq_size_per_block=B)
SMALL = dict(ON, kv_cache_max_tokens=24)          # 6 blocks
BASE = list(range(10, 24))                        # 14 tokens
A = list(range(10, 27))                           # 17 tokens: 4 whole reusable blocks
FLOOD = list(range(300, 318))                     # with 4 new tokens: the whole small pool


def stop(pipe, ids, **cfg) -> tuple[str, int, int]:
    aux = run(pipe, ids, max_new_tokens=4, **cfg).aux_info
    return aux["reuse_stop"], aux["reuse_stop_tokens"], aux["reuse_len"]


def test_reuse_off_for_the_engine_and_for_one_request(make_pipeline):
    assert stop(make_pipeline(seq_size_per_block=B), BASE)[0] == "reuse_off"
    pipe = make_pipeline(**ON)
    run(pipe, BASE, max_new_tokens=4)
    assert stop(pipe, BASE, reuse_cache=False) == ("reuse_off", 0, 0)


def test_prompt_end_with_whole_blocks_and_with_partial_reuse(make_pipeline):
    pipe = make_pipeline(**ON)
    run(pipe, BASE[:13], max_new_tokens=4)
    assert stop(pipe, BASE[:13]) == ("prompt_end", 0, 12)      # 13 - 1 tokens: 3 blocks
    partial = make_pipeline(**ON, enable_partial_reuse=True)
    run(partial, BASE, max_new_tokens=4)
    assert stop(partial, BASE) == ("prompt_end", 0, 13)


def test_partial_block_names_the_tokens_partial_reuse_would_take(make_pipeline):
    pipe = make_pipeline(**ON)
    run(pipe, BASE, max_new_tokens=4)
    assert stop(pipe, BASE[:10] + [900, 901, 902]) == ("partial_block", 2, 8)
    # the last prompt block: BASE's 4th block continues [22] by one token (13 - 12 = 1 allowed)
    assert stop(pipe, BASE) == ("partial_block", 1, 12)
    stats = pipe.cache_stats()["reuse_stops"]
    assert stats["partial_block"] == 2 and stats["not_cached"] == 1


def test_not_cached_and_never_another_tenants_cache(make_pipeline):
    pipe = make_pipeline(**SMALL)
    assert stop(pipe, BASE)[0] == "not_cached"
    # another salt: neither the partial block nor, once evicted, the eviction is told
    assert stop(pipe, BASE[:10] + [900, 901], cache_salt="b")[0] == "not_cached"
    run(pipe, A, max_new_tokens=4)
    run(pipe, FLOOD, max_new_tokens=4)
    assert stop(pipe, A, cache_salt="c")[0] == "not_cached"
    assert stop(pipe, A)[0] == "evicted"


def test_evicted_counts_ghost_hits_and_the_list_is_bounded(make_pipeline):
    pipe = make_pipeline(**SMALL)
    run(pipe, A, max_new_tokens=4)
    run(pipe, FLOOD, max_new_tokens=4)
    assert stop(pipe, A) == ("evicted", 16, 0)
    stats = pipe.cache_stats()
    assert stats["ghost_hit_tokens"] == 16 and stats["ghost_capacity"] == 6
    assert 0 < stats["ghost_blocks"] <= 6
    assert stats["hit_rate_with_ghosts"] == (stats["hits"] + 16) / stats["queries"]
    without = make_pipeline(**SMALL, kv_cache_ghost_blocks=0)
    run(without, A, max_new_tokens=4)
    run(without, FLOOD, max_new_tokens=4)
    assert stop(without, A)[0] == "not_cached"
    assert without.cache_stats()["ghost_hit_tokens"] == 0


def test_ghost_list_forgets_the_oldest_and_a_cached_key():
    ghosts = GhostList(2)
    for key in (b"a", b"b", b"c"):
        ghosts.add(key)
    assert b"a" not in ghosts and b"b" in ghosts and len(ghosts) == 2
    ghosts.discard(b"b")
    assert b"b" not in ghosts and len(ghosts) == 1


def test_window_names_a_hole_before_cached_blocks(make_pipeline):
    """A windowed request releases its old blocks first, so they are evicted first: the prefix
    has a hole before blocks that are still cached."""
    pipe = make_pipeline(**ON, max_attention_window=8, kv_cache_max_tokens=48)   # 12 blocks
    prompt = list(range(10, 40))                  # 30 tokens
    run(pipe, prompt, max_new_tokens=4)
    run(pipe, list(range(500, 520)), max_new_tokens=4)   # 6 blocks: 4 free + 2 evicted
    reason, _, reused = stop(pipe, prompt)
    assert reason == "window" and 0 < reused < 28


def test_tier_disabled_when_the_request_turned_the_holding_tier_off(make_pipeline):
    pipe = make_pipeline(**SMALL, host_cache_size=1 << 20)
    run(pipe, A, max_new_tokens=4)
    run(pipe, FLOOD, max_new_tokens=4)
    assert stop(pipe, A, enable_memory_cache=False) == ("tier_disabled", 0, 0)
    reason, _, reused = stop(pipe, A)
    assert reused == 16 and reason == "prompt_end"


def test_a_follow_up_in_the_last_turns_partly_filled_block_is_a_partial_block(make_pipeline):
    """Partial reuse off: a chat follow-up whose next tokens sit in the previous turn's partly
    filled last block (freed at its end) is told partial_block, with the tokens partial reuse
    takes on the same turns, not not_cached."""
    turn = BASE[:9]                                   # 9 + 2 generated: 10 computed, a tail of 2
    kept = make_pipeline(**ON, enable_partial_reuse=True)
    plain = make_pipeline(**ON)
    for pipe in (kept, plain):
        first = run(pipe, turn, max_new_tokens=2, top_k=1, ignore_eos=True)
        follow = turn + first.output_ids + [900, 901, 902]
        aux = run(pipe, follow, max_new_tokens=2).aux_info
        if pipe is kept:
            taken = aux["partial_reuse_len"]
            assert taken == 2 and aux["reuse_len"] == 8 + 2
        else:
            assert (aux["reuse_stop"], aux["reuse_stop_tokens"], aux["reuse_len"]) == \
                ("partial_block", taken, 8)
    # another tenant's follow-up with the same tokens is told nothing of it
    assert stop(plain, follow, cache_salt="b")[0] == "not_cached"
