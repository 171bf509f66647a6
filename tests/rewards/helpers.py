"""Test-only rewards, importable by reward workers as ``meshrl.tests.rewards.helpers:<name>``."""

from __future__ import annotations

import os
import time
from typing import Any


def sleep_forever(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    while True:
        time.sleep(1.0)


def always_raises(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    raise RuntimeError("reward bug")


def returns_nan(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    return [float("nan")] * len(completions)


def returns_a_string(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    return ["1.0"] * len(completions)  # type: ignore[list-item]


def returns_a_bool(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    return [True] * len(completions)


def returns_two_per_completion(prompts: list[str], completions: list[str], **_: Any
                               ) -> list[float]:
    return [5.0, 6.0] * len(completions)


def kills_worker(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    os._exit(3)


def sleeps_then_scores(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """Scores each completion's length after 0.3 s."""
    time.sleep(0.3)
    return [float(len(c)) for c in completions]


def starts_a_sleeper_and_hangs(prompts: list[str], completions: list[str], pid_file: list[str],
                               **_: Any) -> list[float]:
    """Starts ``sleep 600``, writes its pid to ``pid_file``, then hangs (a timeout)."""
    import subprocess

    child = subprocess.Popen(["sleep", "600"])
    with open(pid_file[0], "w") as f:
        f.write(str(child.pid))
    sleep_forever(prompts, completions)


def hangs_on_marker(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """Hangs only on completions containing HANG; others score their length."""
    if any("HANG" in c for c in completions):
        sleep_forever(prompts, completions)
    return [float(len(c)) for c in completions]


def meets_the_others(prompts: list[str], completions: list[str], barrier_dir: list[str],
                     parties: list[int], **_: Any) -> list[float]:
    """A cross-process barrier: leave a marker, then 1.0 if ``parties`` markers appear within
    5 s (the calls ran side by side), else 0.0 (they ran one after another)."""
    os.makedirs(barrier_dir[0], exist_ok=True)
    with open(os.path.join(barrier_dir[0], f"{os.getpid()}-{time.monotonic_ns()}"), "w"):
        pass
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        if len(os.listdir(barrier_dir[0])) >= parties[0]:
            return [1.0] * len(completions)
        time.sleep(0.01)
    return [0.0] * len(completions)


def allocates(prompts: list[str], completions: list[str], mib: list[int],
              **_: Any) -> list[float]:
    """Allocates (and touches) ``mib`` MiB, then scores 1.0."""
    block = bytearray(mib[0] << 20)
    return [float(len(block) > 0)] * len(completions)


def address_space_limit_mib(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """The worker's RLIMIT_AS soft limit in MiB (-1.0 when unlimited)."""
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    return [-1.0 if soft == resource.RLIM_INFINITY else soft / (1 << 20)] * len(completions)


def cpu_seconds_left(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """CPU seconds the worker may still use before RLIMIT_CPU (-1.0 when unlimited)."""
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_CPU)
    if soft == resource.RLIM_INFINITY:
        return [-1.0] * len(completions)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return [soft - usage.ru_utime - usage.ru_stime] * len(completions)


def normalizes(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """Runs the math reward's answer normaliser on the whole completion; scores 1.0."""
    from meshrl.rewards.math_answer import normalize

    normalize(completions[0])
    return [1.0] * len(completions)


def extracts_boxed(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """Runs ``last_boxed`` on the whole completion; 1.0 when it finds a box."""
    from meshrl.rewards.extract import last_boxed

    return [float(last_boxed(c) is not None) for c in completions]
