"""RateLimitedLog: a failure that repeats (a full disk, a lost server) is logged once per
interval with how often it happened since, so the operator reads one line, not thousands."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

DEFAULT_INTERVAL_S = 60.0


class RateLimitedLog:
    """`log(msg, *args)`: the first call logs at once; later calls within `interval_s` are
    counted, and the next call after it logs with "(N more since the last report)"."""

    def __init__(self, logger: logging.Logger, level: int = logging.WARNING,
                 interval_s: float = DEFAULT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic):
        self.logger, self.level, self.interval_s, self.clock = logger, level, interval_s, clock
        self._lock = threading.Lock()
        self._last = float("-inf")
        self._suppressed = 0

    def __call__(self, msg: str, *args: Any, exc_info: bool = False) -> None:
        with self._lock:
            now = self.clock()
            if now - self._last < self.interval_s:
                self._suppressed += 1
                return
            suppressed, self._suppressed, self._last = self._suppressed, 0, now
        if suppressed:
            msg += f" ({suppressed} more since the last report)"
        self.logger.log(self.level, msg, *args, exc_info=exc_info)
