"""Per-tenant quotas (CACHE_SALT_QUOTA_BLOCKS, cache_salt_quotas): a tenant past its bound gives
up its own cached blocks first, so another tenant's flood of one-off prompts cannot evict a
prefix; bad values are refused naming the variable; per-tenant stats are counts under a digest,
never a salt, a key or a token. Every pipeline is integrity-checked by make_pipeline."""

from __future__ import annotations

import pytest
import torch
from cache_sequence import Seq
from conftest import run

from rtpkv.cache import KVCacheManager, KVEventBuffer, PrefixIndex
from rtpkv.cache.block import DEFAULT_PRIORITY, Block
from rtpkv.cache.eviction import TenantEvictionPolicy
from rtpkv.cache.tenants import tenant_label
from rtpkv.config import Settings
from rtpkv.errors import ConfigError
from rtpkv.model_factory import ModelConfig

B = 4
POOL = dict(reuse_cache=True, seq_size_per_block=B, kv_cache_max_tokens=64)   # 16 blocks
PREFIX = list(range(100, 120))                  # 20 tokens: 5 blocks


def _flood(pipe, n: int, salt: str = "flood") -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        run(pipe, torch.randint(3, 1000, (14,), generator=g).tolist(), max_new_tokens=2,
            cache_salt=salt)


def _survives(pipe) -> int:
    """Tenant a's prefix, a flood by another tenant, then a again: the tokens a reuses."""
    run(pipe, PREFIX + [1, 2], max_new_tokens=2, cache_salt="a")
    _flood(pipe, 6)
    return run(pipe, PREFIX + [3, 4], max_new_tokens=2, cache_salt="a").aux_info["reuse_len"]


def test_a_prefix_survives_another_tenants_flood_only_with_a_quota(make_pipeline):
    assert _survives(make_pipeline(**POOL)) == 0
    # a's 5 blocks are within the quota; the flood's 6 plus its request in flight fit beside them
    pipe = make_pipeline(**POOL, cache_salt_quota_blocks=6)
    assert _survives(pipe) == 20
    stats = pipe.cache_stats()
    flood = stats["tenants"][tenant_label(b"flood")]
    assert flood["quota"] == 6 and flood["quota_evictions"] > 0
    assert stats["tenants"][tenant_label(b"a")]["quota_evictions"] == 0
    assert stats["quota_evictions"] == flood["quota_evictions"]


def test_a_per_tenant_override_and_the_unsalted_tenant(make_pipeline):
    # only the flooder is bounded (by its own entry); the unsalted tenant is not, by default
    pipe = make_pipeline(**POOL, cache_salt_quotas={"flood": 2})
    assert _survives(pipe) == 20
    assert pipe.cache_stats()["tenants"][tenant_label(b"flood")]["quota"] == 2
    unsalted = make_pipeline(**POOL, cache_salt_quota_blocks=6)
    run(unsalted, PREFIX + [1, 2], max_new_tokens=2, cache_salt="a")
    _flood(unsalted, 6, salt=None)
    assert unsalted.cache_stats()["quota_evictions"] == 0
    bounded = make_pipeline(**POOL, cache_salt_quotas={"": 3})
    run(bounded, PREFIX + [1, 2], max_new_tokens=2, cache_salt="a")
    _flood(bounded, 6, salt=None)
    assert bounded.cache_stats()["quota_evictions"] > 0
    reuse = run(bounded, PREFIX + [3, 4], max_new_tokens=2, cache_salt="a").aux_info["reuse_len"]
    assert reuse == 20


def test_quotas_never_change_an_answer(make_pipeline):
    pipe = make_pipeline(**POOL, cache_salt_quota_blocks=2)
    plain = make_pipeline(seq_size_per_block=B)
    g = torch.Generator().manual_seed(4)
    for i in range(8):
        ids = PREFIX[:12] + torch.randint(3, 1000, (6,), generator=g).tolist()
        a = run(pipe, ids, max_new_tokens=3, return_logits=True, cache_salt=f"t{i % 3}")
        b = run(plain, ids, max_new_tokens=3, return_logits=True)
        assert a.output_ids == b.output_ids and torch.equal(a.logits, b.logits)


def test_stats_are_counts_under_a_digest_never_the_salt(make_pipeline):
    pipe = make_pipeline(**POOL, cache_salt_quota_blocks=4)
    run(pipe, PREFIX, max_new_tokens=2, cache_salt="secret-tenant-salt")
    stats = pipe.cache_stats()
    assert "secret-tenant-salt" not in repr(stats)
    entry = stats["tenants"][tenant_label(b"secret-tenant-salt")]
    assert entry == {"blocks": 5, "quota": 4, "quota_evictions": 0}
    assert stats["tenants_over_quota"] == 1


