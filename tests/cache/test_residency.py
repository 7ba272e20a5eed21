"""Residency histograms: lifetime, idle time before eviction and reuse gap, per tier, recorded
on the pool's and the tiers' own events, with a clock the test controls."""

from rtpkv.cache.residency import RESIDENCY_BUCKETS_S, ResidencyHistograms
from rtpkv.cache.tiers.order import EvictionOrder
from conftest import run

SYSTEM = list(range(400, 440))   # 10 blocks of 4


def _bucket(seconds: float) -> int:
    return next(i for i, le in enumerate(RESIDENCY_BUCKETS_S + (float("inf"),)) if seconds <= le)


def test_histograms_count_each_observation_in_its_bucket():
    h = ResidencyHistograms()
    h.observe("reuse_gap", 0.05)
    h.observe("reuse_gap", 30.0)
    h.evicted(now=100.0, stored_at=0.0, used_at=90.0)
    stats = h.stats()
    assert stats["reuse_gap"]["count"] == 2 and stats["reuse_gap"]["sum_s"] == 30.05
    assert stats["reuse_gap"]["counts"][_bucket(0.05)] == 1
    assert stats["reuse_gap"]["counts"][_bucket(30.0)] == 1
    assert stats["lifetime"]["counts"][_bucket(100.0)] == 1
    assert stats["idle_before_eviction"]["counts"][_bucket(10.0)] == 1


def test_the_device_pool_records_on_hits_and_evictions(make_pipeline):
    pipe = make_pipeline(reuse_cache=True, seq_size_per_block=4, kv_cache_max_tokens=128)
    now = [0.0]
    pipe.engine.cache.pool.clock = lambda: now[0]
    run(pipe, SYSTEM + [5], max_new_tokens=1)          # 10 blocks stored at t=0
    now[0] = 7.0
    assert run(pipe, SYSTEM + [6], max_new_tokens=1).aux_info["reuse_len"] == 40
    device = pipe.cache_stats()["residency"]["device"]
    assert device["reuse_gap"]["count"] == 10
    assert device["reuse_gap"]["counts"][_bucket(7.0)] == 10   # released at 0, hit at 7
    assert device["lifetime"]["count"] == 0
    now[0] = 100.0
    for k in range(4):                                 # turn the 32-block pool over
        run(pipe, [(50 * k + 7 * i) % 1000 + 3 for i in range(40)], max_new_tokens=1)
    device = pipe.cache_stats()["residency"]["device"]
    assert device["lifetime"]["count"] >= 10
    assert device["lifetime"]["counts"][_bucket(100.0)] >= 10          # stored at 0
    assert device["idle_before_eviction"]["counts"][_bucket(93.0)] >= 10   # last used at 7


def test_a_tier_records_through_its_eviction_order():
    now = [0.0]
    order = EvictionOrder(clock=lambda: now[0])
    order.add(b"a", 35)
    order.add(b"b", 35)
    now[0] = 2.0
    order.touch(b"a")                                   # a hit after 2 s
    now[0] = 600.0
    victim = order.victim()
    assert victim == b"b"
    order.evicted(victim)
    order.remove(victim)
    order.check()
    stats = order.residency.stats()
    assert stats["reuse_gap"]["counts"][_bucket(2.0)] == 1
    assert stats["lifetime"]["counts"][_bucket(600.0)] == 1
    assert stats["idle_before_eviction"]["counts"][_bucket(600.0)] == 1


def test_tiers_and_metrics_show_it(make_pipeline):
    from rtpkv.server.metrics import ServerMetrics

    pipe = make_pipeline(reuse_cache=True, seq_size_per_block=4, kv_cache_max_tokens=128,
                         enable_memory_cache=True, memory_cache_size_mb=1)
    for k in range(5):
        run(pipe, [(50 * k + 7 * i) % 1000 + 3 for i in range(40)], max_new_tokens=1)
    residency = pipe.cache_stats()["residency"]
    assert set(residency) == {"device", "memory"} and residency["device"]["lifetime"]["count"]
    text = ServerMetrics(pipe.cache_stats, lambda: 0).render().decode()
    for kind in ("lifetime", "idle_before_eviction", "reuse_gap"):
        for tier in ("device", "memory"):
            assert f'rtpkv_kv_block_{kind}_seconds_bucket{{le="+Inf",tier="{tier}"}}' in text
    assert 'rtpkv_kv_block_lifetime_seconds_count{tier="device"} ' + \
        f'{float(residency["device"]["lifetime"]["count"])}' in text


def test_the_cli_table_shows_each_histogram_as_a_mean(make_pipeline):
    from rtpkv.report import stats_table

    pipe = make_pipeline(reuse_cache=True, seq_size_per_block=4, kv_cache_max_tokens=128)
    now = [0.0]
    pipe.engine.cache.pool.clock = lambda: now[0]
    run(pipe, SYSTEM + [5], max_new_tokens=1)
    now[0] = 4.0
    run(pipe, SYSTEM + [6], max_new_tokens=1)
    lines = stats_table(pipe.cache_stats()).splitlines()
    gap = next(line for line in lines if "residency device reuse_gap" in line)
    assert gap.split()[-6:] == ["4.0", "s", "mean", "of", "10", "blocks"]
    assert any("residency device lifetime" in line and " - " in line for line in lines)
