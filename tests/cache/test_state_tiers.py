"""A recurrent model's saved states through the tiers (host memory, disk, Redis) and the
connector (rtpkv/cache/state_group.py's ladder): a fresh pipeline, or one whose device pool
evicted the states, reuses the prefix from the tier up to the last saved boundary with the
outputs of a run without reuse, alone and batched; a damaged or missing state record gives a
shorter hit with the same outputs; nothing leaks."""

import pytest
import torch
from conftest import idle_in_use, run

from dict_connector import DictConnector
from rtpkv.cache.prefix_index import KeyChain
from rtpkv.cache.state_group import tier_key
from rtpkv.cache.tiers.base import TierLayout
from rtpkv.cache.tiers.disk import SUFFIX
from rtpkv.cache.tiers.factory import STATE_NAMESPACE
from rtpkv.cache.tiers.record import decode_record, encode_record

B, STEP = 4, 2               # a state saved every 8 tokens
OPTIONS = dict(seq_size_per_block=B, linear_step=STEP, max_num_batched_tokens=16)
NEW = 4


def _tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 600, (n,), generator=g).tolist()


PROMPT = _tokens(35, 80)     # 8 whole blocks: states after blocks 1, 3, 5, 7 (8..32 tokens)
AGAIN = [PROMPT + _tokens(6, 90), PROMPT + _tokens(9, 91)]


def _same(a, b):
    assert a.output_ids == b.output_ids
    assert torch.equal(a.logits, b.logits)


def _plain(make_pipeline, path):
    pipe = make_pipeline(path, **OPTIONS)
    return [run(pipe, ids, max_new_tokens=NEW, return_logits=True) for ids in AGAIN]


def _flushed(pipe):
    cache = pipe.engine.cache
    for tier in cache.ladder.tiers + cache.state_group.ladder.tiers:
        if tier.name == "remote":
            assert tier.flush(10.0)
        elif tier.name == "disk":
            tier.flush()


def _state_onboarded(pipe, name):
    return pipe.engine.cache.state_group.ladder.onboarded[name]


def _options(tier, tmp_path, request):
    return {"disk": lambda: dict(enable_memory_cache_disk=True,
                                 memory_cache_disk_paths=str(tmp_path)),
            "remote": lambda: dict(enable_remote_cache=True,
                                   remote_cache_url=request.getfixturevalue("redis_url")),
            "connector": lambda: dict(kv_connector=DictConnector)}[tier]()


@pytest.mark.parametrize("tier", ["disk", "remote", "connector"])
def test_a_fresh_pipeline_resumes_from_a_state_in_a_write_through_tier(
        tier, checkpoints, make_pipeline, tmp_path, request):
    path = checkpoints("qwen3_next")
    plain = _plain(make_pipeline, path)
    options = dict(OPTIONS, reuse_cache=True, **_options(tier, tmp_path, request))
    DictConnector.blocks = {}
    first = make_pipeline(path, **options)
    run(first, PROMPT, max_new_tokens=NEW)
    _flushed(first)
    first.stop()
    second = make_pipeline(path, **options)
    alone = run(second, AGAIN[0], max_new_tokens=NEW, return_logits=True)
    assert alone.aux_info["reuse_len"] == 32 == alone.aux_info[f"{tier}_reuse_len"]
    assert _state_onboarded(second, tier) == 1
    _same(alone, plain[0])
    third = make_pipeline(path, **options)
    streams = [third(ids, top_k=1, ignore_eos=True, max_new_tokens=NEW, return_logits=True)
               for ids in AGAIN]
    for stream, ref, hit in zip(streams, plain, (40, 32)):   # the second saved AGAIN[0]'s
        res = list(stream)[-1]
        assert res.aux_info["reuse_len"] == hit
        _same(res, ref)
    assert idle_in_use(third) == 0
    third.engine.cache.check_integrity()


