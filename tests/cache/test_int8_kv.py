"""The int8 KV cache (KV_CACHE_DTYPE=int8, INT8_KV_CACHE=1) in running pipelines: the pool holds
about 4x the blocks of float32 in the same KV_CACHE_MEM_MB, every path that moves blocks (host,
disk and Redis tiers, partial-block copies) moves their scales, reuse gives the bits of no reuse,
and blocks of one KV dtype are never used by a pipeline of another. Every pipeline is
integrity-checked by make_pipeline."""

from __future__ import annotations

import json
import struct
from types import SimpleNamespace

import pytest
import torch
from conftest import run

from rtpkv.cache.builder import pool_blocks
from rtpkv.cache.tiers import BlockMeta
from rtpkv.cache.tiers.factory import tier_layout
from rtpkv.cache.tiers.record import decode_header, encode_record
from rtpkv.config import RuntimeConfig
from rtpkv.errors import ConfigError
from rtpkv.model_factory.factory import _pick_kv_dtype

B = 4
INT8 = dict(kv_cache_dtype="int8", seq_size_per_block=B)
A_IDS = list(range(10, 32))            # 22 tokens: 5 full blocks reusable
B_IDS = list(range(100, 122))


def answer(pipe, ids, **cfg):
    return run(pipe, ids, max_new_tokens=4, return_logits=True, **cfg)


def same(a, b) -> None:
    assert a.output_ids == b.output_ids
    assert torch.equal(a.logits, b.logits)


def disk(path, **extra):
    return dict(enable_memory_cache_disk=True, memory_cache_disk_paths=str(path),
                write_cache_sync=True, **extra)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_pool_holds_the_blocks_its_bytes_allow(make_pipeline, dtype):
    """A row is head_dim int8 values and a 4-byte scale: the tiny model's head_dim of 16 gives
    3.2x the blocks of float32 (1.6x of bfloat16), SmolLM2's 64 (below) 3.76x."""
    mb = 1.0
    plain = make_pipeline(dtype=dtype, seq_size_per_block=B, kv_cache_mem_mb=mb,
                          kv_cache_max_tokens=None)
    int8 = make_pipeline(dtype=dtype, seq_size_per_block=B, kv_cache_mem_mb=mb,
                         kv_cache_max_tokens=None, int8_kv_cache=True)
    spec = int8.engine.model.spec
    d, item = spec.head_dim, 4 if dtype == "float32" else 2
    per_block = 2 * spec.num_layers * B * spec.num_kv_heads
    assert plain.cache_stats()["blocks_total"] == 2**20 // (per_block * d * item)
    assert int8.cache_stats()["blocks_total"] == 2**20 // (per_block * (d + 4))
    measured = int8.cache_stats()["blocks_total"] / plain.cache_stats()["blocks_total"]
    assert measured == pytest.approx(item * 16 / 20, rel=0.01)
    assert int8.engine.cache.memory.int8 and not plain.engine.cache.memory.int8


@pytest.mark.parametrize("dtype,ratio", [(torch.float32, 256 / 68), (torch.bfloat16, 128 / 68)])
def test_smollm2_shaped_pools_hold_3_76x_and_1_88x_the_blocks(dtype, ratio):
    """SmolLM2-135M's KV shape (30 layers, 3 KV heads, head_dim 64) at KV_CACHE_MEM_MB=1024."""
    spec = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64)
    config = RuntimeConfig(kv_cache_mem_mb=1024, seq_size_per_block=64)

    def blocks(kv_dtype):
        return pool_blocks(SimpleNamespace(spec=spec, kv_dtype=kv_dtype,
                                           device=torch.device("cpu")), config)

    assert blocks(torch.int8) / blocks(dtype) == pytest.approx(ratio, rel=1e-3)
    assert blocks(torch.float32) == 2**30 // (2 * 30 * 64 * 3 * 64 * 4) == 364
    assert blocks(torch.int8) == 2**30 // (2 * 30 * 64 * 3 * 68) == 1370


def test_the_fingerprint_includes_the_kv_dtype(make_pipeline):
    fingerprints = {make_pipeline(**options).engine.model.fingerprint
                    for options in ({}, INT8, dict(weight_type="INT8"),
                                    dict(INT8, weight_type="INT8"))}
    assert len(fingerprints) == 4


def test_partial_reuse_copies_the_scales(make_pipeline):
    on = make_pipeline(**INT8, reuse_cache=True, enable_partial_reuse=True)
    off = make_pipeline(**INT8, reuse_cache=True)
    base = list(range(10, 24))
    probe = base[:9] + [900 + i for i in range(6)]
    for pipe in (on, off):
        answer(pipe, base)
    got, ref = answer(on, probe), answer(off, probe)
    assert got.aux_info["partial_reuse_len"] == 1 and got.aux_info["reuse_len"] == 9
    same(got, ref)


