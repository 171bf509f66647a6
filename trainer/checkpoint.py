"""The one canonical checkpoint path: Orbax ``CheckpointManager`` under ``<workdir>/checkpoints``.

A checkpoint holds four items: ``state`` (the ``TrainState``), ``data`` (the data iterator's JSON
state), ``config`` (the resolved config, JSON) and ``counters`` (JSON). Saves are async and keep
the newest ``checkpoint.keep``.

Integrity: once Orbax has finalised a step (its atomic rename), process 0 writes
``meshrl_manifest.json`` into the step directory with the size and SHA-256 of every file. Resume
walks steps newest first and loads only a step whose manifest exists and matches; a step that
fails the check is logged, moved aside to ``corrupt.<step>.<time>`` (kept for inspection,
invisible to Orbax) and the previous step is tried. A crash between Orbax's finalise and the
manifest write therefore costs one checkpoint, never loads an unverified one. A verified step
that still fails to restore is a config mismatch, not corruption: that raises
``CheckpointMismatchError`` rather than discarding good checkpoints.

Multi-host: every process verifies the same files (shared storage), so all pick the same step.
TODO(meshrl): the quarantine rename runs on process 0 only, with no barrier before the other
processes reload; untested beyond one process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import threading
import time
from typing import Any

import orbax.checkpoint as ocp

from meshrl.configs.schema import CheckpointConfig
from meshrl.utils.log import get_logger

MANIFEST = "meshrl_manifest.json"
_log = get_logger("trainer.checkpoint")


class CheckpointMismatchError(RuntimeError):
    """An intact checkpoint whose tree/shapes do not match the state being restored."""


@dataclasses.dataclass(frozen=True)
class Restored:
    step: int
    state: Any
    data: dict[str, Any]
    config: dict[str, Any]
    counters: dict[str, Any]


def _hash_file(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _file_table(step_dir: pathlib.Path) -> dict[str, list[Any]]:
    return {str(p.relative_to(step_dir)): [p.stat().st_size, _hash_file(p)]
            for p in sorted(step_dir.rglob("*")) if p.is_file() and p.name != MANIFEST}


def verify_step_dir(step_dir: pathlib.Path) -> str | None:
    """``None`` when ``step_dir`` matches its manifest, else what is wrong."""
    manifest = step_dir / MANIFEST
    if not manifest.exists():
        return "no manifest (the save never completed)"
    try:
        expected = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError) as e:
        return f"unreadable manifest: {e!r}"
    actual = _file_table(step_dir)
    missing = sorted(set(expected) - set(actual))
    if missing:
        return f"missing files: {missing[:5]}"
    changed = sorted(k for k in expected if expected[k] != actual[k])
    if changed:
        return f"size/checksum mismatch in: {changed[:5]}"
    return None


class Checkpointer:
    """Save/restore of the train state, data iterator state, config and counters."""

    def __init__(self, directory: str | pathlib.Path, cfg: CheckpointConfig, *,
                 process_index: int = 0) -> None:
        self.directory = pathlib.Path(directory).absolute()
        self._cfg = cfg
        self._primary = process_index == 0
        self._lock = threading.Lock()
        async_options = (ocp.AsyncOptions(post_finalization_callback=self._write_manifests)
                         if cfg.async_save else None)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep, create=True, enable_async_checkpointing=cfg.async_save,
            async_options=async_options)
        self._mngr = ocp.CheckpointManager(self.directory, options=options,
                                           item_names=("state", "data", "config", "counters"))

    def _step_dirs(self) -> list[pathlib.Path]:
        if not self.directory.exists():
            return []
        return sorted((p for p in self.directory.iterdir() if p.is_dir() and p.name.isdigit()),
                      key=lambda p: int(p.name))

    def _write_manifests(self) -> None:
        """Manifest every finalised step dir that lacks one (idempotent; runs after finalise)."""
        if not self._primary:
            return
        with self._lock:
            for step_dir in self._step_dirs():
                if (step_dir / MANIFEST).exists():
                    continue
                try:
                    table = _file_table(step_dir)
                except FileNotFoundError:  # keep-N deleted it while we hashed
                    continue
                tmp = step_dir / (MANIFEST + ".tmp")
                tmp.write_text(json.dumps({"step": int(step_dir.name), "files": table}))
                tmp.replace(step_dir / MANIFEST)  # atomic: a manifest is whole or absent

    def save(self, step: int, state: Any, data_state: dict[str, Any],
             config_dict: dict[str, Any], counters: dict[str, Any]) -> None:
        """Start saving ``step`` (returns before the write finishes when async)."""
        self._mngr.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
            config=ocp.args.JsonSave(config_dict), counters=ocp.args.JsonSave(counters)),
            force=True)
        if not self._cfg.async_save:
            self._write_manifests()

    def wait(self) -> None:
        """Block until every started save is durable and manifested."""
        self._mngr.wait_until_finished()
        self._write_manifests()

    def all_steps(self) -> list[int]:
        return sorted(self._mngr.all_steps())

    def _quarantine(self, step: int, why: str) -> None:
        _log.warning("checkpoint step %d is unusable (%s); falling back to the previous one",
                     step, why)
        if self._primary:
            src = self.directory / str(step)
            if src.exists():
                src.rename(self.directory / f"corrupt.{step}.{int(time.time())}")
        self._mngr.reload()

    def restore_latest(self, abstract_state: Any) -> Restored | None:
        """Newest verified checkpoint, restored onto ``abstract_state``'s shardings; ``None`` if
        there is none. Target shardings come from the caller, so the mesh may differ from the
        one that saved."""
        for step in sorted(self._mngr.all_steps(), reverse=True):
            problem = verify_step_dir(self.directory / str(step))
            if problem is not None:
                self._quarantine(step, problem)
                continue
            try:
                out = self._mngr.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore(),
                    config=ocp.args.JsonRestore(), counters=ocp.args.JsonRestore()))
            except Exception as e:
                # The bytes match the manifest, so this is not corruption: the run's state no
                # longer fits the checkpoint (changed model, optimizer, ...). Falling back would
                # silently discard good checkpoints; stop and say so instead.
                raise CheckpointMismatchError(
                    f"checkpoint step {step} under {self.directory} is intact but does not fit "
                    f"this run's train state (did model/optimizer config change?); use a new "
                    f"workdir or restore the old config. Cause: {e!r}"[:2000]) from e
            _log.info("restored checkpoint step %d from %s", step, self.directory)
            return Restored(step=step, state=out["state"], data=out["data"],
                            config=out["config"], counters=out["counters"])
        return None

    def close(self) -> None:
        self.wait()
        self._mngr.close()
