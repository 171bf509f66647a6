"""On-policy distillation's teacher for the RL job (``distill.*``, docs/distill.md): where a
loaded teacher comes from, and the teacher's line in the run's summary.

A teacher path (``distill.teacher``) is a Hugging Face checkpoint directory (``config.json``
beside the safetensors) or a meshrl run's workdir (its newest verified checkpoint, read with the
model section that run saved: ``jobs.weights_source``). Either way it is loaded for the train
role on the trainer's mesh (``models.load``), so it is sharded like the student, and it must
share the student's vocabulary: it scores the student's token ids. A teacher trained in the run
(``distill.teacher_steps``) is ``jobs.rl_setup``'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import Mesh

from meshrl.configs.fields import ConfigError
from meshrl.configs.schema import Config
from meshrl.inference.async_sampler import AsyncSampler
from meshrl.inference.sampler import Sampler
from meshrl.jobs import weights_source
from meshrl.jobs.weights_source import WeightSource, Wording
from meshrl.mesh import rules_for
from meshrl.models.load import LoadedModel
from meshrl.models.tokenizer import Tokenizer, vocabulary_digest
from meshrl.trainer.checkpoint_reader import CheckpointReader
from meshrl.utils import log as log_lib
from meshrl.utils import paths
from meshrl.utils.aio import run_sync
from meshrl.utils.params import process_local_copy
from meshrl.workflows.setup import aevaluate_held_out

log = log_lib.get_logger("rl")

_WORDS = Wording(source="distill.teacher", step="", version="",
                 instead="point distill.teacher at a Hugging Face checkpoint directory")


def teacher_source(config: Config) -> WeightSource:
    """The teacher of ``distill.teacher``, checked to exist (config files only, no weights):
    a Hugging Face directory, else a meshrl run's newest checkpoint; anything else is one
    ``ConfigError`` line naming the path and what it lacks."""
    where = config.distill.teacher
    path = paths.as_path(where)
    if not path.is_dir():
        raise ConfigError(f"distill.teacher = {where!r}: no such directory: point it at a "
                          f"Hugging Face checkpoint directory or a meshrl run's workdir")
    if (path / "config.json").is_file():
        m = config.model
        # Its own tokenizer when it ships one (checked against the student's: check_vocab);
        # without, it scores the student's ids with the student's.
        tokenizer = ("auto" if (path / "tokenizer.json").is_file()
                     else m.tokenizer if m.tokenizer != "auto" else m.hf_path or "char")
        return WeightSource("hf_path", dataclasses.replace(m, hf_path=str(path),
                                                            tokenizer=tokenizer))
    if not (path / "checkpoints").is_dir():
        raise ConfigError(f"distill.teacher = {where!r}: neither a Hugging Face checkpoint "
                          f"(no config.json) nor a meshrl run (no checkpoints/ directory): "
                          f"point it at one of them")
    reader = CheckpointReader(path / "checkpoints")
    try:
        steps = reader.steps()
    finally:
        reader.close()
    if not steps:
        raise ConfigError(f"distill.teacher = {where!r}: no verified checkpoint under "
                          f"{path / 'checkpoints'}: finish (or resume) the teacher's run, or "
                          f"point distill.teacher at another run or a Hugging Face directory")
    return weights_source.resolve(config, path, "checkpoint", _WORDS)


def check_teacher(config: Config, mesh: Mesh, student_tokenizer: Tokenizer,
                  student_rows: int) -> tuple[WeightSource, Any]:
    """The teacher of ``distill.teacher`` (``teacher_source``) and its skeleton (config and
    tokenizer, no weights read), checked against the student (``check_vocab``)."""
    source = teacher_source(config)
    skeleton = weights_source.skeleton(config, source, mesh, "train")
    check_vocab(config, skeleton.arch.vocab_size, skeleton.tokenizer, student_tokenizer,
                student_rows)
    return source, skeleton


def load_teacher(config: Config, mesh: Mesh, student_tokenizer: Tokenizer, student_rows: int,
                 checked: tuple[WeightSource, Any] | None = None) -> LoadedModel:
    """The teacher of ``distill.teacher`` on ``mesh`` for the train role, its weights read
    after ``check_teacher`` (``checked``: what an earlier call of it returned, not redone)."""
    source, skeleton = checked or check_teacher(config, mesh, student_tokenizer, student_rows)
    loaded, _ = weights_source.fill(config, config.distill.teacher, source, skeleton)
    log.info("distillation teacher: %s (%d layers, hidden %d)", config.distill.teacher,
             loaded.arch.num_layers, loaded.arch.hidden_size)
    return loaded


def check_vocab(config: Config, teacher_rows: int, teacher_tokenizer: Tokenizer,
                student_tokenizer: Tokenizer, student_rows: int) -> None:
    """The teacher scores the student's token ids: its tokenizer must give every id the token
    the student's gives it (``vocabulary_digest``), and its model needs a row for every id the
    student's model can sample (``student_rows``; a padded vocabulary may be larger)."""
    what = config.distill.teacher or "<workdir>/teacher"
    teacher_tokens, student_tokens = teacher_tokenizer.vocab_size, student_tokenizer.vocab_size
    if teacher_tokens != student_tokens:
        raise ConfigError(f"distill.teacher = {what!r}: its tokenizer has {teacher_tokens} "
                          f"tokens, the student's {student_tokens}: distillation scores the "
                          f"student's token ids, so both need one tokenizer (pick a teacher of "
                          f"the student's family)")
    if vocabulary_digest(teacher_tokenizer) != vocabulary_digest(student_tokenizer):
        raise ConfigError(f"distill.teacher = {what!r}: its tokenizer has the student's "
                          f"{student_tokens} tokens but gives ids other tokens: distillation "
                          f"scores the student's token ids, so both need one tokenizer (pick a "
                          f"teacher of the student's family)")
    if teacher_rows < student_rows:
        raise ConfigError(f"distill.teacher = {what!r}: its model has {teacher_rows} "
                          f"vocabulary rows, fewer than the student model's {student_rows} "
                          f"(the student may sample any of them): pick a teacher of the "
                          f"student's family")


