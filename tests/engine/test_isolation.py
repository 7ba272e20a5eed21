"""One request's failure is its own: a poisoned sampling config, or a failure in one request's
sampling or postprocessing, never fails the requests beside it in the same step."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest

from rtpkv.engine import sampler
from rtpkv.errors import ConfigError

VICTIMS = [f"victim number {i} asks about the weather in town {i}" for i in range(6)]
N = 8


def _solo(pipe, prompt: str, **config: Any) -> list[int]:
    last = None
    for last in pipe(prompt, generate_config={"top_k": 1, "ignore_eos": True,
                                              "max_new_tokens": N, **config}):
        pass
    return last.output_ids


def _together(pipe, bad_config: dict[str, Any]) -> tuple[list[Any], Any]:
    """The six victims and the bad request submitted in one step (the engine lock held), then
    drained: victims' output ids, and the bad request's output ids or its exception."""
    with pipe.engine.lock:
        streams = [pipe(p, generate_config={"top_k": 1, "ignore_eos": True, "max_new_tokens": N})
                   for p in VICTIMS[:3]]
        bad = pipe("the bad request", generate_config={"ignore_eos": True, "max_new_tokens": N,
                                                       **bad_config})
        streams += [pipe(p, generate_config={"top_k": 1, "ignore_eos": True,
                                             "max_new_tokens": N}) for p in VICTIMS[3:]]
    victims = [list(s)[-1].output_ids for s in streams]
    try:
        outcome: Any = list(bad)[-1].output_ids
    except Exception as exc:
        outcome = exc
    return victims, outcome


@pytest.mark.parametrize("bad_config", [
    {"do_sample": True, "temperature": 1e-45},
    {"do_sample": True, "repetition_penalty": 1e-300},
], ids=["temperature_1e-45", "repetition_penalty_1e-300"])
def test_poisoned_sampling_config_hurts_no_one(make_pipeline, bad_config):
    pipe = make_pipeline()
    solo = [_solo(pipe, p) for p in VICTIMS]
    victims, bad = _together(pipe, bad_config)
    assert victims == solo
    assert isinstance(bad, list) and len(bad) == N, bad  # the bad request itself succeeds
    if "temperature" in bad_config:  # its limit as the temperature goes to 0 is greedy
        assert bad == _solo(pipe, "the bad request")


def test_a_failure_in_one_requests_sampling_fails_it_alone(make_pipeline, monkeypatch):
    pipe = make_pipeline()
    solo = [_solo(pipe, p) for p in VICTIMS]
    real = sampler.process_logits

    def poisoned(row, req):
        if req.config.random_seed == 666:
            raise FloatingPointError("poisoned row")
        return real(row, req)

    monkeypatch.setattr(sampler, "process_logits", poisoned)
    victims, bad = _together(pipe, {"do_sample": True, "random_seed": 666})
    assert victims == solo
    assert isinstance(bad, FloatingPointError)
    assert pipe.cache_stats()["requests_running"] == 0


def test_a_failure_in_one_requests_postprocessing_fails_it_alone(make_pipeline, monkeypatch):
    pipe = make_pipeline()
    solo = [_solo(pipe, p) for p in VICTIMS]
    cache = pipe.engine.cache
    real = cache.commit

    def commit(req):
        if req.config.random_seed == 666:
            raise RuntimeError("commit failed")
        return real(req)

    monkeypatch.setattr(cache, "commit", commit)
    victims, bad = _together(pipe, {"top_k": 1, "random_seed": 666})
    assert victims == solo
    assert isinstance(bad, RuntimeError) and "commit failed" in str(bad)


@pytest.mark.parametrize("key", ["temperature", "repetition_penalty"])
def test_infinite_sampling_values_are_refused_by_name(make_pipeline, key):
    pipe = make_pipeline()
    with pytest.raises(ConfigError, match=key):
        pipe("hello", generate_config={key: float("inf")})


def test_a_step_that_keeps_failing_is_logged_once_and_retried_with_back_off(
        make_pipeline, monkeypatch, caplog):
    pipe = make_pipeline()
    real = pipe.engine.scheduler.schedule
    failing = threading.Event()
    failing.set()
    tries = []

    def schedule():
        if failing.is_set():
            tries.append(time.monotonic())
            raise RuntimeError("scheduler bug")
        return real()

    monkeypatch.setattr(pipe.engine.scheduler, "schedule", schedule)
    with caplog.at_level(logging.ERROR, logger="rtpkv"):
        stream = pipe("hello", top_k=1, max_new_tokens=2)
        time.sleep(2.0)
        failing.clear()
        last = list(stream)[-1]                         # then the waiting request runs
    assert last.finished and len(last.output_ids) == 2
    # pauses of 0.01, 0.02, ... 1 s: about 8 tries in 2 s where a tight loop made thousands
    assert 3 <= len(tries) <= 12, len(tries)
    failures = [r for r in caplog.records if "engine step failed" in r.getMessage()]
    assert len(failures) == 1 and failures[0].exc_info


@pytest.mark.parametrize("seed", [2**64, -2**63 - 1])
def test_a_seed_torch_cannot_take_is_refused_by_name(make_pipeline, seed):
    pipe = make_pipeline()
    with pytest.raises(ConfigError, match="random_seed"):
        pipe("hello", random_seed=seed)
