"""Environment variables rtpkv does not read but a user may expect it to: rtp-llm's variables
for features rtpkv lacks ("has no effect in rtpkv"), and near-misses of rtpkv's own
(`REUSE_CAHCE`: "did you mean REUSE_CACHE?"). Each is warned once per process, at start. A few
rtp-llm switches are refused instead when turned on (`REFUSED_SWITCHES`): running without what
they ask for would change what the user gets, not only how fast."""

from __future__ import annotations

import difflib
import logging
import os
from typing import Iterable, Mapping, Optional

from rtpkv.switches import parse_switch
from rtpkv.errors import ConfigError

log = logging.getLogger("rtpkv")

# rtp-llm's variables that rtpkv does not implement (the ones it does are its own options).
RTP_LLM_ONLY = frozenset({
    "TOKENIZER_PATH", "MODEL_TYPE", "ACT_TYPE", "DATA_TYPE", "LORA_INFO", "PTUNING_PATH",
    "STOP_WORDS_STR", "STOP_WORDS_LIST", "QUANTIZATION", "TP_SIZE", "DP_SIZE", "PP_SIZE",
    "WORLD_SIZE", "SP_TYPE", "SP_MODEL_TYPE", "SP_CHECKPOINT_PATH", "GEN_NUM_PER_CIRCLE",
    "MAX_CONTEXT_BATCH_SIZE", "RESERVER_RUNTIME_MEM_MB",
})
# rtp-llm's switches rtpkv refuses when they are on, and why.
REFUSED_SWITCHES = {
    "FP8_KV_CACHE": "an fp8 (e4m3) KV cache is not implemented: AVX2 has no fp8 conversion, so "
                    "the attention kernel would decode every K/V value bit by bit; "
                    "INT8_KV_CACHE=1 stores K/V in int8",
}
NEAR_MISS_CUTOFF = 0.88  # REUSE_CAHCE/REUSE_CACHE is 0.91; HOSTNAME/HOST is 0.67

_warned: set[str] = set()


def near_miss(name: str, ours: Iterable[str]) -> Optional[str]:
    """Our variable `name` was probably meant as, or None."""
    match = difflib.get_close_matches(name, list(ours), n=1, cutoff=NEAR_MISS_CUTOFF)
    return match[0] if match else None


def check_refused(environ: Mapping[str, str]) -> None:
    """ConfigError naming the variable for a `REFUSED_SWITCHES` switch that is on or unreadable
    (off, 0/false/off, is accepted)."""
    for name, why in REFUSED_SWITCHES.items():
        if name not in environ:
            continue
        try:
            on = parse_switch(environ[name])
        except ValueError as exc:
            raise ConfigError(f"{name}={environ[name]!r} is invalid: {exc}") from None
        if on:
            raise ConfigError(f"{name}={environ[name]!r} is invalid: {why}; accepted: 0 "
                              "(or unset)")


def check_environment(ours: Iterable[str], environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """Refuse a `REFUSED_SWITCHES` switch turned on (ConfigError), then warn (once per process
    each) about rtp-llm variables without effect and near-misses of `ours`; returns the
    warnings issued now."""
    ours = set(ours) | set(REFUSED_SWITCHES)
    environ = os.environ if environ is None else environ
    check_refused(environ)
    messages = []
    for name in sorted(environ):
        if name in ours or name in _warned:
            continue
        if name in RTP_LLM_ONLY:
            message = f"{name} is an rtp-llm variable that has no effect in rtpkv"
        elif (meant := near_miss(name, ours)) is not None:
            message = f"{name} is not an rtpkv variable and has no effect; did you mean {meant}?"
        else:
            continue
        _warned.add(name)
        log.warning("environment: %s", message)
        messages.append(message)
    return messages