async def aevaluate_teacher(config: Config, teacher: Any, sampler_mesh: Mesh, loop: Any
                            ) -> dict[str, float]:
    """The teacher's held-out metrics, measured as the RL loop measures the student
    (``aevaluate_held_out``: agent episodes with ``agent.env``): the same examples, reward
    pool, sampler settings and seed, on a sampler of its own."""
    sampler = AsyncSampler(Sampler(teacher.arch, config.sampler, sampler_mesh,
                                   process_local_copy(teacher.params), version=0,
                                   rules=rules_for("sample")))
    try:
        return await aevaluate_held_out(config, sampler, loop.reward_pool, loop.parts.examples,
                                        loop.tokenizer, version=0)
    finally:
        sampler.shutdown()


def distill_report(config: Config, loop: Any, summary: dict[str, Any]) -> dict[str, Any]:
    """The ``distill`` entry of the RL job's ``summary.json`` (``distill_summary``), the
    teacher evaluated now, after the loop, while its reward pool is still open."""
    teacher_eval = run_sync(aevaluate_teacher(config, loop.reference, loop.sampler_mesh, loop))
    report = distill_summary(teacher_eval, summary)
    log.info("distillation: teacher %s, student %s -> %s", report["teacher_accuracy"],
             report["student_accuracy_before"], report["student_accuracy_after"])
    return report


def distill_summary(teacher_eval: dict[str, float], summary: dict[str, Any]) -> dict[str, Any]:
    """The ``distill`` entry of ``summary.json``: teacher, student before and after (held-out
    greedy accuracy), the gain and the share of the teacher-student gap it closed."""
    teacher = teacher_eval.get("eval/greedy_accuracy")
    before, after = summary.get("accuracy_before"), summary.get("accuracy_after")
    out: dict[str, Any] = {"teacher_accuracy": teacher, "student_accuracy_before": before,
                           "student_accuracy_after": after, "teacher_eval": teacher_eval}
    if None not in (teacher, before, after):
        out["student_gain"] = after - before
        gap = teacher - before
        out["gap_closed"] = (after - before) / gap if gap > 0 else None
    return out
