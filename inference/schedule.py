"""How a decode chunk splits over cache windows: planning from host-side positions.

A decode call attends over one cache window for all its rows, so when live sequences sit at
very different positions (continuous batching refills slots at different times) one call over
the longest window reads the short sequences' empty entries on every step. The sampler ranks
live slots by position (longest first) and may cut that ranking into consecutive ranges, each
its own call over its own window on the slots it names (gathered by index: no slot moves).
Each range is padded to a row bucket; only a range holding every live slot may take all the
slots. A cut pays when the cache entries it saves outweigh one more call: one more pass over
the weights (``weights_pass_cost``) plus a fixed per-call cost (``SPLIT_CALL_OVERHEAD``).

What a weights pass costs next to cache reads depends on the machine: on an accelerator both
stream from HBM; on a CPU the weights of a small model stay in the last-level cache over a
chunk's steps while the cache windows stream from DRAM. ``sampler.decode_split_weights_pass``
sets the share; 0 measures it when a plan first needs it (``measure_weights_pass``).
Only a sampler on this process's devices measures: a timing differs between processes, and
every process of one program must plan the same calls.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshrl.configs.schema import SamplerConfig
from meshrl.inference.programs import SlotState
from meshrl.utils.buckets import bucket_for

# A decode call's fixed cost per step (dispatch, sampling, slot bookkeeping), in cache-entry
# elements read: what one more call costs beyond its weights pass and its own window.
SPLIT_CALL_OVERHEAD = 1 << 20
# Bounds of a measured weights-pass share: timings of a loaded machine are noisy, and a share
# outside them would make the planner split on noise (too low) or never (too high).
SHARE_RANGE = (1 / 64, 1.0)
MEASURE_WINDOW_SPAN = 8  # the longer timed window is at most this many times the shorter

Call = tuple[int, int, int, int]  # (start, end, rows, window): ranks [start, end) of the
# ranking on ``rows`` rows over cache entries [0, window)
_measured: dict[Hashable, float] = {}  # measured shares of this process, by sampler shape


def lagged_readback(cfg: SamplerConfig, platform: str) -> bool:
    """Whether a round is read back after the next one is dispatched (``sampler.readback``).
    On a CPU the overlap buys little, as host and device share the cores, while the extra chunk
    a stopped sequence holds its slot for is a whole chunk of that slot's work."""
    if cfg.readback == "auto":
        return platform != "cpu"
    return cfg.readback == "lagged"


def weights_pass_cost(weights_size: int, share: float) -> int:
    """One more read of ``weights_size`` weights per decode step, in cache-entry elements."""
    return int(weights_size * share)


def weights_pass_share(cfg: SamplerConfig, platform: str, may_split: bool, key: Hashable,
                       measure: Callable[[], float]) -> float:
    """The share ``weights_pass_cost`` uses: ``sampler.decode_split_weights_pass`` when set;
    else 1 on an accelerator or where no chunk may split on a measured share (none can, or the
    sampler spans processes), else ``measure()``, run once per process for each ``key`` (the
    sampler's shape)."""
    if cfg.decode_split_weights_pass > 0:
        return cfg.decode_split_weights_pass
    if platform != "cpu" or not may_split:
        return 1.0
    if key not in _measured:
        _measured[key] = measure()
    return _measured[key]


def sampler_share(sampler: Any) -> float:
    """``weights_pass_share`` for a ``Sampler`` holding its weights, at any point of a run. A
    measurement times the sampler's own decode program on a scratch cache of inactive slots
    (the live cache and slots stay as they are; the scratch is freed after), and the compiled
    variants stay for the windows' later use."""
    cfg, S = sampler.cfg, sampler.cfg.slots
    scratch: list[Any] = []

    def decode_at(window: int) -> Any:
        if not scratch:
            scratch[:] = [sampler.dense_cache(), jax.device_put(SlotState.init(S), sampler._repl)]
        scratch[0], scratch[1], out = sampler._decode(
            sampler.params, scratch[0], scratch[1], np.arange(S, dtype=np.int32), window=window)
        return out

    platform = sampler.mesh.devices.flat[0].platform
    local = all(d.process_index == jax.process_index() for d in sampler.mesh.devices.flat)
    key = (sampler.model_cfg, S, cfg.max_len, cfg.decode_chunk, platform,
           tuple(sampler.mesh.shape.items()))
    may_split = sampler._split and local
    return weights_pass_share(cfg, platform, may_split, key, lambda: measure_weights_pass(
        decode_at, measure_windows(sampler.window_buckets),
        S * sampler._entry_size * cfg.decode_chunk, sampler.params))