def test_host_and_disk_tiers_round_trip_int8_blocks(make_pipeline, tmp_path):
    plain = [answer(make_pipeline(**INT8), ids) for ids in (A_IDS, B_IDS, A_IDS)]
    host = make_pipeline(**INT8, reuse_cache=True, kv_cache_max_tokens=28,
                         host_cache_size=1 << 20)
    onboarded = [answer(host, ids) for ids in (A_IDS, B_IDS, A_IDS)]
    assert onboarded[2].aux_info["memory_reuse_len"] == 20
    first = make_pipeline(**INT8, reuse_cache=True, **disk(tmp_path))
    answer(first, A_IDS)
    first.stop()
    second = make_pipeline(**INT8, reuse_cache=True, **disk(tmp_path))
    from_disk = answer(second, A_IDS)
    assert from_disk.aux_info["disk_reuse_len"] == 20
    for res in (onboarded[2], from_disk):
        same(res, plain[2])
    record = next(tmp_path.glob("*.safetensors")).read_bytes()
    layout = tier_layout(second.engine.model, B)
    assert layout.dtype == torch.int8 and layout.shape[-1] == second.engine.model.spec.head_dim + 4
    decode_header(record, layout)
    length = struct.unpack("<Q", record[:8])[0]
    header = json.loads(record[8:8 + length])
    assert header["__metadata__"]["dtype"] == "int8" and header["kv"]["dtype"] == "I8"


@pytest.mark.parametrize("writer,reader", [({}, INT8), (INT8, {})])
def test_a_disk_tier_of_another_kv_dtype_is_a_miss(make_pipeline, tmp_path, writer, reader):
    options = dict(seq_size_per_block=B, reuse_cache=True)
    first = make_pipeline(**{**options, **writer}, **disk(tmp_path))
    answer(first, A_IDS)
    first.stop()
    written = len(list(tmp_path.glob("*.safetensors")))
    pipe = make_pipeline(**{**options, **reader}, **disk(tmp_path))
    res = answer(pipe, A_IDS)
    assert res.aux_info["disk_reuse_len"] == 0 == res.aux_info["reuse_len"]
    assert pipe.cache_stats()["disk_foreign_files"] == written > 0
    same(res, answer(make_pipeline(**{**options, **reader}), A_IDS))
    assert len(list(tmp_path.glob("*.safetensors"))) >= written     # left alone


def test_a_record_of_another_kv_dtype_under_the_right_name_is_a_miss(make_pipeline, tmp_path):
    """Same fingerprint and key, float32 payload: the header's dtype and shape refuse it."""
    first = make_pipeline(**INT8, reuse_cache=True, **disk(tmp_path))
    ref = answer(first, A_IDS)
    first.stop()
    layout = tier_layout(first.engine.model, B)
    index = first.engine.cache.index
    key0 = index.key(index.root, A_IDS[:B])
    key1 = index.key(key0, A_IDS[B:2 * B])
    float_layout = tier_layout(make_pipeline(seq_size_per_block=B).engine.model, B)
    float_layout = type(layout)(layout.fingerprint, B, float_layout.dtype, float_layout.shape)
    (tmp_path / f"{key1.hex()}.safetensors").write_bytes(encode_record(
        BlockMeta(key1, key0, tuple(A_IDS[B:2 * B])), torch.zeros(float_layout.shape),
        float_layout))
    pipe = make_pipeline(**INT8, reuse_cache=True, **disk(tmp_path))
    res = answer(pipe, A_IDS)
    assert res.aux_info["disk_reuse_len"] == B          # block 0, then the float32 record
    assert pipe.cache_stats()["disk_foreign_files"] == 1
    same(res, ref)


def test_redis_shares_int8_blocks_only_with_int8_replicas(make_pipeline, redis_url):
    options = dict(reuse_cache=True, seq_size_per_block=B, enable_remote_cache=True,
                   remote_cache_url=redis_url)
    first = make_pipeline(**options, kv_cache_dtype="int8")
    ref = answer(first, A_IDS)
    tier = next(t for t in first.engine.cache.ladder.tiers if t.name == "remote")
    assert tier.flush(10.0)
    replica = make_pipeline(**options, int8_kv_cache=True)
    res = answer(replica, A_IDS)
    assert res.aux_info["remote_reuse_len"] == 20
    same(res, ref)
    other = answer(make_pipeline(**options), A_IDS)
    assert other.aux_info["remote_reuse_len"] == 0


def test_int8_kv_is_refused_off_the_cpu_and_with_flash_attn(make_pipeline):
    config = type("Config", (), {"int8_kv": True, "rtpkv_attention": "auto"})()
    with pytest.raises(ConfigError, match=r"INT8_KV_CACHE=1\) runs on a CPU; device=cuda"):
        _pick_kv_dtype(config, torch.device("cuda"), torch.bfloat16)
    with pytest.raises(ConfigError, match="flash-attn does not read an int8 KV cache"):
        make_pipeline(**INT8, rtpkv_attention="flash-attn")
