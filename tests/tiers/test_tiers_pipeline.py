"""The tiers in a running pipeline: host memory (issue 9), disk and connector (issue 10).

Every cache path is checked against a run without reuse and against transformers, and every
pipeline is integrity-checked (tiers included) by the make_pipeline fixture.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import hf_reference, run

from dict_connector import DictConnector
from rtpkv.cache.tiers import BlockMeta
from rtpkv.cache.tiers.factory import tier_layout
from rtpkv.cache.tiers.record import encode_record
from rtpkv.errors import ConfigError

B = 4
A_IDS = list(range(10, 32))            # 22 tokens: 5 full blocks are reusable (the last token never)
B_IDS = list(range(100, 122))
ONE_REQUEST = dict(reuse_cache=True, seq_size_per_block=B, kv_cache_max_tokens=24)  # 6 blocks
HOST = 1 << 20                          # bytes: plenty for the tiny model's blocks


def assert_same(res, ref) -> None:
    tokens, logits = ref if isinstance(ref, tuple) else (ref.output_ids, ref.logits)
    assert res.output_ids == tokens
    torch.testing.assert_close(res.logits, logits, atol=1e-4, rtol=0)


def abab(pipe, n: int = 2, **cfg):
    return [run(pipe, ids, max_new_tokens=n, return_logits=True, **cfg)
            for ids in (A_IDS, B_IDS, A_IDS, B_IDS)]


def lens(results, key: str) -> list[int]:
    return [r.aux_info[key] for r in results]


# ---------------------------------------------------------------------------- host memory tier
def test_abab_without_a_host_tier_reuses_nothing(make_pipeline):
    results = abab(make_pipeline(**ONE_REQUEST))
    assert lens(results, "reuse_len") == [0, 0, 0, 0]
    assert lens(results, "memory_reuse_len") == [0, 0, 0, 0]


def test_abab_with_a_host_tier_onboards_the_second_a_and_b(make_pipeline):
    plain = abab(make_pipeline(**ONE_REQUEST))
    pipe = make_pipeline(**ONE_REQUEST, host_cache_size=HOST)
    results = abab(pipe)
    assert lens(results, "reuse_len") == [0, 0, 20, 20]
    assert lens(results, "memory_reuse_len") == [0, 0, 20, 20]
    assert lens(results, "local_reuse_len") == [0, 0, 0, 0]
    for p, r in zip(plain, results):
        assert_same(r, p)
    s = pipe.cache_stats()
    assert s["memory_onboarded_blocks"] == 10 and s["memory_offloaded_blocks"] >= 10
    assert s["memory_onboarded_bytes"] == 10 * s["memory_offloaded_bytes"] // s["memory_offloaded_blocks"]
    assert 0 < s["memory_hit_rate"] <= 1 and s["memory_blocks_used"] <= s["memory_blocks_total"]


def test_environment_names_enable_the_tier_and_model_config_wins(make_pipeline, monkeypatch, caplog):
    monkeypatch.setenv("ENABLE_MEMORY_CACHE", "1")
    monkeypatch.setenv("MEMORY_CACHE_SIZE_MB", "1")
    with caplog.at_level(logging.INFO, logger="rtpkv"):
        pipe = make_pipeline(**ONE_REQUEST)
    assert "host memory KV tier:" in caplog.text and "MiB" in caplog.text
    assert lens(abab(pipe), "memory_reuse_len") == [0, 0, 20, 20]
    off = make_pipeline(**ONE_REQUEST, host_cache_size=0)      # ModelConfig wins over the env
    assert lens(abab(off), "reuse_len") == [0, 0, 0, 0]
    assert "memory_blocks_total" not in off.cache_stats()


def test_start_up_log_gives_the_tier_size_in_blocks_and_mib(make_pipeline, caplog):
    with caplog.at_level(logging.INFO, logger="rtpkv"):
        pipe = make_pipeline(**ONE_REQUEST, host_cache_size=HOST)
    total = pipe.cache_stats()["memory_blocks_total"]
    assert f"host memory KV tier: {total} blocks of {B} tokens" in caplog.text


def test_tokens_and_logits_after_an_onboard_equal_no_reuse_and_transformers(make_pipeline, hf):
    n = 8
    pipe = make_pipeline(reuse_cache=True, seq_size_per_block=B, kv_cache_max_tokens=32,
                         host_cache_size=HOST)
    first = run(pipe, A_IDS, max_new_tokens=n, return_logits=True)
    run(pipe, B_IDS, max_new_tokens=n)
    again = run(pipe, A_IDS, max_new_tokens=n, return_logits=True)
    assert again.aux_info["memory_reuse_len"] == 20 and again.aux_info["local_reuse_len"] == 0
    plain = run(make_pipeline(seq_size_per_block=B), A_IDS, max_new_tokens=n, return_logits=True)
    ref = hf_reference(hf, A_IDS, n)
    for res in (first, again, plain):
        assert_same(res, ref)


def test_a_chain_split_between_device_and_host(make_pipeline):
    # 10 blocks: B takes the 5 free blocks and evicts one of A's, the tail one, to the host
    pipe = make_pipeline(reuse_cache=True, seq_size_per_block=B, kv_cache_max_tokens=40,
                         host_cache_size=HOST)
    plain = abab(make_pipeline(seq_size_per_block=B))
    results = abab(pipe)
    a2 = results[2].aux_info
    assert (a2["local_reuse_len"], a2["memory_reuse_len"], a2["reuse_len"]) == (16, 4, 20)
    for p, r in zip(plain, results):
        assert_same(r, p)


def test_a_host_tier_smaller_than_the_demand_evicts_its_own_blocks(make_pipeline):
    probe = make_pipeline(**ONE_REQUEST, host_cache_size=HOST)
    block_bytes = HOST // probe.cache_stats()["memory_blocks_total"]
    pipe = make_pipeline(**ONE_REQUEST, host_cache_size=3 * block_bytes + block_bytes // 2)
    plain = abab(make_pipeline(seq_size_per_block=B))
    results = abab(pipe)
    # A's blocks leave the device tail first; the host keeps the last three: A's head
    assert results[2].aux_info["memory_reuse_len"] == 12
    s = pipe.cache_stats()
    assert s["memory_blocks_total"] == 3 and s["memory_blocks_used"] == 3 and s["memory_evictions"] > 0
    for p, r in zip(plain, results):
        assert_same(r, p)


def test_enable_memory_cache_false_skips_lookup_and_offload(make_pipeline):
    pipe = make_pipeline(**ONE_REQUEST, host_cache_size=HOST)
    run(pipe, A_IDS, max_new_tokens=2)
    run(pipe, B_IDS, max_new_tokens=2, enable_memory_cache=False)   # evicts A: A's blocks go
    assert pipe.cache_stats()["memory_offloaded_blocks"] == 5
    a_off = run(pipe, A_IDS, max_new_tokens=2, enable_memory_cache=False)
    assert a_off.aux_info["reuse_len"] == 0                          # the host has A: not asked
    assert pipe.cache_stats()["memory_offloaded_blocks"] == 5        # B's blocks did not go
    b_on = run(pipe, B_IDS, max_new_tokens=2)
    assert b_on.aux_info["reuse_len"] == 0
    assert pipe.cache_stats()["memory_offloaded_blocks"] == 5        # neither did a_off's
    assert run(pipe, A_IDS, max_new_tokens=2).aux_info["memory_reuse_len"] == 20


def test_priority_below_secondary_offload_min_priority_is_not_offloaded(make_pipeline, monkeypatch):
    low = {"token_range_retention_configs": [{"token_start": 0, "priority": 20}],
           "decode_retention_priority": 20}
    pipe = make_pipeline(**ONE_REQUEST, host_cache_size=HOST)
    run(pipe, A_IDS, max_new_tokens=2, kv_cache_retention_config=low)
    run(pipe, B_IDS, max_new_tokens=2)
    assert run(pipe, A_IDS, max_new_tokens=2).aux_info["reuse_len"] == 0
    assert run(pipe, B_IDS, max_new_tokens=2).aux_info["memory_reuse_len"] == 20
    monkeypatch.setenv("SECONDARY_OFFLOAD_MIN_PRIORITY", "50")       # the default 35 is below it
    strict = make_pipeline(**ONE_REQUEST, host_cache_size=HOST)
    assert lens(abab(strict), "reuse_len") == [0, 0, 0, 0]
    assert strict.cache_stats()["memory_offloaded_blocks"] == 0


def test_many_threads_a_small_pool_and_the_tier_give_each_request_its_own_tokens(make_pipeline):
    prompts = [list(range(200 + 30 * k, 222 + 30 * k)) for k in range(6)]
    plain = make_pipeline(seq_size_per_block=B)
    expected = [run(plain, p, max_new_tokens=6).output_ids for p in prompts]
    pipe = make_pipeline(reuse_cache=True, seq_size_per_block=B, kv_cache_max_tokens=64,
                         host_cache_size=HOST)
    got: dict[tuple[int, int], list[int]] = {}
    errors = []

    def client(t: int) -> None:
        try:
            for r in range(3):
                k = (t + r) % len(prompts)
                got[(t, r)] = (k, run(pipe, prompts[k], max_new_tokens=6).output_ids)
        except Exception as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for k, ids in got.values():
        assert ids == expected[k]
    assert pipe.cache_stats()["memory_onboarded_blocks"] > 0


@pytest.mark.parametrize("options,field", [
    (dict(host_cache_size=10), "host_cache_size=10"),
    (dict(host_cache_size=-1), "host_cache_size"),
    (dict(secondary_offload_min_priority=101), "secondary_offload_min_priority"),
    (dict(enable_memory_cache_disk=True), "MEMORY_CACHE_DISK_PATHS"),
    (dict(enable_memory_cache_disk=True, memory_cache_disk_paths="/tmp/x", memory_cache_disk_size_mb=0),
     "memory_cache_disk_size_mb"),
    (dict(kv_connector_module="json"), "KV_CONNECTOR_CLASS"),
    (dict(kv_connector_module="json", kv_connector_class="JSONDecoder"), "KV_CONNECTOR_CLASS"),
    (dict(kv_connector=42), "kv_connector"),
])
def test_bad_tier_settings_are_refused_by_name(make_pipeline, options, field):
    with pytest.raises(ConfigError, match=field):
        make_pipeline(**ONE_REQUEST, **options)


def test_bad_environment_values_are_refused_by_name(make_pipeline, monkeypatch):
    monkeypatch.setenv("MEMORY_CACHE_SIZE_MB", "lots")
    with pytest.raises(ConfigError, match="MEMORY_CACHE_SIZE_MB"):
        make_pipeline(**ONE_REQUEST)


# ---------------------------------------------------------------------------- disk tier
def disk(path: Path, **extra):
    return dict(enable_memory_cache_disk=True, memory_cache_disk_paths=str(path), **extra)


RUNNER = textwrap.dedent("""
    import json, sys
    import torch
    from rtpkv.model_factory import ModelConfig, ModelFactory
    from rtpkv.pipeline import Pipeline
    torch.set_num_threads(1)
    model = ModelFactory.from_huggingface(sys.argv[1], ModelConfig(
        reuse_cache=True, seq_size_per_block=4, kv_cache_max_tokens=256,
        enable_memory_cache_disk=True, memory_cache_disk_paths=sys.argv[2]), show_progress=False)
    with Pipeline(model, model.tokenizer) as pipe:
        for res in pipe(json.loads(sys.argv[3]), top_k=1, ignore_eos=True, max_new_tokens=6,
                        return_logits=True):
            pass
        pipe.check_integrity()
    stats = pipe.cache_stats()   # after stop, which waits for the queued writes (async writer)
    print(json.dumps({"ids": res.output_ids, "logits": res.logits.tolist(), "aux": res.aux_info,
                      "disk_writes": stats["disk_writes"]}))