def measure_windows(window_buckets: Sequence[int]) -> tuple[int, int]:
    """The two windows timed: the shortest, and the longest within ``MEASURE_WINDOW_SPAN`` x."""
    lo = window_buckets[0]
    return lo, max(w for w in window_buckets if w <= MEASURE_WINDOW_SPAN * lo)


def _best_seconds(run: Callable[[], Any], reps: int) -> float:
    jax.block_until_ready(run())  # compiles
    best = math.inf
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(run())
        best = min(best, time.perf_counter() - start)
    return best


def measure_weights_pass(decode_at: Callable[[int], Any], windows: tuple[int, int],
                         elements_per_entry: int, params: Any, reps: int = 3) -> float:
    """Seconds per weight of one pass over ``params`` over seconds per cache element in the
    decode program: ``decode_at(window)`` runs it over cache entries [0, window), reading
    ``elements_per_entry`` elements per entry (rows x entry size x steps), so the difference of
    the two ``windows`` prices a cache element. Clipped to ``SHARE_RANGE``; 1 when the windows
    are one (nothing to difference) or the timings show no cost of a longer window (noise)."""
    short, long = windows
    if long <= short:
        return 1.0
    per_entry = (_best_seconds(lambda: decode_at(long), reps)
                 - _best_seconds(lambda: decode_at(short), reps)) / (long - short)
    if not per_entry > 0:
        return 1.0
    weights = jax.tree.leaves(params)
    weights_pass = jax.jit(lambda ws: sum(jnp.sum(w, dtype=jnp.float32) for w in ws))
    per_weight = _best_seconds(lambda: weights_pass(weights), 4 * reps) / sum(
        w.size for w in weights)
    return min(max(per_weight / (per_entry / elements_per_entry), SHARE_RANGE[0]),
               SHARE_RANGE[1])


def plan_calls(positions: Sequence[int], row_buckets: Sequence[int],
               window_for: Callable[[int], int], fixed_cost: int, entry_size: int,
               split: bool = True) -> list[Call]:
    """The cheapest cut of a chunk's live sequences at ``positions`` (sorted longest first)
    into consecutive ranges of that ranking: (start, end, rows, window) per call, longest
    first. A range runs on the smallest row bucket holding it (the largest bucket, every slot,
    only for a range of the whole ranking) over the window of its first (longest) sequence, and
    costs ``fixed_cost`` plus rows x window x ``entry_size`` elements read per step; ties keep
    the fewer calls. Cuts fall at multiples of the smallest bucket; ``split=False``: one call.
    """
    assert list(positions) == sorted(positions, reverse=True), positions
    n, top = len(positions), row_buckets[-1]
    assert 0 < n <= top, (n, row_buckets)
    step = row_buckets[0] if split and len(row_buckets) > 1 else n
    points = sorted({*range(0, n, step), n})
    # best[i]: (cost, calls) of the ranking's first points[i] sequences, cut at points only.
    best: list[tuple[tuple[int, int], list[Call] | None]] = [((0, 0), [])]  # None: no plan
    for i in range(1, len(points)):
        options = []
        for j in range(i):
            lo, hi = points[j], points[i]
            rows = bucket_for(hi - lo, row_buckets)
            if rows == top and (lo, hi) != (0, n) or best[j][1] is None:
                continue
            window = window_for(positions[lo])
            cost, calls = best[j]
            options.append(((cost[0] + fixed_cost + rows * window * entry_size, cost[1] + 1),
                            [*calls, (lo, hi, rows, window)]))
        best.append(min(options, key=lambda o: o[0]) if options else ((0, 0), None))
    assert best[-1][1], (positions, row_buckets)
    return best[-1][1]
