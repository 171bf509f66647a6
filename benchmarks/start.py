"""Time to the first RL step of the default job, with an empty and with a warm compilation cache.

Each pair runs ``main.py --config configs/default.py`` twice in fresh workdirs: once with a
fresh, empty ``runtime.compile_cache_dir`` (cold) and once with a cache that an untimed priming
run filled before the first pair (warm). The baseline is the cold run: what the same command
costs without the cache. Which run goes first alternates from pair to pair, so neither side
always runs on a machine the other has just warmed (page cache, CPU clocks). A run is timed from its launch to the console line of RL step 1 (the warm start, the
eval before RL and the first step are all inside; a run always logs its first step), then
stopped. The job runs as configured (``trainer.log_every = 10``; logging every step would add
metric writes to each of the warm start's 500 steps).

``--resume`` times a restart instead: a first run (empty cache) is stopped after RL step 110
(its checkpoint of step 100 is written, its cache warm), and two copies of its workdir resume,
one with an empty cache and one with the warm one (in alternating order), each timed to the line of the first step it
trains (101). That is what a second run of the README's command does after an interrupted
first one, so ``ratio_vs_first_run`` also compares the warm restart with the first run's time
to its step 1.

  python benchmarks/start.py              # 3 pairs
  python benchmarks/start.py --resume     # 3 pairs of restarts

Last line: {"benchmark": "start", "scenario", "cold_first_step_s", "warm_first_step_s"
(medians, each with ``_spread``), "ratio" (median of the pairs' cold / warm, with
``ratio_spread``), "first_run_first_step_s" (median time to RL step 1 of the run from an empty
cache in a fresh workdir: the cold run itself without ``--resume``), "ratio_vs_first_run",
"cold_runs", "warm_runs"}. Target: ratio >= 2 for a fresh workdir. The figure this replaces
ran the cold run first in every pair and divided the median cold by the median warm run.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from meshrl.benchmarks.figures import MIN_ROUNDS, emit, paired_ratios, spread

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHECKPOINT = 100  # configs/default.py's checkpoint.every_steps
LOG_EVERY = 10  # and its trainer.log_every: the first step line after the checkpoint


def step_lines_s(workdir: pathlib.Path, cache: pathlib.Path, timeout_s: float,
                 steps: tuple[int, ...] = (1,)) -> list[float]:
    """Seconds from launching the default job to its line of each RL step in ``steps``
    (ascending); the job is stopped after the last."""
    cmd = [sys.executable, str(ROOT / "main.py"), "--config", str(ROOT / "configs/default.py"),
           "--workdir", str(workdir), f"--config.runtime.compile_cache_dir={cache}",
           "--config.logging.progress_bar=false"]
    lines_re = [re.compile(rf"\bversion {step}/\d+ ") for step in steps]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=ROOT)
    lines: list[str] = []
    seen: list[float] = []
    try:
        assert proc.stdout is not None
        for out in proc.stdout:
            lines.append(out)
            if lines_re[len(seen)].search(out):
                seen.append(time.perf_counter() - t0)
                if len(seen) == len(steps):
                    return seen
            if time.perf_counter() - t0 > timeout_s:
                break
        raise RuntimeError(f"no RL step-{steps[len(seen)]} line; the job printed:\n"
                           + "".join(lines[-30:]))
    finally:
        proc.kill()
        proc.wait()


def _ordered(cold: Callable[[], float], warm: Callable[[], float], cold_first: bool
             ) -> tuple[float, float]:
    if cold_first:
        c = cold()
        return c, warm()
    w = warm()
    return cold(), w


def fresh_pair(base: pathlib.Path, warm_cache: pathlib.Path, timeout_s: float,
               cold_first: bool) -> tuple[float, float, float]:
    c, w = _ordered(lambda: step_lines_s(base / "cold", base / "empty", timeout_s)[0],
                    lambda: step_lines_s(base / "warm", warm_cache, timeout_s)[0], cold_first)
    return c, w, c


def resume_pair(base: pathlib.Path, _warm_cache: pathlib.Path, timeout_s: float,
                cold_first: bool) -> tuple[float, float, float]:
    """A first run (empty cache) stopped once its checkpoint of step 100 is written, resumed
    twice from copies; also returns that first run's time to its step 1."""
    first, _ = step_lines_s(base / "run", base / "cache", timeout_s,
                            steps=(1, CHECKPOINT + LOG_EVERY))
    for name in ("cold", "warm"):
        shutil.copytree(base / "run", base / name)
    step = (CHECKPOINT + 1,)
    c, w = _ordered(lambda: step_lines_s(base / "cold", base / "empty", timeout_s, step)[0],
                    lambda: step_lines_s(base / "warm", base / "cache", timeout_s, step)[0],
                    cold_first)
    return c, w, first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=MIN_ROUNDS,
                    help=f"cold/warm pairs, interleaved (>= {MIN_ROUNDS})")
    ap.add_argument("--resume", action="store_true", help="time restarts from a checkpoint")
    ap.add_argument("--timeout_s", type=float, default=300.0)
    args = ap.parse_args()
    if args.pairs < MIN_ROUNDS:
        ap.error(f"--pairs {args.pairs}: must be >= {MIN_ROUNDS} (the headline is a median)")
    pair = resume_pair if args.resume else fresh_pair
    cold, warm, first = [], [], []
    with tempfile.TemporaryDirectory() as shared:
        warm_cache = pathlib.Path(shared) / "cache"
        if not args.resume:  # untimed: fills the cache every warm run starts from
            step_lines_s(pathlib.Path(shared) / "prime", warm_cache, args.timeout_s)
        for i in range(args.pairs):
            with tempfile.TemporaryDirectory() as tmp:
                c, w, f = pair(pathlib.Path(tmp), warm_cache, args.timeout_s, i % 2 == 0)
            cold.append(c)
            warm.append(w)
            first.append(f)
            print(f"pair {i} ({'cold' if i % 2 == 0 else 'warm'} first): cold {c:.2f}s  "
                  f"warm {w:.2f}s  first run {f:.2f}s", flush=True)
    emit({"benchmark": "start", "scenario": "resume" if args.resume else "fresh",
          **spread("cold_first_step_s", cold, 2), **spread("warm_first_step_s", warm, 2),
          **spread("ratio", paired_ratios(cold, warm), 3),
          "first_run_first_step_s": round(statistics.median(first), 2),
          **spread("ratio_vs_first_run", paired_ratios(first, warm), 3),
          "cold_runs": [round(x, 2) for x in cold], "warm_runs": [round(x, 2) for x in warm]})


if __name__ == "__main__":
    main()
