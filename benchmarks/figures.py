"""How every benchmark turns timings into figures: interleaved rounds, medians with spreads,
and floors that a real path cannot beat.

* ``interleave`` runs each side's warm-up, then ``rounds`` rounds in which every side runs once;
  the order rotates each round, so no side always runs first (or right after another).
* A headline is the median over the rounds with ``[min, max]`` beside it (``spread``); a ratio
  is paired round by round (``paired_ratios``) before its median is taken.
* ``Floors`` collects "real path vs its own floor" checks: a real path faster than its floor by
  more than ``FLOOR_SLACK`` is a broken measurement, and ``emit`` then prints ``"valid": false``
  and exits non-zero. A measured figure that must equal a formula is checked the same way
  (``Floors.agree``): the two apart by more than a tolerance means one of them is wrong.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from meshrl.utils.tpu_env import quiet_libtpu_probe

# Every benchmark imports this module before JAX starts a backend: with the TPU compiler
# installed on a host without a TPU, libtpu would print a hostname error at start-up.
quiet_libtpu_probe()

MIN_ROUNDS = 3
FLOOR_SLACK = 0.05


def interleave(sides: Mapping[str, Callable[[], float]], rounds: int, warmup: int = 1,
               verbose: bool = True) -> dict[str, list[float]]:
    """Seconds of each side over ``rounds`` interleaved rounds, after ``warmup`` untimed passes
    of every side (interleaved the same way). Each callable returns its own seconds, so it can
    leave set-up work out of the timed part."""
    if rounds < 1 or warmup < 0:
        raise ValueError(f"rounds must be >= 1 and warmup >= 0, got {rounds}, {warmup}")
    names = list(sides)
    times: dict[str, list[float]] = {k: [] for k in names}
    for i in range(warmup + rounds):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            dt = sides[name]()
            if i >= warmup:
                times[name].append(dt)
    if verbose:
        for name, ts in times.items():
            print(f"  {name}: median {statistics.median(ts):.4f}s  "
                  f"[{min(ts):.4f}, {max(ts):.4f}]  over {len(ts)} rounds", flush=True)
    return times


def paired_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    """Round-by-round ``numerator[i] / denominator[i]``: both sides of a round saw the same
    stretch of the machine."""
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError(f"paired_ratios needs equal, non-empty lengths, got {len(numerator)} "
                         f"and {len(denominator)}")
    return [n / d for n, d in zip(numerator, denominator, strict=True)]


def spread(name: str, values: Sequence[float], digits: int = 4) -> dict[str, Any]:
    """``{name: median, name_spread: [min, max]}``, rounded."""
    if not values:
        raise ValueError(f"{name}: no values")
    return {name: round(statistics.median(values), digits),
            f"{name}_spread": [round(min(values), digits), round(max(values), digits)]}


class Floors:
    """Checks of a real path against its own floor (and of a measured figure against the
    formula it must equal), gathered for ``emit``."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def check(self, what: str, real_s: float, floor_s: float) -> None:
        """``real_s`` (seconds of the real path) below ``floor_s`` by more than ``FLOOR_SLACK``
        cannot come from a correct measurement."""
        if real_s < (1.0 - FLOOR_SLACK) * floor_s:
            self.problems.append(f"{what}: real {real_s:.4g}s is faster than its floor "
                                 f"{floor_s:.4g}s by more than {FLOOR_SLACK:.0%}")

    def check_ratio(self, what: str, real_over_floor: float) -> None:
        """A headline ratio of real over floor seconds (the median of paired ratios) below 1 by
        more than ``FLOOR_SLACK``: the run's own headline says the floor was beaten."""
        if real_over_floor < 1.0 - FLOOR_SLACK:
            self.problems.append(f"{what}: real / floor = {real_over_floor:.4g} is below 1 by "
                                 f"more than {FLOOR_SLACK:.0%}")

    def agree(self, what: str, measured: float, expected: float, rtol: float) -> None:
        """``measured`` and the ``expected`` it must equal, apart by more than ``rtol`` of
        ``expected``: the measurement or the formula is wrong."""
        if abs(measured - expected) > rtol * abs(expected):
            self.problems.append(f"{what}: measured {measured:.6g} and expected {expected:.6g} "
                                 f"differ by more than {rtol:.0%}")


def cpu_threads() -> int:
    """Cores this process may use: what XLA's CPU client sizes its thread pool by (torch's
    default is the physical cores, which differ on an SMT host)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def estimates(*keys: str) -> dict[str, list[str]]:
    """The JSON entry naming which of a result's figures are estimates (a compiler's memory
    analysis, a fitted cost model), not measurements."""
    return {"estimates": list(keys)}


def emit(result: dict[str, Any], floors: Floors | None = None) -> None:
    """Prints ``result`` as the last line, with ``valid``; exits 1 when a check failed."""
    problems = floors.problems if floors is not None else []
    result = {**result, "valid": not problems}
    if problems:
        result["invalid"] = problems
        for p in problems:
            print(f"invalid measurement: {p}", file=sys.stderr, flush=True)
    print(json.dumps(result), flush=True)
    if problems:
        sys.exit(1)
