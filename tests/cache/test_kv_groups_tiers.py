"""KV cache groups through the tiers (host memory, disk, Redis), the connector and partial
reuse, on the Gemma-3-shaped tiny model (a full group and three sliding ones): every group's
blocks of a prefix come back together, the outputs are those of a run without reuse (itself
checked against transformers), alone and batched, a damaged or missing record of any group is a miss, and the pool holds fewer blocks
than one table holding every layer's. Also: the model's key root names its windows."""

import pytest
import torch
import transformers
from conftest import GEMMA_WINDOW as W, idle_in_use, random_prompt, run

from cache_sequence import Seq

from rtpkv.cache import KVCacheManager, PrefixIndex
from dict_connector import DictConnector
from rtpkv.cache.groups import KVGroup, model_root_name
from rtpkv.cache.prefix_index import KeyChain
from rtpkv.cache.tiers.disk import SUFFIX

B = 8
N = 100                          # > 3W: reusable whole blocks 0..11 (96 tokens)
REUSABLE = (N - 1) // B * B
NEW = 4
A, C = random_prompt(N, seed=41), random_prompt(N, seed=42)


def same(res, ref) -> None:
    assert res.output_ids == ref.output_ids
    torch.testing.assert_close(res.logits, ref.logits, atol=1e-4, rtol=0)


def together(pipe, prompts):
    """Each prompt's last response, the requests submitted at once (one batch)."""
    streams = [pipe(ids, generate_config=dict(top_k=1, ignore_eos=True, max_new_tokens=NEW,
                                              return_logits=True)) for ids in prompts]
    return [list(s)[-1] for s in streams]


@pytest.fixture(scope="module")
def gemma3(checkpoints):
    return checkpoints("gemma3")


