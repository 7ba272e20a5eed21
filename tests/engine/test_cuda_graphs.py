"""The CUDA-graph runner's bookkeeping (rtpkv.engine.cuda_graphs) on a CPU: buckets, padding
rows (slot -1, never written), static buffers refilled for each replay, and a replayed step
writing exactly the eager step's K/V rows and giving its logits. Graphs are "captured" by the
EagerReplay stand-in (tests/graph_capture.py), which re-runs the eager model on the graph's
static buffers; the Triton backend's kernels run in Triton's interpreter."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from graph_capture import EagerReplay
from rtpkv.config import RuntimeConfig, env_var_names
from rtpkv.engine.cuda_graphs import DecodeGraphs, buckets, copy_metadata, decode_graphs
from rtpkv.kernels import AttentionBatch

BLOCK = 16


@pytest.fixture
def model(make_pipeline, triton_interpreter):
    """(module, pool) of a tiny Llama on the Triton backend, its KV pool filled with noise."""
    pipe = make_pipeline(rtpkv_attention="triton", dtype="float32", seq_size_per_block=BLOCK,
                         kv_cache_max_tokens=512)
    memory = pipe.engine.cache.memory
    memory.kv.copy_(torch.randn(memory.kv.shape, generator=torch.Generator().manual_seed(0)))
    return pipe.engine.runner.module, memory


def _graphs(module, memory, max_rows=4, capture=None):
    return DecodeGraphs(module, memory.layer_caches(), max_rows, BLOCK, memory.num_blocks,
                        memory.kv.shape[2], None, capture or EagerReplay())


def _eager_logits(module, memory, ids, positions, tables):
    """The same decode step through the eager path (module.forward_logits, no padding)."""
    batch = AttentionBatch(
        positions=positions, row_seq=list(range(len(ids))), block_tables=tables,
        query_start=list(range(len(ids))), query_len=[1] * len(ids),
        context_len=[p + 1 for p in positions], block_size=BLOCK, num_blocks=memory.num_blocks,
        kv_heads=memory.kv.shape[2])
    meta = module.attention_metadata(batch)
    with torch.inference_mode():   # as the engine runs it (torch's RoPE writes views in place)
        return module.forward_logits(ids, positions, memory.layer_caches(), meta,
                                     list(range(len(ids))))


def test_buckets_are_powers_of_two_up_to_the_largest_batch():
    assert buckets(1) == [1]
    assert buckets(5) == [1, 2, 4, 8]
    assert buckets(32) == [1, 2, 4, 8, 16, 32]


def test_a_batch_runs_at_the_smallest_bucket_that_holds_it(model):
    graphs = _graphs(*model, max_rows=6)
    assert [graphs.bucket(n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert graphs.bucket(9) is None


def test_padding_rows_fill_the_bucket_and_are_never_written(model):
    module, memory = model
    graphs = _graphs(module, memory)
    ids, batch = graphs.padded([5, 6, 7], [3, 20, 40], [[1], [2, 3], [4, 5, 6]], 4)
    width = -(-module.cos.shape[0] // BLOCK)
    assert ids == [5, 6, 7, 0] and batch.positions == [3, 20, 40, 0] and batch.padding == 1
    assert all(len(t) == width for t in batch.block_tables)
    assert batch.block_tables[1][:3] == [2, 3, 0] and batch.block_tables[3] == [0] * width
    meta = module.attention.build(batch)
    assert meta.slots.tolist() == [1 * BLOCK + 3, 3 * BLOCK + 4, 6 * BLOCK + 8, -1]
    assert meta.tiles.shape == (4, 4) and meta.tables.shape == (4, width)
    with pytest.raises(ValueError, match=f"longer than {width} blocks"):
        graphs.padded([5], [3], [[0] * (width + 1)], 1)


def test_replays_write_the_eager_rows_and_give_the_eager_logits(model):
    """Two decode steps of three rows (bucket 4): the first captures, the second copies new
    ids, positions and tables into the static buffers; each leaves the pool as the eager step
    does (the padding row wrote nothing) and gives its logits."""
    module, memory = model
    capture = EagerReplay()
    graphs = _graphs(module, memory, capture=capture)
    start = memory.kv.clone()
    steps = [([5, 6, 7], [3, 20, 40], [[1], [2, 3], [4, 5, 6]]),
             ([9, 8, 1], [4, 21, 17], [[1], [2, 3], [7, 8]])]
    for ids, positions, tables in steps:
        before = memory.kv.clone()
        eager = _eager_logits(module, memory, ids, positions, tables)
        after_eager = memory.kv.clone()
        memory.kv.copy_(before)
        with torch.inference_mode():   # as ModelRunner calls it
            graphed = graphs.run(ids, positions, tables)
        assert torch.equal(graphed, eager)
        assert torch.equal(memory.kv, after_eager)
    assert not torch.equal(memory.kv, start)
    assert list(graphs.graphs) == [4] and capture.captures == 1 and capture.replays == 2


def test_a_step_the_graphs_cannot_run_is_refused(model):
    module, memory = model
    graphs = _graphs(module, memory, max_rows=2)
    with pytest.raises(ValueError, match="a graph runs 1 to 2 decode rows"):
        graphs.run([1, 2, 3], [0, 0, 0], [[0], [0], [0]])
    with pytest.raises(ValueError, match="2 ids, 1 positions"):
        graphs.run([1, 2], [0], [[0], [0]])
    with pytest.raises(IndexError, match="past the RoPE table"):
        graphs.run([1], [module.cos.shape[0]], [[0]])


def test_metadata_that_does_not_fit_the_captured_graph_is_refused(model):
    module, memory = model
    graphs = _graphs(module, memory)
    _, one = graphs.padded([1], [0], [[0]], 1)
    _, two = graphs.padded([1, 2], [0, 0], [[0], [1]], 2)
    static = module.attention.build(one)
    with pytest.raises(ValueError, match="metadata field slots: shape"):
        copy_metadata(static, module.attention.build(two))
    with pytest.raises(ValueError, match="metadata field window: 8"):
        copy_metadata(static, dataclasses.replace(module.attention.build(one), window=8))


def test_graphs_need_a_graph_safe_backend_and_a_cuda_model(make_pipeline):
    pipe = make_pipeline(rtpkv_attention="torch", dtype="float32")
    runner = pipe.engine.runner
    with pytest.raises(ValueError, match="graph-safe attention backend \\(triton\\), not torch"):
        DecodeGraphs(runner.module, runner.kv_caches, 4, runner.block_size,
                     runner.memory.num_blocks, runner.kv_heads, None, EagerReplay())
    assert runner.graphs is None
    assert decode_graphs(runner.module, runner.kv_caches, 4, runner.block_size,
                         runner.memory.num_blocks, runner.kv_heads, None, False) is None


def test_enforce_eager_is_an_option_and_an_environment_variable(monkeypatch):
    assert "ENFORCE_EAGER" in env_var_names()
    assert RuntimeConfig().enforce_eager is False
    assert RuntimeConfig(enforce_eager="1").enforce_eager is True
    from rtpkv.config import Settings

    monkeypatch.setenv("ENFORCE_EAGER", "1")
    assert Settings.from_env().enforce_eager is True
