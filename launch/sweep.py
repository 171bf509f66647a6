"""Hyper-parameter sweeps: one ``main.py`` run per trial, XManager style.

  python launch/sweep.py launch/sweeps/smoke_lr.py --workdir /tmp/sweep [--parallel 2]
                         [--launcher local|xmanager]

Contract:

* A sweep file names the base config, ``CONFIG = "configs/default.py:smoke"`` (a relative path
  is taken from the current directory, else from the repository root), and defines
  ``sweep()``, returning the trials as a list of override dicts (``{"trainer.seed": 0}``),
  built with ``sweep(name, values)``, ``product(...)`` and ``zip(...)`` from this module. An
  optional ``FIXED`` dict holds overrides every trial gets (they are not in the trial names).
* Every key is checked against the config schema and the config file is loaded before anything
  runs; a bad sweep file exits 2 with one ``error:`` line naming the file (and the trial and key).
* Trial ``t`` runs ``<python> main.py --config CONFIG --workdir W/<t> --config.<k>=<v> ...``;
  its name is built from its overrides (``learning_rate=0.001,seed=0``; the full dotted key
  where two short names clash) and is unique, deterministic and filesystem-safe.
* The local launcher runs at most ``--parallel`` trials at once as subprocesses, each one's
  stdout and stderr to ``W/<t>/sweep.log``. A trial is finished when ``W/<t>/summary.json``
  holds a whole JSON object (jobs write it to a temporary file and rename it into place, so a
  kill mid-write leaves none; one cut short by an older build does not count): a rerun skips finished trials and reruns the others in their workdirs, where
  ``main.py`` resumes from the newest checkpoint.
* ``--launcher xmanager`` adds the same command lines as one ``xm.Job`` each (local executor) to
  an XManager experiment; it needs ``pip install xmanager`` (not a meshrl dependency).
* At the end: ``W/results.csv`` (every trial, its overrides and every scalar of its
  summary.json), a table on stdout, ``W/sweep_curves.png`` (see ``launch/sweep_report.py``).
  The exit code is 1 when any trial is not finished, else 0.
"""

from __future__ import annotations

import argparse
import builtins
import dataclasses
import hashlib
import importlib.util
import itertools
import json
import os
import pathlib
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from meshrl.configs.overrides import check_config_file, check_override_keys

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAIN = ROOT / "main.py"
SUMMARY = "summary.json"
Overrides = dict[str, Any]
Launcher = Literal["local", "xmanager"]
_SCALARS = (bool, int, float, str)
_MAX_NAME = 150  # well under the 255 bytes a file name may have


class SweepError(ValueError):
    """A sweep file, or one of its trials, that cannot run; the message names the file."""


@dataclasses.dataclass(frozen=True)
class Trial:
    """One run of the sweep: its workdir name and the overrides that make it differ."""

    name: str
    overrides: Overrides


@dataclasses.dataclass(frozen=True)
class Sweep:
    """A loaded, checked sweep file."""

    path: pathlib.Path
    config: str  # the --config value, its file made absolute
    fixed: Overrides  # overrides every trial gets
    trials: list[Trial]


# --- building trials (used by sweep files) -------------------------------------------------


def sweep(name: str, values: Sequence[Any]) -> list[Overrides]:
    """``[{name: v} for v in values]``: one axis of a sweep (``name`` is ``section.field``)."""
    if not isinstance(name, str) or "." not in name:
        raise SweepError(f"sweep({name!r}, ...): the name must be a 'section.field' string")
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
        raise SweepError(f"sweep({name!r}, {values!r}): values must be a non-empty list")
    return [{name: v} for v in values]


def _merge(parts: Sequence[Overrides], how: str) -> Overrides:
    out: Overrides = {}
    for part in parts:
        twice = sorted(set(out) & set(part))
        if twice:
            raise SweepError(f"{how}: key {twice[0]!r} appears in more than one argument")
        out.update(part)
    return out


def product(*axes: Sequence[Overrides]) -> list[Overrides]:
    """Every combination of one dict from each axis (the first axis varies slowest)."""
    return [_merge(combo, "product") for combo in itertools.product(*axes)]


