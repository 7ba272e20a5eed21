"""TextStream: output token ids -> the text a response may show so far.

Stop words are cut from the text; while streaming, a tail that could still become a stop word is
held back, and so is an incomplete UTF-8 character (decoded as U+FFFD at the end).
"""

from __future__ import annotations

from typing import Any, Sequence


class TextStream:
    def __init__(self, tokenizer: Any, stop_words: Sequence[str]):
        self.tokenizer = tokenizer
        self.stop_words = list(stop_words)
        self.stopped = False

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def visible(self, ids: Sequence[int], finished: bool) -> str:
        text = self.decode(ids)
        cut = min((i for i in (text.find(s) for s in self.stop_words) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return text[:cut]
        if finished:
            return text
        end = len(text)
        while end and text[end - 1] == "\ufffd":
            end -= 1
        hold = 0
        for word in self.stop_words:
            for k in range(min(len(word) - 1, end), hold, -1):
                if text[end - k:end] == word[:k]:
                    hold = k
                    break
        return text[:end - hold]

    def stop_check(self) -> "StopCheck | None":
        return StopCheck(self) if self.stop_words else None


class StopCheck:
    """The engine's per-token stop_words_str test: decodes only the tail of the output."""

    def __init__(self, stream: TextStream):
        self.stream = stream
        longest = max(len(s) for s in stream.stop_words)
        self.window = 4 * longest + 8  # byte-fallback tokens may carry a quarter of a character

    def __call__(self, output_ids: list[int]) -> bool:
        tail = self.stream.decode(output_ids[-self.window:])
        return any(s in tail for s in self.stream.stop_words)
