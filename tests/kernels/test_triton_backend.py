"""RTPKV_ATTENTION=triton through the whole pipeline on a CPU, its kernels run by Triton's
interpreter (the `triton_interpreter` fixture): tokens equal the torch backend's across
chunked prefill, prefix reuse, an attention window and a batch; reuse on and off give the same
tokens and logits bit for bit (the kernel is batch-invariant), in float32 and bfloat16; and the
decode steps replayed from graphs (rtpkv.engine.cuda_graphs, captured by a stand-in that
re-runs the eager model on the same static buffers) give the eager steps' tokens and logits.

Tiny prompts: the interpreter runs each kernel program in Python.
"""

from __future__ import annotations

import pytest
import torch

from conftest import hf_reference, run
from graph_capture import EagerReplay
from rtpkv.engine.cuda_graphs import DecodeGraphs


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (n,), generator=g).tolist()


@pytest.fixture
def triton_pipeline(make_pipeline, triton_interpreter):
    """triton_pipeline(**options) -> a pipeline on the Triton backend."""

    def make(**options):
        pipe = make_pipeline(rtpkv_attention="triton", **options)
        assert pipe.model.module.attention_name == "triton"
        return pipe

    return make


def _same(ours, theirs, atol=1e-4):
    assert ours.output_ids == theirs.output_ids
    torch.testing.assert_close(ours.logits, theirs.logits, atol=atol, rtol=0)


@pytest.mark.parametrize("window", [None, 40])
def test_pipeline_matches_the_torch_backend(triton_pipeline, make_pipeline, window):
    """A 75-token prompt prefilled in chunks of 32 (each chunk after the first attends a cached
    prefix), then one sharing 48 tokens with it (reused), 16-token blocks; with a window of 40
    the oldest blocks are released and masked out."""
    options = dict(dtype="float32", seq_size_per_block=16, reuse_cache=True,
                   max_num_batched_tokens=32, max_attention_window=window)
    ours, reference = triton_pipeline(**options), make_pipeline(rtpkv_attention="torch", **options)
    first = _ids(75, 1)
    second = first[:48] + _ids(10, 2)
    for pipe in (ours, reference):
        pipe.outputs = [run(pipe, p, max_new_tokens=4, return_logits=True)
                        for p in (first, second)]
    if window is None:
        assert ours.outputs[1].aux_info["reuse_len"] == 48
    for a, b in zip(ours.outputs, reference.outputs):
        _same(a, b)


def test_reused_prefix_matches_transformers(triton_pipeline, hf):
    """A prompt whose first 32 tokens are cached: tokens and logits of transformers on the same
    weights."""
    pipe = triton_pipeline(dtype="float32", seq_size_per_block=16, reuse_cache=True)
    prompt = _ids(45, 11)
    run(pipe, prompt[:33], max_new_tokens=1)
    res = run(pipe, prompt, max_new_tokens=4, return_logits=True)
    assert res.aux_info["reuse_len"] == 32
    tokens, logits = hf_reference(hf, prompt, 4)
    assert res.output_ids == tokens
    torch.testing.assert_close(res.logits, logits, atol=1e-4, rtol=0)


def test_a_batch_matches_the_torch_backend(triton_pipeline, make_pipeline):
    options = dict(dtype="float32", seq_size_per_block=8, max_num_batched_tokens=24)
    ours, reference = triton_pipeline(**options), make_pipeline(rtpkv_attention="torch", **options)
    """Three streams under a token budget of 24: steps mix decodes with prefill chunks."""
    prompts = [_ids(9, 3), _ids(30, 4), _ids(17, 5)]
    outs = [_together(pipe, prompts, [4, 4, 4]) for pipe in (ours, reference)]
    for a, b in zip(*outs):
        _same(a, b)
    assert any(len(step) == 3 for step in ours.engine.step_log)


def _together(pipe, prompts, news):
    """Each prompt's final response, the prompts submitted together (batched steps)."""
    streams = [pipe(p, top_k=1, ignore_eos=True, max_new_tokens=n, return_logits=True)
               for p, n in zip(prompts, news)]
    return [list(s)[-1] for s in streams]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reuse_on_and_off_give_the_same_tokens_and_logits(triton_pipeline, dtype):
    prompts = [_ids(40, 6), None]
    prompts[1] = prompts[0][:35] + _ids(8, 7)
    outs = []
    for reuse in (True, False):
        pipe = triton_pipeline(dtype=dtype, seq_size_per_block=16, reuse_cache=reuse)
        outs.append([run(pipe, p, max_new_tokens=4, return_logits=True) for p in prompts])
    assert outs[0][1].aux_info["reuse_len"] == 32 and outs[1][1].aux_info["reuse_len"] == 0
    for on, off in zip(*outs):
        assert on.output_ids == off.output_ids
        assert torch.equal(on.logits, off.logits)


def test_decode_graphs_give_the_eager_tokens_and_logits(triton_pipeline):
    """Three streams: their decode steps run padded to the bucket of 4 from one captured graph
    (then 2 and 1 as streams end), the prefill steps eagerly; tokens and logits equal the eager
    pipeline's bit for bit, and the padding rows wrote nothing to the pool (the checks of
    the pool's integrity after the test, and the equal logits)."""
    options = dict(dtype="float32", seq_size_per_block=8, concurrency_limit=4)
    eager, graphed = triton_pipeline(**options), triton_pipeline(**options)
    runner = graphed.engine.runner
    assert runner.graphs is None   # a CPU model: no CUDA graphs of its own
    capture = EagerReplay()
    runner.graphs = DecodeGraphs(runner.module, runner.kv_caches, 4, runner.block_size,
                                 runner.memory.num_blocks, runner.kv_heads, runner.window, capture)
    prompts = [_ids(12, 8), _ids(5, 9), _ids(19, 10)]
    news = [6, 3, 5]
    outs = [_together(pipe, prompts, news) for pipe in (eager, graphed)]
    for a, b in zip(*outs):
        assert a.output_ids == b.output_ids
        assert torch.equal(a.logits, b.logits)
    assert set(runner.graphs.graphs) <= {1, 2, 4} and 4 in runner.graphs.graphs
    assert capture.captures == len(runner.graphs.graphs) and capture.replays > capture.captures
