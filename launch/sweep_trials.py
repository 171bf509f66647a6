"""What a sweep's launchers and its report share: the trials, their names, command lines, log
and summary. The sweep modules import this one; it imports none of them back.

A trial ``t`` of a sweep in workdir ``W`` runs ``<python> main.py --config CONFIG --workdir
W/<t> --config.<k>=<v> ...``, logs to ``W/<t>/sweep.log`` and is finished when
``W/<t>/summary.json`` holds a whole JSON object.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import pathlib
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from meshrl.launch.sweep_hyper import Overrides

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAIN = ROOT / "main.py"
SUMMARY = "summary.json"
LOG = "sweep.log"
_MAX_NAME = 150  # well under the 255 bytes a file name may have


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
    label = {k: s if shorts.count(s) == 1 else k for k, s in zip(keys, shorts)}
    names = [_safe(",".join(f"{label[k]}={_name_value(v)}" for k, v in t.items()) or "base")
             for t in trials]
    clashes = {n for n in names if names.count(n) > 1}
    return [f"{n}-{hashlib.sha1(repr(sorted(t.items())).encode()).hexdigest()[:8]}"
            if n in clashes else n for n, t in zip(names, trials)]


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


def log_tail(path: pathlib.Path, lines: int = 8) -> list[str]:
    """The last non-empty ``lines`` of ``path`` (none when it does not exist)."""
    if not path.is_file():
        return []
    with open(path, errors="replace") as f:
        tail = collections.deque((ln.rstrip() for ln in f if ln.strip()), maxlen=lines)
    return list(tail)
