"""Published weight versions under ``<workdir>/weights/<version>`` (Orbax checkpoints).

A version appears whole (Orbax renames a finished write into place). ``publish_version`` keeps
the newest ``keep`` versions up to the one it publishes: a version leaves by a rename to
``retired.<version>.<ns>`` (so a reader sees it whole or not at all), done only after the new
version is complete, and the renamed directory is then deleted (a kill mid-deletion leaves it
for the next publication to delete). A reader that loses a version to this mid-read gets
``WeightVersionGoneError`` (a ``FileNotFoundError``). ``retire_versions_after`` clears the
versions a run that starts at an earlier step did not publish.
"""

from __future__ import annotations

import json
import time
from typing import Any

import jax
from etils import epath

from meshrl.utils import multihost, paths
from meshrl.utils.errors import UserError
from meshrl.utils.log import get_logger
from meshrl.utils.params import flat_params, nested

log = get_logger("inference")

RETIRED = "retired"  # weights/retired.<version>.<ns>: a version on its way out


class WeightVersionGoneError(UserError, FileNotFoundError):
    """A published version was removed (retention or a re-publication) while being read."""


def weights_dir(workdir: paths.PathLike, version: int) -> epath.Path:
    return paths.as_path(workdir) / "weights" / str(int(version))


def published_versions(workdir: paths.PathLike) -> list[int]:
    """The weight versions published under ``<workdir>/weights``, ascending (Orbax writes each
    under a temporary name and renames it whole, so a listed version is complete)."""
    root = paths.as_path(workdir) / "weights"
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if p.is_dir() and p.name.isdigit())


def version_stamp(workdir: paths.PathLike, version: int) -> int | None:
    """When the save of ``version`` began (ns, from Orbax's step metadata file): a version a
    resumed run publishes again has another. None when it cannot be read (gone)."""
    try:
        meta = json.loads((weights_dir(workdir, version) / "_CHECKPOINT_METADATA").read_text())
        return int(meta["init_timestamp_nsecs"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def publish_weights(params: Any, workdir: paths.PathLike, version: int) -> epath.Path:
    """Write ``params`` (any sharding) as an Orbax checkpoint at ``<workdir>/weights/<version>``."""
    import orbax.checkpoint as ocp

    path = weights_dir(workdir, version)
    path.parent.mkdir(parents=True, exist_ok=True)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(path, nested(flat_params(params)))
    ckptr.wait_until_finished()
    log.debug("published weights version %d at %s", version, path)
    return path


def _set_aside(path: epath.Path) -> epath.Path | None:
    """Rename ``path`` to ``retired.<name>.<ns>`` beside it; None when it is already gone."""
    aside = path.parent / f"{RETIRED}.{path.name}.{time.time_ns()}"
    try:
        path.rename(aside)
    except FileNotFoundError:
        return None
    return aside


def _remove_retired(root: epath.Path) -> None:
    for p in root.glob(f"{RETIRED}.*") if root.is_dir() else ():
        paths.remove_tree(p)


def retire_versions_after(workdir: paths.PathLike, step: int) -> list[int]:
    """Delete the versions published after ``step`` (process 0; the others return []): a run
    starting at ``step`` (0: from scratch) did not publish them, so a reader taking the newest
    version must not find a dead or discarded run's. Returns the versions deleted."""
    if jax.process_index() != 0:
        return []
    root = paths.as_path(workdir) / "weights"
    later = [v for v in published_versions(workdir) if v > step]
    _remove_retired(root)
    for aside in [_set_aside(weights_dir(workdir, v)) for v in later]:
        if aside is not None:
            paths.remove_tree(aside)
    if later:
        log.warning("weight versions %s were published by a run this one does not continue "
                    "(it starts at step %d): deleted", later, step)
    return later


def publish_version(params: Any, workdir: paths.PathLike, version: int, keep: int) -> epath.Path:
    """Publish ``params`` as ``version``, then keep only the newest ``keep`` versions up to it
    (0: all). Every process calls it (the save is collective); process 0 alone renames and
    deletes. A leftover ``version`` of a killed run is renamed aside first, under a barrier so
    no process starts the save while it is still there, and deleted once the new one is
    complete. Versions newer than ``version`` (a killed run's, about to be re-published) are
    left alone."""
    path, root = weights_dir(workdir, version), paths.as_path(workdir) / "weights"
    primary = jax.process_index() == 0
    replaced = None
    if primary:
        _remove_retired(root)
        replaced = _set_aside(path) if path.exists() else None
    multihost.sync(f"meshrl-publish-{version}-aside")
    publish_weights(params, workdir, version)
    if not primary:
        return path
    older = [v for v in published_versions(workdir) if v < version]
    gone = older[:len(older) - (keep - 1)] if keep and len(older) >= keep else []
    retired = [replaced] + [_set_aside(weights_dir(workdir, v)) for v in gone]
    for aside in retired:
        if aside is not None:
            paths.remove_tree(aside)
    if gone:
        log.info("weight versions %s deleted (checkpoint.keep_versions = %d)", gone, keep)
    return path
