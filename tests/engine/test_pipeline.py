"""The Pipeline contract: responses, aux info, streaming text, stop words, async, stop(),
sampling options, concurrency, and clear errors for bad input."""

import asyncio
import json
import threading

import pytest

from conftest import idle_in_use, load, run
from rtpkv.errors import ConfigError, EngineStoppedError, RequestError
from rtpkv.generate_config import GenerateConfig
from rtpkv.model_factory import ModelConfig, ModelFactory
from rtpkv.pipeline import Pipeline
from rtpkv.text_stream import TextStream

PROMPT = "hello, what's your name"


def test_seed_api_and_aux_info(make_pipeline):
    pipe = make_pipeline()
    responses = list(pipe(PROMPT, generate_config={"top_k": 1, "max_new_tokens": 12}))
    last = responses[-1]
    assert last.finished and not any(r.finished for r in responses[:-1])
    assert last.batch_response == last.generate_texts and isinstance(last.batch_response[0], str)
    aux = last.aux_info
    for key in ("input_len", "prefix_len", "reuse_len", "output_len", "iter_count", "cost_time",
                "first_token_cost_time", "wait_time"):
        assert key in aux
    assert aux["input_len"] == len(pipe.tokenizer(PROMPT).input_ids)
    assert aux["prefix_len"] == 0 and aux["reuse_len"] == 0
    assert aux["output_len"] == len(last.output_ids) <= 12
    assert aux["cost_time"] >= aux["first_token_cost_time"] > 0


def test_one_response_per_generated_token_the_last_one_finished(make_pipeline):
    pipe = make_pipeline()
    responses = list(pipe(PROMPT, top_k=1, max_new_tokens=5, ignore_eos=True))
    assert [len(r.output_ids) for r in responses] == [1, 2, 3, 4, 5]
    assert [r.finished for r in responses] == [False] * 4 + [True]
    assert responses[-1].aux_info["finish_reason"] == "length"
    stopped = list(pipe(PROMPT, top_k=1, max_new_tokens=20, ignore_eos=True,
                        stop_words_list=[responses[2].output_ids[2:3]]))
    assert len(stopped) == 3 and stopped[-1].finished and not stopped[-2].finished


def test_a_request_ended_before_its_first_token_gets_one_final_response(make_pipeline):
    pipe = make_pipeline()
    with pipe.engine.lock:  # cancelled before the engine ever schedules it
        stream = pipe(PROMPT, top_k=1, max_new_tokens=5)
        pipe.engine.abort(stream.requests[0])
    responses = list(stream)
    assert len(responses) == 1 and responses[0].finished and responses[0].output_ids == []
    assert responses[0].aux_info["finish_reason"] == "cancelled"


def test_token_id_prompt_is_used_as_given(make_pipeline):
    pipe = make_pipeline()
    ids = pipe.tokenizer(PROMPT).input_ids
    a = run(pipe, PROMPT, max_new_tokens=8)
    b = run(pipe, list(ids), max_new_tokens=8)
    assert a.output_ids == b.output_ids and b.aux_info["input_len"] == len(ids)


def test_incremental_text_concatenates_to_cumulative(make_pipeline):
    pipe = make_pipeline()
    deltas = [r.batch_response[0] for r in pipe(PROMPT, top_k=1, max_new_tokens=20,
                                                 ignore_eos=True, return_incremental=True)]
    full = run(pipe, PROMPT, max_new_tokens=20).batch_response[0]
    assert "".join(deltas) == full
    # no U+FFFD shown early for a character later tokens complete: every text shown so far
    # is a prefix of the full decode (a byte run known invalid shows its U+FFFD at once)
    assert all(full.startswith("".join(deltas[:i])) for i in range(len(deltas)))


def test_incomplete_utf8_is_held_back(make_pipeline):
    pipe = make_pipeline()
    ids = pipe.tokenizer("你好", add_special_tokens=False).input_ids
    assert len(ids) >= 6, "expected byte-fallback tokens"
    stream = TextStream(pipe.tokenizer, [])
    partial = [stream.visible(ids[:n], finished=False) for n in range(1, len(ids) + 1)]
    assert all("\ufffd" not in p for p in partial)
    assert "你" in [p.strip() for p in partial] and partial[-1].strip() == "你好"


def test_stop_words_are_cut_and_held_back(make_pipeline):
    pipe = make_pipeline()
    base = run(pipe, PROMPT, max_new_tokens=24)
    text = base.batch_response[0]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), f"need a visible stop word, got {stop!r} from {text!r}"
    seen = []
    for res in pipe(PROMPT, top_k=1, max_new_tokens=24, ignore_eos=True, stop_words_str=[stop]):
        seen.append(res.batch_response[0])
    assert res.finished and seen[-1] == text[: text.find(stop)]
    assert all(stop not in s for s in seen)
    assert res.aux_info["output_len"] < 24


