"""Rewards: one file per reward, a registry, and a process pool with timeouts.

``get(name)`` / ``register(name)``; built-ins: ``math``, ``gsm8k``, ``countdown``, ``format``.
``RewardPool.from_config(RewardConfig)`` scores ``sum(weight * reward)`` in worker processes.
"""

from meshrl.rewards import countdown, format, gsm8k, math_answer  # noqa: F401  (registration)
from meshrl.rewards.pool import RewardPool, RewardPoolError
from meshrl.rewards.registry import get, names, register

__all__ = ["RewardPool", "RewardPoolError", "get", "names", "register"]
