"""Sampler: static KV cache, bucketed prefill, windowed chunked decode, continuous batching,
weight versions (in-process handoff and Orbax), interruptible generation, an asyncio facade."""

from meshrl.inference.async_engine import AsyncEngine, EngineShutdownError
from meshrl.inference.engine import Completion, Request, Sampler
from meshrl.inference.weights import WeightMismatchError, publish_weights

__all__ = ["AsyncEngine", "Completion", "EngineShutdownError", "Request", "Sampler",
           "WeightMismatchError", "publish_weights"]
