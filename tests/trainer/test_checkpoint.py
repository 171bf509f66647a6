"""Checkpoints: exact resume after a kill, restore onto another mesh, fallback from a corrupt
latest step."""

from __future__ import annotations

import json
import logging
import pathlib
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from meshrl.tests.trainer.tiny import make_loop, make_trainee, mesh_for, tiny_config
from meshrl.tests.trees import assert_trees_equal
from meshrl.tests.xla import cpu_env
from meshrl.trainer.checkpoint import (
    DELETED,
    MANIFEST,
    TMP_SUFFIX,
    Checkpointer,
    CheckpointMismatchError,
    verify_step_dir,
)
from meshrl.trainer.engine import expand_prefix
from meshrl.trainer.optimizer import make_optimizer
from meshrl.trainer.sft_loop import run_sft
from meshrl.trainer.state import abstract_state, init_state, state_shardings

ENV = cpu_env(8)

# Phase one of the resume test: train, and die without any shutdown two steps after the step-3
# checkpoint is durable (as a preempted or OOM-killed job would), metrics rows up to 4 written.
_PHASE_ONE = textwrap.dedent("""
    import os, sys
    from meshrl.tests.trainer.tiny import make_loop, tiny_config
    from meshrl.trainer.sft_loop import run_sft
    loop = make_loop(tiny_config(), sys.argv[1])
    def die(step, loop):
        if step == 5:
            loop.checkpointer.wait()
            os._exit(0)
    run_sft(loop, hooks=[die])
    os._exit(3)
""")


def _losses(workdir: pathlib.Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}  # a re-run step keeps its latest value


def _run(config, workdir):
    loop = make_loop(config, workdir)
    run_sft(loop)
    params = jax.device_get(loop.state.params)
    start = loop.start_step
    loop.close()
    return params, start


