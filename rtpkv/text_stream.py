"""TextStream: output token ids -> the text a response may show so far.

Stop words are cut from the text; while streaming, a tail that could still become a stop word is
held back, and so is an incomplete UTF-8 character, for at most `HOLD_TOKENS` tokens; after that
the bytes show as U+FFFD, as a full decode shows them. Text once shown is never taken back, so
cumulative texts only grow and deltas add up to the final text.

Hugging Face's ByteFallback decoder (byte pieces `<0xNN>`) turns a whole run of byte pieces into
U+FFFD, one per byte, when the run's bytes are not valid UTF-8, so "é" shown from the start of a
run would be taken back by a later stray byte. A trailing run of up to `HOLD_TOKENS` byte pieces
is therefore held until it ends (a token that is no byte piece: it decodes as the full decode
decodes it) or is known invalid (its bytes can start no valid UTF-8 whatever follows: it shows
as U+FFFD, and every later byte of the run adds one); the text shown is then what decoding all
output ids at once gives. The one exception a bounded wait cannot avoid: a run still valid after
`HOLD_TOKENS` pieces is shown, and should a later byte make it invalid, what was shown of it
stays. A response that showed nothing before its end (non-streaming, or the final cumulative
text) takes `final_text`: the full decode, cut at its stop word, without that exception.
"""

from __future__ import annotations

import codecs
import re
from typing import Any, Optional, Sequence

REPLACEMENT = "\ufffd"
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# How far back a trailing run of byte pieces is looked for: a longer run is shown as it decodes.
RUN_SCAN_TOKENS = 64
# The longest wait for a character to complete: a UTF-8 character is at most 4 bytes, and a
# byte-fallback token carries one. A tail still undecodable after this many tokens holds an
# invalid sequence, which a full decode shows as U+FFFD too.
HOLD_TOKENS = 4


