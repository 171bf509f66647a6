"""The one step clock of both training loops: a step's wall time is the gap between two step
ends minus the host work the loop excludes (checkpoints, evaluation, publishing), with the
process's CPU time beside it, and throughput and MFU from the model's FLOPs per token."""

from __future__ import annotations

import time


class StepClock:
    """``lap(tokens)`` at each step end returns that step's ``step_time_s`` and ``process_cpu_s``
    (CPU seconds of this process, all threads, XLA's included: on a CPU host, CPU over wall
    time is how many cores the job kept busy). The first lap after ``start`` or a (re)start is
    timed from ``start`` and so includes compilation. ``exclude(seconds)`` takes host work
    between steps out of the next lap; ``resume()`` at a step's start takes out everything
    since the last lap. With ``flops_per_token`` (0: the tokens are not what the
    step trained on, e.g. RL's generated tokens) the lap adds model FLOP/s and MFU."""

    def __init__(self, flops_per_token: float, peak_flops: float, devices: int,
                 prefix: str = "") -> None:
        self.flops_per_token, self.peak_flops, self.devices = flops_per_token, peak_flops, devices
        self.prefix = prefix
        self._last: float | None = None
        self._cpu_last = 0.0
        self._excluded = self._cpu_excluded = 0.0

    def start(self) -> None:
        self._last, self._cpu_last = time.perf_counter(), time.process_time()
        self._excluded = self._cpu_excluded = 0.0

    def resume(self) -> None:
        """A step starts now: everything since the last lap was host work between steps."""
        if self._last is not None:
            self._excluded = time.perf_counter() - self._last
            self._cpu_excluded = time.process_time() - self._cpu_last

    def exclude(self, wall_s: float, cpu_s: float = 0.0) -> None:
        self._excluded += wall_s
        self._cpu_excluded += cpu_s

    def lap(self, tokens: float, at: float | None = None) -> dict[str, float]:
        """The step that ended ``at`` (``perf_counter``; default now) on ``tokens`` tokens."""
        now, cpu = time.perf_counter() if at is None else at, time.process_time()
        if self._last is None:
            self._last, self._cpu_last = now, cpu
        wall = max(now - self._last - self._excluded, 1e-9)
        cpu_s = max(cpu - self._cpu_last - self._cpu_excluded, 0.0)
        self._last, self._cpu_last = now, cpu
        self._excluded = self._cpu_excluded = 0.0
        p = self.prefix
        out = {f"{p}step_time_s": wall, f"{p}tokens_per_s": tokens / wall,
               f"{p}process_cpu_s": cpu_s}
        if self.flops_per_token:  # FLOPs only where every counted token is a trained one
            flops_s = self.flops_per_token * tokens / wall
            out[f"{p}model_flops_per_s"] = flops_s
            out[f"{p}mfu"] = (flops_s / (self.peak_flops * self.devices)
                              if self.peak_flops else 0.0)
        return out


class Stopwatch:
    """Wall and CPU seconds of a block of host work, for ``StepClock.exclude``."""

    def __enter__(self) -> Stopwatch:
        self.t0, self.c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s = time.perf_counter() - self.t0
        self.cpu_s = time.process_time() - self.c0
