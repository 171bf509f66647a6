"""Hyper-parameter sweeps: one ``main.py`` run per trial, XManager style.

  python launch/sweep.py launch/sweeps/smoke_lr.py --workdir /tmp/sweep [--parallel 2]
                         [--launcher local|xmanager]
  python launch/sweep.py configs/my_config.py:variant --workdir /tmp/sweep

Contract:

* The first argument is a sweep file (``CONFIG`` and ``sweep()``) or a config file that defines
  ``get_sweep(hyper)`` or ``get_hyper(hyper)``, as big_vision and scenic config files do (see
  ``launch/sweep_load.py``). The trials are a list of override dicts (``{"trainer.seed": 0}``),
  built with ``sweep``, ``fixed``, ``product([...])`` and ``zipit([...])`` of
  ``launch/sweep_hyper.py``, which this module re-exports (``from meshrl.launch import sweep
  as hyper``).
* Every key is checked against the config schema and the config file is loaded before anything
  runs; a bad sweep exits 2 with one ``error:`` line naming the file and the rule.
* Trial ``t`` runs ``<python> main.py --config CONFIG --workdir W/<t> --config.<k>=<v> ...``;
  its name is built from its overrides alone (``learning_rate=0.001,seed=0``; the full dotted
  key where an earlier config section owns the field name, as ``lora.seed``) and is unique,
  deterministic and filesystem-safe.
* The local launcher runs at most ``--parallel`` trials at once as subprocesses, each one's
  stdout and stderr to ``W/<t>/sweep.log``. A trial is finished when ``W/<t>/summary.json``
  holds a whole JSON object (jobs write it to a temporary file and rename it into place, so a
  kill mid-write leaves none): a rerun skips finished trials and reruns the others in their
  workdirs, where ``main.py`` resumes from the newest checkpoint.
* ``--launcher xmanager`` adds the same command lines as one ``xm.Job`` each (local executor) to
  an XManager experiment; it needs ``pip install xmanager`` (not a meshrl dependency).
* At the end: ``W/results.csv`` (every trial, its overrides and every scalar of its
  summary.json), a table on stdout, ``W/sweep_curves.png`` (see ``launch/sweep_report.py``).
  The exit code is 1 when any trial is not finished, else 0.
* Ctrl-C or SIGTERM starts no more trials, stops the running ones (SIGINT: each saves the step
  it reached; SIGKILL to what is left after a grace period), writes the report and exits 130 or
  143; a rerun goes on. A finished trial whose recorded settings (``sweep_settings.json``:
  config and overrides) differ from the sweep's now is an error, not a result.
"""

from __future__ import annotations

import argparse
import pathlib
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from meshrl.launch import sweep_report, sweep_run
from meshrl.launch.sweep_hyper import (  # noqa: F401 (the vocabulary sweep files use)
    SweepError,
    fixed,
    product,
    sweep,
    zip,
    zipit,
)
from meshrl.launch.sweep_load import load_sweep
from meshrl.launch.sweep_trials import (  # noqa: F401 (the trials, for callers of this module)
    ROOT,
    SUMMARY,
    Sweep,
    Trial,
    format_value,
    is_finished,
    override_args,
    read_summary,
    trial_args,
    trial_command,
    trial_names,
)
from meshrl.utils import log as log_lib

Runner = Callable[[Sweep, Sequence[Trial], pathlib.Path, int], None]


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="launch/sweep.py", description=__doc__.split("\n")[0])
    p.add_argument("sweep_file", help="a sweep file (CONFIG and sweep()), e.g. "
                                      "launch/sweeps/smoke_lr.py, or a config file[:arg] that "
                                      "defines get_sweep(hyper) or get_hyper(hyper)")
    p.add_argument("--workdir", required=True, help="one subdirectory per trial, results.csv")
    p.add_argument("--parallel", type=int, default=1, help="trials running at once (>= 1)")
    p.add_argument("--launcher", choices=["local", "xmanager"], default="local")
    args = p.parse_args(argv)
    if args.parallel < 1:
        p.error(f"--parallel = {args.parallel}: must be >= 1")
    return args


class _Terminated(BaseException):
    """SIGTERM reached the sweep: its trials are stopped as on Ctrl-C."""


def _catch_sigterm() -> Any:
    """Turn the first SIGTERM into ``_Terminated`` (main thread only); the handler to put
    back, or None."""
    if threading.current_thread() is not threading.main_thread():
        return None
    seen: list[int] = []

    def handler(signum: int, frame: object) -> None:
        if not seen:  # a second one while the trials stop is ignored
            seen.append(signum)
            raise _Terminated()

    return signal.signal(signal.SIGTERM, handler)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweep; 0 when every trial finished, 1 when one did not, 2 on bad input, 130 or
    143 when Ctrl-C or SIGTERM stopped it (the report covers what ran)."""
    args = _parse(sys.argv[1:] if argv is None else argv)
    log_lib.setup("INFO")
    workdir = pathlib.Path(args.workdir).resolve()
    stopped, spec = 0, None
    previous = _catch_sigterm()
    try:
        spec = load_sweep(args.sweep_file)
        if args.launcher == "xmanager":
            sweep_run.require_xmanager()
        runner: Runner = (sweep_run.run_local if args.launcher == "local"
                          else sweep_run.run_xmanager)
        sweep_run.run_pending(spec, workdir, args.parallel, runner)
    except SweepError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        stopped = 130
    except _Terminated:
        stopped = 128 + signal.SIGTERM
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if spec is None:  # stopped while the sweep file loaded: nothing ran
        print("sweep stopped before any trial started", file=sys.stderr)
        return stopped
    rows = sweep_report.write_report(spec.trials, workdir)
    print(sweep_report.format_table(spec.trials, rows, workdir))
    if stopped:
        print("sweep stopped; the same command goes on where it stopped", file=sys.stderr)
        return stopped
    return 0 if all(r["status"] == "done" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
