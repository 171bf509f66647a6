"""Read-only access to a run's checkpoints: the newest verified step, its saved config, and the
params (with the weight version) alone of its ``TrainState``, never the optimizer state.

Same layout and integrity check as ``checkpoint.Checkpointer`` (the one writer), but it never
writes, renames or deletes: a run may be saving next to the reader (the generate job reading a
live RL run). A step that fails ``verify_step_dir`` is skipped and logged, not quarantined; the
run's own resume deals with it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from meshrl.trainer.checkpoint import verify_step_dir
from meshrl.utils import paths
from meshrl.utils.log import get_logger

_log = get_logger("trainer.checkpoint")
_ITEMS = ("state", "data", "config", "counters")


class CheckpointReader:
    """The checkpoints under ``directory`` (``<workdir>/checkpoints``), read only."""

    def __init__(self, directory: paths.PathLike) -> None:
        self.directory = paths.as_path(directory)
        self._mngr: ocp.CheckpointManager | None = None
        if self.directory.is_dir():
            self._mngr = ocp.CheckpointManager(
                self.directory, options=ocp.CheckpointManagerOptions(
                    read_only=True, create=False, save_interval_steps=0),
                item_names=_ITEMS)

    def latest_step(self) -> int | None:
        """The newest step whose files match its manifest; ``None`` when there is none."""
        if self._mngr is None:
            return None
        for step in sorted(self._mngr.all_steps(), reverse=True):
            problem = verify_step_dir(self.directory / str(step))
            if problem is None:
                return step
            _log.warning("checkpoint step %d under %s is skipped: %s", step, self.directory,
                         problem)
        return None

    def steps(self) -> list[int]:
        """Every step whose files match its manifest, ascending (the others are logged)."""
        if self._mngr is None:
            return []
        out = []
        for step in sorted(self._mngr.all_steps()):
            problem = verify_step_dir(self.directory / str(step))
            if problem is None:
                out.append(step)
            else:
                _log.warning("checkpoint step %d under %s is skipped: %s", step, self.directory,
                             problem)
        return out

    def config(self, step: int) -> dict[str, Any]:
        """The resolved config the run saved with ``step`` (``Config.to_dict()`` layout)."""
        assert self._mngr is not None, self.directory
        out = self._mngr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
        return dict(out["config"])

    def params(self, step: int, abstract_params: Any) -> tuple[Any, int]:
        """(params, weight_version) of ``step``, restored onto ``abstract_params``' shardings
        (``ShapeDtypeStruct`` leaves; the mesh may differ from the run's)."""
        assert self._mngr is not None, self.directory
        leaf = jax.tree.leaves(abstract_params)[0]
        version = jax.ShapeDtypeStruct((), jnp.int32, sharding=jax.sharding.NamedSharding(
            leaf.sharding.mesh, jax.sharding.PartitionSpec()))
        target = {"params": abstract_params, "weight_version": version}
        # Explicit restore args: without them Orbax places arrays as the run saved them.
        out = self._mngr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=True)))
        state = out["state"]
        return state["params"], int(jax.device_get(state["weight_version"]))

    def close(self) -> None:
        if self._mngr is not None:
            self._mngr.close()
