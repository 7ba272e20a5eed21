"""The engine gives freed heap memory back: malloc_trim at most every RTPKV_MALLOC_TRIM_S
seconds, and only after it has stepped."""

from __future__ import annotations

import platform

from rtpkv.engine.heap_trim import HeapTrimmer, libc_malloc_trim


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_trims_once_per_interval_and_only_after_steps():
    clock, calls = Clock(), []
    heap = HeapTrimmer(10.0, lambda: calls.append(clock.now), clock)
    heap.stepped()
    clock.now += 9
    heap.stepped()
    assert calls == []                         # not yet due
    clock.now += 1
    heap.maybe_trim()
    assert calls == [110]
    clock.now += 30
    heap.maybe_trim()
    assert calls == [110]                    # idle since: nothing freed to give back
    heap.stepped()
    assert calls == [110, 140] and heap.trims == 2


def test_interval_zero_turns_it_off():
    calls = []
    heap = HeapTrimmer(0.0, lambda: calls.append(1), Clock())
    heap.stepped()
    heap.maybe_trim()
    assert calls == [] and heap.trims == 0


def test_glibc_malloc_trim_is_found_where_the_c_library_is_glibc():
    trim = libc_malloc_trim()
    assert (trim is not None) == (platform.libc_ver()[0] == "glibc")
    if trim is not None:
        trim()


def test_a_pipeline_trims_from_its_engine_thread(make_pipeline):
    pipe = make_pipeline(rtpkv_malloc_trim_s=0.001)
    assert pipe.engine.heap.interval_s == 0.001
    list(pipe("hello", top_k=1, max_new_tokens=3))
    assert pipe.engine.heap.trims >= 1