def test_stop_words_list_stops_on_token_ids(make_pipeline):
    pipe = make_pipeline()
    base = run(pipe, PROMPT, max_new_tokens=16)
    stop = base.output_ids[5:7]
    res = run(pipe, PROMPT, max_new_tokens=16, stop_words_list=[stop])
    assert res.output_ids[-2:] == stop and len(res.output_ids) <= 7


def test_eos_and_min_new_tokens(make_pipeline):
    pipe = make_pipeline()
    base = run(pipe, PROMPT, max_new_tokens=12)
    eos = base.output_ids[3]
    pipe.eos_token_ids = frozenset({eos})  # pretend that token is EOS
    stopped = run(pipe, PROMPT, max_new_tokens=12, ignore_eos=False)
    assert stopped.output_ids == base.output_ids[: base.output_ids.index(eos) + 1]
    longer = run(pipe, PROMPT, max_new_tokens=12, ignore_eos=False, min_new_tokens=8)
    assert len(longer.output_ids) >= 8


def test_generate_config_object_merges_with_keywords(make_pipeline):
    pipe = make_pipeline()
    res = run(pipe, PROMPT, max_new_tokens=3)
    again = list(pipe(PROMPT, GenerateConfig(top_k=1, max_new_tokens=9), max_new_tokens=3,
                      ignore_eos=True))[-1]
    assert again.output_ids == res.output_ids


def test_sampling_is_reproducible_with_a_seed(make_pipeline):
    pipe = make_pipeline()
    cfg = dict(top_k=50, top_p=0.9, temperature=1.3, repetition_penalty=1.2, max_new_tokens=16)
    a = run(pipe, PROMPT, random_seed=7, **cfg).output_ids
    b = run(pipe, PROMPT, random_seed=7, **cfg).output_ids
    c = run(pipe, PROMPT, random_seed=8, **cfg).output_ids
    assert a == b and a != c


