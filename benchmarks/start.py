"""Time to the first RL step of the default job, with an empty and with a warm compilation cache.

Each pair runs ``main.py --config configs/default.py`` twice in fresh workdirs: first with a
fresh, empty ``runtime.compile_cache_dir`` (cold), then with the directory that run filled
(warm). A run is timed from its launch to the console line of RL step 1 (the warm start, the
eval before RL and the first step are all inside; a run always logs its first step), then
stopped. The job runs as configured (``trainer.log_every = 10``; logging every step would add
~1 s of metric writes to the warm start's 500 steps). Pairs are interleaved, so a slow stretch
of the machine hits both kinds of run.

``--resume`` times a restart instead: a run is stopped after RL step 110 (its checkpoint of
step 100 is written, its cache warm), and two copies of its workdir resume, one with an empty
cache and one with the warm one, each timed to the line of the first step it trains (101).

  python benchmarks/start.py              # 3 pairs, ~3 minutes on 2 CPU cores
  python benchmarks/start.py --resume     # 3 pairs of restarts, ~5 minutes

Last line: {"benchmark": "start", "scenario", "cold_first_step_s", "warm_first_step_s",
"ratio" (median cold / median warm), "cold_runs", "warm_runs"}. Issue 22 asks ratio >= 2 for
a fresh workdir.
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


def first_step_s(workdir: pathlib.Path, cache: pathlib.Path, timeout_s: float, step: int = 1
                 ) -> float:
    """Seconds from launching the default job to its line of RL step ``step``; the job is
    then stopped."""
    cmd = [sys.executable, str(ROOT / "main.py"), "--config", str(ROOT / "configs/default.py"),
           "--workdir", str(workdir), f"--config.runtime.compile_cache_dir={cache}",
           "--config.logging.progress_bar=false"]
    line = re.compile(rf"\bversion {step}/\d+ ")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=ROOT)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for out in proc.stdout:
            lines.append(out)
            if line.search(out):
                return time.perf_counter() - t0
            if time.perf_counter() - t0 > timeout_s:
                break
        raise RuntimeError(f"no RL step-{step} line; the job printed:\n" + "".join(lines[-30:]))
    finally:
        proc.kill()
        proc.wait()


def fresh_pair(base: pathlib.Path, timeout_s: float) -> tuple[float, float]:
    cache = base / "cache"
    return (first_step_s(base / "cold", cache, timeout_s),
            first_step_s(base / "warm", cache, timeout_s))


def resume_pair(base: pathlib.Path, timeout_s: float) -> tuple[float, float]:
    """A run stopped once its checkpoint of step 100 is written, resumed twice from copies."""
    first_step_s(base / "run", base / "cache", timeout_s, step=CHECKPOINT + LOG_EVERY)
    for name in ("cold", "warm"):
        shutil.copytree(base / "run", base / name)
    return (first_step_s(base / "cold", base / "empty", timeout_s, step=CHECKPOINT + 1),
            first_step_s(base / "warm", base / "cache", timeout_s, step=CHECKPOINT + 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3, help="cold/warm pairs, interleaved")
    ap.add_argument("--resume", action="store_true", help="time restarts from a checkpoint")
    ap.add_argument("--timeout_s", type=float, default=300.0)
    args = ap.parse_args()
    pair = resume_pair if args.resume else fresh_pair
    cold, warm = [], []
    for i in range(args.pairs):
        with tempfile.TemporaryDirectory() as tmp:
            c, w = pair(pathlib.Path(tmp), args.timeout_s)
        cold.append(c)
        warm.append(w)
        print(f"pair {i}: cold {c:.2f}s  warm {w:.2f}s", flush=True)
    c, w = statistics.median(cold), statistics.median(warm)
    print(json.dumps({"benchmark": "start", "scenario": "resume" if args.resume else "fresh",
                      "cold_first_step_s": round(c, 2),
                      "warm_first_step_s": round(w, 2), "ratio": round(c / w, 3),
                      "cold_runs": [round(x, 2) for x in cold],
                      "warm_runs": [round(x, 2) for x in warm]}))


if __name__ == "__main__":
    main()
