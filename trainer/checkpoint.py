"""The one canonical checkpoint path: Orbax ``CheckpointManager`` under ``<workdir>/checkpoints``.

A checkpoint holds four items: ``state`` (the ``TrainState``), ``data`` (the data iterator's JSON
state), ``config`` (the resolved config, JSON) and ``counters`` (JSON). Saves are async (or
awaited at once with ``checkpoint.async_save = False``) and keep the newest ``checkpoint.keep``.

Contract: a step directory ``<N>`` is complete and restorable, or absent. Process 0 writes
``meshrl_manifest.json`` (size and SHA-256 of every file) into Orbax's temporary directory
``<N>.orbax-checkpoint-tmp`` after the items are finalised and before Orbax's atomic rename, so
a step becomes visible under its final name only with its integrity record. A kill at any moment
leaves either the finished step or a temporary directory, which the next run deletes (never
reported as corrupt). Steps past ``keep`` are renamed into ``deleted/`` before removal, so a kill
mid-deletion never leaves a half-deleted step. Resume walks steps newest first until one matches
its manifest; the newer steps that did not are then moved aside to ``corrupt.<step>.<time>``
and kept until a step at least as new is saved and verifies (verification never deletes).
When steps exist and none verifies, nothing is moved: ``UnverifiedCheckpointsError``, unless
``checkpoint.on_unverified = "restart"``, which moves them all aside and starts from scratch. A
verified step that still fails to restore does not fit this run: ``CheckpointMismatchError``,
nothing discarded. With several processes, each checks every file's size but hashes only its
share of the files, the processes agree on the verdict, and process 0 moves a bad step aside
between two barriers.
Design notes: docs/checkpoints.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from meshrl.configs.schema import CheckpointConfig
from meshrl.utils import multihost, paths
from meshrl.utils.errors import UserError, one_line
from meshrl.utils.log import get_logger

MANIFEST = "meshrl_manifest.json"
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # Orbax's name for a step being written
DELETED = "deleted"  # Orbax renames steps past ``keep`` here before removing them
QUARANTINE = "corrupt"  # ``corrupt.<step>.<ns>``: a step moved aside for failing verification
_log = get_logger("trainer.checkpoint")


class CheckpointMismatchError(UserError, RuntimeError):
    """An intact checkpoint whose tree/shapes do not match the state being restored."""


class CheckpointWriteError(UserError, RuntimeError):
    """A checkpoint that cannot be written (a read-only or full disk). Orbax's threads of the
    failed save never finish, so the process must end without waiting for them
    (``hard_exit``)."""

    hard_exit = True


class UnverifiedCheckpointsError(UserError, RuntimeError):
    """Checkpoints exist and none matches its manifest (``checkpoint.on_unverified = "stop"``)."""


@dataclasses.dataclass(frozen=True)
class Restored:
    step: int
    state: Any
    data: dict[str, Any]
    config: dict[str, Any]
    counters: dict[str, Any]


def _hash_file(path: epath.Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# Orbax rewrites the step's own metadata (commit timestamp) after the manifest is written.
_UNHASHED = {MANIFEST, "_CHECKPOINT_METADATA"}


def _file_table(step_dir: epath.Path, hashed: Any = None) -> dict[str, list[Any]]:
    """``{relative path: [size, sha256]}``; with ``hashed`` (a set of relative paths) only those
    are hashed, the others get ``None``."""
    out = {}
    for rel, p in paths.files_under(step_dir):
        if rel not in _UNHASHED:
            digest = _hash_file(p) if hashed is None or rel in hashed else None
            out[rel] = [paths.size_of(p), digest]
    return out


def verify_step_dir(step_dir: paths.PathLike, share: tuple[int, int] = (0, 1)) -> str | None:
    """``None`` when ``step_dir`` matches its manifest, else what is wrong. ``share = (i, n)``
    checks every file's size but hashes only every n-th file from the i-th (sorted by path), so
    n processes together read each byte once (``Checkpointer`` combines their answers)."""
    step_dir = epath.Path(step_dir)
    manifest = step_dir / MANIFEST
    if not manifest.exists():
        return "no manifest (deleted, or not written by meshrl's checkpointer)"
    try:
        expected = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError) as e:
        return f"unreadable manifest: {e!r}"
    index, count = share
    mine = set(sorted(expected)[index::count])
    actual = _file_table(step_dir, hashed=mine)
    missing = sorted(set(expected) - set(actual))
    if missing:
        return f"missing files: {missing[:5]}"
    changed = sorted(k for k in expected
                     if actual[k][0] != expected[k][0] or (k in mine and actual[k] != expected[k]))
    if changed:
        return f"size/checksum mismatch in: {changed[:5]}"
    return None


class Checkpointer:
    """Save/restore of the train state, data iterator state, config and counters."""

    def __init__(self, directory: paths.PathLike, cfg: CheckpointConfig, *,
                 process_index: int = 0) -> None:
        self.directory = paths.as_path(directory)
        self._cfg = cfg
        self._primary = process_index == 0
        self._saving: int | None = None
        # Always Orbax's async path: its post-finalisation callback is the one moment when the
        # items are complete and the step is not yet visible; a sync save waits right away.
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep, create=True, enable_async_checkpointing=True,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._write_manifest),
            cleanup_tmp_directories=True, todelete_subdir=DELETED)
        # Handlers named up front, so a fresh manager can read an item's metadata before any
        # save or restore of this process.
        handlers = {"state": ocp.StandardCheckpointHandler(),
                    **{k: ocp.JsonCheckpointHandler() for k in ("data", "config", "counters")}}
        self._check_writable()
        self._mngr = ocp.CheckpointManager(self.directory, options=options,
                                           item_handlers=handlers)
        self._empty_deleted()

    def _check_writable(self) -> None:
        """Fail now, in one line, where a save would fail later in Orbax's threads (a directory
        copied read-only from an archive, say)."""
        probe = self.directory / f".meshrl-write-probe.{jax.process_index()}.{os.getpid()}"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            raise CheckpointWriteError(f"checkpoint directory {self.directory}: cannot write "
                                       f"there ({e.strerror or e}): make it writable, or pass "
                                       f"another --workdir") from None

    def _await_saves(self) -> None:
        """Wait for the save in flight; its failure is one ``CheckpointWriteError``."""
        try:
            self._mngr.wait_until_finished()
        except (OSError, ValueError) as e:  # ValueError: tensorstore's RESOURCE_EXHAUSTED
            raise CheckpointWriteError(
                f"checkpoint step {self._saving} under {self.directory} could not be written "
                f"({type(e).__name__}: {one_line(e)}): free space or fix permissions there; "
                f"the earlier steps are intact") from e

    def _empty_deleted(self) -> None:
        """Finish removing steps past ``keep`` (a kill may have interrupted it)."""
        trash = self.directory / DELETED
        if self._primary:
            paths.remove_tree(trash)

    def _write_manifest(self) -> None:
        """Manifest the step being saved, inside its temporary directory (runs after Orbax
        finalised the items, before its atomic rename)."""
        step = self._saving
        if not self._primary or step is None:
            return
        # Orbax writes into <step>.orbax-checkpoint-tmp and renames it, or on an object store
        # (gs://) writes into <step> itself and marks it complete with a commit file.
        tmp, final = self.directory / f"{step}{TMP_SUFFIX}", self.directory / str(step)
        step_dir = tmp if tmp.exists() else final
        if not step_dir.exists():
            raise RuntimeError(f"checkpoint step {step}: neither Orbax's temporary directory "
                               f"{tmp} nor {final} exists at finalisation; cannot manifest it")
        # Atomic: a manifest is whole or absent.
        paths.write_text_atomic(step_dir / MANIFEST,
                                json.dumps({"step": step, "files": _file_table(step_dir)}))

    def save(self, step: int, state: Any, data_state: dict[str, Any],
             config_dict: dict[str, Any], counters: dict[str, Any]) -> None:
        """Start saving ``step`` (returns before the write finishes when async)."""
        self._await_saves()  # one save in flight: the callback knows its step
        self._empty_deleted()
        self._prune_quarantined()
        self._saving = step
        self._mngr.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
            config=ocp.args.JsonSave(config_dict), counters=ocp.args.JsonSave(counters)),
            force=True)
        if not self._cfg.async_save:
            self.wait()

    def wait(self) -> None:
        """Block until every started save is durable (and manifested)."""
        self._await_saves()
        self._empty_deleted()
        self._prune_quarantined()

    def all_steps(self) -> list[int]:
        return sorted(self._mngr.all_steps())

    def _verify(self, step: int) -> str | None:
        """``verify_step_dir`` with the hashing shared by all processes; every process gets the
        same answer (the first problem any process found)."""
        mine = verify_step_dir(self.directory / str(step),
                               (jax.process_index(), jax.process_count()))
        return next((p for p in multihost.allgather_json(mine) if p is not None), None)

    def _quarantine(self, step: int) -> None:
        """Move ``step`` aside to ``corrupt.<step>.<ns>``; it stays until ``_prune_quarantined``
        sees a step at least as new verify."""
        # No process may still be reading the step while process 0 moves it, nor list steps
        # before the move is done.
        multihost.sync(f"meshrl-quarantine-{step}-start")
        if self._primary:
            src = self.directory / str(step)
            if src.exists():
                src.rename(self.directory / f"{QUARANTINE}.{step}.{time.time_ns()}")
        multihost.sync(f"meshrl-quarantine-{step}-done")
        self._mngr.reload()

    def quarantined(self) -> list[tuple[int, epath.Path]]:
        """``(step, directory)`` of every step moved aside, oldest step first."""
        out = []
        for p in self.directory.glob(f"{QUARANTINE}.*"):
            parts = p.name.split(".")
            if len(parts) == 3 and parts[1].isdigit():
                out.append((int(parts[1]), p))
        return sorted(out, key=lambda item: item[0])

    def _prune_quarantined(self) -> None:
        """Delete the moved-aside steps that a finished, verified step at least as new
        supersedes (process 0; only when there is one to delete, so a save pays for hashing
        the newest step once after a quarantine, never otherwise)."""
        if not self._primary:
            return
        newest = max(self._mngr.all_steps(), default=None)
        stale = [(s, p) for s, p in self.quarantined() if newest is not None and s <= newest]
        if not stale:
            return
        problem = verify_step_dir(self.directory / str(newest))
        if problem is not None:
            _log.warning("checkpoint step %d does not verify (%s): keeping the moved-aside "
                         "steps %s", newest, problem, [s for s, _ in stale])
            return
        for step, p in stale:
            _log.info("deleting moved-aside checkpoint step %d (%s): step %d verifies", step,
                      p, newest)
            paths.remove_tree(p)

    def _none_verified(self, failed: list[tuple[int, str]]) -> None:
        """Every step failed verification: refuse (nothing moved), or with
        ``on_unverified = "restart"`` move them all aside and let the run start over."""
        steps = [s for s, _ in failed]
        if self._cfg.on_unverified == "stop":
            why = "; ".join(f"step {s}: {p}" for s, p in failed[:3])
            more = f"; and {len(failed) - 3} more" if len(failed) > 3 else ""
            raise UnverifiedCheckpointsError(
                f"checkpoints under {self.directory}: steps {steps}: none matches its manifest "
                f"({why}{more}); nothing was moved or deleted: restore a complete copy, use "
                f"another --workdir, or pass --config.checkpoint.on_unverified=restart to move "
                f"them aside (as {QUARANTINE}.<step>.<ns>) and train from scratch here")
        _log.warning("checkpoints under %s: steps %s: none matches its manifest (%s); "
                     "checkpoint.on_unverified = restart: moving them aside and training from "
                     "scratch", self.directory, steps, failed[0][1])
        for step in steps:
            self._quarantine(step)

    def _misfit(self, step: int, abstract_state: Any) -> str | None:
        """How step's saved train state differs from ``abstract_state`` in tree or shapes,
        read from Orbax's metadata before any array is read (a failed read would leave
        Orbax's half-finished reads reporting on stderr)."""
        try:
            meta = self._mngr.item_metadata(step)["state"]
        except Exception:  # no readable metadata: let the restore itself decide
            return None
        if meta is None:
            return None
        saved = ocp.tree.to_flat_dict(meta)
        want = ocp.tree.to_flat_dict(ocp.tree.serialize_tree(abstract_state,
                                                              keep_empty_nodes=True))
        name = "/".join  # ('params', 'embed', 'value') -> params/embed/value
        for key in sorted(want, key=lambda k: k[0] != "params"):  # params first: clearest
            if key not in saved:
                return f"{name(key)} is not in the checkpoint"
            have, need = tuple(saved[key].shape or ()), tuple(getattr(want[key], "shape", ()))
            if have != need:
                return f"{name(key)} has shape {have} in the checkpoint and {need} in this run"
        extra = sorted(set(saved) - set(want))
        return f"{name(extra[0])} is in the checkpoint but not in this run" if extra else None

    def _mismatch_message(self, step: int, what: str) -> str:
        return (f"checkpoint step {step} under {self.directory}: intact but does not fit this "
                f"run's train state ({what}): the model or optimizer config changed; use a new "
                f"--workdir, or the config that wrote it (logging.level = DEBUG shows the whole "
                f"difference)")

    def restore_latest(self, abstract_state: Any) -> Restored | None:
        """Newest verified checkpoint, restored onto ``abstract_state``'s shardings; ``None`` if
        there is none. Target shardings come from the caller, so the mesh may differ from the
        one that saved."""
        failed: list[tuple[int, str]] = []
        for step in sorted(self._mngr.all_steps(), reverse=True):
            problem = self._verify(step)
            if problem is not None:
                failed.append((step, problem))
                continue
            # Only now that an older step verified are the newer ones known to be damaged
            # rather than, say, written by a build without manifests: move them aside.
            for bad, why in failed:
                _log.warning("checkpoint step %d is unusable (%s); falling back to step %d",
                             bad, why, step)
                self._quarantine(bad)
            misfit = self._misfit(step, abstract_state)
            if misfit:
                raise CheckpointMismatchError(self._mismatch_message(step, misfit))
            try:
                out = self._mngr.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore(),
                    config=ocp.args.JsonRestore(), counters=ocp.args.JsonRestore()))
            except Exception as e:
                # The bytes match the manifest, so this is not corruption: the run's state no
                # longer fits the checkpoint (changed model, optimizer, ...). Falling back would
                # silently discard good checkpoints; stop and say so instead.
                cause = (str(e).splitlines() or [repr(e)])[0].split(". ")[0].rstrip(":")
                raise CheckpointMismatchError(self._mismatch_message(step, cause[:160])) from e
            _log.info("restored checkpoint step %d from %s", step, self.directory)
            return Restored(step=step, state=out["state"], data=out["data"],
                            config=out["config"], counters=out["counters"])
        if failed:
            self._none_verified(failed)
        return None

    def close(self) -> None:
        self.wait()
        self._mngr.close()
