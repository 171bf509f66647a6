"""meshrl entry point.

  python main.py --config configs/default.py --workdir /tmp/meshrl
  python main.py --config configs/default.py:smoke --config.trainer.steps=5 --dry_run

An error the user can fix (``meshrl.utils.errors.UserError``: config, mesh, data, model
directory, tokenizer, checkpoint, workdir) prints one line ``error: <what>: <value>: <fix>`` to
stderr and exits 1; the traceback is printed too with ``--config.logging.level=DEBUG``.
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
    from meshrl.configs import from_config_dict
    from meshrl.jobs import dispatch as jobs
    from meshrl.utils.errors import UserError, exit_on_user_error, quiet_shutdown_noise

    config = None
    quiet_shutdown_noise(lambda: _debug(config))
    try:
        config = from_config_dict(_CONFIG.value)
        if _DRY_RUN.value:
            print(jobs.dry_run(config))
            return
        from meshrl.utils.workdir import default_workdir

        jobs.run(config, _WORKDIR.value or default_workdir())
    except UserError as e:
        exit_on_user_error(e, verbose=_debug(config))


if __name__ == "__main__":
    from meshrl.configs.overrides import check_config_file, check_override_keys

    problem = check_config_file(sys.argv[1:]) or check_override_keys(sys.argv[1:])
    if problem:
        sys.exit(f"error: {problem}")
    app.run(main)