@pytest.fixture(scope="module")
def hf_expected(gemma3):
    """transformers' greedy tokens and logits (float32) for A and C."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(gemma3, dtype=torch.float32).eval()
    expected = {}
    for ids in (A, C):
        x = torch.tensor([ids])
        with torch.inference_mode():
            out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                              max_new_tokens=NEW, min_new_tokens=NEW, output_logits=True,
                              return_dict_in_generate=True)
        expected[tuple(ids)] = (out.sequences[0, len(ids):].tolist(), torch.cat(out.logits))
    return expected


@pytest.fixture
def plain(gemma3, make_pipeline, hf_expected):
    """The reference: the same model without reuse, A and C computed (transformers' outputs)."""
    pipe = make_pipeline(gemma3, seq_size_per_block=B)
    results = {tuple(ids): run(pipe, ids, max_new_tokens=NEW, return_logits=True)
               for ids in (A, C)}
    for ids, res in results.items():
        tokens, logits = hf_expected[ids]
        assert res.output_ids == tokens
        torch.testing.assert_close(res.logits, logits, atol=1e-4, rtol=0)
    return results


def _remote(url):
    return dict(enable_remote_cache=True, remote_cache_url=url)


def _flushed(pipe) -> None:
    for tier in pipe.engine.cache.ladder.tiers:
        if tier.name == "remote":
            assert tier.flush(10.0)
        elif tier.name == "disk":
            tier.flush()


@pytest.mark.parametrize("tier", ["disk", "remote", "connector"])
def test_a_fresh_pipeline_gets_every_groups_blocks_from_a_write_through_tier(
        tier, gemma3, make_pipeline, plain, tmp_path, request):
    """One pipeline computes A and C; a fresh one (empty device pool) gets all of A from the
    tier alone, then A and C batched, each with the outputs of a run without reuse."""
    options = {"disk": lambda: dict(enable_memory_cache_disk=True,
                                    memory_cache_disk_paths=str(tmp_path)),
               "remote": lambda: _remote(request.getfixturevalue("redis_url")),
               "connector": lambda: dict(kv_connector=DictConnector)}[tier]()
    DictConnector.blocks = {}
    first = make_pipeline(gemma3, seq_size_per_block=B, reuse_cache=True, **options)
    assert len(first.engine.cache.groups) == 4
    for ids in (A, C):
        run(first, ids, max_new_tokens=NEW)
    _flushed(first)
    first.stop()
    second = make_pipeline(gemma3, seq_size_per_block=B, reuse_cache=True, **options)
    alone = run(second, A, max_new_tokens=NEW, return_logits=True)
    assert alone.aux_info["reuse_len"] == REUSABLE == alone.aux_info[f"{tier}_reuse_len"]
    same(alone, plain[tuple(A)])
    third = make_pipeline(gemma3, seq_size_per_block=B, reuse_cache=True, **options)
    for res, ids in zip(together(third, [A, C]), (A, C)):
        assert res.aux_info["reuse_len"] == REUSABLE
        same(res, plain[tuple(ids)])
    assert idle_in_use(third) == 0


def test_host_memory_takes_evicted_blocks_of_every_group(gemma3, make_pipeline, plain):
    """A pool for about one request: A and C evict each other's blocks to host memory, and A
    comes back from the device and host memory together, alone and batched with C."""
    pipe = make_pipeline(gemma3, seq_size_per_block=B, reuse_cache=True,
                         kv_cache_max_tokens=18 * B, host_cache_size=1 << 22)
    run(pipe, A, max_new_tokens=NEW)
    run(pipe, C, max_new_tokens=NEW)
    again = run(pipe, A, max_new_tokens=NEW, return_logits=True)
    assert again.aux_info["reuse_len"] == REUSABLE and again.aux_info["memory_reuse_len"] > 0
    same(again, plain[tuple(A)])
    run(pipe, random_prompt(N, seed=43), max_new_tokens=NEW)    # evicts A and C again
    for res, ids in zip(together(pipe, [A, C]), (A, C)):
        assert res.aux_info["memory_reuse_len"] > 0
        same(res, plain[tuple(ids)])
    assert pipe.cache_stats()["memory_onboarded_blocks"] > 0


def test_partial_reuse_copies_the_partial_block_in_every_group(gemma3, make_pipeline):
    """ENABLE_PARTIAL_REUSE with groups: a prompt sharing A's first 90 tokens reuses exactly
    90 (11 whole blocks and 2 tokens copied in each group), alone and batched."""
    reused = make_pipeline(gemma3, seq_size_per_block=B, reuse_cache=True,
                           enable_partial_reuse=True)
    fresh = make_pipeline(gemma3, seq_size_per_block=B)
    assert len(reused.engine.cache.groups) == 4
    run(reused, A, max_new_tokens=NEW)
    turns = [A[:90] + random_prompt(20, seed=s) for s in (44, 45)]
    got = run(reused, turns[0], max_new_tokens=NEW, return_logits=True)
    assert got.aux_info["reuse_len"] == 90 and got.aux_info["local_reuse_len"] == 90
    same(got, run(fresh, turns[0], max_new_tokens=NEW, return_logits=True))
    for res, ids in zip(together(reused, [turns[1], A[:90] + turns[0][90:]]), turns[1:] + [turns[0]]):
        assert res.aux_info["reuse_len"] >= 90
        same(res, run(fresh, ids, max_new_tokens=NEW, return_logits=True))
    assert idle_in_use(reused) == 0


def test_a_damaged_or_missing_group_record_is_a_miss(gemma3, make_pipeline, plain, tmp_path):
    """On disk, a sliding group's record inside the last window damaged: the hit ends where that
    group still serves its window (block 10); a full group's record missing: it ends there."""
    disk = dict(enable_memory_cache_disk=True, memory_cache_disk_paths=str(tmp_path),
                write_cache_sync=True)
    first = make_pipeline(gemma3, seq_size_per_block=B, reuse_cache=True, **disk)
    run(first, A, max_new_tokens=NEW)
    first.stop()
    cache = first.engine.cache
    sliding = KeyChain(cache.index, A, b"", 0, root=cache.roots[1])
    record = tmp_path / (sliding.key(10).hex() + SUFFIX)
    data = bytearray(record.read_bytes())
    data[-3] ^= 0xFF
    record.write_bytes(bytes(data))
    pipe = make_pipeline(gemma3, seq_size_per_block=B, reuse_cache=True, **disk)
    res = run(pipe, A, max_new_tokens=NEW, return_logits=True)
    assert res.aux_info["disk_reuse_len"] == 10 * B
    assert pipe.cache_stats()["disk_corrupt_files"] == 1
    same(res, plain[tuple(A)])
    pipe.stop()
    full = KeyChain(cache.index, A, b"", 0, root=cache.roots[0])
    (tmp_path / (full.key(5).hex() + SUFFIX)).unlink()
    pipe = make_pipeline(gemma3, seq_size_per_block=B, reuse_cache=True, **disk)
    res = run(pipe, A, max_new_tokens=NEW, return_logits=True)
    assert res.aux_info["disk_reuse_len"] == 5 * B
    same(res, plain[tuple(A)])


def test_the_pool_holds_fewer_blocks_with_a_tier_than_one_table(gemma3, make_pipeline,
                                                                 make_one_table_pipeline):
    """With host memory on, a 120-token request and its 4 new tokens hold at most 16 + 3 x 5
    one-layer blocks at once (the full group every block, each sliding group its window's and
    the one being filled), where one table of every layer's blocks held 16 four-layer ones
    (64 layers' worth); the same tokens either way."""
    options = dict(seq_size_per_block=B, reuse_cache=True, host_cache_size=1 << 22,
                   max_num_batched_tokens=B)
    grouped = make_pipeline(gemma3, **options)
    one_table = make_one_table_pipeline(gemma3, **options)
    assert len(one_table.engine.cache.groups) == 1
    ids = random_prompt(120, seed=46)
    peaks = []
    for pipe in (grouped, one_table):
        cache, scheduler, most = pipe.engine.cache, pipe.engine.scheduler, [0]
        postprocess = scheduler.postprocess

        def recording(*args, cache=cache, scheduler=scheduler, most=most, postprocess=postprocess):
            finished = postprocess(*args)
            layers = cache.memory.kv.shape[1]
            most[0] = max(most[0], layers * sum(cache.num_held(r) for r in scheduler.running))
            return finished

        scheduler.postprocess = recording
        peaks.append((most, run(pipe, ids, max_new_tokens=NEW)))
    (grouped_peak, a), (one_peak, b) = peaks
    full = -(-(120 + NEW - 2) // B)          # up to the step before the last
    assert grouped_peak[0] == full + 3 * (W // B + 1) and one_peak[0] == 4 * full
    assert a.output_ids == b.output_ids


def test_check_integrity_checks_every_group():
    """A block of one group in another group's table, or a key that is not its block's, is
    caught."""
    groups = (KVGroup(0, None, (0,)), KVGroup(1, 16, (1,)))
    cache = KVCacheManager(32, B, PrefixIndex("m", B), reuse_enabled=True, groups=groups)
    seq = Seq(random_prompt(40, seed=47))
    cache.admit(seq, cache.lookup(seq))
    assert cache.grow(seq, 40)
    seq.num_computed = 40
    cache.commit(seq)
    cache.check_integrity([seq])
    table = seq.group_tables[0].block_table
    seq.block_table[0], table[0] = table[0], seq.block_table[0]
    with pytest.raises(AssertionError, match="group"):
        cache.check_integrity([seq])
    seq.block_table[0], table[0] = table[0], seq.block_table[0]
    seq.block_keys[1] = seq.block_keys[2]
    with pytest.raises(AssertionError, match="key"):
        cache.check_integrity([seq])


def test_the_key_root_names_the_windows(gemma3, llama_path, make_pipeline):
    """MAX_ATTENTION_WINDOW changes every layer's K/V past the first, so it changes the root
    of every group; a model without windows keeps the fingerprint's root."""
    llama = make_pipeline(seq_size_per_block=B)
    assert llama.engine.root_key == PrefixIndex(llama.model.fingerprint, B).root
    windowed = make_pipeline(seq_size_per_block=B, max_attention_window=16)
    assert windowed.engine.root_key != llama.engine.root_key
    roots = [make_pipeline(gemma3, seq_size_per_block=B, max_attention_window=w).engine.cache.roots
             for w in (None, 64, 128)]
    assert len({r for rs in roots for r in rs}) == sum(len(rs) for rs in roots)
    assert model_root_name("fp", [None, 32], None) == "fp|windows=full,32"
    assert model_root_name("fp", [None, 32], 16) == "fp|windows=16,16"
    assert model_root_name("fp", [None, None], None) == "fp"
