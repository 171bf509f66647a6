"""Checkpoint and published-weight faults: verification never deletes, a run whose every step
fails to verify stops (or starts over on request), quarantined steps live until a newer step
verifies, the watchdog covers the restore, and weight-version retention holds across a resume."""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshrl.inference.published import (
    RETIRED,
    WeightVersionGoneError,
    publish_version,
    published_versions,
)
from meshrl.inference.weights import restore_weights
from meshrl.tests.trainer.tiny import make_loop, tiny_config
from meshrl.tests.xla import cpu_env
from meshrl.trainer import engine as engine_lib
from meshrl.trainer.checkpoint import MANIFEST, UnverifiedCheckpointsError
from meshrl.trainer.sft_loop import run_sft
from meshrl.utils.errors import one_line
from meshrl.utils.params import flat_params
from meshrl.utils.watchdog import EXIT_HANG


def _tree(root: pathlib.Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``root`` (paths too: a rename shows)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _train(config, workdir: pathlib.Path, hooks=()) -> list[dict[str, float]]:
    loop = make_loop(config, workdir)
    try:
        return list(run_sft(loop, hooks=hooks))
    finally:
        loop.close()


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A finished 4-step tiny SFT run with checkpoints at steps 2 and 4; tests use copies."""
    workdir = tmp_path_factory.mktemp("trained")
    _train(tiny_config(**{"trainer.steps": 4, "checkpoint.every_steps": 2}), workdir)
    return workdir


def _without_manifests(trained: pathlib.Path, workdir: pathlib.Path) -> pathlib.Path:
    """A copy of ``trained`` whose steps have no manifest (an older build, a sync that dropped
    it): intact bytes that cannot be verified."""
    shutil.copytree(trained, workdir)
    ckpt = workdir / "checkpoints"
    for step in (2, 4):
        (ckpt / str(step) / MANIFEST).unlink()
    return ckpt


def test_every_step_unverified_refuses_and_deletes_nothing(trained, tmp_path):
    ckpt = _without_manifests(trained, tmp_path / "run")
    before = _tree(ckpt)

    with pytest.raises(UnverifiedCheckpointsError) as err:
        make_loop(tiny_config(**{"trainer.steps": 4, "checkpoint.every_steps": 2}),
                  tmp_path / "run")

    line = one_line(err.value)
    assert line.startswith(f"checkpoints under {ckpt}: steps [4, 2]: none matches its manifest")
    assert "--config.checkpoint.on_unverified=restart" in line
    assert _tree(ckpt) == before  # every file, same path, same bytes
    assert not list(ckpt.glob("corrupt.*"))


def test_every_step_unverified_with_restart_starts_over_and_drops_old_steps_once_new_verify(
        trained, tmp_path):
    ckpt = _without_manifests(trained, tmp_path / "run")
    old = {s: _tree(ckpt / str(s)) for s in (2, 4)}
    config = tiny_config(**{"trainer.steps": 4, "checkpoint.every_steps": 2,
                            "checkpoint.on_unverified": "restart"})

    loop = make_loop(config, tmp_path / "run")
    try:
        assert loop.start_step == 0
        moved = {int(p.name.split(".")[1]): p for p in ckpt.glob("corrupt.*")}
        assert sorted(moved) == [2, 4]
        assert {s: _tree(p) for s, p in moved.items()} == old  # kept whole while unverified
        run_sft(loop)
    finally:
        loop.close()

    assert all((ckpt / str(s) / MANIFEST).exists() for s in (2, 4))
    assert not list(ckpt.glob("corrupt.*"))  # superseded by steps that verify


def test_history_keeps_the_first_and_newest_records_within_its_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_lib, "HISTORY_MAX", 3)

    history = _train(tiny_config(**{"trainer.steps": 4, "checkpoint.every_steps": 2}), tmp_path)

    assert [h["step"] for h in history] == [1, 3, 4]


_HANG_IN_RESTORE = textwrap.dedent("""
    import sys
    from meshrl.tests.trainer.tiny import make_loop, tiny_config
    make_loop(tiny_config(**{"distributed.first_step_timeout_s": 2.0,
                             "distributed.step_timeout_s": 2.0}), sys.argv[1])
    sys.exit(3)
""")


@pytest.mark.slow  # waits out a watchdog
def test_restore_that_hangs_ends_in_the_watchdog_report(trained, tmp_path):
    shutil.copytree(trained, tmp_path / "run")
    step = tmp_path / "run" / "checkpoints" / "4"
    victim = max((p for p in step.rglob("*") if p.is_file() and p.name != MANIFEST),
                 key=lambda p: p.stat().st_size)
    victim.unlink()
    os.mkfifo(victim)  # reading it never returns: a stuck network filesystem, a hung mount

    out = subprocess.run([sys.executable, "-c", _HANG_IN_RESTORE, str(tmp_path / "run")],
                         env=cpu_env(), capture_output=True, text=True, timeout=120)

    assert out.returncode == EXIT_HANG, out.stderr[-3000:]
    assert ("distributed.first_step_timeout_s = 2); last completed step: None; last program "
            "launched: checkpoint restore") in out.stderr, out.stderr[-3000:]


class _DiedError(Exception):
    """The run's end in the middle of training, after a publication."""


def _publish_each_step(stop_after: int | None = None):
    def hook(step: int, loop) -> None:
        loop.publish(step)
        if step == stop_after:
            raise _DiedError(step)
    return hook


def test_keep_versions_is_honoured_across_a_resume(tmp_path):
    config = tiny_config(**{"trainer.steps": 6, "checkpoint.every_steps": 3,
                            "checkpoint.keep_versions": 2})
    with pytest.raises(_DiedError):  # dies at step 5: newest checkpoint is step 3
        _train(config, tmp_path, hooks=[_publish_each_step(stop_after=5)])
    assert published_versions(tmp_path) == [4, 5]
    dead_run_5 = (tmp_path / "weights" / "5").stat().st_ino
    (tmp_path / "weights" / f"{RETIRED}.3.1" / "d").mkdir(parents=True)  # killed mid-deletion

    _train(config, tmp_path, hooks=[_publish_each_step()])  # resumes at 3: 4, 5, 6 again

    assert published_versions(tmp_path) == [5, 6]
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["5", "6"]
    assert (tmp_path / "weights" / "5").stat().st_ino != dead_run_5  # published again


def test_a_resumed_run_deletes_the_versions_a_dead_run_published_after_its_start(tmp_path):
    config = tiny_config(**{"trainer.steps": 6, "checkpoint.every_steps": 3,
                            "checkpoint.keep_versions": 0})
    with pytest.raises(_DiedError):  # dies at step 5: newest checkpoint is step 3
        _train(config, tmp_path, hooks=[_publish_each_step(stop_after=5)])
    assert published_versions(tmp_path) == [1, 2, 3, 4, 5]

    # Resumed at 3 and ending at 4: the dead run's 5 must not stay the newest version.
    _train(tiny_config(**{"trainer.steps": 4, "checkpoint.every_steps": 3,
                          "checkpoint.keep_versions": 0}), tmp_path,
           hooks=[_publish_each_step()])

    assert published_versions(tmp_path) == [1, 2, 3, 4]
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["1", "2", "3", "4"]


def test_keep_versions_zero_keeps_every_version(tmp_path):
    params = {"w": jnp.ones((4,), jnp.float32)}

    for version in range(1, 6):
        publish_version(params, tmp_path, version, keep=0)

    assert published_versions(tmp_path) == [1, 2, 3, 4, 5]


def test_reading_a_version_retired_mid_read_is_a_clear_error(tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    params = {"w": jnp.arange(8, dtype=jnp.float32)}
    for version in (1, 2):
        publish_version(params, tmp_path, version, keep=2)
    real = ocp.StandardCheckpointer.metadata

    moved_on: list[int] = []

    def metadata_then_retire(self, path):
        out = real(self, path)
        if not moved_on:
            moved_on.append(3)
            publish_version(params, tmp_path, 3, keep=1)  # the trainer moves on mid-read
        return out

    monkeypatch.setattr(ocp.StandardCheckpointer, "metadata", metadata_then_retire)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    with pytest.raises(WeightVersionGoneError, match=r"weight version 1 at \S+ was deleted "
                       r"while being read: .*\(published now: \[3\]\)") as err:
        restore_weights(tmp_path, 1, flat_params(params), {"w": sharding})

    assert isinstance(err.value, FileNotFoundError)  # the evaluator skips such a version
    monkeypatch.setattr(ocp.StandardCheckpointer, "metadata", real)
    again = restore_weights(tmp_path, 3, flat_params(params), {"w": sharding})
    np.testing.assert_array_equal(np.asarray(again["w"]), np.arange(8, dtype=np.float32))
    assert published_versions(tmp_path) == [3]


def test_a_checkpoint_directory_that_cannot_be_written_fails_before_training(tmp_path):
    from meshrl.trainer.checkpoint import CheckpointWriteError

    (tmp_path / "checkpoints").write_text("")  # stands in for a read-only directory

    with pytest.raises(CheckpointWriteError, match="checkpoint directory .*checkpoints: "
                                                   "cannot write there"):
        make_loop(tiny_config(), tmp_path)


def test_a_save_that_fails_in_orbax_is_one_error_naming_the_step(tmp_path, monkeypatch):
    from meshrl.trainer.checkpoint import Checkpointer, CheckpointWriteError

    ckpt = Checkpointer(tmp_path, tiny_config().checkpoint)
    ckpt._saving = 6

    def full_disk():
        raise ValueError("RESOURCE_EXHAUSTED: Error writing local file: No space left")

    monkeypatch.setattr(ckpt._mngr, "wait_until_finished", full_disk)
    with pytest.raises(CheckpointWriteError, match=r"checkpoint step 6 under .* could not be "
                                                   r"written \(ValueError: RESOURCE_EXHAUSTED"):
        ckpt.wait()
    monkeypatch.undo()
    ckpt.close()


def test_a_failed_save_ends_the_process_though_threads_it_left_never_finish():
    # Orbax's threads of a failed save wait forever; a normal exit would wait for them.
    code = ("import threading\n"
            "from meshrl.trainer.checkpoint import CheckpointWriteError\n"
            "from meshrl.utils.errors import exit_on_user_error\n"
            "threading.Thread(target=threading.Event().wait).start()\n"
            "exit_on_user_error(CheckpointWriteError('checkpoint step 9: disk full'), "
            "verbose=False)\n")
    done = subprocess.run([sys.executable, "-c", code], env=cpu_env(), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == "error: checkpoint step 9: disk full"