class TextStream:
    """Incremental detokenizer: each call decodes only the tokens since the last visible
    boundary (plus the chunk before it, for word boundaries), so a long generation costs O(1)
    per token rather than a full re-decode."""

    def __init__(self, tokenizer: Any, stop_words: Sequence[str], min_new_tokens: int = 0,
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop_words = list(stop_words)
        self.min_new_tokens = min_new_tokens
        self.stopped = False
        self.text = ""          # the decoded text of ids[:self._read]
        self._prefix = 0        # ids[_prefix:_read] are decoded again as context
        self._read = 0
        self._scanned = 0       # text before this offset holds no stop word
        self._floor = 0         # a stop word ending at or before this offset came before
        self._cut = 0           # min_new_tokens, and does not count; where the text ends
        self._longest_stop = max((len(w) for w in self.stop_words), default=0)
        # ids a decode drops (unknown ids too): they do not end a run of byte pieces
        self._dropped = frozenset(getattr(tokenizer, "all_special_ids", ())
                                  if skip_special_tokens else ())

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def _trailing_run(self, ids: Sequence[int]) -> Optional[list[tuple[int, int]]]:
        """(position, byte) of each byte piece in the run that `ids` end with, oldest first
        (empty for none; ids a decode drops are skipped, the run goes on across them); None
        when the run reaches past RUN_SCAN_TOKENS or pieces cannot be read."""
        tail = list(ids[-RUN_SCAN_TOKENS:])
        offset = len(ids) - len(tail)
        try:
            last = self.tokenizer.convert_ids_to_tokens(tail[-1:])[0]
            if isinstance(last, str) and tail[-1] not in self._dropped \
                    and not BYTE_PIECE.fullmatch(last):
                return []        # the common case: no run, one id looked up
            pieces = self.tokenizer.convert_ids_to_tokens(tail)
        except (AttributeError, TypeError, ValueError, IndexError):
            return None
        run = []
        for i in reversed(range(len(tail))):
            if pieces[i] is None or tail[i] in self._dropped:
                continue
            match = BYTE_PIECE.fullmatch(pieces[i])
            if match is None:
                break
            run.append((offset + i, int(match.group(1), 16)))
        else:
            if offset:
                return None
        return run[::-1]

    def _catch_up(self, ids: Sequence[int], finished: bool) -> None:
        if len(ids) == self._read:
            return
        cut = len(ids)
        run = self._trailing_run(ids)
        if run:
            run_start = run[0][0]
            if not _may_be_utf8(bytes(b for _, b in run)):
                # the full decode shows this run as U+FFFD, one per byte, whatever follows
                new_bytes = sum(i >= self._read for i, _ in run)
                self._add(ids, run_start)
                self.text += REPLACEMENT * new_bytes
                self._read = cut
                return
            if not finished and run_start >= self._read and len(run) <= HOLD_TOKENS:
                cut = run_start  # held until it ends or is known invalid
                if cut == self._read:
                    return
        before = self.decode(ids[self._prefix:self._read])
        after = self.decode(ids[self._prefix:cut])
        if after.endswith(REPLACEMENT) and not finished:
            if cut - self._read < HOLD_TOKENS:
                return  # an incomplete character: the next token may complete it
            # Held long enough: show the longest part that ends in a whole character, or else
            # the oldest token, whose bytes no later token can complete any more.
            for cut in range(cut - 1, self._read, -1):
                after = self.decode(ids[self._prefix:cut])
                if not after.endswith(REPLACEMENT):
                    break
            else:
                cut = self._read + 1
                after = self.decode(ids[self._prefix:cut])
        self._append(after[len(before):], cut)

    def _add(self, ids: Sequence[int], cut: int) -> None:
        """Show ids[_read:cut], which end where a run of byte pieces begins (decoded whole)."""
        if cut > self._read:
            before = self.decode(ids[self._prefix:self._read])
            self._append(self.decode(ids[self._prefix:cut])[len(before):], cut)

    def _append(self, added: str, cut: int) -> None:
        self.text += added
        if added:  # keep a context that decodes to something, for the word boundary
            self._prefix = self._read
        self._read = cut

    def visible(self, ids: Sequence[int], finished: bool) -> str:
        """The text to show for output `ids` (the whole output so far)."""
        if self.stopped:
            return self.text[:self._cut]
        self._catch_up(ids, finished)
        text = self.text
        if len(ids) < self.min_new_tokens:
            self._floor = len(text)
        start = max(0, self._scanned - self._longest_stop + 1)
        hits = [i for i in (text.find(s, max(start, self._floor - len(s) + 1))
                            for s in self.stop_words) if i >= 0]
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

    def final_text(self, ids: Sequence[int]) -> str:
        """The full decode of the output `ids`, cut at the first stop word that counts: the
        text of an answer that nothing was shown of before (no shown text has to stay)."""
        text = self.decode(ids)
        hits = [i for i in (text.find(s, max(0, self._floor - len(s) + 1))
                            for s in self.stop_words) if i >= 0]
        return text[:min(hits)] if hits else text

    def stop_check(self) -> "StopCheck | None":
        return StopCheck(self) if self.stop_words else None


def _may_be_utf8(data: bytes) -> bool:
    """Whether `data` is valid UTF-8 or the start of it (more bytes may complete it)."""
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data, final=False)
    except UnicodeDecodeError:
        return False
    return True


class StopCheck:
    """The engine's per-token stop_words_str test: does a stop word end in the newest token's
    text? Decodes only the tail of the output."""

    def __init__(self, stream: TextStream):
        self.stream = stream
        longest = max(len(s) for s in stream.stop_words)
        self.window = 4 * longest + 8  # byte-fallback tokens may carry a quarter of a character

    def __call__(self, output_ids: list[int]) -> bool:
        window = output_ids[-self.window:]
        tail = self.stream.decode(window)
        new_from = len(self.stream.decode(window[:-1]).rstrip(REPLACEMENT))
        return any(tail.find(s, max(0, new_from - len(s) + 1)) >= 0 for s in self.stream.stop_words)
