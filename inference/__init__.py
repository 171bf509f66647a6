"""Sampler: static KV cache, bucketed prefill, windowed chunked decode, continuous batching,
weight versions (in-process handoff and Orbax), interruptible generation, an asyncio facade."""

from meshrl.inference.async_sampler import (
    AsyncSampler,
    SamplerFailedError,
    SamplerShutdownError,
)
from meshrl.inference.published import publish_weights
from meshrl.inference.sampler import Completion, Request, Sampler
from meshrl.inference.weights import WeightMismatchError

__all__ = ["AsyncSampler", "Completion", "SamplerFailedError", "SamplerShutdownError", "Request",
           "Sampler",
           "WeightMismatchError", "publish_weights"]
