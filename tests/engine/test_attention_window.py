"""Attention windows: MAX_ATTENTION_WINDOW and the models' sliding_window attend only the last W
tokens (equal to transformers), release the blocks that fell out of the window, admit by the
window's blocks, and keep prefix reuse exact."""

import threading

import pytest
import torch
import transformers
from conftest import idle_in_use, load, needs_c_kernels, random_prompt, run, use_attention

from rtpkv.errors import CapacityError, ConfigError
from rtpkv.model_factory.tiny import build_tiny_checkpoint

W = 64
WINDOWED = {
    "mistral": dict(architecture="MistralForCausalLM", sliding_window=W, tie_word_embeddings=True),
    "qwen2": dict(architecture="Qwen2ForCausalLM", sliding_window=W),
}
# flash-attn: the CPU stand-in (conftest)
BACKENDS = ["torch", pytest.param("cpu-paged", marks=needs_c_kernels), "flash-attn"]


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    built = {}

    def get(name):
        if name not in built:
            built[name] = build_tiny_checkpoint(tmp_path_factory.mktemp(name), **WINDOWED[name])
        return built[name]

    return get


def _hf_generate(path, ids, new):
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=new,
                      min_new_tokens=new, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(ids):].tolist(), torch.cat(out.logits)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", list(WINDOWED))
def test_windowed_models_match_transformers(windowed, make_pipeline, monkeypatch, arch, backend,
                                            request):
    """Prompts of 1x, 2x and 5x the window, prefilled in chunks of 48 (band masks across
    chunk boundaries) and in one chunk, then 24 decodes: tokens and every step's logits."""
    use_attention(backend, monkeypatch, request)
    path = windowed(arch)
    chunked = make_pipeline(path, seq_size_per_block=16, max_num_batched_tokens=48)
    whole = make_pipeline(path, seq_size_per_block=16)
    assert chunked.cache_stats()["attention_window"] == W
    assert chunked.model.config.max_seq_len == 1024  # no longer capped at the window
    for factor in (1, 2, 5):
        ids = random_prompt(W * factor, seed=factor)
        tokens, logits = _hf_generate(path, ids, 24)
        for pipe in (chunked, whole):
            res = run(pipe, ids, max_new_tokens=24, return_logits=True)
            assert res.output_ids == tokens
            torch.testing.assert_close(res.logits, logits, atol=1e-4, rtol=0)
        chunked.check_integrity()


@pytest.mark.parametrize("backend", BACKENDS)
def test_max_attention_window_changes_outputs_only_past_the_window(make_pipeline, monkeypatch,
                                                                   backend, request):
    use_attention(backend, monkeypatch, request)
    full = make_pipeline(seq_size_per_block=8)
    windowed = make_pipeline(seq_size_per_block=8, max_attention_window=32,
                             max_num_batched_tokens=20)
    assert full.cache_stats()["attention_window"] is None
    ids = random_prompt(20)
    a = run(full, ids, max_new_tokens=40, return_logits=True)
    b = run(windowed, ids, max_new_tokens=40, return_logits=True)
    # the query of output step k sits at position 19 + k: it sees the whole sequence up to 31
    inside = 32 - 19
    assert a.output_ids[:inside + 1] == b.output_ids[:inside + 1]
    torch.testing.assert_close(a.logits[:inside], b.logits[:inside], atol=1e-5, rtol=0)
    assert (a.logits[inside:] - b.logits[inside:]).abs().amax(dim=1).min() > 1e-3


def test_window_source_in_stats_and_log(windowed, make_pipeline, caplog):
    path = windowed("mistral")
    with caplog.at_level("INFO", logger="rtpkv"):
        pipe = make_pipeline(path, seq_size_per_block=16)
    assert "attention window: 64 tokens (the model's sliding_window)" in caplog.text
    stats = pipe.cache_stats()
    assert (stats["attention_window"], stats["attention_window_source"]) == (
        64, "the model's sliding_window")
    smaller = make_pipeline(path, seq_size_per_block=16, max_attention_window=32).cache_stats()
    assert (smaller["attention_window"], smaller["attention_window_source"]) == (
        32, "MAX_ATTENTION_WINDOW")
    larger = make_pipeline(path, seq_size_per_block=16, max_attention_window=128).cache_stats()
    assert larger["attention_window"] == 64  # the smaller of the two wins


def test_bad_windows_are_refused_naming_the_variable(make_pipeline, llama_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"MAX_ATTENTION_WINDOW=8 is invalid: .*one KV block"):
        make_pipeline(seq_size_per_block=16, max_attention_window=8)
    with pytest.raises(ConfigError, match=r"MAX_ATTENTION_WINDOW=2048 is invalid: .*max_seq_len"):
        make_pipeline(seq_size_per_block=16, max_attention_window=2048)
    with pytest.raises(ConfigError, match=r"max_attention_window=0 is invalid"):
        make_pipeline(max_attention_window=0)
    monkeypatch.setenv("MAX_ATTENTION_WINDOW", "-3")
    with pytest.raises(ConfigError, match=r"MAX_ATTENTION_WINDOW='-3' is invalid"):
        load(llama_path)


