"""ConfigDict <-> typed ``Config``.

Config files start from ``base_config()`` (every field at its schema default, so command-line
overrides of any field type-check) and set what they change. ``from_config_dict`` is the only
way to a ``Config``: it rejects unknown keys with the closest valid key and validates values,
each section and the rules across sections (``cross_section.py``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
from collections.abc import Mapping
from typing import Any

import ml_collections

from meshrl.configs.fields import ConfigError, unknown_key_error
from meshrl.configs.renames import rename_values
from meshrl.configs.schema import SECTIONS, Config, Job


def base_config(job: Job | str = Job.SFT) -> ml_collections.ConfigDict:
    """A ConfigDict holding every schema field at its default; config files edit it."""
    cfg = ml_collections.ConfigDict()
    cfg.job = Job(job).value
    for name, cls in SECTIONS.items():
        cfg[name] = ml_collections.ConfigDict(dataclasses.asdict(cls()))
    if cfg.job in ("sft", "rl"):  # --config.job=compile then compiles this file's own job
        cfg.compile.job = cfg.job
    return cfg


def from_config_dict(cfg: ml_collections.ConfigDict | dict[str, Any]) -> Config:
    """Validate ``cfg`` against the schema and return the frozen ``Config``; any broken rule
    that needs only the config (cross-section ones included) raises ``ConfigError``."""
    values = rename_values(cfg.to_dict() if isinstance(cfg, ml_collections.ConfigDict)
                           else dict(cfg))
    top = ["job", *SECTIONS]
    for key in values:
        if key not in top:
            raise unknown_key_error("", key, top)
    if "job" not in values:
        raise ConfigError(f"job: required, one of {[j.value for j in Job]}")
    try:
        job = Job(values["job"])
    except ValueError:
        raise ConfigError(f"job = {values['job']!r}: must be one of "
                          f"{[j.value for j in Job]}") from None
    sections = {}
    for name, cls in SECTIONS.items():
        section = values.get(name, {})
        if not isinstance(section, dict):
            raise ConfigError(f"{name} = {section!r}: must be a section (a dict of fields)")
        sections[name] = cls.from_mapping(section)
    config = Config(job=job, **sections)
    if config.distill.enabled and job != Job.RL:
        # Checked here, for the config a user wrote: the SFT warm-start configs the RL job
        # derives keep the section.
        d = config.distill
        what = f"distill.teacher = {d.teacher!r}" if d.teacher else (
            f"distill.teacher_steps = {d.teacher_steps}")
        raise ConfigError(f"{what}: only job = rl distils (job = {job.value}): clear distill.* "
                          f"or set job = rl")
    return config


def render(config: Config, *, replace: Mapping[str, Any] | None = None,
           notes: Mapping[str, str] | None = None) -> str:
    """One ``section.field = value`` line per field, as a user would type an override.

    ``replace`` swaps whole sections for the values a run uses instead (the dry run's effective
    model); ``notes`` appends ``  # note`` to the line of a ``section.field``."""
    lines = [f"job = {config.job.value}"]
    values_of = {**config.to_dict(), **{k: dataclasses.asdict(v) for k, v in
                                        (replace or {}).items()}}
    for name, values in values_of.items():
        if name == "job":
            continue
        for key, value in values.items():
            note = (notes or {}).get(f"{name}.{key}")
            lines.append(f"{name}.{key} = {value!r}" + (f"  # {note}" if note else ""))
    return "\n".join(lines)


def to_config_dict(config: Config) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(config.to_dict())


def load_config_file(path: str | pathlib.Path, arg: str | None = None) -> Config:
    """Import a ``configs/*.py`` file, call ``get_config(arg)`` and validate the result."""
    path = pathlib.Path(path)
    spec = importlib.util.spec_from_file_location(f"_meshrl_config_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"config file {str(path)!r}: cannot be imported")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return from_config_dict(module.get_config(arg))