""")


def test_two_processes_in_a_row_share_the_disk_cache(tmp_path, llama_path, hf):
    script = tmp_path / "runner.py"
    script.write_text(RUNNER)
    prompt = list(range(300, 341))                  # 41 tokens: 10 full blocks reusable

    def process() -> dict:
        out = subprocess.run([sys.executable, str(script), str(llama_path), str(tmp_path / "kv"),
                              json.dumps(prompt)], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    first, second = process(), process()
    assert first["aux"]["disk_reuse_len"] == 0 and first["disk_writes"] >= 10
    assert second["aux"]["disk_reuse_len"] == 40 == second["aux"]["reuse_len"]
    tokens, logits = hf_reference(hf, prompt, 6)
    for res in (first, second):
        assert res["ids"] == tokens
        torch.testing.assert_close(torch.tensor(res["logits"]), logits, atol=1e-4, rtol=0)


def _fill_disk(make_pipeline, path: Path, n: int = 6):
    pipe = make_pipeline(reuse_cache=True, seq_size_per_block=B, write_cache_sync=True, **disk(path))
    res = run(pipe, A_IDS, max_new_tokens=n, return_logits=True)
    pipe.check_integrity()
    pipe.stop()
    return res


def _block_files(path: Path, pipe) -> list[Path]:
    """A's prompt block files in chain order (keys as the cache computes them)."""
    index = pipe.engine.cache.index
    key, files = index.root, []
    for i in range(5):
        key = index.key(key, A_IDS[i * B:(i + 1) * B])
        files.append(path / f"{key.hex()}.safetensors")
    return files