def _steps_logged(path: pathlib.Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_resume_after_kill_gives_bitwise_identical_params_and_losses(tmp_path):
    config = tiny_config()
    straight, _ = _run(config, tmp_path / "straight")

    resumed_dir = tmp_path / "resumed"
    out = subprocess.run([sys.executable, "-c", _PHASE_ONE, str(resumed_dir)], env=ENV,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(int(p.name) for p in (resumed_dir / "checkpoints").iterdir()
                  if p.name.isdigit()) == [3]
    assert _steps_logged(resumed_dir / "metrics.jsonl") == [1, 2, 3, 4]
    resumed, start = _run(config, resumed_dir)

    assert start == 3
    assert_trees_equal(resumed, straight)
    assert _losses(resumed_dir) == _losses(tmp_path / "straight")
    # The dead run's row of step 4 did not happen in the resumed history: moved aside, kept.
    assert _steps_logged(resumed_dir / "metrics.jsonl") == [1, 2, 3, 4, 5, 6]
    assert _steps_logged(resumed_dir / "metrics.discarded.jsonl") == [4]


@pytest.mark.distributed
def test_restore_onto_other_mesh_keeps_values(tmp_path):
    src_cfg = tiny_config(**{"mesh.data": 8, "mesh.fsdp": True})
    dst_cfg = tiny_config(**{"mesh.data": 2, "mesh.tensor": 4})

    def build(cfg):
        mesh = mesh_for(cfg)
        trainee = make_trainee(cfg, mesh)
        tx, _ = make_optimizer(cfg.optimizer, cfg.trainer.learning_rate, cfg.trainer.steps)
        sh = state_shardings(expand_prefix(trainee.params_shardings, trainee.params), tx, mesh,
                             trainee.params)
        return trainee, tx, sh

    trainee, tx, sh = build(src_cfg)
    state = jax.jit(lambda p: init_state(p, tx, 7), out_shardings=sh)(trainee.params)
    ckpt = Checkpointer(tmp_path / "ckpt", src_cfg.checkpoint)
    ckpt.save(5, state, {"index": 5}, src_cfg.to_dict(), {"step": 5})
    ckpt.close()

    dst_trainee, dst_tx, dst_sh = build(dst_cfg)
    target = abstract_state(dst_sh, dst_trainee.params, dst_tx)
    reader = Checkpointer(tmp_path / "ckpt", dst_cfg.checkpoint)
    restored = reader.restore_latest(target)
    reader.close()

    assert restored is not None and restored.step == 5 and restored.data == {"index": 5}
    assert restored.config["mesh"]["fsdp"] is True
    assert_trees_equal(restored.state, state)
    assert jax.tree.structure(restored.state) == jax.tree.structure(dst_sh)
    for b, want in zip(jax.tree.leaves(restored.state), jax.tree.leaves(dst_sh), strict=True):
        assert b.sharding == want
    # The layout really changed: FSDP split params over data on the source mesh, not here.
    specs = {tuple(s.spec) for s in jax.tree.leaves(dst_sh.params)}
    assert all("data" not in str(s) for s in specs)


@pytest.mark.parametrize("damage", ["truncate", pytest.param("drop_manifest", marks=pytest.mark.slow)])
def test_corrupt_latest_checkpoint_falls_back_to_previous(tmp_path, damage):
    config = tiny_config(**{"trainer.steps": 4, "checkpoint.every_steps": 2})
    _run(config, tmp_path)
    step4 = tmp_path / "checkpoints" / "4"
    if damage == "truncate":
        victim = max((p for p in (step4 / "state").rglob("*") if p.is_file()),
                     key=lambda p: p.stat().st_size)
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    else:
        (step4 / MANIFEST).unlink()

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("meshrl.trainer.checkpoint")
    logger.addHandler(handler)
    try:
        loop = make_loop(config, tmp_path)
    finally:
        logger.removeHandler(handler)

    assert loop.start_step == 2
    assert any("step 4 is unusable" in r.getMessage() for r in records)
    assert not step4.exists() and list((tmp_path / "checkpoints").glob("corrupt.4.*"))
    run_sft(loop)  # training continues from step 2 and writes a good step 4 again
    loop.close()
    assert (step4 / MANIFEST).exists()


def test_shared_verification_hashes_each_file_once_and_every_size_everywhere(tmp_path):
    config = tiny_config(**{"trainer.steps": 1})
    _run(config, tmp_path)
    step = tmp_path / "checkpoints" / "1"
    files = sorted(json.loads((step / MANIFEST).read_text())["files"])
    victim = step / files[-1]
    data = bytearray(victim.read_bytes())
    data[0] ^= 0xFF  # same size, other bytes: only the hash can tell
    victim.write_bytes(bytes(data))
    shares = [(i, 3) for i in range(3)]
    verdicts = [verify_step_dir(step, share) for share in shares]
    owner = (len(files) - 1) % 3  # sorted(files)[i::3] holds the last file for this i
    assert [v is not None for v in verdicts] == [i == owner for i in range(3)]
    assert files[-1] in verdicts[owner]
    victim.write_bytes(bytes(data[:-1]))  # a size change is seen by every share
    assert all(verify_step_dir(step, share) for share in shares)


def test_intact_checkpoint_of_another_model_raises_instead_of_falling_back(tmp_path):
    _run(tiny_config(**{"trainer.steps": 1}), tmp_path)
    with pytest.raises(CheckpointMismatchError,
                       match=r"step 1 .* intact .*params/\S+ has shape \(\d+, 32\) in the checkpoint "
                             r"and \(\d+, 48\) in this run"):
        make_loop(tiny_config(**{"trainer.steps": 1, "model.hidden_size": 48}), tmp_path)
    assert (tmp_path / "checkpoints" / "1" / MANIFEST).exists()  # nothing was discarded



def _tiny_saves(directory: pathlib.Path, steps: list[int], keep: int = 3) -> dict:
    cfg = tiny_config(**{"checkpoint.keep": keep}).checkpoint
    ckpt = Checkpointer(directory, cfg)
    for s in steps:
        ckpt.save(s, {"w": np.full((4,), s, np.float32)}, {"index": s}, {}, {"step": s})
    ckpt.close()
    return {"w": jax.ShapeDtypeStruct((4,), np.float32,
                                      sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))}


def test_unfinished_save_and_half_deleted_step_are_cleaned_up_not_called_corrupt(tmp_path, caplog):
    target = _tiny_saves(tmp_path, [1, 2])
    unfinished = tmp_path / f"3{TMP_SUFFIX}"  # a kill during step 3's write leaves this
    (unfinished / "state").mkdir(parents=True)
    (unfinished / "state" / "partial").write_bytes(b"\0" * 10)
    (tmp_path / DELETED / "0" / "state").mkdir(parents=True)  # a kill mid keep-N removal

    with caplog.at_level(logging.WARNING, logger="meshrl.trainer.checkpoint"):
        ckpt = Checkpointer(tmp_path, tiny_config().checkpoint)
        restored = ckpt.restore_latest(target)
        ckpt.close()

    assert restored is not None and restored.step == 2
    np.testing.assert_array_equal(np.asarray(restored.state["w"]), np.full((4,), 2.0))
    assert not unfinished.exists() and not (tmp_path / DELETED).exists()
    assert not list(tmp_path.glob("corrupt.*")) and "unusable" not in caplog.text


def test_moved_aside_steps_are_kept_until_a_step_at_least_as_new_verifies(tmp_path):
    target = _tiny_saves(tmp_path, [1, 2, 3, 4], keep=4)
    for step in (4, 3, 2):  # the three newest fail verification; step 1 is restored
        (tmp_path / str(step) / MANIFEST).unlink()
    ckpt = Checkpointer(tmp_path, tiny_config(**{"checkpoint.keep": 1}).checkpoint)
    restored = ckpt.restore_latest(target)

    assert restored is not None and restored.step == 1
    assert [s for s, _ in ckpt.quarantined()] == [2, 3, 4]  # all kept, whatever keep says
    ckpt.save(3, {"w": np.full((4,), 3, np.float32)}, {"index": 3}, {}, {"step": 3})
    ckpt.wait()
    assert [s for s, _ in ckpt.quarantined()] == [4]  # 2 and 3 superseded by a verified 3
    ckpt.save(4, {"w": np.full((4,), 4, np.float32)}, {"index": 4}, {}, {"step": 4})
    ckpt.close()
    assert not list(tmp_path.glob("corrupt.*"))


def test_a_commit_file_store_like_gcs_saves_manifests_and_restores(tmp_path, monkeypatch):
    # On gs:// Orbax writes each step into <step> itself and marks it with a commit file
    # (CommitFileTemporaryPath), never <step>.orbax-checkpoint-tmp. Orbax's own "is this GCS"
    # test, answering yes for this directory, makes it take that path without a bucket.
    import jax.numpy as jnp
    from orbax.checkpoint._src.path import gcs_utils

    from meshrl.configs.loader import base_config, from_config_dict

    monkeypatch.setattr(gcs_utils, "is_gcs_path", lambda p: str(p).startswith(str(tmp_path)))
    ck = Checkpointer(tmp_path / "checkpoints", from_config_dict(base_config("sft")).checkpoint)
    state = {"w": jnp.arange(4.0)}
    try:
        ck.save(1, state, {"i": 1}, {"c": 1}, {"step": 1})
        ck.wait()
        restored = ck.restore_latest(jax.eval_shape(lambda: state))
    finally:
        ck.close()

    assert not (tmp_path / "checkpoints" / f"1{TMP_SUFFIX}").exists()  # the commit-file path
    assert (tmp_path / "checkpoints" / "1" / MANIFEST).exists()
    assert restored is not None and restored.step == 1
    np.testing.assert_array_equal(restored.state["w"], np.arange(4.0))
