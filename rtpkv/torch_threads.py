"""Keep torch's CPU parallelism in the engine thread.

With libgomp, once the main thread has run a parallel region with N > 1 threads, its idle team
stays alive, and every other thread's team loses the spin-wait (the runtime sees more threads
than cores): small matmuls in the engine thread then run ~40% slower. Set-up work done in the
caller's thread (loading weights, zeroing the KV pool) therefore runs single-threaded, and the
engine thread sets its own thread count when it starts.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def serial_torch() -> Iterator[None]:
    """Run the block with one intra-op thread, then restore the caller's setting."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
