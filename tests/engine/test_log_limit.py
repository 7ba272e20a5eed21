"""RateLimitedLog: one line per interval, with the count of what it held back."""

import logging

from rtpkv.log_limit import RateLimitedLog


def test_repeats_within_the_interval_are_counted_not_logged(caplog):
    now = [0.0]
    warn = RateLimitedLog(logging.getLogger("rtpkv.test"), interval_s=10, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="rtpkv.test"):
        for i in range(1000):
            now[0] = i * 0.01
            warn("write failed: %s", "EROFS")
        now[0] = 10.5
        warn("write failed: %s", "EROFS")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["write failed: EROFS",
                     "write failed: EROFS (999 more since the last report)"]
