"""How close continuous batching comes to an ideal scheduler on this machine (an estimate).

  python benchmarks/cb_bound.py            # benchmarks/sampler.py's long-tail workload
  python benchmarks/cb_bound.py --quick    # its --quick workload

Workload, model, sampler settings and both schedules are benchmarks/sampler.py's
``cb_speedup``: 256 requests (``--quick``: 64) whose lengths no scheduler knows, static
arrival-order batches of 32 against continuous batching over 32 slots, first come first served.
Every decode and prefill call here is timed to its completion, so both runs are a little
slower than in benchmarks/sampler.py, which stays the source of ``cb_speedup``. Each side gets
one untimed warm-up pass, then ``--rounds`` interleaved rounds.

Figures (medians over the rounds, ``<name>_spread`` [min, max]):
* cb_speedup: static / continuous seconds of these timed-call runs.
* cb_speedup_ideal (estimate): static seconds over those of an ideal continuous scheduler: one
  that computes only the useful tokens, every one in a call with all 32 slots live, each at the
  per-row-step cost of this run's own all-live decode calls, plus this run's prefill seconds.
  No first-come-first-served scheduler of unknown lengths decodes fewer row-steps or fuller
  calls, so this bounds what ``cb_speedup`` can reach here.
* of_ideal: ideal continuous seconds / measured continuous seconds (1: no scheduling loss).
* full_row_step_us: that per-row-step cost; drain_s: continuous decode seconds in chunks with
  fewer than half of the slots live; prefill_calls and decode_calls of each schedule.
Floor check: a continuous run faster than its ideal by more than 5% is a broken measurement
(``"valid": false``, exit 1).
Last line: one JSON object (``figures.emit``).
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from meshrl.benchmarks.figures import MIN_ROUNDS, Floors, emit, interleave, paired_ratios, spread
from meshrl.benchmarks.sampler import CFG, PROMPT, SLOTS, _chunks, _long_tail
from meshrl.configs.schema import MeshConfig, SamplerConfig
from meshrl.inference.sampler import Request, Sampler
from meshrl.mesh import create_mesh
from meshrl.models import create_model, split_model

CHUNK = 16  # benchmarks/sampler.py's decode_chunk


class TimedCalls:
    """Wraps a sampler's decode and prefill programs to time each call to completion; records
    (kind, rows, live rows, live slots of the chunk, seconds) per call (a chunk may split its
    live slots over several decode calls)."""

    def __init__(self, sampler: Sampler):
        self.calls: list[tuple[str, int, int, int, float]] = []
        self.chunk_live = 0
        decode, prefill, dispatch = sampler._decode, sampler._prefill, sampler._dispatch_chunk

        def timed_decode(*args, **kw):
            slots_R = np.asarray(args[3])
            return self._time("decode", len(slots_R), int(np.sum(slots_R < SLOTS)), decode,
                              args, kw)

        def timed_prefill(*args, **kw):
            return self._time("prefill", 0, 0, prefill, args, kw)

        def chunk(rnd, live):
            self.chunk_live = len(live)
            return dispatch(rnd, live)

        sampler._decode, sampler._prefill = timed_decode, timed_prefill
        sampler._dispatch_chunk = chunk

    def _time(self, kind: str, rows: int, live: int, fn, args, kw):
        t = time.perf_counter()
        out = jax.block_until_ready(fn(*args, **kw))
        self.calls.append((kind, rows, live, self.chunk_live, time.perf_counter() - t))
        return out


class Side:
    """One schedule of the workload: ``generate`` per batch; keeps each run's calls and useful
    tokens."""

    def __init__(self, sampler: Sampler, timer: TimedCalls, batches: list[list[Request]]):
        self.sampler, self.timer, self.batches = sampler, timer, batches
        self.runs: list[tuple[int, list]] = []

    def __call__(self) -> float:
        self.timer.calls.clear()
        t = time.perf_counter()
        outs = [c for b in self.batches for c in self.sampler.generate(b, longest_first=False)]
        dt = time.perf_counter() - t
        self.runs.append((sum(len(c.tokens) for c in outs), list(self.timer.calls)))
        return dt


def ideal_seconds(useful: int, calls: list) -> tuple[float, float, float]:
    """(ideal continuous seconds, per-row-step seconds of the all-live decode calls, drain
    seconds) of one continuous run (module docstring)."""
    full = [c for c in calls if c[0] == "decode" and c[1] == c[2] == SLOTS]
    if not full:
        raise RuntimeError("the continuous run made no decode call with every slot live")
    per_row_step = sum(c[4] for c in full) / (len(full) * SLOTS * CHUNK)
    prefill = sum(c[4] for c in calls if c[0] == "prefill")
    drain = sum(c[4] for c in calls if c[0] == "decode" and c[3] < SLOTS // 2)
    return useful * per_row_step + prefill, per_row_step, drain


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
    cont = Side(sampler, timer, [tail.by_stop])
    static = Side(sampler, timer, _chunks(tail.by_stop, SLOTS))
    secs = interleave({"continuous, first come first served": cont,
                       "static, arrival order": static}, args.rounds)
    cont_s, static_s = secs.values()
    floors = Floors()
    ideal, per_step, drain = zip(*(ideal_seconds(n, calls) for n, calls in cont.runs[1:]))
    for i, (c, best) in enumerate(zip(cont_s, ideal, strict=True)):
        if c < 0.95 * best:
            floors.problems.append(f"round {i}: continuous {c:.3f} s is faster than its ideal "
                                   f"{best:.3f} s")
    _, cont_calls = cont.runs[-1]
    _, static_calls = static.runs[-1]
    emit({"benchmark": "cb_bound",
          **spread("cb_speedup", paired_ratios(static_s, cont_s), 3),
          **spread("cb_speedup_ideal", paired_ratios(static_s, ideal), 3),
          **spread("of_ideal", paired_ratios(ideal, cont_s), 3),
          **spread("full_row_step_us", [p * 1e6 for p in per_step], 1),
          **spread("drain_s", drain, 3),
          "useful_tokens": sum(tail.lengths), "requests": n_requests,
          "decode_calls": {"continuous": sum(c[0] == "decode" for c in cont_calls),
                           "static": sum(c[0] == "decode" for c in static_calls)},
          "prefill_calls": {"continuous": sum(c[0] == "prefill" for c in cont_calls),
                            "static": sum(c[0] == "prefill" for c in static_calls)},
          "rounds": args.rounds, "quick": args.quick, "platform": jax.devices()[0].platform},
         floors)


if __name__ == "__main__":
    main()
