"""XLA settings for the test run and every process it starts (``cpu_env``).

The suite runs tiny programs whose compile time, not run time, is most of its cost, and LLVM's
optimisation passes are most of the compile time: with ``FAST_COMPILE``,
tests/trainer/test_step.py plus tests/models/test_properties.py take 64 s instead of 89 s (user
CPU 85 s instead of 136 s). The flags change how fast the compiled code runs, not what it
computes. The benchmarks never set them.
"""

from __future__ import annotations

import os

FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")


def xla_flags(devices: int | None = None) -> str:
    """``XLA_FLAGS`` with ``FAST_COMPILE`` and, given ``devices``, that many fake CPU devices
    (none: one CPU device, as on a laptop)."""
    fake = [f"--xla_force_host_platform_device_count={devices}"] if devices else []
    return " ".join([*fake, *FAST_COMPILE])


def cpu_env(devices: int | None = None, **extra: str) -> dict[str, str]:
    """This process's environment for a CPU-only child with ``devices`` fake devices."""
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(devices), **extra}