def test_the_tenant_furthest_past_its_quota_is_the_victim_though_others_are_older():
    quota = {b"x": 1, b"y": 1, b"w": 3}
    cache = KVCacheManager(8, B, PrefixIndex("test-model", B), reuse_enabled=True,
                           events=KVEventBuffer(0), quota=quota.get)
    for salt, base, n in ((b"w", 1, 8), (b"y", 10, 8), (b"x", 50, 12)):
        seq = Seq(list(range(base, base + n)), salt=salt)
        cache.admit(seq, cache.lookup(seq))
        assert cache.grow(seq, n)
        seq.num_computed = n
        cache.commit(seq)
        cache.free(seq)
    assert cache.pool.num_free == 1 and cache.tenants.num_over_quota == 2    # x: 3 > 1, y: 2 > 1
    cache.check_integrity([])
    newcomer = Seq(list(range(90, 106)), salt=b"z")   # 4 blocks: 1 free, then 3 evictions
    cache.admit(newcomer, cache.lookup(newcomer))
    assert cache.grow(newcomer, 16)
    # x (2 past) gives one, then x and y tie (1 past: by salt, x), then y; w (within) keeps all
    assert cache.tenants.quota_evictions == {b"x": 2, b"y": 1}
    assert cache.tenants.blocks == {b"w": 2, b"x": 1, b"y": 1}
    cache.check_integrity([newcomer])


@pytest.mark.parametrize("env,value,shown", [
    ("CACHE_SALT_QUOTA_BLOCKS", "-1", "CACHE_SALT_QUOTA_BLOCKS='-1' is invalid"),
    ("CACHE_SALT_QUOTA_BLOCKS", "many", "CACHE_SALT_QUOTA_BLOCKS='many' is invalid"),
    ("CACHE_SALT_QUOTAS", '{"a": -2}', "CACHE_SALT_QUOTAS="),
    ("CACHE_SALT_QUOTAS", "[1, 2]", "CACHE_SALT_QUOTAS="),
])
def test_bad_quotas_are_refused_naming_the_variable(monkeypatch, env, value, shown):
    monkeypatch.setenv(env, value)
    with pytest.raises(ConfigError, match="is invalid") as info:
        Settings.from_env()
    assert shown in str(info.value)


def test_bad_quota_in_code_names_the_field_and_the_salt():
    with pytest.raises(ConfigError, match=r"^cache_salt_quotas=.* the quota of cache_salt 'a' "
                                          r"is -2"):
        ModelConfig(cache_salt_quotas={"a": -2})
    with pytest.raises(ConfigError, match=r"^cache_salt_quota_blocks=-3 is invalid"):
        ModelConfig(cache_salt_quota_blocks=-3)


def test_tenant_queues_follow_the_global_one_through_lapses_and_removals():
    policy = TenantEvictionPolicy()
    blocks = [Block(i, priority=p, duration_s=d, tenant=t) for i, (p, d, t) in enumerate(
        [(90, 5.0, b"x"), (35, None, b"y"), (10, None, b"x"), (90, None, b"y")])]
    for block in blocks:
        policy.add(block, now=0.0)
    lapsed = policy.lapse(now=10.0)
    assert lapsed == [blocks[0]]
    blocks[0].priority = DEFAULT_PRIORITY         # as the pool does with what lapse returns
    policy.check()
    assert policy.pop_tenant(b"x") == 2           # x's lowest priority: 10
    assert policy.pop_tenant(b"x") == 0           # then its lapsed block, now at 35
    assert policy.pop_tenant(b"x") is None
    policy.remove(blocks[1])
    policy.remove(blocks[1])                      # not queued any more: nothing happens
    policy.check()
    assert len(policy) == 1 and policy.pop() == 3 and len(policy) == 0
    policy.check()


def test_task_prompt_blocks_count_against_no_tenant(make_pipeline):
    """Task-prompt blocks are the operator's, nobody's: they never count against the unsalted
    tenant's quota (5 pinned task blocks would keep it past a bound of 4 for good)."""
    pipe = make_pipeline(**POOL, cache_salt_quotas={"": 4})
    pipe.add_task("t", PREFIX)                                   # 5 pinned blocks
    run(pipe, list(range(200, 212)), max_new_tokens=2)           # the unsalted tenant: 3 blocks
    stats = pipe.cache_stats()
    assert stats["tenants"][tenant_label(b"")]["blocks"] == 3, stats["tenants"]
    assert stats["tenants_over_quota"] == 0
    _flood(pipe, 4)
    assert pipe.cache_stats()["quota_evictions"] == 0           # nobody was past a quota
