"""The engine: background loop, scheduler, model runner, sampler, requests."""

from rtpkv.engine.engine import Engine
from rtpkv.engine.request import FinishReason, Request, StepOutput
from rtpkv.engine.scheduler import ScheduledChunk, Scheduler

__all__ = ["Engine", "FinishReason", "Request", "ScheduledChunk", "Scheduler", "StepOutput"]
