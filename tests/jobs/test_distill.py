"""On-policy distillation end to end on tiny shapes: the RL job with a ``distill`` section trains
a wider teacher under ``<workdir>/teacher`` first, distils the student from it (the advantages
the step trains on are the teacher's minus the sampler's logprobs), reports teacher and student
accuracy in ``summary.json``, and ``distill.teacher`` loads that teacher back from the run's
``teacher`` directory at its own width."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from meshrl.tests.trainer.tiny import tiny_rl_config


def _teacher_run_config():
    # One RL step of a random-init student; one compiled RL step (no packed row buckets).
    return tiny_rl_config(**{"trainer.steps": 1, "distill.teacher_steps": 2,
                             "distill.teacher_hidden_size": 64,
                             "distill.teacher_intermediate_size": 128,
                             "rl.warm_start_batch_size": 4, "rl.pack_sequences": False})


# ~30 s of one distillation run shared by the module; the advantage math, the teacher's loading
# at another width on a sharded mesh and the config rules run in the default suite
# (tests/algorithms/test_distill.py, tests/jobs/test_distill_setup.py).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    from meshrl.jobs import rl as rl_job
    from meshrl.trainer import reference

    workdir = tmp_path_factory.mktemp("distill")
    prepared = []  # (batch, metrics) of each step after the teacher set its advantages
    real = reference.ReferencePolicy.apply

    def spy(policy, batch):
        out = real(policy, batch)
        prepared.append(jax.device_get(out))  # explicit: the transfer guard allows it
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(reference.ReferencePolicy, "apply", spy)
        summary = rl_job.run(_teacher_run_config(), str(workdir))
    return workdir, summary, prepared


def test_distill_job_trains_the_teacher_first_and_reports_teacher_and_student(distilled):
    workdir, summary, _ = distilled

    teacher_ckpts = [p.name for p in (workdir / "teacher" / "checkpoints").iterdir()
                     if p.name.isdigit()]
    assert teacher_ckpts == ["2"]
    written = json.loads((workdir / "summary.json").read_text())
    d = written["distill"]
    assert set(d) >= {"teacher_accuracy", "student_accuracy_before", "student_accuracy_after",
                      "student_gain", "teacher_eval"}
    assert d["student_accuracy_after"] == summary["accuracy_after"]
    assert 0.0 <= d["teacher_accuracy"] <= 1.0
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    kls = [r["train/distill_reverse_kl"] for r in rows if "train/distill_reverse_kl" in r]
    # A 2-step teacher and a 1-step student disagree: the reverse KL is far from 0.
    assert len(kls) == 1 and np.isfinite(kls[0]) and abs(kls[0]) > 1e-3


def test_step_trains_on_teacher_minus_sampler_logprob_advantages(distilled):
    _, _, prepared = distilled
    ((batch, metrics),) = prepared
    mask = np.asarray(batch.loss_mask) > 0
    adv = np.asarray(batch.advantages)

    # On the mask: advantage + behaviour logprob is the teacher's logprob (<= 0), not the task
    # advantage the host built (distill.reward_weight is 0); off the mask: 0.
    teacher = adv + np.asarray(batch.behaviour_logprobs)
    assert mask.any() and (teacher[mask] <= 1e-5).all()
    assert not adv[~mask].any()
    np.testing.assert_allclose(float(metrics["distill_reverse_kl"]), -adv[mask].mean(),
                               rtol=1e-5, atol=1e-6)


def test_teacher_loads_back_from_the_runs_workdir_at_its_own_width(distilled):
    from meshrl.jobs.distill import load_teacher
    from meshrl.mesh import create_mesh
    from meshrl.models.tokenizer import CharTokenizer

    workdir, _, _ = distilled
    config = tiny_rl_config(**{"distill.teacher": str(workdir / "teacher")})

    teacher = load_teacher(config, create_mesh(config.mesh), CharTokenizer(256), 256)

    # The width comes from the model section the teacher's run saved, not from model.*.
    assert (teacher.arch.hidden_size, config.model.hidden_size) == (64, 32)
    assert not teacher.abstract
