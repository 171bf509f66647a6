"""Loading and checking a sweep: a sweep file, or a config file that defines its own sweep.

A file defines its trials with one of

* ``sweep()``: a sweep file; ``CONFIG = "configs/default.py:smoke"`` names the base config;
* ``get_sweep(hyper)`` (big_vision) or ``get_hyper(hyper)`` (scenic): ``hyper`` is
  ``meshrl.launch.sweep_hyper`` (``sweep``, ``fixed``, ``product``, ``zipit``). Without
  ``CONFIG`` the file is the base config itself: it defines ``get_config(arg)`` and the sweep
  runs ``main.py --config <file>[:<arg>]``.

Each returns a non-empty list of override dicts. An optional ``FIXED`` dict holds overrides
every trial gets (not in the trial names); keys may carry the ``config.`` prefix. Every trial's
config is parsed and validated as ``main.py`` would (keys, value types, schema rules; the job
must write a ``summary.json``: sft, rl or dpo) before anything runs; any mistake, an exception
raised by the file included, is one ``SweepError`` naming the file and the rule.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from meshrl.configs.overrides import check_config_file, check_override_keys, config_from_argv
from meshrl.launch import sweep_hyper
from meshrl.launch.sweep_hyper import SweepError
from meshrl.launch.sweep_trials import ROOT, Sweep, Trial, override_args, trial_names

_SCALARS = (bool, int, float, str)
SWEEP_FUNCTIONS = ("sweep", "get_sweep", "get_hyper")
SWEEP_JOBS = ("sft", "rl", "dpo")  # the jobs that write summary.json
FORMS = ("a sweep file sets CONFIG = 'configs/<file>.py[:variant]' and defines sweep(); a config "
         "file defines get_config(arg) and get_sweep(hyper) or get_hyper(hyper); each returns "
         "a list of override dicts")


def _raised(path: pathlib.Path, e: BaseException) -> str:
    """``ValueError at s.py:5: bad`` -- where in ``path`` the exception came from."""
    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__)
             if pathlib.Path(f.filename).resolve() == path.resolve()]
    where = f" at {path.name}:{lines[-1]}" if lines else ""
    return f"{type(e).__name__}{where}: {e}"


def _import(path: pathlib.Path) -> Any:
    if not path.is_file():
        raise SweepError(f"{path}: no such sweep file: {FORMS}")
    spec = importlib.util.spec_from_file_location(f"_meshrl_sweep_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise SweepError(f"{path}: cannot be imported: give a Python sweep or config file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SweepError as e:  # a helper rejected its arguments at import
        raise SweepError(f"{path}: {e}") from None
    except Exception as e:  # the user's file: one line, not a traceback
        raise SweepError(f"{path}: importing it raised {_raised(path, e)}") from None
    return module


def _resolve_config(path: pathlib.Path, config: Any) -> str:
    if not isinstance(config, str) or not config:
        raise SweepError(f"{path}: CONFIG = {config!r}: must be a config file name such as "
                         f"'configs/default.py:smoke'")
    file, sep, arg = config.partition(":")
    if not os.path.isfile(file) and (ROOT / file).is_file():
        file = str(ROOT / file)
    resolved = f"{os.path.abspath(file)}{sep}{arg}"
    try:
        problem = check_config_file(["--config", resolved])
    except Exception as e:  # the config file's own code: one line, not a traceback
        problem = f"loading it raised {_raised(pathlib.Path(file), e)}"
    if problem:
        raise SweepError(f"{path}: CONFIG = {config!r}: {problem}")
    return resolved


def _config_of(path: pathlib.Path, module: Any, sep: str, arg: str) -> str:
    """The ``--config`` value: ``CONFIG``, else the file itself when it is a config file."""
    if hasattr(module, "CONFIG"):
        if sep:
            raise SweepError(f"{path}{sep}{arg}: a sweep file with CONFIG takes no ':{arg}': "
                             f"put the variant in CONFIG")
        return _resolve_config(path, module.CONFIG)
    if not callable(getattr(module, "get_config", None)):
        raise SweepError(f"{path}: defines no CONFIG and no get_config: {FORMS}")
    return _resolve_config(path, f"{path}{sep}{arg}")


def _sweep_function(path: pathlib.Path, module: Any) -> tuple[str, Callable[..., Any]]:
    # ``from meshrl.launch.sweep import sweep`` brings the vocabulary's sweep, no sweep file's.
    found = [n for n in SWEEP_FUNCTIONS if hasattr(module, n)
             and getattr(module, n) is not sweep_hyper.sweep]
    if len(found) != 1:
        what = f"defines {' and '.join(found)}" if found else "defines no sweep function"
        raise SweepError(f"{path}: {what}: define one; {FORMS}")
    name = found[0]
    if not callable(getattr(module, name)):
        raise SweepError(f"{path}: {name} is not a function: {FORMS}")
    return name, getattr(module, name)


def _call(path: pathlib.Path, name: str, function: Callable[..., Any]) -> list[Any]:
    call = "sweep()" if name == "sweep" else f"{name}(hyper)"
    try:
        overrides = function() if name == "sweep" else function(sweep_hyper)
    except SweepError as e:
        raise SweepError(f"{path}: {call}: {e}") from None
    except Exception as e:  # the user's function: one line, not a traceback
        raise SweepError(f"{path}: {call} raised {_raised(path, e)}") from None
    if not isinstance(overrides, list) or not overrides:
        raise SweepError(f"{path}: {call} returned {type(overrides).__name__} "
                         f"{overrides!r:.80}: it must return a non-empty list of dicts")
    return [_keys(f"{path}: {call} item {i}", o) for i, o in enumerate(overrides)]


def _keys(where: str, overrides: Any) -> dict[str, Any]:
    """``overrides`` with ``config.section.field`` keys as ``section.field``."""
    if not isinstance(overrides, Mapping) or not all(isinstance(k, str) for k in overrides):
        raise SweepError(f"{where}: {overrides!r:.80} is not a dict of 'section.field' "
                         f"overrides")
    out = {sweep_hyper.key_name(k): v for k, v in overrides.items()}
    if len(out) < len(overrides):
        raise SweepError(f"{where}: {overrides!r:.80} names a key twice (with and without "
                         f"'config.')")
    return out


def _check_runs(where: str, config: str, overrides: Mapping[str, Any]) -> None:
    """The trial's config as ``main.py`` parses and validates it: a value of the wrong type or
    out of range fails here, before any trial starts; so does a job that writes no
    ``summary.json`` (the mark of a finished trial)."""
    try:
        job = config_from_argv(["--config", config, *override_args(overrides)]).job
    except ValueError as e:
        raise SweepError(f"{where}: {' '.join(str(e).split())}") from None
    if job.value not in SWEEP_JOBS:
        raise SweepError(f"{where}: job = {job.value!r}: a sweep runs {', '.join(SWEEP_JOBS)} "
                         f"(their summary.json marks a trial finished)")


def _check_overrides(where: str, overrides: Mapping[str, Any]) -> None:
    for key, value in overrides.items():
        if not (isinstance(value, _SCALARS) or (isinstance(value, (list, tuple)) and all(
                isinstance(v, _SCALARS) for v in value))):
            raise SweepError(f"{where}: {key} = {value!r}: values must be a bool, int, float, "
                             f"str or a list of them")
        problem = check_override_keys([f"--config.{key}=x"])
        if problem:
            raise SweepError(f"{where}: {problem}")


def load_sweep(file: str | pathlib.Path) -> Sweep:
    """Import the sweep or config file (``path[:arg]``, the arg for a config file's
    ``get_config``), build its trials and check each one's config; raises ``SweepError``."""
    name, sep, arg = str(file).partition(":")
    path = pathlib.Path(name)
    module = _import(path)
    function_name, function = _sweep_function(path, module)
    config = _config_of(path, module, sep, arg)
    fixed = _keys(f"{path}: FIXED", getattr(module, "FIXED", {}))
    _check_overrides(f"{path}: FIXED", fixed)
    overrides = _call(path, function_name, function)
    names = trial_names(overrides)
    for i, (trial, o) in enumerate(zip(names, overrides)):
        _check_overrides(f"{path}: trial {trial}", o)
        if o in overrides[:i] or trial in names[:i]:
            raise SweepError(f"{path}: trial {trial}: the same overrides as an earlier trial")
        both = sorted(set(o) & set(fixed))
        if both:
            raise SweepError(f"{path}: trial {trial}: key {both[0]!r} is in FIXED too")
        _check_runs(f"{path}: trial {trial}", config, {**fixed, **o})
    return Sweep(path, config, dict(fixed), [Trial(n, dict(o)) for n, o in zip(names, overrides)])
