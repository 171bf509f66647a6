"""How close continuous batching comes to an ideal scheduler on this machine (an estimate).

  python benchmarks/cb_bound.py            # benchmarks/sampler.py's long-tail workload
  python benchmarks/cb_bound.py --quick    # its --quick workload

Workload, model, sampler settings and both schedules are benchmarks/sampler.py's
``cb_speedup``: 256 requests (``--quick``: 64) whose lengths no scheduler knows, static
arrival-order batches of 32 against continuous batching over 32 slots, first come first served.
Every decode and prefill call here is timed to its completion, so both runs are a little
slower than in benchmarks/sampler.py, which stays the source of ``cb_speedup``. Each side gets
one untimed warm-up pass, then ``--rounds`` interleaved rounds.

Cost model, fitted per round by least squares on all of that round's decode calls (both
schedules): a call of R rows over a cache window of w entries takes
``call + R x chunk x (row_step + w x entry)`` seconds.

Figures (medians over the rounds, ``<name>_spread`` [min, max]):
* cb_speedup: static / continuous seconds of these timed-call runs.
* cb_speedup_ideal (estimate): static seconds over those of an ideal continuous scheduler: one
  that decodes only the useful tokens (a completion of n tokens takes n - 1 steps: its first
  comes from the prefill), in calls of all 32 slots (``call`` shared by 32 x chunk
  row-steps), each token over the window of its own position, plus the continuous run's
  prefill seconds. A first-come-first-served scheduler of unknown lengths computes at least
  those row-steps, in calls no fuller, over windows no narrower, so this bounds what
  ``cb_speedup`` can reach on this machine, as far as the model fits.
* cb_speedup_fifo_ideal (estimate): static seconds over those of an ideal first-come-first-
  served scheduler of unknown lengths: every step a call over the live rows only, each over its
  own window, a freed slot refilled the next step (no chunk ends, no padding rows), each step
  costing ``call / chunk`` however few rows are live (the weights are read every step), plus
  the continuous run's prefill seconds. Its tail, the last requests running with few slots
  live, is the one any such scheduler has; the run itself must not beat it by 5% (the floor).
* of_ideal, of_fifo_ideal: each ideal's seconds / measured continuous seconds.
* call_ms, row_step_us, entry_ns: the fitted model; fit_error: the median relative error of
  its fit to the calls. length_match: as in benchmarks/sampler.py (below 0.9: invalid). drain_s: continuous decode seconds in chunks with fewer than half of
  the slots live; prefill_calls and decode_calls of each schedule.
Floor check: a continuous run faster than its first-come-first-served ideal by more than 5% is
a broken measurement (``"valid": false``, exit 1).
Last line: one JSON object (``figures.emit``); its "estimates" names the model's figures.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from functools import partial

import jax
import numpy as np

from meshrl.benchmarks.figures import (
    MIN_ROUNDS,
    Floors,
    emit,
    estimates,
    interleave,
    paired_ratios,
    spread,
)
from meshrl.benchmarks.sampler import (
    CFG,
    MIN_LENGTH_MATCH,
    PROMPT,
    SLOTS,
    MeshrlSide,
    _chunks,
    _long_tail,
)
from meshrl.configs.schema import MeshConfig, SamplerConfig
from meshrl.inference.sampler import Request, Sampler
from meshrl.mesh import create_mesh
from meshrl.models import create_model, split_model
from meshrl.utils.buckets import bucket_for

CHUNK = 16  # benchmarks/sampler.py's decode_chunk


class TimedCalls:
    """Wraps a sampler's decode and prefill programs to time each call to completion; records
    (kind, rows, live rows, live slots of the chunk, window, seconds) per call (a chunk may
    split its live slots over several decode calls)."""

    def __init__(self, sampler: Sampler):
        self.calls: list[tuple[str, int, int, int, int, float]] = []
        self.chunk_live = 0
        decode, prefill, dispatch = sampler._decode, sampler._prefill, sampler._dispatch_chunk

        def timed_decode(*args, **kw):
            slots_R = np.asarray(args[3])
            return self._time(("decode", len(slots_R), int(np.sum(slots_R < SLOTS)),
                               self.chunk_live, kw["window"]), decode, args, kw)

        def timed_prefill(*args, **kw):
            return self._time(("prefill", 0, 0, 0, 0), prefill, args, kw)

        def chunk(rnd, live):
            self.chunk_live = len(live)
            return dispatch(rnd, live)

        sampler._decode, sampler._prefill = timed_decode, timed_prefill
        sampler._dispatch_chunk = chunk

    def _time(self, what: tuple, fn, args, kw):
        t = time.perf_counter()
        out = jax.block_until_ready(fn(*args, **kw))
        self.calls.append((*what, time.perf_counter() - t))
        return out


class Side:
    """One schedule of the workload: benchmarks/sampler.py's ``MeshrlSide`` (its seconds, useful
    tokens and length match), keeping each run's timed calls."""

    def __init__(self, sampler: Sampler, timer: TimedCalls, batches: list[list[Request]],
                 expected: list[int]):
        self.run, self.timer = MeshrlSide(sampler, batches, expected, False), timer
        self.calls: list[list] = []

    def __call__(self) -> float:
        self.timer.calls.clear()
        dt = self.run()
        self.calls.append(list(self.timer.calls))
        return dt


