"""min_new_tokens against stop words longer than one token: an occurrence that ends before the
minimum neither stops the request nor cuts its text; one that ends at or after it does."""

import pytest

from conftest import run

PROMPT = "hello, what's your name"
MAX = 20


def _first_end(output, stop, minimum):
    """Where the first occurrence of `stop` ending at token >= minimum ends (or MAX)."""
    for end in range(max(minimum, len(stop)), len(output) + 1):
        if output[end - len(stop):end] == stop:
            return end
    return MAX


@pytest.fixture
def greedy(make_pipeline):
    pipe = make_pipeline()
    base = run(pipe, PROMPT, max_new_tokens=MAX).output_ids
    stop = base[3:5]  # a two-token stop word that first ends at token 5
    assert all(base[i:i + 2] != stop for i in range(3)), "need a first occurrence at 3..5"
    assert not set(base) & pipe.eos_token_ids, "the EOS ban of min_new_tokens must not matter"
    return pipe, base, stop


@pytest.mark.parametrize("minimum", [0, 4, 5, 6, 12])
def test_multi_token_stop_ids_wait_for_min_new_tokens(greedy, minimum):
    pipe, base, stop = greedy
    res = run(pipe, PROMPT, max_new_tokens=MAX, min_new_tokens=minimum, stop_words_list=[stop])
    end = _first_end(base, stop, minimum)
    assert res.output_ids == base[:end]
    assert len(res.output_ids) >= minimum


def test_multi_token_stop_text_waits_for_min_new_tokens(greedy):
    pipe, base, _ = greedy
    full = pipe.tokenizer.decode(base)
    k = next(k for k in range(2, 8) if len(pipe.tokenizer.decode(base[:k]).strip()) >= 4)
    word = pipe.tokenizer.decode(base[:k]).strip()  # spans k tokens, the first of them output
    assert full.count(word) == 1, f"need {word!r} once in {full!r}"
    early = run(pipe, PROMPT, max_new_tokens=MAX, stop_words_str=[word])
    assert len(early.output_ids) <= k and word not in early.batch_response[0]
    late = run(pipe, PROMPT, max_new_tokens=MAX, min_new_tokens=k + 1, stop_words_str=[word])
    assert late.output_ids == base and late.batch_response[0] == full


def test_stop_text_seen_before_min_new_tokens_stops_at_its_next_occurrence(greedy):
    pipe, base, _ = greedy
    texts = [pipe.tokenizer.decode(base[:n]) for n in range(len(base) + 1)]
    # a word whose first occurrence ends before token 8 and which occurs again later
    word, first, second = next(
        (w, n1, n2) for n1 in range(1, 8) for w in {texts[n1][-3:]}
        if len(w.strip()) == 3 and "\ufffd" not in w
        for n2 in range(n1 + 1, len(base) + 1) if texts[n2].count(w) == 2 and texts[n2 - 1].count(w) == 1)
    res = run(pipe, PROMPT, max_new_tokens=MAX, min_new_tokens=first + 1, stop_words_str=[word])
    assert res.output_ids == base[:second]
    assert res.batch_response[0] == texts[second][:texts[second].rindex(word)]
