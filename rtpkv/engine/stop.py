"""When a request stops: the one rule (`check_stop`) the engine applies to each new token, and
the token ids that end or must not yet end a request on their own, which a burst's C loop stops
on and the sampler bans before `min_new_tokens` (vLLM's sched/utils.check_stop)."""

from __future__ import annotations

from typing import Optional

from rtpkv.engine.request import FinishReason, Request


def check_stop(req: Request) -> Optional[FinishReason]:
    """Why `req` stops after the token just appended to it, or None: EOS (unless ignore_eos),
    a stop word the output ends with (ids or text), both only from `min_new_tokens` on; else its
    length. A stop-word check that raises fails this request only."""
    cfg = req.config
    if req.min_new_tokens_reached:
        if req.token_ids[-1] in req.eos_token_ids and not cfg.ignore_eos:
            return FinishReason.EOS
        if any(req.num_output >= len(s) and req.token_ids[-len(s):] == s
               for s in cfg.stop_words_list):  # a stop word lies in the output only
            return FinishReason.STOP
        if req.stop_text is not None:
            try:
                if req.stop_text(req.output_ids):
                    return FinishReason.STOP
            except Exception as exc:
                req.error = exc
                return FinishReason.ERROR
    if req.num_output >= req.max_new_tokens:
        return FinishReason.LENGTH
    return None


def one_token_stop_words(req: Request) -> list[int]:
    """The stop words of a single token id."""
    return [s[0] for s in req.config.stop_words_list if len(s) == 1]


def ending_token_ids(req: Request) -> list[int]:
    """The ids that stop `req` by themselves once `min_new_tokens` is reached: its EOS ids
    (unless ignore_eos) and one-token stop words. A burst's C loop stops a row on them."""
    eos = [] if req.config.ignore_eos else sorted(req.eos_token_ids)
    return eos + one_token_stop_words(req)


def banned_before_min_tokens(req: Request) -> list[int]:
    """The ids the sampler bans until `min_new_tokens` is reached: EOS and one-token stop
    words, so neither can end the request early."""
    return list(req.eos_token_ids) + one_token_stop_words(req)
