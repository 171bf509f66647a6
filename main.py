"""meshrl entry point.

  python main.py --config configs/default.py --workdir /tmp/meshrl
  python main.py --config configs/default.py:smoke --config.trainer.steps=5 --dry_run

An error the user can fix (``meshrl.utils.errors.UserError``: config, mesh, data, model
directory, tokenizer, checkpoint, workdir) prints one line ``error: <what>: <value>: <fix>`` to
stderr and exits 1; the traceback is printed too with ``--config.logging.level=DEBUG``.
Ctrl-C stops SFT, RL and DPO at the next step boundary with a checkpoint and one line, ``stopped
at step N; checkpoint saved: <path>``; a second Ctrl-C, or one in any other job, stops at once.
"""

from __future__ import annotations

import sys
from typing import Any

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file defining get_config(arg).")
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Checkpoints, weights, logs, summary; default "
    "$XDG_CACHE_HOME/meshrl/workdir (~/.cache/meshrl/workdir). Refused when it is a symlink, "
    "another user's, or writable by group or others, or when another run holds it.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Validate config, build the mesh, print, exit 0.")
flags.mark_flag_as_required("config")


def _debug(config: Any) -> bool:
    """``logging.level = DEBUG`` in the validated config, or in the raw one when it failed."""
    if config is not None:
        return config.logging.level == "DEBUG"
    try:
        return _CONFIG.value.logging.level == "DEBUG"
    except Exception:  # the raw config may lack the field or have failed to load
        return False


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from meshrl.utils.tpu_env import quiet_libtpu_probe

    quiet_libtpu_probe()  # before JAX starts a backend
    from meshrl.configs import from_config_dict
    from meshrl.jobs import dispatch as jobs
    from meshrl.utils import interrupt
    from meshrl.utils.errors import UserError, exit_on_user_error, quiet_shutdown_noise

    config = workdir = None
    quiet_shutdown_noise(lambda: _debug(config))
    try:
        config = from_config_dict(_CONFIG.value)
        if _DRY_RUN.value:
            print(jobs.dry_run(config))
            return
        from meshrl.utils.workdir import default_workdir

        if _WORKDIR.value is not None and not _WORKDIR.value.strip():  # an unset $VAR
            sys.exit(f"error: --workdir = {_WORKDIR.value!r}: empty; give a directory, or leave "
                     f"the flag out for the default ({default_workdir()})")
        workdir = _WORKDIR.value or default_workdir()
        if config.job in jobs.STEP_JOBS:  # the others stop at once on Ctrl-C
            interrupt.install()
        jobs.run(config, workdir)
    except UserError as e:
        exit_on_user_error(e, verbose=_debug(config))
    except interrupt.Stopped as e:
        _interrupted(str(e))
    except KeyboardInterrupt:
        _interrupted(f"interrupted: stopped at once, without saving (a second Ctrl-C, a Ctrl-C "
                     f"in a multi-process run, or before the job started); the newest "
                     f"checkpoint under {workdir or 'the workdir'} is kept")


def _config_args(argv: list[str]) -> list[str]:
    """The ``--config`` flag (``--config=F`` or ``--config F``) and its overrides in ``argv``."""
    out = []
    for i, arg in enumerate(argv):
        if arg.startswith("--config.") or arg.startswith("--config="):
            out.append(arg)
        elif arg == "--config" and i + 1 < len(argv):
            out += [arg, argv[i + 1]]
    return out


def _interrupted(line: str) -> None:
    """One line on stderr and the shell's exit status for SIGINT."""
    print(line, file=sys.stderr)
    sys.exit(130)


if __name__ == "__main__":
    from meshrl.configs.overrides import check_config_file, check_override_keys, config_from_argv
    from meshrl.configs.renames import rename_argv

    sys.argv = [sys.argv[0], *rename_argv(sys.argv[1:])]  # deprecated keys, one warning each
    problem = check_config_file(sys.argv[1:]) or check_override_keys(sys.argv[1:])
    if problem:
        sys.exit(f"error: {problem}")
    try:  # a value of the wrong type: absl would print a FATAL flags line instead
        config_from_argv(_config_args(sys.argv[1:]))
    except ValueError as e:
        sys.exit(f"error: {' '.join(str(e).split())}")
    app.run(main)
