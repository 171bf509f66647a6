"""How a decode chunk splits over cache windows: planning from host-side positions.

A decode call attends over one cache window for all its rows, so when live sequences sit at
very different positions (continuous batching refills slots at different times) one call over
the longest window reads the short sequences' empty entries on every step. The sampler ranks
live slots by position (longest first) and may cut that ranking into consecutive ranges, each
its own call over its own window on the slots it names (gathered by index: no slot moves).
Each range is padded to a row bucket; only a range holding every live slot may take all the
slots. A cut pays when the cache entries it saves outweigh what one more call costs.

What a call costs beside its window (``CallCosts``: a fixed part per call, and a part per row
it runs, padding rows included) depends on the machine, so it is measured: the sampler's own
decode program is timed at three (rows, window) shapes on a scratch cache when a plan first
needs it, once per process (``measure_call_costs``); ``sampler.decode_call_costs`` sets it
instead. Only a sampler on this process's devices measures: a timing differs between
processes, and every process of one program must plan the same calls (elsewhere a chunk
splits only on configured costs).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import numpy as np

from meshrl.configs.schema import SamplerConfig
from meshrl.inference.programs import SlotState
from meshrl.utils import multihost
from meshrl.utils.buckets import bucket_for
from meshrl.utils.log import get_logger

log = get_logger("sampler")

MEASURE_WINDOW_SPAN = 8  # the longer timed window is at most this many times the shorter

Call = tuple[int, int, int, int]  # (start, end, rows, window): ranks [start, end) of the
# ranking on ``rows`` rows over cache entries [0, window)
Shape = tuple[int, int]  # (rows, window) of a timed decode call


@dataclasses.dataclass(frozen=True)
class CallCosts:
    """What a decode call costs per step beside reading its window, in KV-cache elements read:
    ``call`` once per call (dispatch, a pass over the weights, sampling), ``row`` for each row
    it runs (a row's share of the matmuls; padding rows cost it too)."""

    call: float
    row: float


_measured: dict[Hashable, CallCosts | None] = {}  # measured costs of this process, by shape


def lagged_readback(cfg: SamplerConfig, platform: str) -> bool:
    """Whether a round is read back after the next one is dispatched (``sampler.readback``).
    On a CPU the overlap buys little, as host and device share the cores, while the extra chunk
    a stopped sequence holds its slot for is a whole chunk of that slot's work."""
    if cfg.readback == "auto":
        return platform != "cpu"
    return cfg.readback == "lagged"


def configured_costs(cfg: SamplerConfig, weights_size: int) -> CallCosts | None:
    """``sampler.decode_call_costs``; the deprecated ``decode_split_weights_pass`` share as a
    call costing that share of a pass over ``weights_size`` weights; else None (measure)."""
    if cfg.decode_call_costs:
        return CallCosts(*map(float, cfg.decode_call_costs))
    if cfg.decode_split_weights_pass > 0:
        log.warning("config: sampler.decode_split_weights_pass is deprecated and will be "
                    "removed in the next release: use sampler.decode_call_costs = (%d, 0)",
                    int(cfg.decode_split_weights_pass * weights_size))
        return CallCosts(cfg.decode_split_weights_pass * weights_size, 0.0)
    return None


def call_costs(cfg: SamplerConfig, weights_size: int, may_measure: bool, key: Hashable,
               measure: Callable[[], CallCosts | None]) -> CallCosts | None:
    """The costs a plan weighs: configured; else ``measure()`` where ``may_measure``, run once
    per process for each ``key`` (the sampler's shape); else None: no chunk splits."""
    configured = configured_costs(cfg, weights_size)
    if configured is not None or not may_measure:
        return configured
    if key not in _measured:
        _measured[key] = measure()
        log.info("decode call costs (cache elements a step): %s", _measured[key])
    return _measured[key]


def sampler_costs(sampler: Any) -> CallCosts | None:
    """``call_costs`` for a ``Sampler`` holding its weights, at any point of a run. A
    measurement times the sampler's own decode program on a scratch cache of inactive slots
    (the live cache and slots stay as they are; the scratch is freed after), and the compiled
    variants stay for later use."""
    cfg, S = sampler.cfg, sampler.cfg.slots
    scratch: list[Any] = []

    def decode_at(rows: int, window: int) -> Any:
        if not scratch:
            # The live state's sampling level: the timing compiles the run's own programs.
            state = SlotState.init(S, sampler.state.sampling)
            scratch[:] = [sampler.dense_cache(), jax.device_put(state, sampler._repl)]
        scratch[0], scratch[1], out = sampler._decode(
            sampler.params, scratch[0], scratch[1], np.arange(rows, dtype=np.int32),
            window=window)
        return out

    platform = sampler.mesh.devices.flat[0].platform
    local = multihost.on_this_process(sampler.mesh)
    key = (sampler.model_cfg, S, cfg.max_len, cfg.decode_chunk, platform,
           tuple(sampler.mesh.shape.items()), sampler.row_buckets)
    shapes = measure_shapes(sampler.row_buckets, sampler.window_buckets)
    return call_costs(cfg, sampler._weights_size, sampler._split and local, key,
                      lambda: measure_call_costs(decode_at, shapes, sampler._entry_size))


def measure_windows(window_buckets: Sequence[int]) -> tuple[int, int]:
    """The two windows timed: the shortest, and the longest within ``MEASURE_WINDOW_SPAN`` x."""
    lo = window_buckets[0]
    return lo, max(w for w in window_buckets if w <= MEASURE_WINDOW_SPAN * lo)


def measure_shapes(row_buckets: Sequence[int], window_buckets: Sequence[int]
                   ) -> tuple[Shape, Shape, Shape]:
    """The (rows, window) shapes timed: every row over the shortest and the longer window
    (``measure_windows``), and the smallest row bucket over the longer one (a shape splits
    use, where the shortest window may lie below every prompt)."""
    lo, hi = measure_windows(window_buckets)
    return (row_buckets[-1], lo), (row_buckets[-1], hi), (row_buckets[0], hi)


def _best_seconds(runs: dict[Shape, Callable[[], Any]], reps: int) -> dict[Shape, float]:
    """The fastest of ``reps`` timed runs of each of ``runs`` (after one compiling run each),
    taken in turns so that a machine slowing down mid-measurement slows every shape alike."""
    for run in runs.values():
        jax.block_until_ready(run())  # compiles
    best = dict.fromkeys(runs, math.inf)
    for _ in range(reps):
        for shape, run in runs.items():
            start = time.perf_counter()
            jax.block_until_ready(run())
            best[shape] = min(best[shape], time.perf_counter() - start)
    return best


def measure_call_costs(decode_at: Callable[[int, int], Any], shapes: tuple[Shape, Shape, Shape],
                       entry_size: int, reps: int = 7) -> CallCosts | None:
    """Time ``decode_at(rows, window)`` (a decode call of ``rows`` rows over cache entries
    [0, window)) at ``shapes`` (``measure_shapes``) and fit ``fit_call_costs``; None where the
    shapes leave nothing to difference."""
    (rows, lo), (_, hi), (small, _) = shapes
    if hi <= lo or small >= rows:
        return None
    runs = {shape: (lambda s=shape: decode_at(*s)) for shape in shapes}
    return fit_call_costs(_best_seconds(runs, reps), entry_size)


def fit_call_costs(seconds: dict[Shape, float], entry_size: int) -> CallCosts | None:
    """``CallCosts`` from the seconds of decode calls at three shapes (``measure_shapes``),
    modelling a call of R rows over a window of W entries as ``call + R x (row + W x entry)``
    seconds: the two windows price an entry, the two row counts a row, the rest is the call.
    None (no chunk splits) when a longer window shows no cost: a cut could save nothing. A
    negative part (timing noise) counts as 0."""
    (rows, lo), (_, hi), (small, _) = seconds
    t_lo, t_hi, t_small = seconds.values()
    entry = (t_hi - t_lo) / (rows * (hi - lo))
    if not entry > 0:
        return None
    # Each timing less its window's entries: call + R x row, at R = rows and R = small.
    u_rows, u_small = t_hi - rows * hi * entry, t_small - small * hi * entry
    row = max((u_rows - u_small) / (rows - small), 0.0)
    call = max(u_rows - rows * row, 0.0)
    per_element = entry / entry_size
    return CallCosts(call / per_element, row / per_element)


def plan_calls(positions: Sequence[int], row_buckets: Sequence[int],
               window_for: Callable[[int], int], costs: CallCosts | None, entry_size: int
               ) -> list[Call]:
    """The cheapest cut of a chunk's live sequences at ``positions`` (sorted longest first)
    into consecutive ranges of that ranking: (start, end, rows, window) per call, longest
    first. A range runs on the smallest row bucket holding it (the largest bucket, every slot,
    only for a range of the whole ranking) over the window of its first (longest) sequence, and
    costs ``costs.call`` plus rows x (``costs.row`` + window x ``entry_size``) elements read
    per step; ties keep the fewer calls. Cuts fall at multiples of the smallest bucket;
    ``costs`` None: one call.
    """
    assert list(positions) == sorted(positions, reverse=True), positions
    n, top = len(positions), row_buckets[-1]
    assert 0 < n <= top, (n, row_buckets)
    step = row_buckets[0] if costs is not None and len(row_buckets) > 1 else n
    call, per_row = (costs.call, costs.row) if costs is not None else (0.0, 0.0)
    points = sorted({*range(0, n, step), n})
    # best[i]: (cost, calls) of the ranking's first points[i] sequences, cut at points only.
    best: list[tuple[tuple[float, int], list[Call] | None]] = [((0.0, 0), [])]  # None: no plan
    for i in range(1, len(points)):
        options = []
        for j in range(i):
            lo, hi = points[j], points[i]
            rows = bucket_for(hi - lo, row_buckets)
            if rows == top and (lo, hi) != (0, n) or best[j][1] is None:
                continue
            window = window_for(positions[lo])
            cost, calls = best[j]
            options.append(((cost[0] + call + rows * (per_row + window * entry_size),
                             cost[1] + 1),
                            [*calls, (lo, hi, rows, window)]))
        best.append(min(options, key=lambda o: o[0]) if options else ((0.0, 0), None))
    assert best[-1][1], (positions, row_buckets)
    return best[-1][1]
