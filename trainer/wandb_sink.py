"""An optional Weights & Biases sink beside TensorBoard (``logging.wandb_project``).

Process 0 only, like TensorBoard; ``wandb`` is imported only when a project is set, and a set
project without the package is a one-line ``UserError`` naming the extra (``check_wandb`` runs
in the dry run's and the run's preflight, before anything is written), as is a run wandb
refuses to start (no login: ``wandb login`` or ``WANDB_MODE=offline``). The run is named after
the workdir unless ``logging.wandb_run_name`` says otherwise, carries the resolved config, and
resumes the same W&B run on a restart (its id comes from the workdir's path). W&B keeps no
row at a step below one it already holds, so after a resume from an older checkpoint the
replayed steps up to the dead run's last logged one are in TensorBoard and metrics.jsonl only.
"""

from __future__ import annotations

import hashlib
import importlib.util

from meshrl.configs.schema import Config
from meshrl.utils import paths
from meshrl.utils.errors import UserError


def check_wandb(config: Config) -> None:
    if config.logging.wandb_project and importlib.util.find_spec("wandb") is None:
        raise UserError(f"logging.wandb_project = {config.logging.wandb_project!r}: the wandb "
                        f"package is not installed: pip install -e \".[wandb]\" -c "
                        f"constraints.txt, or leave logging.wandb_project empty")


class WandbSink:
    def __init__(self, config: Config, workdir: paths.PathLike) -> None:
        check_wandb(config)
        import wandb

        workdir = paths.as_path(workdir)
        project = config.logging.wandb_project
        name = config.logging.wandb_run_name or workdir.name
        # One W&B run per workdir: a restart resumes it, another workdir never joins it.
        run_id = f"{name}-{hashlib.sha1(str(workdir).encode()).hexdigest()[:8]}"
        try:
            self._run = wandb.init(project=project, name=name, id=run_id, resume="allow",
                                   dir=str(workdir), config=config.to_dict())
        except wandb.errors.Error as e:
            reason = " ".join(str(e).split()).rstrip(".")
            raise UserError(f"logging.wandb_project = {project!r}: wandb did not start a run: "
                            f"{reason}: run `wandb login` (or set WANDB_API_KEY), set "
                            f"WANDB_MODE=offline, or leave logging.wandb_project empty") from e

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self._run.log(dict(scalars), step=step)

    def close(self) -> None:
        self._run.finish()


def wandb_sink(config: Config, workdir: paths.PathLike) -> WandbSink | None:
    """The sink when ``logging.wandb_project`` is set and this is process 0, else None."""
    import jax

    if not config.logging.wandb_project or jax.process_index() != 0:
        return None
    return WandbSink(config, workdir)
