"""LockedTokenizer: one Hugging Face tokenizer shared by many threads, used one call at a time.

A fast tokenizer is a Rust object behind a RefCell: two threads inside it at once can fail with
"Already borrowed" (encode with truncation or padding mutates it). The engine thread (stop-word
checks), the threads that iterate response streams (detokenization) and the callers that submit
prompts (tokenization) all use the pipeline's tokenizer, so every call goes through one lock
(a pipeline encodes long prompts with a copy of its own, so that they do not hold this one).
"""

from __future__ import annotations

import functools
import threading
from typing import Any


class LockedTokenizer:
    """Wraps a tokenizer: calling it, its methods and reading its attributes take one lock."""

    def __init__(self, tokenizer: Any):
        self.__dict__["_tokenizer"] = tokenizer
        self.__dict__["_lock"] = threading.RLock()

    @classmethod
    def around(cls, tokenizer: Any) -> "LockedTokenizer":
        """`tokenizer` itself if it is already locked (one lock per tokenizer), else wrapped."""
        return tokenizer if isinstance(tokenizer, cls) else cls(tokenizer)

    @property
    def wrapped(self) -> Any:
        """The tokenizer itself, for code that is known to run on one thread."""
        return self._tokenizer

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return self._tokenizer(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        with self._lock:
            value = getattr(self._tokenizer, name)
        if not callable(value):
            return value

        @functools.wraps(value)
        def locked(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return value(*args, **kwargs)

        return locked

    def __setattr__(self, name: str, value: Any) -> None:
        with self._lock:
            setattr(self._tokenizer, name, value)

    def __len__(self) -> int:
        with self._lock:
            return len(self._tokenizer)

    def __repr__(self) -> str:
        return f"LockedTokenizer({self._tokenizer!r})"
