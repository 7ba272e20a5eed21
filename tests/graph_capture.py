"""A stand-in for CUDA graph capture (rtpkv.engine.cuda_graphs.Capture) on a CPU: "capturing"
runs the step once, and each replay runs the eager step again on the same static buffers and
copies its result into the captured output, as a replayed graph writes it."""

from __future__ import annotations

from typing import Callable

import torch


class EagerReplay:
    def __init__(self) -> None:
        self.captures = 0
        self.replays = 0

    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        self.captures += 1
        output = fn()

        def replay() -> None:
            self.replays += 1
            output.copy_(fn())

        return replay, output