def _most_held(pipe, ids, new):
    """The most blocks the request held between two engine steps (recorded on the engine
    thread after each step's bookkeeping), and its final response."""
    scheduler, cache, most = pipe.engine.scheduler, pipe.engine.cache, []
    postprocess = scheduler.postprocess

    def recording(*args):
        finished = postprocess(*args)
        most.extend(cache.num_held(r) for r in scheduler.running)
        return finished

    scheduler.postprocess = recording
    res = run(pipe, ids, max_new_tokens=new)
    return max(most), res


@pytest.mark.parametrize("reuse", [False, True])
def test_long_generation_holds_only_the_windows_blocks(make_pipeline, reuse):
    """B=4, window 16: between steps a request holds the blocks of its last 16 positions plus
    the one being filled, 5 blocks, where the full length holds all of them."""
    pipe = make_pipeline(seq_size_per_block=4, max_attention_window=16, reuse_cache=reuse,
                         max_num_batched_tokens=8)
    full = make_pipeline(seq_size_per_block=4, reuse_cache=reuse, max_num_batched_tokens=8)
    ids = random_prompt(10)
    most, res = _most_held(pipe, ids, 100)
    assert most == 16 // 4 + 1
    assert idle_in_use(pipe) == 0
    most_full, res_full = _most_held(full, ids, 100)
    assert most_full == (10 + 100 - 2) // 4   # recorded up to the step before the last
    assert res.output_ids[:5] == res_full.output_ids[:5]
    stats = pipe.cache_stats()
    if reuse:   # the released full blocks stayed cached (evictable), not in use
        assert stats["blocks_cached"] == (10 + 100 - 1) // 4
    else:
        assert stats["blocks_cached"] == 0


def test_capacity_counts_the_window_not_the_length(make_pipeline):
    """A 64-token pool (16 blocks of 4) cannot hold 210 tokens, but it holds two requests with a
    16-token window (at most cdiv(16 + 8 - 1, 4) + 1 = 7 blocks each) at once."""
    small = dict(seq_size_per_block=4, kv_cache_max_tokens=64, max_num_batched_tokens=8)
    with pytest.raises(CapacityError, match="needs 53 KV blocks"):
        make_pipeline(**small)(random_prompt(10), max_new_tokens=200)
    pipe = make_pipeline(max_attention_window=16, **small)
    ref = make_pipeline(max_attention_window=16, seq_size_per_block=4, max_num_batched_tokens=8)
    prompts = [random_prompt(10, seed=s) for s in (1, 2)]
    results = [None, None]

    def worker(i):
        results[i] = run(pipe, prompts[i], max_new_tokens=200)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for prompt, res in zip(prompts, results):
        assert res.output_ids == run(ref, prompt, max_new_tokens=200).output_ids
        assert res.aux_info["num_preemptions"] == 0
    assert max(len(s) for s in pipe.engine.step_log) == 2   # they ran side by side
    tiny = make_pipeline(max_attention_window=16, seq_size_per_block=4, kv_cache_max_tokens=16,
                         max_num_batched_tokens=8)
    with pytest.raises(CapacityError, match="needs 7 KV blocks .*attention window 16"):
        tiny(random_prompt(10), max_new_tokens=200)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reuse_under_a_window_equals_recomputation(windowed, make_pipeline, monkeypatch, backend,
                                                  request):
    """Prompt repeated and prompt extended (a conversation) on Mistral with its 64-token window:
    every reused prefix is reported exactly and gives recomputation's tokens and logits."""
    use_attention(backend, monkeypatch, request)
    path = windowed("mistral")
    reused = make_pipeline(path, seq_size_per_block=16, reuse_cache=True, max_num_batched_tokens=48)
    plain = make_pipeline(path, seq_size_per_block=16, max_num_batched_tokens=48)
    history = random_prompt(150, seed=7)
    for turn in range(3):
        for _ in range(2):   # the same prompt twice, then extended
            a = run(reused, history, max_new_tokens=20, return_logits=True)
            b = run(plain, history, max_new_tokens=20, return_logits=True)
            assert a.output_ids == b.output_ids
            torch.testing.assert_close(a.logits, b.logits, atol=1e-4, rtol=0)
            if backend == "cpu-paged":   # batch-invariant kernel: bit-identical
                assert torch.equal(a.logits, b.logits)
            reused.check_integrity()
        assert a.aux_info["reuse_len"] == (len(history) - 1) // 16 * 16
        history = history + a.output_ids + random_prompt(30, seed=turn)
    assert idle_in_use(reused) == 0


def test_reuse_stops_where_an_out_of_window_block_was_evicted(windowed, make_pipeline):
    """The chained lookup needs every block of the prefix: once an old block is gone the prefix
    ends before it, and the shorter reuse is still exact."""
    path = windowed("mistral")
    pipe = make_pipeline(path, seq_size_per_block=16, reuse_cache=True, kv_cache_max_tokens=16 * 14)
    plain = make_pipeline(path, seq_size_per_block=16)
    ids = random_prompt(150, seed=9)
    run(pipe, ids, max_new_tokens=4)
    run(pipe, random_prompt(150, seed=10), max_new_tokens=4)   # evicts the oldest cached blocks
    again = run(pipe, ids, max_new_tokens=8, return_logits=True)
    ref = run(plain, ids, max_new_tokens=8, return_logits=True)
    assert again.aux_info["reuse_len"] < (150 - 1) // 16 * 16
    assert again.output_ids == ref.output_ids
    torch.testing.assert_close(again.logits, ref.logits, atol=1e-5, rtol=0)