@pytest.mark.parametrize("damage", ["corrupt", "truncated"])
def test_a_damaged_file_is_a_miss_and_the_answer_is_still_right(make_pipeline, tmp_path, caplog, damage):
    first = _fill_disk(make_pipeline, tmp_path)
    pipe = make_pipeline(reuse_cache=True, seq_size_per_block=B, **disk(tmp_path))
    files = _block_files(tmp_path, pipe)
    assert all(f.exists() for f in files)
    data = bytearray(files[2].read_bytes())
    if damage == "corrupt":
        data[-3] ^= 0xFF                            # payload bytes: found on load
    else:
        data = data[:-100]                          # found on re-index: already gone
    files[2].write_bytes(bytes(data))
    pipe.stop()
    with caplog.at_level(logging.WARNING, logger="rtpkv"):
        pipe = make_pipeline(reuse_cache=True, seq_size_per_block=B, **disk(tmp_path))
        res = run(pipe, A_IDS, max_new_tokens=6, return_logits=True)
    assert res.aux_info["disk_reuse_len"] == 8      # blocks 0 and 1, then the damaged one
    assert files[2].name in caplog.text
    assert pipe.cache_stats()["disk_corrupt_files"] == 1
    assert_same(res, first)


def test_files_of_another_model_are_ignored_and_counted(make_pipeline, tmp_path, checkpoints):
    _fill_disk(make_pipeline, tmp_path)
    count = len(list(tmp_path.glob("*.safetensors")))
    other = make_pipeline(checkpoints("qwen2"), reuse_cache=True, seq_size_per_block=B,
                          **disk(tmp_path))
    res = run(other, A_IDS, max_new_tokens=2)
    assert res.aux_info["disk_reuse_len"] == 0
    assert other.cache_stats()["disk_foreign_files"] == count > 0
    assert len(list(tmp_path.glob("*.safetensors"))) >= count   # left alone


