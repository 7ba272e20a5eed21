"""Streamed text never stalls on bytes that never complete a character, never waits more than
one character's worth of tokens, decodes O(1) tokens per step, and ends as a full decode."""

import random

import pytest
from transformers import AutoTokenizer

from rtpkv.text_stream import HOLD_TOKENS, TextStream


@pytest.fixture(scope="module")
def tokenizer(llama_path):
    tok = AutoTokenizer.from_pretrained(str(llama_path))
    assert tok.convert_tokens_to_ids("<0xE4>") != tok.unk_token_id, "need a byte-fallback vocab"
    return tok


class CountingTokenizer:
    """Records the longest id list decoded while streaming."""

    def __init__(self, inner):
        self.inner, self.longest = inner, 0

    def decode(self, ids, **kwargs):
        self.longest = max(self.longest, len(ids))
        return self.inner.decode(ids, **kwargs)


def _byte(tok, value):
    return tok.convert_tokens_to_ids(f"<0x{value:02X}>")


def _stream(tok, ids):
    counting = CountingTokenizer(tok)
    stream = TextStream(counting, [])
    shown = [stream.visible(ids[:n], finished=False) for n in range(1, len(ids) + 1)]
    streaming_longest = counting.longest
    final = stream.visible(ids, finished=True)
    return shown, final, streaming_longest


def _never_completing(tok):
    lead = _byte(tok, 0xE4)            # starts a 3-byte character
    word = tok.convert_tokens_to_ids("▁hello")
    cont = _byte(tok, 0xB8)            # one continuation byte: still incomplete
    return [lead] * 12 + [word] + [lead, cont] * 10 + [word] + [lead] * 9


def test_bytes_that_never_complete_do_not_freeze_the_text(tokenizer):
    ids = _never_completing(tokenizer)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    shown, final, longest = _stream(tokenizer, ids)
    assert final == full and "\ufffd" in full
    for n in range(len(shown) - HOLD_TOKENS):
        assert len(shown[n + HOLD_TOKENS]) > len(shown[n]), f"text froze after token {n + 1}"
    assert all(full.startswith(s) for s in shown), "streamed text diverged from the full decode"
    assert longest <= 2 * HOLD_TOKENS + 1, "decoding must stay O(1) tokens per step"


def test_complete_characters_wait_only_for_their_bytes(tokenizer):
    ids = tokenizer("hello 你好 world", add_special_tokens=False).input_ids
    shown, final, _ = _stream(tokenizer, ids)
    assert final == tokenizer.decode(ids) and all("\ufffd" not in s for s in shown)
    assert "你" in [s.strip()[-1:] for s in shown], "a character appears once its bytes are in"


def _random_ids(tok, rng, n):
    """Words, runs of byte tokens that decode to whole characters, and runs of bytes that never
    can (continuation bytes without a lead, lead bytes cut short); a word between two runs."""
    words = [tok.convert_tokens_to_ids(w) for w in ("▁hello", "▁the", "▁cat", ",", "▁name")]
    ids = []
    while len(ids) < n:
        kind = rng.random()
        if kind < 0.4:
            text = "".join(rng.choice("éß你好世界😀ж") for _ in range(rng.randint(1, 3)))
            ids += [_byte(tok, b) for b in text.encode()]
        elif kind < 0.7:
            if rng.random() < 0.5:
                bad = [rng.randrange(0x80, 0xC0) for _ in range(rng.randint(1, 6))]
            else:  # a lead byte whose character the word after it cuts short
                lead = rng.choice([0xE4, 0xF0])
                bad = [lead] + [rng.randrange(0x80, 0xC0) for _ in range(rng.randint(0, 1 if lead == 0xE4 else 2))]
            ids += [_byte(tok, b) for b in bad]
        ids.append(rng.choice(words))
    return ids


def test_random_bytes_and_words_end_as_a_full_decode(tokenizer):
    rng = random.Random(7)
    for trial in range(20):
        ids = _random_ids(tokenizer, rng, 120)
        full = tokenizer.decode(ids, skip_special_tokens=True)
        shown, final, longest = _stream(tokenizer, ids)
        assert final == full, f"trial {trial}"
        assert all(full.startswith(s) for s in shown), f"trial {trial}: the stream diverged"
        stalls = [n for n in range(len(shown) - HOLD_TOKENS) if len(shown[n + HOLD_TOKENS]) <= len(shown[n])]
        assert not stalls, f"trial {trial}: text froze after tokens {stalls[:5]}"
        assert longest <= 2 * HOLD_TOKENS + 1


def test_shown_text_is_never_taken_back(tokenizer):
    # A byte run that is valid so far ("é"), then turns invalid: Hugging Face's ByteFallback
    # decoder shows the whole run as U+FFFD in a full decode; the stream keeps what it showed.
    ids = [_byte(tokenizer, 0xC3), _byte(tokenizer, 0xA9), _byte(tokenizer, 0x95),
           tokenizer.convert_tokens_to_ids("▁hello")]
    shown, final, _ = _stream(tokenizer, ids)
    assert shown[1] == "é" and final.startswith("é\ufffd") and final.endswith(" hello")
    assert all(final.startswith(s) for s in shown)
    assert tokenizer.decode(ids) == "\ufffd" * 3 + " hello"