def zip(*axes: Sequence[Overrides]) -> list[Overrides]:  # shadows the builtin: sweep vocabulary
    """The i-th dicts of all axes merged; the axes must have one length."""
    lengths = [len(a) for a in axes]
    if len(set(lengths)) > 1:
        raise SweepError(f"zip: the arguments have different lengths {lengths}")
    return [_merge(parts, "zip") for parts in builtins.zip(*axes)]


# --- names and command lines ---------------------------------------------------------------


def format_value(value: Any) -> str:
    """``value`` as ``--config.k=<this>`` takes it (floats round-trip through ``repr``)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return repr(tuple(value))
    return str(value)


def _safe(name: str) -> str:
    name = re.sub(r"[^A-Za-z0-9._,=+-]", "_", name)
    if len(name) > _MAX_NAME:
        name = f"{name[:_MAX_NAME - 9]}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"
    return name


def _name_value(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "+".join(format_value(v) for v in value)
    return format_value(value)


def trial_names(trials: Sequence[Overrides]) -> list[str]:
    """``short=value,...`` per trial, short being the field name, or the dotted key when two
    keys of the sweep share a field name; ``base`` for no overrides. Names that still clash
    (values equal once made filesystem-safe) get a digest of their overrides."""
    keys = list(dict.fromkeys(k for t in trials for k in t))
    shorts = [k.rsplit(".", 1)[-1] for k in keys]
    label = {k: s if shorts.count(s) == 1 else k for k, s in builtins.zip(keys, shorts)}
    names = [_safe(",".join(f"{label[k]}={_name_value(v)}" for k, v in t.items()) or "base")
             for t in trials]
    clashes = {n for n in names if names.count(n) > 1}
    return [f"{n}-{hashlib.sha1(repr(sorted(t.items())).encode()).hexdigest()[:8]}"
            if n in clashes else n for n, t in builtins.zip(names, trials)]


def override_args(overrides: Mapping[str, Any]) -> list[str]:
    return [f"--config.{k}={format_value(v)}" for k, v in overrides.items()]


def trial_args(spec: Sweep, trial: Trial, workdir: pathlib.Path) -> list[str]:
    """``main.py``'s arguments for ``trial`` (the interpreter and main.py not included)."""
    return ["--config", spec.config, "--workdir", str(workdir / trial.name),
            *override_args(spec.fixed), *override_args(trial.overrides)]


def trial_command(spec: Sweep, trial: Trial, workdir: pathlib.Path) -> list[str]:
    return [sys.executable, str(MAIN), *trial_args(spec, trial, workdir)]


def read_summary(workdir: pathlib.Path, trial: Trial) -> dict[str, Any] | None:
    """The trial's summary.json; None when it is absent or not a whole JSON object."""
    try:
        summary = json.loads((workdir / trial.name / SUMMARY).read_text())
    except (OSError, ValueError):  # absent, or cut short
        return None
    return summary if isinstance(summary, dict) else None


def is_finished(workdir: pathlib.Path, trial: Trial) -> bool:
    return read_summary(workdir, trial) is not None


# --- loading and checking a sweep file -----------------------------------------------------