def test_a_foreign_file_under_a_matching_name_is_a_miss(make_pipeline, tmp_path):
    first = _fill_disk(make_pipeline, tmp_path)
    pipe = make_pipeline(reuse_cache=True, seq_size_per_block=B, **disk(tmp_path))
    files = _block_files(tmp_path, pipe)
    pipe.stop()
    layout = tier_layout(pipe.engine.model, B)
    foreign = replace(layout, fingerprint="ef" * 32)
    files[1].write_bytes(encode_record(BlockMeta(b"k" * 32, b"p" * 32, tuple(A_IDS[4:8])),
                                       torch.zeros(layout.shape, dtype=layout.dtype), foreign))
    pipe = make_pipeline(reuse_cache=True, seq_size_per_block=B, **disk(tmp_path))
    res = run(pipe, A_IDS, max_new_tokens=6, return_logits=True)
    assert res.aux_info["disk_reuse_len"] == 4
    assert pipe.cache_stats()["disk_foreign_files"] == 1 and files[1].exists()
    assert_same(res, first)


def test_a_full_disk_bound_evicts_least_recently_used_files(make_pipeline, tmp_path):
    pipe = make_pipeline(reuse_cache=True, seq_size_per_block=B, write_cache_sync=True,
                         **disk(tmp_path, memory_cache_disk_size_mb=0.02))
    for k in range(4):
        run(pipe, list(range(400 + 30 * k, 422 + 30 * k)), max_new_tokens=2)
    s = pipe.cache_stats()
    assert s["disk_evictions"] > 0 and s["disk_bytes"] <= 0.02 * 2 ** 20
    assert s["disk_files"] == len(list(tmp_path.glob("*.safetensors")))


def test_enable_disk_cache_false_neither_writes_nor_reads(make_pipeline, tmp_path):
    pipe = make_pipeline(reuse_cache=True, seq_size_per_block=B, write_cache_sync=True, **disk(tmp_path))
    run(pipe, A_IDS, max_new_tokens=2, enable_disk_cache=False)
    assert not list(tmp_path.glob("*.safetensors"))
    pipe.stop()
    _fill_disk(make_pipeline, tmp_path)
    pipe = make_pipeline(reuse_cache=True, seq_size_per_block=B, **disk(tmp_path))
    assert run(pipe, A_IDS, max_new_tokens=2, enable_disk_cache=False).aux_info["reuse_len"] == 0
    assert run(pipe, A_IDS, max_new_tokens=2).aux_info["reuse_len"] == 20   # device hit now
    pipe.stop()
    pipe = make_pipeline(reuse_cache=True, seq_size_per_block=B, **disk(tmp_path))
    assert run(pipe, A_IDS, max_new_tokens=2).aux_info["disk_reuse_len"] == 20