def fit_call_cost(calls: Sequence[tuple]) -> tuple[np.ndarray, float]:
    """((call, row_step, entry) seconds, median relative error): the least-squares fit of
    ``call + rows x CHUNK x (row_step + window x entry)`` to the decode calls."""
    dec = np.array([(c[1], c[4], c[5]) for c in calls if c[0] == "decode"], float)
    if len(dec) < 3:
        raise RuntimeError(f"the cost model needs >= 3 decode calls, got {len(dec)}")
    rows, window, secs = dec.T
    X = np.stack([np.ones_like(rows), rows * CHUNK, rows * CHUNK * window], axis=1)
    coef = np.linalg.lstsq(X, secs, rcond=None)[0]
    return coef, float(np.median(np.abs(X @ coef - secs) / secs))


def fifo_ideal_seconds(steps: Sequence[int], coef: np.ndarray,
                       window_for: Callable[[int], int], prefill_s: float) -> float:
    """Seconds of the ideal first-come-first-served scheduler (module docstring) for requests
    of ``steps`` decode steps each, in arrival order: a step at a time, a slot refilled the step
    after its sequence ends, each step costing ``call / CHUNK`` plus each live row's row-step
    over its own window."""
    call, row_step, entry = coef
    queue = list(steps)[::-1]
    live: list[list[int]] = []  # [position, tokens left] a slot
    seconds = prefill_s
    while queue or live:
        while queue and len(live) < SLOTS:
            live.append([PROMPT, queue.pop()])
        seconds += call / CHUNK + sum(row_step + entry * window_for(p) for p, _ in live)
        for slot in live:
            slot[0] += 1
            slot[1] -= 1
        live = [slot for slot in live if slot[1] > 0]
    return seconds


def ideal_seconds(positions: Sequence[int], coef: np.ndarray,
                  window_for: Callable[[int], int], prefill_s: float) -> float:
    """Seconds of the ideal continuous scheduler (module docstring) for useful tokens fed at
    ``positions``, under the fitted ``coef``."""
    call, row_step, entry = coef
    windows = np.array([window_for(p) for p in positions], float)
    return float(len(positions) * (call / (SLOTS * CHUNK) + row_step)
                 + entry * windows.sum() + prefill_s)


