"""Renamed config keys: old names keep working for one release, each with one warning line.

``job = sample`` and the ``sample.*`` section are ``generate`` (so the job section and the
``sampler.*`` settings cannot be confused); for ``job = rl`` the SFT warm start's batch is
``rl.warm_start_batch_size`` (the RL batch is ``rollout.prompts_per_step x group_size``), not
``trainer.batch_size``. ``rename_argv`` rewrites ``--config.*`` overrides before flag parsing;
``rename_values`` rewrites a config's values before validation. CHANGELOG.md lists each rename.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from meshrl.configs.fields import ConfigError
from meshrl.utils.log import get_logger

log = get_logger("config")

JOBS = {"sample": "generate"}
SECTIONS = {"sample": "generate"}
# trainer.batch_size's default: a value other than this, with job = rl, was meant for the warm start.
_TRAINER_BATCH_DEFAULT = 8


def _warn(old: str, new: str) -> None:
    log.warning("config: %s is deprecated and will be removed in the next release: use %s",
                old, new)


def rename_argv(argv: Sequence[str], flag: str = "config") -> list[str]:
    """``argv`` with deprecated ``--config.job=`` values and ``--config.<section>.`` keys renamed."""
    out = []
    for arg in argv:
        prefix = f"--{flag}."
        if arg.startswith(f"{prefix}job=") and arg.split("=", 1)[1] in JOBS:
            old = arg.split("=", 1)[1]
            _warn(f"job = {old}", f"job = {JOBS[old]}")
            arg = f"{prefix}job={JOBS[old]}"
        elif arg.startswith(prefix) and arg[len(prefix):].split(".", 1)[0] in SECTIONS:
            section, rest = arg[len(prefix):].split(".", 1)
            _warn(f"{section}.{rest.split('=', 1)[0]}", f"{SECTIONS[section]}.{rest.split('=', 1)[0]}")
            arg = f"{prefix}{SECTIONS[section]}.{rest}"
        out.append(arg)
    return out


def rename_values(values: dict[str, Any]) -> dict[str, Any]:
    """A copy of a config's values with every deprecated job, section and key renamed."""
    values = copy.deepcopy(values)
    if values.get("job") in JOBS:
        _warn(f"job = {values['job']}", f"job = {JOBS[values['job']]}")
        values["job"] = JOBS[values["job"]]
    for old, new in SECTIONS.items():
        if old in values:
            if new in values and values[new] != values[old]:
                raise ConfigError(f"{old}.*: renamed {new}.*; set only {new}.* (both are set, "
                                  f"with different values)")
            _warn(f"{old}.*", f"{new}.*")
            values[new] = values.pop(old)
    _warm_start_batch(values)
    return values


def _warm_start_batch(values: dict[str, Any]) -> None:
    trainer, rl = values.get("trainer", {}), values.get("rl", {})
    batch = trainer.get("batch_size", _TRAINER_BATCH_DEFAULT)
    if values.get("job") != "rl" or batch == _TRAINER_BATCH_DEFAULT:
        return
    if rl.get("warm_start_batch_size", _TRAINER_BATCH_DEFAULT) != _TRAINER_BATCH_DEFAULT:
        raise ConfigError(f"trainer.batch_size = {batch}: job = 'rl' does not read it (the RL "
                          f"batch is rollout.prompts_per_step x rollout.group_size); the warm "
                          f"start's batch is rl.warm_start_batch_size: leave trainer.batch_size "
                          f"at {_TRAINER_BATCH_DEFAULT}")
    _warn("trainer.batch_size with job = rl", "rl.warm_start_batch_size")
    values.setdefault("rl", {})["warm_start_batch_size"] = batch
    trainer["batch_size"] = _TRAINER_BATCH_DEFAULT