def test_host_evictions_go_to_disk_and_come_back(make_pipeline, tmp_path):
    probe = make_pipeline(**ONE_REQUEST, host_cache_size=HOST)
    block_bytes = HOST // probe.cache_stats()["memory_blocks_total"]
    pipe = make_pipeline(**ONE_REQUEST, host_cache_size=2 * block_bytes, write_cache_sync=True,
                         **disk(tmp_path))
    plain = abab(make_pipeline(seq_size_per_block=B))
    results = abab(pipe)
    a2 = results[2].aux_info
    assert a2["reuse_len"] == 20 and a2["disk_reuse_len"] > 0
    assert pipe.cache_stats()["memory_handed_off"] > 0
    for p, r in zip(plain, results):
        assert_same(r, p)


# ---------------------------------------------------------------------------- connector
class RaisingConnector(DictConnector):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        raise RuntimeError("store unreachable")


def test_a_connector_serves_a_new_pipeline(make_pipeline):
    DictConnector.blocks = {}
    first = run(make_pipeline(reuse_cache=True, seq_size_per_block=B, kv_connector=DictConnector),
                A_IDS, max_new_tokens=6, return_logits=True)
    assert len(DictConnector.blocks) >= 5
    pipe = make_pipeline(reuse_cache=True, seq_size_per_block=B, kv_connector=DictConnector())
    res = run(pipe, A_IDS, max_new_tokens=6, return_logits=True)
    assert res.aux_info["connector_reuse_len"] == 20 == res.aux_info["reuse_len"]
    assert_same(res, first)


def test_a_connector_from_the_environment(make_pipeline, monkeypatch):
    monkeypatch.setenv("KV_CONNECTOR_MODULE", "test_tiers_pipeline")
    monkeypatch.setenv("KV_CONNECTOR_CLASS", "DictConnector")
    DictConnector.blocks = {}
    run(make_pipeline(reuse_cache=True, seq_size_per_block=B), A_IDS, max_new_tokens=2)
    res = run(make_pipeline(reuse_cache=True, seq_size_per_block=B), A_IDS, max_new_tokens=2)
    assert res.aux_info["connector_reuse_len"] == 20


def test_a_connector_that_raises_is_a_miss_and_the_engine_goes_on(make_pipeline, caplog):
    pipe = make_pipeline(reuse_cache=True, seq_size_per_block=B, kv_connector=RaisingConnector)
    plain = run(make_pipeline(seq_size_per_block=B), A_IDS, max_new_tokens=4, return_logits=True)
    with caplog.at_level(logging.ERROR, logger="rtpkv"):
        for _ in range(2):
            res = run(pipe, B_IDS, max_new_tokens=2)
            assert res.aux_info["connector_reuse_len"] == 0
        res = run(pipe, A_IDS, max_new_tokens=4, return_logits=True)
    assert "store unreachable" in caplog.text
    assert pipe.cache_stats()["connector_errors"] == 2   # the second B hits on the device
    assert_same(res, plain)


def test_the_folder_connector_example_persists_blocks_across_pipelines(make_pipeline, tmp_path,
                                                                        monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "examples"))
    from kv_cache_connector import CONNECTOR_CACHE_FOLDER_KEY, FolderKvCacheConnector

    monkeypatch.setenv(CONNECTOR_CACHE_FOLDER_KEY, str(tmp_path))
    first = make_pipeline(reuse_cache=True, seq_size_per_block=B, kv_connector=FolderKvCacheConnector)
    res1 = run(first, A_IDS, max_new_tokens=6, return_logits=True)
    first.stop()
    assert len(list(tmp_path.glob("*.safetensors"))) >= 5
    second = make_pipeline(reuse_cache=True, seq_size_per_block=B, kv_connector=FolderKvCacheConnector)
    res2 = run(second, A_IDS, max_new_tokens=6, return_logits=True)
    assert res2.aux_info["connector_reuse_len"] == 20
    assert_same(res2, res1)
