"""MULTI_TASK_PROMPT: pinned static system-prompt caches keyed by task_id."""

import json

import pytest
import torch

from conftest import idle_in_use, load, run
from rtpkv.errors import ConfigError, RequestError
from rtpkv.pipeline import Pipeline
from rtpkv.tasks import parse_tasks_json

SYSTEM = ("You are a helpful assistant. Please answer every question about the city, the river "
          "and the mountain with a careful and short answer.")
TASKS = [{"task_id": 1, "prompt": SYSTEM}, {"task_id": "coder", "prompt": "You're a careful python model."}]


@pytest.mark.parametrize("backend", ["auto", "flash-attn"])   # flash-attn: the CPU stand-in
def test_task_output_equals_concatenated_prompt_without_reuse(make_pipeline, backend, request):
    if backend == "flash-attn":
        request.getfixturevalue("flash_attn_standin")
    pipe = make_pipeline(seq_size_per_block=4, tasks=TASKS, rtpkv_attention=backend)
    plain = make_pipeline(seq_size_per_block=4, reuse_cache=False, rtpkv_attention=backend)
    tok = pipe.tokenizer
    question = "what is the river called?"
    with_task = run(pipe, question, task_id="1", max_new_tokens=16, return_logits=True)
    concat = tok(SYSTEM).input_ids + tok(question, add_special_tokens=False).input_ids
    alone = run(plain, concat, max_new_tokens=16, return_logits=True)
    assert with_task.output_ids == alone.output_ids
    torch.testing.assert_close(with_task.logits, alone.logits, atol=1e-4, rtol=0)
    aux = with_task.aux_info
    system_len = len(tok(SYSTEM).input_ids)
    assert aux["prefix_len"] == system_len
    assert aux["input_len"] == len(tok(question, add_special_tokens=False).input_ids)
    assert aux["reuse_len"] == system_len // 4 * 4 > 0
    # the integer id in the file and the string in the request are the same task
    assert run(pipe, question, task_id=1, max_new_tokens=16).output_ids == with_task.output_ids


def test_request_without_task_id_hits_the_task_blocks(make_pipeline):
    pipe = make_pipeline(seq_size_per_block=4, tasks=TASKS, reuse_cache=True)
    res = run(pipe, SYSTEM + " and the city?", max_new_tokens=4)
    assert res.aux_info["reuse_len"] >= 16 and res.aux_info["prefix_len"] == 0


def test_reuse_len_covers_pinned_blocks_plus_history(make_pipeline):
    pipe = make_pipeline(seq_size_per_block=4, tasks=TASKS, reuse_cache=True)
    q = "tell me about the mountain and the river and the city please"
    first = run(pipe, q, task_id=1, max_new_tokens=4)
    second = run(pipe, q, task_id=1, max_new_tokens=4)
    total = first.aux_info["prefix_len"] + first.aux_info["input_len"]
    assert second.aux_info["reuse_len"] == (total - 1) // 4 * 4 > first.aux_info["reuse_len"]


def test_pinned_blocks_survive_a_flood(make_pipeline):
    pipe = make_pipeline(seq_size_per_block=4, kv_cache_max_tokens=512, tasks=TASKS, reuse_cache=True)
    pinned = pipe.cache_stats()["blocks_pinned"]
    assert pinned > 0
    g = torch.Generator().manual_seed(2)
    for _ in range(30):  # 30 x 24 blocks: the 128-block pool cycles several times
        run(pipe, torch.randint(3, 1000, (90,), generator=g).tolist(), max_new_tokens=8)
    stats = pipe.cache_stats()
    assert stats["evictions"] > 2 * stats["blocks_total"] and stats["blocks_pinned"] == pinned
    res = run(pipe, "and the river?", task_id=1, max_new_tokens=2)
    assert res.aux_info["reuse_len"] == res.aux_info["prefix_len"] // 4 * 4
    pipe.check_integrity()


def test_reuse_off_keeps_task_prompts_for_task_requests_only(make_pipeline, caplog):
    """REUSE_CACHE=0 with task prompts: a task request starts from the pinned blocks, any other
    request neither looks up nor inserts, and the meeting of the two settings is warned once."""
    with caplog.at_level("WARNING", logger="rtpkv"):
        pipe = make_pipeline(seq_size_per_block=4, tasks=TASKS)
    assert caplog.text.count("REUSE_CACHE is off and task prompts are loaded") == 1
    assert not pipe.config.reuse_cache
    cached = pipe.cache_stats()["blocks_cached"]
    question = " and the city?"
    with_task = run(pipe, question, task_id=1, max_new_tokens=4)
    system_len = len(pipe.tokenizer(SYSTEM).input_ids)
    assert with_task.aux_info["reuse_len"] == system_len // 4 * 4 > 0
    again = run(pipe, question, task_id=1, max_new_tokens=4)
    assert again.aux_info["reuse_len"] == with_task.aux_info["reuse_len"], "history was reused"
    plain = run(pipe, SYSTEM + question, max_new_tokens=4)
    assert plain.aux_info["reuse_len"] == 0, "a request without task_id looked up"
    run(pipe, SYSTEM + question, max_new_tokens=4)
    stats = pipe.cache_stats()
    assert stats["blocks_cached"] == cached and stats["queries"] == 0, "a request inserted blocks"


