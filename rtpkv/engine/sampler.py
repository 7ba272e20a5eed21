"""Sampler: next tokens from the last-position logits of the requests that need one.

Processing order follows transformers: repetition penalty, min-new-tokens EOS ban, then
temperature, top-k and top-p; greedy takes the arg-max. A request with `random_seed` draws from
its own generator, so the same seed gives the same output whatever else is in the batch.

Sampling is numerically safe: when a temperature or repetition penalty near zero overflows the
float32 logits (inf or nan probabilities), they are processed again in float64, and where even
that overflows the draw takes the distribution's limit, the arg-max. A
request whose sampling still fails fails alone (`sample_batch`); the others keep their tokens.
"""

from __future__ import annotations

import torch

from rtpkv.engine.request import Request
from rtpkv.engine.stop import banned_before_min_tokens
from rtpkv.kernels.fused_ops import argmax


def plain_greedy(req: Request) -> bool:
    """Greedy with no processor that changes the arg-max: the sampled token is the logits'."""
    cfg = req.config
    return cfg.greedy and cfg.repetition_penalty == 1.0 and req.min_new_tokens_reached


def sample_batch(logits: torch.Tensor, requests: list[Request]
                 ) -> tuple[list[int], dict[Request, Exception]]:
    """The tokens sampled from logits (n, vocab) float32, one row per request in `requests`
    (-1 where a request failed), and each failed request's exception: a failure stays confined
    to its request, so one bad request never fails the step."""
    if all(plain_greedy(r) for r in requests):
        return argmax(logits), {}
    tokens, failed = [], {}
    for i, req in enumerate(requests):
        try:
            tokens.append(_sample_one(logits[i], req))
        except Exception as exc:
            tokens.append(-1)
            failed[req] = exc
    return tokens, failed


def process_logits(row: torch.Tensor, req: Request) -> torch.Tensor:
    """The request's logits row after every processor (a new tensor): what it samples from,
    or takes the arg-max of when greedy."""
    cfg = req.config
    row = row.clone()
    if cfg.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.token_ids)), dtype=torch.long, device=row.device)
        scores = row[seen]
        row[seen] = torch.where(scores < 0, scores * cfg.repetition_penalty,
                                scores / cfg.repetition_penalty)
    if not req.min_new_tokens_reached:
        banned = banned_before_min_tokens(req)
        if banned:
            row[torch.tensor(banned, device=row.device)] = float("-inf")
    if cfg.greedy:
        return row
    row = row / cfg.temperature
    if cfg.top_k > 0 and cfg.top_k < row.numel():
        kth = torch.topk(row, cfg.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= cfg.top_p  # keep the token that crosses top_p
        row[order[drop]] = float("-inf")
    return row


def _argmax(row: torch.Tensor) -> int:
    """The arg-max, nan counted as -inf (an overflowed logit is never the winner by accident)."""
    return int(torch.nan_to_num(row, nan=float("-inf")).argmax())


def _safe_logits(row: torch.Tensor, req: Request) -> torch.Tensor:
    """`process_logits`, redone in float64 when a temperature or penalty near zero overflowed
    float32 (+inf or nan), so the largest logit still wins as it does in the exact limit."""
    out = process_logits(row, req)
    if bool(torch.isnan(out).any() or torch.isposinf(out).any()):
        out = process_logits(row.double(), req)
    return out


def _sample_one(row: torch.Tensor, req: Request) -> int:
    row = _safe_logits(row, req)
    if req.config.greedy:
        return _argmax(row)
    probs = row.softmax(-1)
    if not bool(torch.isfinite(probs).all()):  # overflowed even in float64: the limit
        return _argmax(row)
    return int(torch.multinomial(probs.cpu(), 1, generator=req.generator))
