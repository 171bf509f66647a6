"""meshrl entry point.

  python main.py --config configs/default.py --workdir /tmp/meshrl
  python main.py --config configs/default.py:smoke --config.trainer.steps=5 --dry_run
"""

from __future__ import annotations

import sys

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file defining get_config(arg).")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/meshrl", "Checkpoints, weights, logs, summary.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Validate config, build the mesh, print, exit 0.")
flags.mark_flag_as_required("config")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from meshrl.configs import ConfigError, from_config_dict
    from meshrl.launch import jobs
    from meshrl.mesh import MeshShapeError

    try:
        config = from_config_dict(_CONFIG.value)
        if _DRY_RUN.value:
            print(jobs.dry_run(config))
            return
        jobs.run(config, _WORKDIR.value)
    except (ConfigError, MeshShapeError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    from meshrl.configs.overrides import check_override_keys

    problem = check_override_keys(sys.argv[1:])
    if problem:
        sys.exit(f"error: {problem}")
    app.run(main)