def test_unknown_task_id_names_known_ids(make_pipeline):
    pipe = make_pipeline(seq_size_per_block=4, tasks=TASKS)
    with pytest.raises(RequestError, match=r"unknown task_id '7'.*'1', 'coder'"):
        pipe("hi", task_id=7)
    assert run(pipe, "hi", task_id="coder", max_new_tokens=2).finished


def test_add_and_remove_task_at_run_time(make_pipeline):
    pipe = make_pipeline(seq_size_per_block=4, kv_cache_max_tokens=1024)
    assert not pipe.config.reuse_cache
    pipe.add_task("t", SYSTEM)
    pinned = pipe.cache_stats()["blocks_pinned"]
    assert pinned == len(pipe.tokenizer(SYSTEM).input_ids) // 4
    with pytest.raises(ConfigError, match="already exists"):
        pipe.add_task("t", "other")
    pipe.remove_task("t")
    stats = pipe.cache_stats()
    assert stats["blocks_pinned"] == 0 and stats["blocks_cached"] >= pinned
    with pytest.raises(RequestError, match="unknown task_id 't'"):
        pipe("hi", task_id="t")
    assert idle_in_use(pipe) == 0


def test_pinned_prompts_over_half_the_pool_fail_start_up(llama_path):
    model = load(llama_path, seq_size_per_block=4, kv_cache_max_tokens=48)  # 12 blocks
    with pytest.raises(ConfigError, match=r"would take \d+ KV blocks.*more than half.*12 blocks"):
        Pipeline(model, model.tokenizer, tasks=[{"task_id": 1, "prompt": SYSTEM}])


def test_environment_file_wins_over_string(llama_path, tmp_path, monkeypatch, caplog):
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps([{"task_id": "file", "prompt": SYSTEM}]))
    monkeypatch.setenv("MULTI_TASK_PROMPT", str(path))
    monkeypatch.setenv("MULTI_TASK_PROMPT_STR", json.dumps([{"task_id": "str", "prompt": "x y"}]))
    monkeypatch.setenv("SEQ_SIZE_PER_BLOCK", "4")
    model = load(llama_path, kv_cache_max_tokens=2048)
    with caplog.at_level("INFO", logger="rtpkv"), Pipeline(model, model.tokenizer) as pipe:
        assert pipe.tasks.ids() == ["file"]
    assert "using the file" in caplog.text and "REUSE_CACHE is off and task prompts" in caplog.text
    monkeypatch.delenv("MULTI_TASK_PROMPT")
    with Pipeline(load(llama_path, kv_cache_max_tokens=2048)) as pipe:
        assert pipe.tasks.ids() == ["str"]


@pytest.mark.parametrize("text,match", [
    ("[{", "invalid JSON"),
    ('{"task_id": 1}', "expected a JSON list"),
    ('[{"task_id": 1, "prompt": "a"}, {"prompt": "b"}]', "entry 1: task_id is missing"),
    ('[{"task_id": 1, "prompt": "a", "extra": 2}]', "entry 0: extra is an unexpected key"),
    ('[{"task_id": 1, "prompt": ""}]', "entry 0: prompt='' is invalid: prompt must not be empty"),
    ('[{"task_id": 1, "prompt": "a"}, {"task_id": "1", "prompt": "b"}]', "entry 1 repeats task_id '1'"),
    ('[{"task_id": [1], "prompt": "a"}]', "entry 0: task_id=\\[1\\] is invalid: task_id must be an int or a string"),
    ('["a"]', "entry 0 is str"),
])
def test_malformed_task_json_names_the_entry(text, match):
    with pytest.raises(ConfigError, match=match):
        parse_tasks_json(text, "MULTI_TASK_PROMPT_STR")


def test_missing_task_file_is_named(llama_path, tmp_path, monkeypatch):
    monkeypatch.setenv("MULTI_TASK_PROMPT", str(tmp_path / "missing.json"))
    model = load(llama_path, kv_cache_max_tokens=1024)
    with pytest.raises(ConfigError, match="MULTI_TASK_PROMPT file .*missing.json.* does not exist"):
        Pipeline(model)
    bad = tmp_path / "bad.json"
    bad.write_text('[{"task_id": 1}]')
    monkeypatch.setenv("MULTI_TASK_PROMPT", str(bad))
    with pytest.raises(ConfigError, match="bad.json.*entry 0: prompt is missing"):
        Pipeline(load(llama_path, kv_cache_max_tokens=1024))


def test_tasks_in_model_config(llama_path):
    model = load(llama_path, seq_size_per_block=4, kv_cache_max_tokens=2048, tasks=TASKS)
    with Pipeline(model) as pipe:
        assert pipe.tasks.ids() == ["1", "coder"] and pipe.cache_stats()["blocks_pinned"] > 0
