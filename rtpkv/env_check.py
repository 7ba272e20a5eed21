"""Environment variables rtpkv does not read but a user may expect it to: rtp-llm's variables
(what rtpkv does with each is decided in rtpkv.rtp_llm_compat: mapped, accepted, warned about
or refused) and near-misses of rtpkv's own (`REUSE_CAHCE`: "did you mean REUSE_CACHE?"). Each
warning is given once per process, at start."""

from __future__ import annotations

import difflib
import logging
import os
from typing import Iterable, Mapping, Optional

from rtpkv.rtp_llm_compat import check_env_refused, env_rule, env_warning

log = logging.getLogger("rtpkv")

NEAR_MISS_CUTOFF = 0.88  # REUSE_CAHCE/REUSE_CACHE is 0.91; HOSTNAME/HOST is 0.67

_warned: set[str] = set()


def near_miss(name: str, ours: Iterable[str]) -> Optional[str]:
    """Our variable `name` was probably meant as, or None."""
    match = difflib.get_close_matches(name, list(ours), n=1, cutoff=NEAR_MISS_CUTOFF)
    return match[0] if match else None


def check_environment(ours: Iterable[str], environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """Refuse an rtp-llm variable whose value rtpkv cannot honour (ConfigError naming it), then
    warn (once per process each) about rtp-llm variables without effect and near-misses of
    `ours`; returns the warnings issued now."""
    ours = set(ours)
    environ = os.environ if environ is None else environ
    check_env_refused(environ)
    messages = []
    for name in sorted(environ):
        if name in ours or name in _warned:
            continue
        if env_rule(name) is not None:
            message = env_warning(name, environ)
        elif (meant := near_miss(name, ours)) is not None:
            message = f"{name} is not an rtpkv variable and has no effect; did you mean {meant}?"
        else:
            continue
        if message is None:
            continue
        _warned.add(name)
        log.warning("environment: %s", message)
        messages.append(message)
    return messages
