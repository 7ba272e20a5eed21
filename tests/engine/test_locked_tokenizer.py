"""The pipeline's tokenizer is used one call at a time, whichever thread calls it."""

import threading
import time

from conftest import run
from rtpkv.locked_tokenizer import LockedTokenizer
from rtpkv.pipeline import Pipeline

PROMPT = "hello, what's your name"


class OverlapProbe:
    """Wraps a tokenizer (or stands alone) and records how many threads were inside at once."""

    def __init__(self, inner=None):
        self.inner = inner
        self.inside = 0
        self.most_inside = 0
        self.calls = 0
        self._count = threading.Lock()

    def _visit(self, fn, *args, **kwargs):
        with self._count:
            self.inside += 1
            self.calls += 1
            self.most_inside = max(self.most_inside, self.inside)
        try:
            time.sleep(0.001)  # widen the window another thread could enter through
            return fn(*args, **kwargs) if fn is not None else None
        finally:
            with self._count:
                self.inside -= 1

    def __call__(self, *args, **kwargs):
        return self._visit(self.inner, *args, **kwargs)

    def decode(self, *args, **kwargs):
        return self._visit(self.inner.decode if self.inner else None, *args, **kwargs)

    @property
    def eos_token_id(self):
        return self.inner.eos_token_id if self.inner else None


def _hammer(tokenizer, threads=8, calls=60):
    start = threading.Barrier(threads)

    def work():
        start.wait()  # all threads call at once, however slowly they were started
        for i in range(calls):
            tokenizer("some text", truncation=True, max_length=4 + i % 8)
            tokenizer.decode([5, 6, 7])
    pool = [threading.Thread(target=work) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()


def test_raw_tokenizer_is_entered_concurrently_locked_one_is_not():
    raw = OverlapProbe()
    _hammer(raw)
    assert raw.most_inside > 1, "the probe must be able to see overlapping calls"
    probe = OverlapProbe()
    locked = LockedTokenizer(probe)
    _hammer(locked)
    assert probe.calls == 8 * 60 * 2 and probe.most_inside == 1


def test_locked_tokenizer_passes_attributes_and_results_through(llama_path):
    from transformers import AutoTokenizer

    real = AutoTokenizer.from_pretrained(str(llama_path))
    locked = LockedTokenizer(real)
    assert locked(PROMPT).input_ids == real(PROMPT).input_ids
    assert locked.decode([5, 6, 7]) == real.decode([5, 6, 7])
    assert locked.eos_token_id == real.eos_token_id and len(locked) == len(real)
    assert locked.wrapped is real


def test_the_model_and_its_pipelines_share_one_locked_tokenizer(make_pipeline):
    pipe = make_pipeline()
    assert isinstance(pipe.model.tokenizer, LockedTokenizer)
    assert pipe.tokenizer is pipe.model.tokenizer, "a caller using model.tokenizer takes the same lock"
    assert LockedTokenizer.around(pipe.tokenizer) is pipe.tokenizer


def test_pipeline_routes_every_tokenizer_call_through_one_lock(make_pipeline):
    pipe = make_pipeline()
    probe = OverlapProbe(pipe.tokenizer.wrapped)
    guarded = Pipeline(pipe.model, probe, kv_cache_max_tokens=8192)
    try:
        alone = {i: run(guarded, f"{PROMPT} {i}", max_new_tokens=12, stop_words_str=["zzz"]).output_ids
                 for i in range(6)}
        results = {}

        def worker(i):
            results[i] = run(guarded, f"{PROMPT} {i}", max_new_tokens=12,
                             stop_words_str=["zzz"]).output_ids

        pool = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        assert results == alone
        assert probe.calls > 6 * 12 and probe.most_inside == 1
        guarded.check_integrity()
    finally:
        guarded.stop()
