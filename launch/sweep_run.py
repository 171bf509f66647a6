"""Running a sweep's trials: local subprocesses, or an XManager experiment.

Both launchers start the same command line per trial (``sweep_trials.trial_command``) and leave the
verdict to the trial's workdir: a trial is finished when its ``summary.json`` exists and it
exited with 0, so a rerun of the sweep starts only the others (``main.py`` resumes them from
their checkpoints). A trial that started with other settings than the sweep gives it now is
refused, finished or not: its results, or its checkpoint, would pass for this sweep's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import pathlib
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from meshrl.launch.local import stop_groups
from meshrl.launch.sweep_hyper import SweepError
from meshrl.launch.sweep_trials import (
    LOG,
    Sweep,
    Trial,
    is_finished,
    log_tail,
    record_exit,
    record_settings,
    settings_change,
    trial_command,
)
from meshrl.utils.log import get_logger

log = get_logger("launch.sweep")
XMANAGER_MISSING = ("--launcher xmanager needs the xmanager package, which is not installed: "
                    "pip install xmanager (it is no meshrl dependency: it pins protobuf < 7); "
                    "or use --launcher local")


def run_pending(spec: Sweep, workdir: pathlib.Path, parallel: int,
                runner: Callable[[Sweep, Sequence[Trial], pathlib.Path, int], None]) -> None:
    """Run, with ``runner``, the trials of ``spec`` that are not finished. A trial whose
    recorded settings differ from the sweep's now is a ``SweepError``."""
    for t in spec.trials:
        if change := settings_change(spec, t, workdir):
            what, harm = (("finished", "its results") if is_finished(workdir, t)
                          else ("started", "resuming its checkpoint, its results"))
            raise SweepError(f"trial {t.name} {what} with other settings ({change}) than "
                             f"{spec.path} gives it now: {harm} would pass for this "
                             f"sweep's; use another --workdir, or remove {workdir / t.name}")
    todo = [t for t in spec.trials if not is_finished(workdir, t)]
    log.info("sweep %s: %d trials, %d finished, %d to run (up to %d at once) under %s",
             spec.path, len(spec.trials), len(spec.trials) - len(todo), len(todo), parallel,
             workdir)
    if todo:
        workdir.mkdir(parents=True, exist_ok=True)
        runner(spec, todo, workdir, parallel)


def _prepare(spec: Sweep, trial: Trial, workdir: pathlib.Path) -> None:
    """The trial's workdir, with the settings it starts with recorded."""
    # Private, as main.py creates a workdir: it refuses one that group or others may write,
    # which a umask of 002 would give.
    (workdir / trial.name).mkdir(mode=0o700, exist_ok=True)
    record_settings(spec, trial, workdir)
    record_exit(workdir, trial, None)


class _Running:
    """The local trials' processes, so that a stop reaches every one, and no trial starts
    after it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.procs: set[subprocess.Popen] = set()
        self.stopping = False


def _run_one(spec: Sweep, trial: Trial, workdir: pathlib.Path, running: _Running) -> int | None:
    """The trial's exit code; None when the sweep was stopped before it started."""
    tdir = workdir / trial.name
    cmd = trial_command(spec, trial, workdir)
    with running.lock:
        if running.stopping:
            return None
        _prepare(spec, trial, workdir)
        f = open(tdir / LOG, "a")  # noqa: SIM115 (closed below) appended: earlier attempts stay
        try:
            f.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} sweep: {shlex.join(cmd)}\n")
            f.flush()
            # A session of its own: a terminal's Ctrl-C reaches the sweep alone, and ``_stop``
            # signals each trial's whole process group exactly once.
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        except BaseException:
            f.close()
            raise
        running.procs.add(proc)
    t0 = time.perf_counter()
    log.info("trial %s: started", trial.name)
    try:
        rc = proc.wait()
    finally:
        f.close()
        with running.lock:
            running.procs.discard(proc)
    wall = time.perf_counter() - t0
    record_exit(workdir, trial, rc)
    if rc == 0 and is_finished(workdir, trial):
        log.info("trial %s: finished in %.0f s", trial.name, wall)
    else:
        tail = "\n  ".join(log_tail(tdir / LOG, 5))
        log.error("trial %s: failed (exit code %d) after %.0f s; the end of %s:\n  %s",
                  trial.name, rc, wall, tdir / LOG, tail)
    return rc