@pytest.mark.parametrize("arch", ["qwen3_next", "granite_hybrid_dense"])
def test_states_the_device_pool_evicts_come_back_from_host_memory(arch, checkpoints,
                                                                  make_pipeline):
    """A pool of 16 blocks and 8 saved states: other prompts (with reuse, so saving states)
    evict the prompt's blocks and states to host memory; two prompts extending it, batched,
    then resume from there."""
    path = checkpoints(arch)
    plain = _plain(make_pipeline, path)
    pipe = make_pipeline(path, reuse_cache=True, kv_cache_max_tokens=64,
                         enable_memory_cache=True, memory_cache_size_mb=4, **OPTIONS)
    run(pipe, PROMPT, max_new_tokens=1)
    for seed in range(3):
        run(pipe, _tokens(50, 81 + seed), max_new_tokens=1)
    assert pipe.engine.cache.state_group.ladder.offloaded["memory"] > 0
    streams = [pipe(ids, top_k=1, ignore_eos=True, max_new_tokens=NEW, return_logits=True)
               for ids in AGAIN]                           # batched
    for stream, ref in zip(streams, plain):
        res = list(stream)[-1]
        assert res.aux_info["reuse_len"] == 32
        _same(res, ref)
    assert _state_onboarded(pipe, "memory") >= 1
    assert idle_in_use(pipe) == 0
    pipe.engine.cache.check_integrity()


@pytest.mark.parametrize("damage", ["missing", "corrupt", "foreign"])
def test_a_damaged_or_missing_state_record_gives_a_shorter_hit(
        damage, checkpoints, make_pipeline, tmp_path):
    """On disk, the state after block 7 (32 tokens) removed, damaged, or rewritten as a record
    of another layout (4 bytes shorter) under its key: the hit ends on the state before it (24
    tokens), with the same outputs; a corrupt record is counted, a foreign one too."""
    path = checkpoints("qwen3_next")
    plain = _plain(make_pipeline, path)
    options = dict(OPTIONS, reuse_cache=True, enable_memory_cache_disk=True,
                   memory_cache_disk_paths=str(tmp_path))
    first = make_pipeline(path, **options)
    run(first, PROMPT, max_new_tokens=NEW)
    _flushed(first)
    cache = first.engine.cache
    key = KeyChain(cache.index, PROMPT, b"", 0, root=cache.roots[0]).key(7)
    layout = cache.state_group.ladder.tiers[0].layout
    first.stop()
    record = tmp_path / STATE_NAMESPACE / (tier_key(key).hex() + SUFFIX)
    assert record.exists()
    if damage == "missing":
        record.unlink()
    elif damage == "foreign":
        meta, payload = decode_record(record.read_bytes(), layout)
        shorter = TierLayout(layout.fingerprint, layout.block_size, layout.dtype,
                             (layout.shape[0] - 4,))
        record.write_bytes(encode_record(meta, payload[:-4], shorter))
    else:
        data = bytearray(record.read_bytes())
        data[-3] ^= 0xFF
        record.write_bytes(bytes(data))
    second = make_pipeline(path, **options)
    res = run(second, AGAIN[0], max_new_tokens=NEW, return_logits=True)
    assert res.aux_info["reuse_len"] == 24
    _same(res, plain[0])
    stats = second.engine.cache.state_group.stats()["tiers"]
    assert stats["disk_corrupt_files"] == (damage == "corrupt")
    assert stats["disk_foreign_files"] == (damage == "foreign")
    assert idle_in_use(second) == 0


def test_a_salted_prefix_state_is_found_with_its_salt_only(checkpoints, make_pipeline,
                                                          tmp_path):
    path = checkpoints("qwen3_next")
    options = dict(OPTIONS, reuse_cache=True, enable_memory_cache_disk=True,
                   memory_cache_disk_paths=str(tmp_path))
    first = make_pipeline(path, **options)
    run(first, PROMPT, max_new_tokens=NEW, cache_salt="a")
    _flushed(first)
    first.stop()
    pipe = make_pipeline(path, **options)
    assert run(pipe, AGAIN[0], max_new_tokens=NEW, cache_salt="b").aux_info["reuse_len"] == 0
    assert run(pipe, AGAIN[1], max_new_tokens=NEW, cache_salt="a").aux_info["reuse_len"] == 32



def test_a_connector_instance_keeps_blocks_only(checkpoints, make_pipeline):
    """A kv_connector given as an instance holds the KV blocks' staging, so no state goes
    there: a fresh pipeline finds the blocks but no state, computes all, answers the same."""
    path = checkpoints("qwen3_next")
    plain = _plain(make_pipeline, path)
    DictConnector.blocks = {}
    first = make_pipeline(path, reuse_cache=True, kv_connector=DictConnector(), **OPTIONS)
    assert not first.engine.cache.state_group.ladder
    run(first, PROMPT, max_new_tokens=NEW)
    first.stop()
    assert DictConnector.blocks
    second = make_pipeline(path, reuse_cache=True, kv_connector=DictConnector(), **OPTIONS)
    res = run(second, AGAIN[0], max_new_tokens=NEW, return_logits=True)
    assert res.aux_info["reuse_len"] == 0
    _same(res, plain[0])
