"""The Python API's rtp-llm forms: a list of strings is a batch, `messages=` goes through the
chat template (ChatML when the checkpoint has none)."""

from __future__ import annotations

import asyncio

import pytest

from conftest import idle_in_use, run
from rtpkv.chat import CHATML_TEMPLATE, render_chat
from rtpkv.errors import RequestError
from rtpkv.pipeline import BatchResponse

PROMPTS = ["hello, what's your name", "tell me about the river", "the cat and the dog"]
GREEDY = {"top_k": 1, "ignore_eos": True, "max_new_tokens": 10}


@pytest.mark.parametrize("backend", ["auto", "flash-attn"])   # flash-attn: the CPU stand-in
def test_batch_gives_one_entry_per_prompt(make_pipeline, backend, request):
    if backend == "flash-attn":
        request.getfixturevalue("flash_attn_standin")
    pipe = make_pipeline(rtpkv_attention=backend)
    alone = [run(pipe, p, **GREEDY) for p in PROMPTS]
    updates = list(pipe(PROMPTS, **GREEDY))
    assert all(isinstance(u, BatchResponse) for u in updates)
    last = updates[-1]
    assert last.finished and not any(u.finished for u in updates[:-1])
    assert last.batch_response == last.generate_texts == [r.generate_texts[0] for r in alone]
    assert last.output_ids == [r.output_ids for r in alone]
    assert [a["output_len"] for a in last.aux_info] == [10, 10, 10]
    assert len(updates) >= 30  # an update per token of any member
    assert max(len(s) for s in pipe.engine.step_log) == 3  # the batch ran together


def test_incremental_batch_repeats_no_delta(make_pipeline):
    pipe = make_pipeline()
    alone = [run(pipe, p, **GREEDY).generate_texts[0] for p in PROMPTS]
    joined = ["", "", ""]
    for update in pipe(PROMPTS, return_incremental=True, **GREEDY):
        for i, text in enumerate(update.generate_texts):
            joined[i] += text
    assert joined == alone


def test_async_batch(make_pipeline):
    pipe = make_pipeline()
    alone = [run(pipe, p, **GREEDY).output_ids for p in PROMPTS]

    async def main():
        last = None
        async for last in pipe.pipeline_async(PROMPTS, **GREEDY):
            pass
        return last

    assert asyncio.run(main()).output_ids == alone


def test_closing_a_batch_cancels_every_member(make_pipeline):
    pipe = make_pipeline()
    stream = pipe(PROMPTS, top_k=1, ignore_eos=True, max_new_tokens=500)
    next(stream)
    stream.close()
    assert all(r.done.wait(5) for r in stream.requests)
    assert idle_in_use(pipe) == 0


def test_a_bad_member_fails_the_whole_batch_before_submission(make_pipeline):
    pipe = make_pipeline()
    with pytest.raises(RequestError, match="empty"):
        pipe(["fine", ""])
    assert pipe.engine.steps == 0 and idle_in_use(pipe) == 0


def test_messages_use_chatml_when_the_checkpoint_has_no_template(make_pipeline):
    pipe = make_pipeline()
    assert not pipe.tokenizer.chat_template
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
            "<|im_start|>assistant\n")
    ids = list(pipe.tokenizer(text).input_ids)
    assert pipe.chat_prompt(messages) == ids
    via_messages = list(pipe(messages=messages, **GREEDY))[-1]
    assert via_messages.output_ids == run(pipe, ids, **GREEDY).output_ids


def test_messages_use_the_checkpoint_template(make_pipeline):
    pipe = make_pipeline()
    pipe.tokenizer.chat_template = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] "
                                    "{{ m['content'] }}\n{% endfor %}[assistant] ")
    try:
        ids = render_chat(pipe.tokenizer, [{"role": "user", "content": "hi"}])
        expected = pipe.tokenizer("<s>[user] hi\n[assistant] ", add_special_tokens=False).input_ids
        assert ids == list(expected) and ids[0] == pipe.tokenizer.bos_token_id
        assert ids.count(pipe.tokenizer.bos_token_id) == 1  # no second BOS added
    finally:
        pipe.tokenizer.chat_template = None
    assert "im_start" in CHATML_TEMPLATE


def test_messages_with_text_parts(make_pipeline):
    pipe = make_pipeline()
    plain = pipe.chat_prompt([{"role": "user", "content": "hello there"}])
    parts = pipe.chat_prompt([{"role": "user", "content": [{"type": "text", "text": "hello "},
                                                           {"type": "text", "text": "there"}]}])
    assert plain == parts


@pytest.mark.parametrize("kwargs,match", [
    ({"messages": []}, "non-empty"),
    ({"messages": [{"role": "robot", "content": "x"}]}, r"messages\[0\]\.role"),
    ({"messages": [{"role": "user"}]}, r"messages\[0\]\.content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, r"content\[0\]"),
    ({"messages": [{"role": "user", "content": "x"}], "prompt": "y"}, "not both"),
])
def test_bad_messages_are_refused_by_name(make_pipeline, kwargs, match):
    pipe = make_pipeline()
    with pytest.raises(RequestError, match=match):
        pipe(**kwargs)
