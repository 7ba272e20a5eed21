"""TextStream: output token ids -> the text a response may show so far.

Stop words are cut from the text; while streaming, a tail that could still become a stop word is
held back, and so is an incomplete UTF-8 character (decoded as U+FFFD at the end).
"""

from __future__ import annotations

from typing import Any, Sequence


class TextStream:
    """Incremental detokenizer: each call decodes only the tokens since the last visible
    boundary (plus a few before it, for word boundaries), so a long generation costs O(1) per
    token rather than a full re-decode."""

    def __init__(self, tokenizer: Any, stop_words: Sequence[str]):
        self.tokenizer = tokenizer
        self.stop_words = list(stop_words)
        self.stopped = False
        self.text = ""          # the decoded text of ids[:self._read]
        self._prefix = 0        # ids[_prefix:_read] are decoded again as context
        self._read = 0
        self._scanned = 0       # text before this offset holds no stop word
        self._cut = 0           # where the text ends once a stop word was found
        self._longest_stop = max((len(w) for w in self.stop_words), default=0)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _catch_up(self, ids: Sequence[int], finished: bool) -> None:
        if len(ids) == self._read:
            return
        before = self.decode(ids[self._prefix:self._read])
        after = self.decode(ids[self._prefix:])
        added = after[len(before):]
        # U+FFFD marks bytes not yet decodable: an incomplete character, or invalid bytes
        # that only a wider window decodes as the full text does. Wait for more tokens.
        if added and (finished or "\ufffd" not in added):
            self.text += added
            self._prefix, self._read = self._read, len(ids)

    def visible(self, ids: Sequence[int], finished: bool) -> str:
        """The text to show for output `ids` (the whole output so far)."""
        if self.stopped:
            return self.text[:self._cut]
        self._catch_up(ids, finished)
        text = self.text
        start = max(0, self._scanned - self._longest_stop + 1)
        hits = [i for i in (text.find(s, start) for s in self.stop_words) if i >= 0]
        self._scanned = len(text)
        if hits:
            self.stopped, self._cut = True, min(hits)
            return text[:self._cut]
        if finished:
            return text
        end, hold = len(text), 0
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