def test_concurrent_threads_get_the_tokens_they_get_alone(make_pipeline):
    pipe = make_pipeline()
    prompts = [f"tell me about the {w} number {i}" for i, w in
               enumerate(["cat", "dog", "river", "city"] * 4)]
    alone = {p: run(pipe, p, max_new_tokens=12).output_ids for p in prompts}
    results = {}

    def worker(chunk):
        for p in chunk:
            results[p] = run(pipe, p, max_new_tokens=12).output_ids

    threads = [threading.Thread(target=worker, args=(prompts[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == alone
    assert max(len(s) for s in pipe.engine.step_log) > 1, "decodes were never batched"


def test_async_stream(make_pipeline):
    pipe = make_pipeline()
    expected = run(pipe, PROMPT, max_new_tokens=10).output_ids

    async def main():
        last = None
        async for res in pipe.pipeline_async(PROMPT, {"top_k": 1, "max_new_tokens": 10},
                                             ignore_eos=True):
            last = res
        return last

    assert asyncio.run(main()).output_ids == expected


def test_many_async_streams_at_once(make_pipeline):
    pipe = make_pipeline()
    prompts = [f"tell me about the river number {i}" for i in range(12)]
    expected = [run(pipe, p, max_new_tokens=8).output_ids for p in prompts]

    async def one(prompt):
        last = None
        async for res in pipe.pipeline_async(prompt, top_k=1, max_new_tokens=8, ignore_eos=True):
            last = res
        return last.output_ids

    async def main():
        return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(main()) == expected
    assert max(len(s) for s in pipe.engine.step_log) >= 7, "async streams were not batched"


def test_stop_ends_in_flight_streams(make_pipeline):
    pipe = make_pipeline()
    stream = pipe(PROMPT, top_k=1, max_new_tokens=200, ignore_eos=True)
    next(stream)
    pipe.stop()
    with pytest.raises(EngineStoppedError):
        for _ in stream:
            pass
    with pytest.raises(RequestError):
        pipe(PROMPT)


def test_a_request_submitted_while_the_pipeline_stops_is_refused_not_left_waiting(
        make_pipeline):
    """stop() runs to its end between a submission's checks and its hand-off to the engine:
    the submission is refused, never queued after stop() drained the queue (that request
    would wait forever)."""
    pipe = make_pipeline()
    engine = pipe.engine
    check_fits = engine.scheduler.check_fits

    def stop_meanwhile(req):
        check_fits(req)
        stopper = threading.Thread(target=engine.stop)
        stopper.start()
        stopper.join()

    engine.scheduler.check_fits = stop_meanwhile
    outcome: list = []

    def consume() -> None:
        try:
            for _ in pipe(PROMPT, top_k=1, max_new_tokens=2):
                pass
            outcome.append("finished")
        except EngineStoppedError as exc:
            outcome.append(exc)

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    consumer.join(20)
    assert outcome and isinstance(outcome[0], EngineStoppedError), outcome


def test_context_manager_stops(llama_path):
    model = load(llama_path, kv_cache_max_tokens=1024)
    with Pipeline(model, model.tokenizer) as pipe:
        run(pipe, PROMPT, max_new_tokens=4)
    assert pipe.engine.stopped and not pipe.engine._thread.is_alive()


@pytest.mark.parametrize("prompt,match", [("", "empty"), (None, "NoneType"), (42, "int"),
                                          ([], "empty"), ([1, 10**9], "outside")])
def test_bad_prompts(make_pipeline, prompt, match):
    pipe = make_pipeline()
    with pytest.raises(RequestError, match=match):
        pipe(prompt)
    assert run(pipe, PROMPT, max_new_tokens=2).finished  # still serving


@pytest.mark.parametrize("config,match", [
    ({"max_new_token": 3}, "max_new_token"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"top_p": 1.5}, "top_p"),
    ({"cache_salt": "x" * 300}, "cache_salt"),
])
def test_bad_generate_config(make_pipeline, config, match):
    pipe = make_pipeline()
    with pytest.raises(ConfigError, match=match):
        pipe(PROMPT, generate_config=config)
    assert run(pipe, PROMPT, max_new_tokens=2).finished


def test_over_long_prompt(make_pipeline):
    pipe = make_pipeline(max_seq_len=64)
    with pytest.raises(RequestError, match="max_seq_len 64"):
        pipe(list(range(3, 40)), max_new_tokens=40)
    with pytest.raises(RequestError, match="no room"):
        pipe(list(range(3, 67)))
    assert run(pipe, list(range(3, 40)), max_new_tokens=20).aux_info["output_len"] == 20
    assert idle_in_use(pipe) == 0


def test_missing_directory_and_unsupported_architecture(tmp_path, llama_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ModelFactory.from_huggingface(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache"):
        ModelFactory.from_huggingface("no-such-org/no-such-model-rtpkv")
    bad = tmp_path / "gpt2"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        ModelFactory.from_huggingface(bad)


def test_model_config_positional_and_keyword(llama_path):
    a = ModelFactory.from_huggingface(llama_path, ModelConfig(seq_size_per_block=8), show_progress=False)
    b = ModelFactory.from_huggingface(llama_path, model_config=ModelConfig(seq_size_per_block=8),
                                      show_progress=False)
    assert a.config.seq_size_per_block == b.config.seq_size_per_block == 8


def test_invalid_environment_is_refused_by_name(llama_path, monkeypatch):
    monkeypatch.setenv("SEQ_SIZE_PER_BLOCK", "48")
    with pytest.raises(ConfigError, match=r"SEQ_SIZE_PER_BLOCK='48'.*power of two from 1 to 1024"):
        load(llama_path)
    monkeypatch.setenv("SEQ_SIZE_PER_BLOCK", "16")
    monkeypatch.setenv("REUSE_CACHE", "maybe")
    with pytest.raises(ConfigError, match=r"REUSE_CACHE='maybe'.*1/0, true/false, on/off"):
        load(llama_path)
    monkeypatch.setenv("REUSE_CACHE", "On")
    model = load(llama_path)
    assert model.config.reuse_cache and model.config.seq_size_per_block == 16
    assert load(llama_path, seq_size_per_block=4).config.seq_size_per_block == 4  # code wins
    with pytest.raises(ConfigError, match="dtype"):
        load(llama_path, dtype="float8")


def _equal_but_for_retracted_runs(streamed: str, full: str) -> bool:
    """streamed == full, except that a character the stream showed may be U+FFFD per byte in the
    full decode (ByteFallback invalidates a whole byte run when a later byte of it is invalid)."""
    i = j = 0
    while i < len(streamed) and j < len(full):
        if streamed[i] == full[j]:
            i, j = i + 1, j + 1
            continue
        width = len(streamed[i].encode())
        if full[j:j + width] != "\ufffd" * width:
            return False
        i, j = i + 1, j + width
    return i == len(streamed) and j == len(full)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_incremental_detokenization_equals_a_full_decode(make_pipeline, checkpoints, arch):
    """Cumulative texts grow and the last one is the full decode exactly; an incremental
    stream never takes shown text back, so its deltas add up to the full decode but for byte
    runs invalidated after they were shown."""
    pipe = make_pipeline(checkpoints(arch))
    responses = list(pipe(PROMPT, top_k=1, max_new_tokens=200, ignore_eos=True))
    texts = [r.batch_response[0] for r in responses]
    full = pipe.tokenizer.decode(responses[-1].output_ids, skip_special_tokens=True)
    assert texts[-1] == full
    assert all(b.startswith(a) for a, b in zip(texts[:-1], texts[1:-1])), "text grows"
    deltas = [r.batch_response[0] for r in pipe(PROMPT, top_k=1, max_new_tokens=200,
                                                ignore_eos=True, return_incremental=True)]
    if arch == "qwen2":  # byte-level BPE: no byte run is invalidated after the fact
        assert "".join(deltas) == full
    else:
        assert _equal_but_for_retracted_runs("".join(deltas), full)


def test_the_stream_itself_supports_async_for(make_pipeline):
    pipe = make_pipeline()
    expected = [r.output_ids for r in pipe(PROMPT, top_k=1, max_new_tokens=6, ignore_eos=True)]

    async def main():
        stream = pipe(PROMPT, top_k=1, max_new_tokens=6, ignore_eos=True)
        first = next(stream)  # a stream may start with `for` and go on with `async for`
        return [first.output_ids] + [r.output_ids async for r in stream]

    assert asyncio.run(main()) == expected


def test_breaking_out_of_async_for_cancels(make_pipeline):
    pipe = make_pipeline()

    async def main():
        stream = pipe(PROMPT, top_k=1, max_new_tokens=200, ignore_eos=True)
        async for res in stream:
            if len(res.output_ids) == 3:
                break
        await stream.aclose()
        return stream

    stream = asyncio.run(main())
    req = stream.requests[0]
    assert req.done.wait(5) and req.num_output < 200
    assert idle_in_use(pipe) == 0


def test_a_stream_awaited_once_refuses_plain_next(make_pipeline):
    pipe = make_pipeline()

    async def main():
        stream = pipe(PROMPT, top_k=1, max_new_tokens=50, ignore_eos=True)
        await stream.__anext__()
        with pytest.raises(RuntimeError, match="async for"):
            next(stream)
        stream.close()

    asyncio.run(main())


def test_top_level_imports():
    import rtpkv
    from rtpkv import ModelConfig as MC, ModelFactory as MF, Pipeline as P

    assert (P, MF, MC) == (Pipeline, ModelFactory, ModelConfig)
    assert {"Pipeline", "ModelFactory", "ModelConfig"} <= set(dir(rtpkv))
    with pytest.raises(AttributeError, match="Pipline"):
        rtpkv.Pipline


def test_the_engine_yields_its_core_after_each_first_token_only(make_pipeline, monkeypatch):
    """A step that gives a request its first token ends with the engine thread yielding its
    core, so the stream's reader runs before the next step (rtpkv/engine/engine.py); decode
    steps after it do not yield."""
    import rtpkv.engine.engine as engine_module

    yields = []
    monkeypatch.setattr(engine_module, "yield_core", lambda: yields.append(1))
    pipe = make_pipeline()
    first = run(pipe, PROMPT, max_new_tokens=6)
    assert len(first.output_ids) == 6 and len(yields) == 1
    streams = [pipe(p, generate_config={"top_k": 1, "ignore_eos": True, "max_new_tokens": 4})
               for p in (PROMPT, PROMPT + " and yours")]
    for s in streams:
        list(s)
    assert 2 <= len(yields) <= 3   # one per step that gave a first token: the two may share one


def test_the_engine_reserves_a_steps_scratch_on_its_thread_when_it_starts(make_pipeline,
                                                                          monkeypatch):
    """The engine thread maps the fused decoder's scratch for a step's token budget before any
    request (rtpkv/engine/engine.py), so no request pays it."""
    from rtpkv.engine.model_runner import ModelRunner

    reserved = []
    reserve = ModelRunner.reserve_scratch
    monkeypatch.setattr(ModelRunner, "reserve_scratch", lambda self, rows: reserved.append(
        (rows, threading.current_thread().name)) or reserve(self, rows))
    pipe = make_pipeline(max_num_batched_tokens=512)
    assert len(run(pipe, PROMPT, max_new_tokens=2).output_ids) == 2
    assert reserved == [(512, "rtpkv-engine")]
