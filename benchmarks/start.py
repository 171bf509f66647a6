"""Time to the first RL step of the default job, with an empty and with a warm compilation cache.

Each pair runs ``main.py --config configs/default.py`` twice in fresh workdirs: first with a
fresh, empty ``runtime.compile_cache_dir`` (cold), then with the directory that run filled
(warm). A run is timed from its launch to the console line of RL step 1 (the warm start, the
eval before RL and the first step are all inside; a run always logs its first step), then
stopped. The job runs as configured (``trainer.log_every = 10``; logging every step would add
~1 s of metric writes to the warm start's 500 steps). Pairs are interleaved, so a slow stretch
of the machine hits both kinds of run.

``--resume`` times a restart instead: a first run (empty cache) is stopped after RL step 110
(its checkpoint of step 100 is written, its cache warm), and two copies of its workdir resume,
one with an empty cache and one with the warm one, each timed to the line of the first step it
trains (101). That is what a second run of the README's command does after an interrupted
first one, so ``ratio_vs_first_run`` also compares the warm restart with the first run's time
to its step 1.

  python benchmarks/start.py              # 3 pairs, ~3 minutes on 2 CPU cores
  python benchmarks/start.py --resume     # 3 pairs of restarts, ~5 minutes

Last line: {"benchmark": "start", "scenario", "cold_first_step_s", "warm_first_step_s",
"ratio" (median cold / median warm), "first_run_first_step_s" (median time to RL step 1 of
the run from an empty cache in a fresh workdir: the cold run itself without ``--resume``),
"ratio_vs_first_run", "cold_runs", "warm_runs"}. Issue 22 asks ratio >= 2 for a fresh workdir.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

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


def fresh_pair(base: pathlib.Path, timeout_s: float) -> tuple[float, float, float]:
    cache = base / "cache"
    cold = step_lines_s(base / "cold", cache, timeout_s)[0]
    return cold, step_lines_s(base / "warm", cache, timeout_s)[0], cold


def resume_pair(base: pathlib.Path, timeout_s: float) -> tuple[float, float, float]:
    """A first run (empty cache) stopped once its checkpoint of step 100 is written, resumed
    twice from copies; also returns that first run's time to its step 1."""
    first, _ = step_lines_s(base / "run", base / "cache", timeout_s,
                            steps=(1, CHECKPOINT + LOG_EVERY))
    for name in ("cold", "warm"):
        shutil.copytree(base / "run", base / name)
    return (step_lines_s(base / "cold", base / "empty", timeout_s, (CHECKPOINT + 1,))[0],
            step_lines_s(base / "warm", base / "cache", timeout_s, (CHECKPOINT + 1,))[0], first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3, help="cold/warm pairs, interleaved")
    ap.add_argument("--resume", action="store_true", help="time restarts from a checkpoint")
    ap.add_argument("--timeout_s", type=float, default=300.0)
    args = ap.parse_args()
    pair = resume_pair if args.resume else fresh_pair
    cold, warm, first = [], [], []
    for i in range(args.pairs):
        with tempfile.TemporaryDirectory() as tmp:
            c, w, f = pair(pathlib.Path(tmp), args.timeout_s)
        cold.append(c)
        warm.append(w)
        first.append(f)
        print(f"pair {i}: cold {c:.2f}s  warm {w:.2f}s  first run {f:.2f}s", flush=True)
    c, w, f = statistics.median(cold), statistics.median(warm), statistics.median(first)
    print(json.dumps({"benchmark": "start", "scenario": "resume" if args.resume else "fresh",
                      "cold_first_step_s": round(c, 2),
                      "warm_first_step_s": round(w, 2), "ratio": round(c / w, 3),
                      "first_run_first_step_s": round(f, 2),
                      "ratio_vs_first_run": round(f / w, 3),
                      "cold_runs": [round(x, 2) for x in cold],
                      "warm_runs": [round(x, 2) for x in warm]}))


if __name__ == "__main__":
    main()
