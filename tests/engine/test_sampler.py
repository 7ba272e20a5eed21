"""The sampler's logits processors against transformers' on fixed logits, one at a time and
chained in transformers' order."""

import pytest
import torch
from transformers import (MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor,
                          TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from rtpkv.engine.request import Request
from rtpkv.engine.sampler import process_logits, sample_batch
from rtpkv.generate_config import GenerateConfig

VOCAB = 64
PROMPT = [3, 9, 9, 17, 40]
OUTPUT = [21, 3, 55]
EOS = 2


def _logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    row = torch.randn(VOCAB, generator=g) * 3
    row[[3, 21]] = torch.tensor([2.5, -1.5])  # seen tokens with either sign
    return row


def _request(**config) -> Request:
    req = Request(list(PROMPT), GenerateConfig(**config), max_new_tokens=16,
                  eos_token_ids=frozenset({EOS}))
    req.token_ids.extend(OUTPUT)
    return req


def _hf(processors, req: Request, row: torch.Tensor) -> torch.Tensor:
    ids = torch.tensor([req.token_ids])
    scores = row.clone().unsqueeze(0)
    for p in processors:
        scores = p(ids, scores)
    return scores[0]


def _same(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    finite = ~torch.isinf(ours)
    torch.testing.assert_close(ours[finite], theirs[finite])


@pytest.mark.parametrize("config,processors", [
    ({"repetition_penalty": 1.3}, [RepetitionPenaltyLogitsProcessor(1.3)]),
    ({"temperature": 0.7}, [TemperatureLogitsWarper(0.7)]),
    ({"top_k": 5}, [TopKLogitsWarper(5)]),
    ({"top_p": 0.8}, [TopPLogitsWarper(0.8)]),
    ({"repetition_penalty": 0.8, "temperature": 1.4, "top_k": 20, "top_p": 0.9},
     [RepetitionPenaltyLogitsProcessor(0.8), TemperatureLogitsWarper(1.4), TopKLogitsWarper(20),
      TopPLogitsWarper(0.9)]),
], ids=["repetition_penalty", "temperature", "top_k", "top_p", "chained"])
def test_processors_match_transformers(config, processors):
    row = _logits()
    req = _request(**config)
    ours = process_logits(row, req)
    _same(ours, _hf(processors, req, row))
    assert not torch.equal(ours, row), "the processor must change these logits"


def test_min_new_tokens_bans_eos_like_transformers():
    row = _logits()
    row[EOS] = 50.0  # EOS would win
    req = _request(min_new_tokens=5, top_k=1)
    hf = MinNewTokensLengthLogitsProcessor(len(PROMPT), 5, EOS)
    _same(process_logits(row, req), _hf([hf], req, row))
    assert sample_batch(row.unsqueeze(0), [req])[0] != [EOS]
    req.token_ids.extend([7, 8])  # five outputs: the ban is over
    assert sample_batch(row.unsqueeze(0), [req])[0] == [EOS]


def test_seeded_draws_follow_the_processed_distribution():
    row = _logits()
    req = _request(top_k=3, random_seed=0)
    allowed = set(torch.topk(row, 3).indices.tolist())
    draws = [sample_batch(row.unsqueeze(0), [req])[0][0] for _ in range(200)]
    assert set(draws) == allowed
