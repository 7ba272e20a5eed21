"""benchmarks/fleet.py's own logic, without a fleet: the trace's hash ids become shared token
blocks, and each goal line passes or fails on the figures it is given."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
_spec = importlib.util.spec_from_file_location("fleet_benchmark", BENCHMARKS / "fleet.py")
bench = sys.modules["fleet_benchmark"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_requests_that_share_leading_hash_ids_share_exactly_those_token_blocks(tmp_path):
    trace = tmp_path / "trace.jsonl"
    records = [{"timestamp": 0, "output_length": 500, "hash_ids": [0, 1, 2]},
               {"timestamp": 1500, "output_length": 3, "hash_ids": [0, 1, 3]},
               {"timestamp": 2000, "output_length": 9, "hash_ids": [0, 4, 1, 2, 5]}]
    trace.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    a, b, c = bench.load_trace(trace, 3, tokens_per_id=16, max_ids=4, max_new_tokens=16,
                               vocab=1024)
    assert len(a.prompt) == 48 and len(c.prompt) == 64   # c keeps its first 4 ids
    assert a.prompt[:32] == b.prompt[:32] and a.prompt[32:] != b.prompt[32:]
    assert c.prompt[:16] == a.prompt[:16] and c.prompt[16:32] != a.prompt[16:32]
    assert c.prompt[32:64] == a.prompt[16:48]   # ids 1, 2 again: the same tokens, elsewhere
    assert all(bench.LOWEST_TOKEN_ID <= t < 1024 for t in a.prompt + b.prompt + c.prompt)
    assert [r.new_tokens for r in (a, b, c)] == [16, 3, 9]
    assert [r.arrival for r in (a, b, c)] == [0.0, 1.5, 2.0]
    assert [r.session for r in (a, b, c)] == ["1", "1", "4"]


def result(hit_rate: float, ttft_p90: float, failed: int = 0) -> dict:
    return {"hit_rate": hit_rate, "ttft_p90": ttft_p90, "failed": failed}


def test_the_goals_are_checked_for_dynamos_best_setting_at_every_load():
    ceiling = 0.20
    by_load = {8.0: {"round_robin": result(0.12, 1.0), "kv_aware": result(0.15, 0.6),
                     "dynamo-credit0": result(0.12, 0.9),
                     "dynamo-credit2": result(0.195, 0.5)},
               16.0: {"round_robin": result(0.12, 3.0), "kv_aware": result(0.15, 1.5),
                      "dynamo-credit0": result(0.12, 2.0),
                      "dynamo-credit2": result(0.19, 1.8, failed=1)}}
    assert bench.best_dynamo(2, by_load, ceiling) == "dynamo-credit2"
    verdicts = {g.text: bench.check(g, "dynamo-credit2", by_load, ceiling)
                for g in bench.GOALS[2]}
    assert verdicts["hit rate >= 95% of the one-replica ceiling"] == (
        True, "97.5% at 8, 95.0% at 16")
    assert verdicts["hit rate >= 1.5x round_robin's"][0] is True
    assert verdicts["TTFT p90 >= 1.5x better than round_robin's"] == (
        True, "2.00x at 8, 1.67x at 16")
    assert verdicts["TTFT p90 no worse than kv_aware's"][0] is False   # 1.8 s against 1.5 s
    assert verdicts["0 failed requests"] == (False, "0 failed at 8, 1 failed at 16")
    del by_load[8.0]["kv_aware"]
    assert bench.check(bench.GOALS[2][3], "dynamo-credit2", by_load, ceiling)[0] is None
    assert bench.check(bench.GOALS[4][0], "dynamo-credit2", by_load, ceiling)[0] is False


def test_the_lru_simulation_counts_hits_per_replica_and_evicts_least_recent_first():
    def req(*blocks: int) -> "bench.Request":
        return bench.Request([t for b in blocks for t in [b] * 4], 1, 0.0, "s")

    # two conversations, two turns each, every prompt opening with the shared block 0: round
    # robin sends each conversation's turns to different replicas, a prefix-aware router keeps
    # them together (its first turn of B goes to the idler replica, losing the shared block)
    trace = [req(0, 1), req(0, 1, 3), req(0, 2), req(0, 2, 4)]
    total = 40
    r = bench.simulate(trace, replicas=2, pool_tokens=64, block=4)
    assert r["round_robin"] == (0 + 0 + 4 + 4) / total
    assert r["prefix-aware"] == (0 + 8 + 0 + 8) / total
    assert r[bench.CEILING] == (0 + 8 + 4 + 8) / total
    # a pool of one block: the shared head, released last, is the one that survives
    assert bench.simulate(trace, replicas=1, pool_tokens=4, block=4)[bench.CEILING] == 12 / total
    # a request never reuses its last token
    again = bench.simulate([req(7, 8), req(7, 8)], replicas=1, pool_tokens=64, block=4)
    assert again[bench.CEILING] == 7 / 16