def _own_window(buckets: Sequence[int], position: int) -> int:
    """The narrowest cache window holding ``position``."""
    return bucket_for(position + 1, buckets)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="64 requests with budget 128")
    ap.add_argument("--rounds", type=int, default=MIN_ROUNDS, help=f">= {MIN_ROUNDS}")
    args = ap.parse_args()
    if args.rounds < MIN_ROUNDS:
        ap.error(f"--rounds must be >= {MIN_ROUNDS}, got {args.rounds}")
    n_requests, max_new, median = (64, 128, 24.0) if args.quick else (256, 512, 48.0)
    rng = np.random.default_rng(0)
    rng.integers(3, CFG.vocab_size, size=(SLOTS, PROMPT))  # sampler.py's fixed prompts first
    mesh = create_mesh(MeshConfig(data=1, tensor=1), jax.devices()[:1])
    cfg = SamplerConfig(max_len=1024, slots=SLOTS, max_new_tokens=128, temperature=0.0,
                        decode_chunk=CHUNK, prompt_buckets=(PROMPT,))
    sampler = Sampler(CFG, cfg, mesh, split_model(create_model(CFG, seed=0))[1])
    tail = _long_tail(sampler, n_requests, max_new, median, rng)
    timer = TimedCalls(sampler)
    cont = Side(sampler, timer, [tail.by_stop], tail.lengths)
    static = Side(sampler, timer, _chunks(tail.by_stop, SLOTS), tail.lengths)
    secs = interleave({"continuous, first come first served": cont,
                       "static, arrival order": static}, args.rounds)
    cont_s, static_s = secs.values()
    # A completion of n tokens takes n - 1 decode steps (its first token comes from the
    # prefill), feeding positions PROMPT .. PROMPT + n - 2.
    steps = [n - 1 for n in tail.lengths]
    positions = [PROMPT + k for n in steps for k in range(n)]
    floors = Floors()
    match = min(m for side in (cont, static) for m in side.run.match)
    if match < MIN_LENGTH_MATCH:
        floors.problems.append(f"long tail: only {match:.0%} of completions stopped at their "
                               f"intended length (needs {MIN_LENGTH_MATCH:.0%})")
    own_window = partial(_own_window, sampler.window_buckets)
    ideal, fifo, fits, errors, drains = [], [], [], [], []
    for i, (cont_calls, static_calls) in enumerate(zip(cont.calls[1:], static.calls[1:],
                                                       strict=True)):
        coef, err = fit_call_cost(cont_calls + static_calls)
        prefill = sum(c[5] for c in cont_calls if c[0] == "prefill")
        ideal.append(ideal_seconds(positions, coef, own_window, prefill))
        fifo.append(fifo_ideal_seconds(steps, coef, own_window, prefill))
        fits.append(coef)
        errors.append(err)
        drains.append(sum(c[5] for c in cont_calls if c[0] == "decode" and c[3] < SLOTS // 2))
        if cont_s[i] < 0.95 * fifo[-1]:
            floors.problems.append(f"round {i}: continuous {cont_s[i]:.3f} s is faster than "
                                   f"its first-come-first-served ideal {fifo[-1]:.3f} s")
    cont_calls, static_calls = cont.calls[-1], static.calls[-1]
    emit({"benchmark": "cb_bound",
          **spread("cb_speedup", paired_ratios(static_s, cont_s), 3),
          **spread("cb_speedup_ideal", paired_ratios(static_s, ideal), 3),
          **spread("cb_speedup_fifo_ideal", paired_ratios(static_s, fifo), 3),
          **spread("of_ideal", paired_ratios(ideal, cont_s), 3),
          **spread("of_fifo_ideal", paired_ratios(fifo, cont_s), 3),
          **spread("call_ms", [f[0] * 1e3 for f in fits], 2),
          **spread("row_step_us", [f[1] * 1e6 for f in fits], 1),
          **spread("entry_ns", [f[2] * 1e9 for f in fits], 1),
          **spread("fit_error", errors, 3),
          **spread("drain_s", drains, 3),
          "useful_tokens": sum(tail.lengths), "requests": n_requests,
          "length_match": round(match, 4),
          "decode_calls": {"continuous": sum(c[0] == "decode" for c in cont_calls),
                           "static": sum(c[0] == "decode" for c in static_calls)},
          "prefill_calls": {"continuous": sum(c[0] == "prefill" for c in cont_calls),
                            "static": sum(c[0] == "prefill" for c in static_calls)},
          "rounds": args.rounds, "quick": args.quick, "platform": jax.devices()[0].platform,
          **estimates("cb_speedup_ideal", "cb_speedup_fifo_ideal", "of_ideal", "of_fifo_ideal",
                      "call_ms", "row_step_us", "entry_ns", "fit_error")}, floors)


if __name__ == "__main__":
    main()
