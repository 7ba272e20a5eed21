"""task_id with chat messages: the task's prompt stands in for the system message, so the
request has one system prompt (the task's), never the template's default one as well."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from conftest import load
from rtpkv.errors import RequestError
from rtpkv.pipeline import Pipeline

# Qwen2.5's shape: a default system turn when the messages have none
TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a default helper."
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TASK = "<|im_start|>system\nyou answer questions about rivers.<|im_end|>\n"


@pytest.fixture
def pipe(llama_path):
    tok = AutoTokenizer.from_pretrained(str(llama_path))
    tok.chat_template = TEMPLATE
    model = load(llama_path, kv_cache_max_tokens=4096, seq_size_per_block=4)
    pipeline = Pipeline(model, tok, tasks=[{"task_id": "rivers", "prompt": TASK}])
    yield pipeline
    pipeline.check_integrity()
    pipeline.stop()


def _prompt_text(pipe, **kwargs) -> str:
    stream = pipe(messages=[{"role": "user", "content": "how long is the nile?"}],
                  max_new_tokens=1, **kwargs)
    ids = stream.requests[0].prompt_ids
    list(stream)
    return pipe.tokenizer.decode(ids, skip_special_tokens=False)


def test_task_prompt_stands_in_for_the_system_message(pipe):
    text = _prompt_text(pipe, task_id="rivers")
    assert "You are a default helper" not in text and text.count("system") == 1
    assert text.endswith("<|im_start|>user\nhow long is the nile?<|im_end|>\n"
                         "<|im_start|>assistant\n")
    assert "you answer questions about rivers." in text
    assert "You are a default helper" in _prompt_text(pipe)   # without a task: the template's


def test_task_prompt_beside_a_system_message_is_refused(pipe):
    with pytest.raises(RequestError, match="task_id takes no system message"):
        pipe(messages=[{"role": "system", "content": "be brief"},
                       {"role": "user", "content": "hi"}], task_id="rivers")


def test_task_with_messages_reuses_the_pinned_task_prompt(pipe):
    last = list(pipe(messages=[{"role": "user", "content": "hi"}], task_id="rivers",
                     max_new_tokens=2))[-1]
    assert last.aux_info["prefix_len"] == len(pipe.tasks.get("rivers").token_ids)
    assert last.aux_info["reuse_len"] >= 4
