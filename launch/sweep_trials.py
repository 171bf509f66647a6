"""What a sweep's launchers and its report share: the trials, their names, command lines, log
and summary. The sweep modules import this one; it imports none of them back.

A trial ``t`` of a sweep in workdir ``W`` runs ``<python> main.py --config CONFIG --workdir
W/<t> --config.<k>=<v> ...``, logs to ``W/<t>/sweep.log`` and is finished when
``W/<t>/summary.json`` holds a whole JSON object and its last exit code (``W/<t>/sweep_exit.json``)
was 0.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import json
import pathlib
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from meshrl.launch.sweep_hyper import Overrides
from meshrl.utils import paths

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAIN = ROOT / "main.py"
SUMMARY = "summary.json"
LOG = "sweep.log"
SETTINGS = "sweep_settings.json"  # the config and overrides the trial last started with
EXIT = "sweep_exit.json"  # the trial's last exit code
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


def _plain(value: Any) -> Any:
    """A float subclass (numpy's float64 from ``np.logspace``) as a float: its ``repr`` is
    ``np.float64(0.001)``, which no override parses."""
    return float(value) if isinstance(value, float) else value


def format_value(value: Any) -> str:
    """``value`` as ``--config.k=<this>`` takes it (floats round-trip through ``repr``)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return repr(float(value))
    if isinstance(value, (list, tuple)):
        return repr(tuple(_plain(v) for v in value))
    return str(value)


def _safe(name: str) -> str:
    digest = hashlib.sha1(name.encode()).hexdigest()[:8]
    safe = re.sub(r"[^A-Za-z0-9._,=+-]", "_", name)
    if len(safe) > _MAX_NAME:
        safe = f"{safe[:_MAX_NAME - 9]}-{digest}"
    return safe


def _name_value(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "+".join(format_value(v) for v in value)
    return format_value(value)


@functools.cache
def _field_owners() -> dict[str, str]:
    """Field name -> the dotted key of the first schema section that has it."""
    from meshrl.configs.schema import SECTIONS

    owners: dict[str, str] = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            owners.setdefault(f.name, f"{section}.{f.name}")
    return owners


def _label(key: str) -> str:
    """The field name, unless an earlier schema section owns it (``trainer.seed`` is ``seed``,
    ``lora.seed`` is ``lora.seed``): from the schema alone, so a trial's name never depends on
    the other trials of its sweep."""
    short = key.rsplit(".", 1)[-1]
    return short if _field_owners().get(short, key) == key else key


def trial_name(overrides: Overrides) -> str:
    """``label=value,...`` (``_label``); ``base`` for no overrides. A name with characters a
    file name should not have gets them replaced and a digest of the whole name, so two
    trials never share a directory and a trial's name depends on its overrides alone."""
    name = ",".join(f"{_label(k)}={_name_value(v)}" for k, v in overrides.items()) or "base"
    safe = _safe(name)
    if safe != name and len(name) <= _MAX_NAME:  # _safe digests a name it shortens itself
        safe = f"{safe}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"
    return safe


def trial_names(trials: Sequence[Overrides]) -> list[str]:
    return [trial_name(t) for t in trials]


def override_args(overrides: Mapping[str, Any]) -> list[str]:
    return [f"--config.{k}={format_value(v)}" for k, v in overrides.items()]


def trial_args(spec: Sweep, trial: Trial, workdir: pathlib.Path) -> list[str]:
    """``main.py``'s arguments for ``trial`` (the interpreter and main.py not included)."""
    return ["--config", spec.config, "--workdir", str(workdir / trial.name),
            *override_args(spec.fixed), *override_args(trial.overrides)]


def trial_command(spec: Sweep, trial: Trial, workdir: pathlib.Path) -> list[str]:
    return [sys.executable, str(MAIN), *trial_args(spec, trial, workdir)]


def trial_settings(spec: Sweep, trial: Trial) -> dict[str, Any]:
    """What makes the trial's run: the config and every override (the sweep's fixed ones too)."""
    return {"config": spec.config,
            "overrides": [*override_args(spec.fixed), *override_args(trial.overrides)]}


def record_settings(spec: Sweep, trial: Trial, workdir: pathlib.Path) -> None:
    paths.write_text_atomic(paths.as_path(workdir / trial.name / SETTINGS),
                            json.dumps(trial_settings(spec, trial), indent=1))


def settings_change(spec: Sweep, trial: Trial, workdir: pathlib.Path) -> str | None:
    """How the trial's recorded settings differ from the sweep's now (None: they do not, or
    none were recorded)."""
    try:
        old = json.loads((workdir / trial.name / SETTINGS).read_text())
    except (OSError, ValueError):
        return None
    new = trial_settings(spec, trial)
    # Main.py applies overrides of distinct keys in any order alike.
    if old.get("config") == new["config"] and sorted(old.get("overrides", [])) == sorted(
            new["overrides"]):
        return None
    if old.get("config") != new["config"]:
        return f"config {old.get('config')!r} -> {new['config']!r}"
    gone = [a for a in old.get("overrides", []) if a not in new["overrides"]]
    added = [a for a in new["overrides"] if a not in old.get("overrides", [])]
    return f"overrides {' '.join(gone) or '(none)'} -> {' '.join(added) or '(none)'}"


def read_summary(workdir: pathlib.Path, trial: Trial) -> dict[str, Any] | None:
    """The trial's summary.json; None when it is absent or not a whole JSON object."""
    try:
        summary = json.loads((workdir / trial.name / SUMMARY).read_text())
    except (OSError, ValueError):  # absent, or cut short
        return None
    return summary if isinstance(summary, dict) else None


def record_exit(workdir: pathlib.Path, trial: Trial, code: int | None) -> None:
    """The trial's last exit code, None while it runs (``EXIT``)."""
    paths.write_text_atomic(paths.as_path(workdir / trial.name / EXIT),
                            json.dumps({"exit_code": code}))


def exit_code(workdir: pathlib.Path, trial: Trial) -> int | None:
    """The trial's recorded exit code; 0 when none was recorded (a directory no launcher of
    this version started), None while it runs or when its launcher died with it."""
    try:
        return json.loads((workdir / trial.name / EXIT).read_text())["exit_code"]
    except FileNotFoundError:
        return 0
    except (OSError, ValueError, KeyError, TypeError):
        return None


def is_finished(workdir: pathlib.Path, trial: Trial) -> bool:
    """A whole ``summary.json`` and exit code 0: a trial that wrote its summary and then
    crashed is not finished."""
    return read_summary(workdir, trial) is not None and exit_code(workdir, trial) == 0


def log_tail(path: pathlib.Path, lines: int = 8) -> list[str]:
    """The last non-empty ``lines`` of ``path`` (none when it does not exist)."""
    if not path.is_file():
        return []
    with open(path, errors="replace") as f:
        tail = collections.deque((ln.rstrip() for ln in f if ln.strip()), maxlen=lines)
    return list(tail)