def _stop(running: _Running, grace_s: float) -> None:
    """Start no more trials; SIGINT to each running one (``main.py`` saves the step it reached
    and exits), SIGKILL to what is left of its process group after ``grace_s``."""
    with running.lock:
        running.stopping = True
        procs = list(running.procs)
    log.warning("sweep stopped: stopping %d running trials (each saves its step); a rerun "
                "resumes them", len(procs))
    stop_groups(procs, signal.SIGINT, grace_s)


def run_local(spec: Sweep, trials: Sequence[Trial], workdir: pathlib.Path,
              parallel: int, stop_grace_s: float = 60.0) -> None:
    """Each trial as a subprocess, at most ``parallel`` at once; a failure stops no other. An
    exception here (Ctrl-C; SIGTERM as ``sweep.main`` raises it) stops every trial
    (``_stop``) and is raised again."""
    running = _Running()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=parallel)
    try:
        for future in [pool.submit(_run_one, spec, t, workdir, running) for t in trials]:
            future.result()
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        _stop(running, stop_grace_s)
        raise
    finally:
        pool.shutdown(wait=True)


# --- XManager ------------------------------------------------------------------------------


def xmanager_jobs(spec: Sweep, trials: Sequence[Trial], workdir: pathlib.Path,
                  executable: Any = None) -> list[Any]:
    """One ``xm.Job`` per trial on the local executor: this interpreter running ``main.py``
    with the trial's arguments, named after the trial. ``executable`` is the interpreter as
    ``experiment.package([python_packageable()])`` returns it; None builds the
    ``LocalBinary`` that packaging gives for the local executor, which needs no experiment
    (to inspect the jobs without launching them)."""
    from xmanager import xm, xm_local

    if executable is None:
        from xmanager.xm_local.executables import LocalBinary

        executable = LocalBinary(name="python", command=sys.executable)
    return [xm.Job(executable=executable, executor=xm_local.Local(), name=t.name,
                   args=trial_command(spec, t, workdir)[1:]) for t in trials]


def python_packageable() -> Any:
    """This interpreter as an XManager binary for the local executor."""
    from xmanager import xm, xm_local

    return xm.binary(executor_spec=xm_local.Local.Spec(), path=sys.executable)


async def _run_experiment(spec: Sweep, trials: Sequence[Trial], workdir: pathlib.Path,
                          parallel: int) -> None:
    from xmanager import xm, xm_local

    title = f"meshrl sweep {spec.path.name} -> {workdir}"
    failed: list[str] = []
    done = False
    try:
        async with xm_local.create_experiment(experiment_title=title) as experiment:
            [executable] = experiment.package([python_packageable()])
            jobs = xmanager_jobs(spec, trials, workdir, executable)
            slots = asyncio.Semaphore(parallel)
            trial_of = {t.name: t for t in trials}

            async def one(job: Any) -> None:
                async with slots:
                    unit = await experiment.add(job)
                    log.info("trial %s: started as XManager work unit %d", job.name,
                             unit.work_unit_id)
                    try:
                        await unit.wait_until_complete()
                        record_exit(workdir, trial_of[job.name], 0)
                        log.info("trial %s: exited with code 0", job.name)
                    except xm.ExperimentUnitError as e:
                        record_exit(workdir, trial_of[job.name], 1)  # its code is not given
                        failed.append(job.name)
                        log.error("trial %s: failed: %s", job.name, e)

            await asyncio.gather(*(one(j) for j in jobs))
            done = True
    except RuntimeError:
        # Leaving the experiment re-raises the exit code of a failed job, already reported
        # above; the trials' summary.json and exit records give the verdict.
        if not (done and failed):
            raise


def require_xmanager() -> None:
    """Raise ``SweepError`` saying what to install when xmanager cannot be imported."""
    try:
        import xmanager  # noqa: F401 (only probing)
    except ImportError:
        raise SweepError(XMANAGER_MISSING) from None


def run_xmanager(spec: Sweep, trials: Sequence[Trial], workdir: pathlib.Path,
                 parallel: int) -> None:
    """The trials as one XManager experiment, at most ``parallel`` work units at once."""
    require_xmanager()
    from absl import flags

    for t in trials:
        _prepare(spec, t, workdir)

    if not flags.FLAGS.is_parsed():  # xmanager reads its absl flags; this CLI uses argparse
        flags.FLAGS.mark_as_parsed()
    asyncio.run(_run_experiment(spec, trials, workdir, parallel))