def _import(path: pathlib.Path) -> Any:
    if not path.is_file():
        raise SweepError(f"{path}: no such sweep file")
    spec = importlib.util.spec_from_file_location(f"_meshrl_sweep_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise SweepError(f"{path}: cannot be imported: give a Python sweep file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SweepError as e:  # a helper rejected its arguments at import
        raise SweepError(f"{path}: {e}") from None
    return module


def _resolve_config(path: pathlib.Path, config: Any) -> str:
    if not isinstance(config, str) or not config:
        raise SweepError(f"{path}: CONFIG = {config!r}: must be a config file name such as "
                         f"'configs/default.py:smoke'")
    file, sep, arg = config.partition(":")
    if not os.path.isfile(file) and (ROOT / file).is_file():
        file = str(ROOT / file)
    resolved = f"{os.path.abspath(file)}{sep}{arg}"
    problem = check_config_file(["--config", resolved])
    if problem:
        raise SweepError(f"{path}: CONFIG = {config!r}: {problem}")
    return resolved


def _check_dict(where: str, overrides: Any) -> None:
    if not isinstance(overrides, Mapping) or not all(isinstance(k, str) for k in overrides):
        raise SweepError(f"{where}: {overrides!r:.80} is not a dict of 'section.field' "
                         f"overrides")


def _check_overrides(where: str, overrides: Mapping[str, Any]) -> None:
    for key, value in overrides.items():
        if not (isinstance(value, _SCALARS) or (isinstance(value, (list, tuple)) and all(
                isinstance(v, _SCALARS) for v in value))):
            raise SweepError(f"{where}: {key} = {value!r}: values must be a bool, int, float, "
                             f"str or a list of them")
        problem = check_override_keys([f"--config.{key}=x"])
        if problem:
            raise SweepError(f"{where}: {problem}")


def load_sweep(path: str | pathlib.Path) -> Sweep:
    """Import the sweep file, build its trials and check every key; raises ``SweepError``."""
    path = pathlib.Path(path)
    module = _import(path)
    for name in ("CONFIG", "sweep"):
        if not hasattr(module, name):
            raise SweepError(f"{path}: defines no {name}: a sweep file sets CONFIG = "
                             f"'configs/<file>.py[:variant]' and defines sweep() -> list[dict]")
    config = _resolve_config(path, module.CONFIG)
    fixed = getattr(module, "FIXED", {})
    _check_dict(f"{path}: FIXED", fixed)
    _check_overrides(f"{path}: FIXED", fixed)
    if not callable(module.sweep):
        raise SweepError(f"{path}: sweep is not a function")
    try:
        overrides = module.sweep()
    except SweepError as e:
        raise SweepError(f"{path}: sweep(): {e}") from None
    if not isinstance(overrides, list) or not overrides:
        raise SweepError(f"{path}: sweep() returned {type(overrides).__name__} "
                         f"{overrides!r:.80}: it must return a non-empty list of dicts")
    for i, o in enumerate(overrides):
        _check_dict(f"{path}: sweep() item {i}", o)
    names = trial_names(overrides)
    for i, (name, o) in enumerate(builtins.zip(names, overrides)):
        _check_overrides(f"{path}: trial {name}", o)
        if o in overrides[:i]:
            raise SweepError(f"{path}: trial {name}: the same overrides as an earlier trial")
        both = sorted(set(o) & set(fixed))
        if both:
            raise SweepError(f"{path}: trial {name}: key {both[0]!r} is in FIXED too")
    return Sweep(path, config, dict(fixed), [Trial(n, dict(o)) for n, o in
                                             builtins.zip(names, overrides)])


# --- the command line ----------------------------------------------------------------------

Runner = Callable[[Sweep, Sequence[Trial], pathlib.Path, int], None]


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="launch/sweep.py", description=__doc__.split("\n")[0])
    p.add_argument("sweep_file", help="a sweep file (CONFIG and sweep()), e.g. "
                                      "launch/sweeps/smoke_lr.py")
    p.add_argument("--workdir", required=True, help="one subdirectory per trial, results.csv")
    p.add_argument("--parallel", type=int, default=1, help="trials running at once (>= 1)")
    p.add_argument("--launcher", choices=["local", "xmanager"], default="local")
    args = p.parse_args(argv)
    if args.parallel < 1:
        p.error(f"--parallel = {args.parallel}: must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweep; 0 when every trial finished, 1 when one did not, 2 on bad input."""
    from meshrl.launch import sweep_report, sweep_run
    from meshrl.utils import log as log_lib

    args = _parse(sys.argv[1:] if argv is None else argv)
    log_lib.setup("INFO")
    workdir = pathlib.Path(args.workdir).resolve()
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
    rows = sweep_report.write_report(spec.trials, workdir)
    print(sweep_report.format_table(spec.trials, rows, workdir))
    return 0 if all(r["status"] == "done" for r in rows) else 1


if __name__ == "__main__":
    # Through the package, so that this module and sweep_run share one SweepError.
    from meshrl.launch.sweep import main as _main

    sys.exit(_main())
