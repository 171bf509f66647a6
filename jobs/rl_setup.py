"""Setup of the RL job: the trainee, the SFT warm start that gives RL a mediocre rather than a
random policy (``docs/rl.md``), the KL reference or the distillation teacher
(``docs/distill.md``) and this process's place in the batch."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from etils import epath

from meshrl.configs.distill_schema import teacher_model
from meshrl.configs.schema import Config, Job
from meshrl.datasets import make_sft_iterator
from meshrl.jobs.distill import check_teacher, check_vocab, load_teacher
from meshrl.jobs.lora_source import finished_warm_start, warm_start_dir
from meshrl.mesh import logical_to_sharding, rules_for
from meshrl.models import load
from meshrl.trainer.engine import Trainee, TrainEngine
from meshrl.trainer.reference import ReferencePolicy
from meshrl.trainer.sft_loop import run_sft
from meshrl.trainer.spec import rl_batch_size, sft_spec
from meshrl.utils import log as log_lib

log = log_lib.get_logger("rl")


def warm_start_steps(config: Config) -> int:
    """SFT steps before RL: none for a pretrained model (``model.hf_path``), else
    ``rl.warm_start_steps`` with -1 meaning as many as ``trainer.steps``."""
    if config.model.hf_path:
        return 0
    n = config.rl.warm_start_steps
    return config.trainer.steps if n == -1 else n


def warm_start_config(config: Config, steps: int) -> Config:
    """The SFT config of the warm start: ``steps`` steps of ``rl.warm_start_batch_size``
    sequences with AdamW at peak rate ``rl.warm_start_lr``, no held-out evaluation, no Weights &
    Biases run (the RL run is the one a user follows there; the warm start's curves stay in
    <workdir>/sft) and no profiler trace (``logging.profile_steps`` names RL steps); every other
    field as in ``config``; with LoRA the warm start trains the full model (``lora.rank = 0``):
    RL then adapts it, as it would adapt a pretrained checkpoint.
    """
    t = config.trainer
    return dataclasses.replace(
        config, job=Job.SFT,
        trainer=dataclasses.replace(t, steps=steps, eval_every=0,
                                    learning_rate=config.rl.warm_start_lr,
                                    batch_size=config.rl.warm_start_batch_size),
        optimizer=dataclasses.replace(config.optimizer, name="adamw"),
        logging=dataclasses.replace(config.logging, wandb_project="", profile_steps=()),
        lora=dataclasses.replace(config.lora, rank=0))


def run_warm_start(config: Config, workdir: epath.Path, mesh: Any, trainee: Trainee,
                   tokenizer: Any, steps: int, subdir: str = "sft") -> Any:
    """``steps`` of SFT under ``<workdir>/<subdir>`` (resumable; a finished one is only
    restored); returns the final params. ``subdir`` "teacher": the distillation teacher."""
    sft = warm_start_config(config, steps)
    t = sft.trainer
    data = make_sft_iterator(config.data, tokenizer, batch_size=t.batch_size, seq_len=t.seq_len,
                             seed=t.seed, process_index=jax.process_index(),
                             process_count=jax.process_count(), pack=config.data.pack)
    (workdir / subdir).mkdir(parents=True, exist_ok=True)
    log.info("SFT %s: %d steps of %d x %d tokens under %s",
             "warm start" if subdir == "sft" else subdir, steps, t.batch_size, t.seq_len,
             workdir / subdir)
    engine = TrainEngine(sft, workdir / subdir, mesh, trainee, sft_spec(sft, mesh))
    try:
        engine.start(data=data)
        run_sft(engine)  # a stop request is honoured at its steps
        return engine.params
    finally:
        engine.close()


def load_trainee(config: Config, mesh: Any) -> tuple[Trainee, Any, Any]:
    """(the trainee on the trainer mesh, the model's architecture, the tokenizer); a missing
    tokenizer fails before any weights are read (``models.load``)."""
    loaded = load(config, mesh, "train")
    return Trainee.of(loaded, config), loaded.arch, loaded.tokenizer


def sample_rows(config: Config, mesh: Any) -> np.ndarray:
    """Each of this process's samples' index in the global batch, in the order its local data
    fills them (``jax.make_array_from_process_local_data``: its slices of the batch axis by
    start). On a TPU pod the slices of one host need not be adjacent."""
    B = rl_batch_size(config)
    sh = logical_to_sharding(("batch",), mesh, rules_for("train", config.mesh.fsdp), (B,))
    slices = {idx[0].indices(B)[:2] for idx in sh.addressable_devices_indices_map((B,)).values()}
    return np.concatenate([np.arange(lo, hi) for lo, hi in sorted(slices)]).astype(np.int32)


def reference_and_params(config: Config, workdir: epath.Path, engine: TrainEngine,
                         tokenizer: Any, vocab_rows: int
                         ) -> tuple[ReferencePolicy | None, Any, int]:
    """(the KL reference or None, the params RL starts from, the run's warm-start steps, a
    resumed run's included). A fresh run warm-starts when ``warm_start_steps`` says so. A
    resumed run whose warm start ran needs its result again when it is the KL reference or
    the frozen LoRA base: it reruns the finished warm start to its last checkpoint, which
    restores and trains nothing, whatever ``trainer.steps`` says now (with
    ``rl.warm_start_steps = -1`` a longer run would otherwise train the reference further).
    ``vocab_rows``: the student model's vocabulary rows (a loaded teacher needs as many)."""
    kl, restored = config.rl.kl_coef > 0.0, engine.restored
    checked = None
    if config.distill.teacher:
        # A bad teacher path or another vocabulary fails before the warm start trains.
        checked = check_teacher(config, engine.mesh, tokenizer, vocab_rows)
    trainee = engine.trainee
    params = trainee.params
    sft_steps = warm_start_steps(config)
    # A resumed run's train state holds every weight RL trains; the warm start's result is
    # needed again only as the KL reference or the frozen LoRA base.
    needed = restored is None or kl or engine.lora is not None
    if restored is not None and sft_steps:
        finished = finished_warm_start(workdir)
        if finished is None and needed:
            log.warning("no SFT checkpoint under %s: retraining the warm start to rebuild the "
                        "%s", warm_start_dir(workdir),
                        "KL reference policy" if kl else "frozen LoRA base")
        sft_steps = sft_steps if finished is None else finished
    if sft_steps and needed:
        params = run_warm_start(config, workdir, engine.mesh, dataclasses.replace(trainee),
                                tokenizer, sft_steps)
    if config.distill.enabled:
        reference: ReferencePolicy | None = teacher_policy(config, workdir, engine, tokenizer,
                                                           vocab_rows, checked)
    else:
        # With LoRA the reference is the adapter-disabled forward over the engine's frozen
        # base (the params the engine starts from): no second copy of the weights.
        lora = engine.lora
        reference = None if not kl else ReferencePolicy(
            config.rl, trainee.forward if lora is None else lora.reference_forward(
                trainee.forward), params, engine.params_sh if lora is None else lora.frozen_sh,
            engine.mesh, engine.batch_sh, samples=rl_batch_size(config),
            temperature=config.sampler.temperature, group_size=config.rollout.group_size,
            microbatches=forward_microbatches(config),
            base=None if lora is None else engine.frozen_base)
    return reference, params, sft_steps


def forward_microbatches(config: Config) -> int:
    """Microbatches of a reference or teacher forward over the batch: as many as the RL step's
    proximal pass, so that no forward holds more rows than one update's microbatch."""
    return config.trainer.microbatches * config.rl.ppo_minibatches


def teacher_policy(config: Config, workdir: epath.Path, engine: TrainEngine, tokenizer: Any,
                   vocab_rows: int, checked: Any = None) -> ReferencePolicy:
    """The distillation teacher on the trainer's mesh, in the reference's place: loaded from
    ``distill.teacher`` (``jobs.distill``), or trained in this run first with
    ``distill.teacher_steps`` SFT steps under ``<workdir>/teacher`` (a resumed run restores
    it and trains nothing)."""
    d = config.distill
    if d.teacher_steps:
        # The teacher's config is the student's with the teacher's model section; its warm
        # start config (SFT at rl.warm_start_lr) is the teacher's training.
        tcfg = dataclasses.replace(config, model=teacher_model(config.model, d))
        loaded = load(tcfg, engine.mesh, "train")
        check_vocab(config, loaded.arch.vocab_size, loaded.tokenizer, tokenizer, vocab_rows)
        trainee = Trainee.of(loaded, tcfg)
        params = run_warm_start(tcfg, workdir, engine.mesh, trainee, tokenizer,
                                d.teacher_steps, subdir="teacher")
    else:
        loaded = load_teacher(config, engine.mesh, tokenizer, vocab_rows, checked)
        trainee = Trainee.of(loaded, config)
        params = trainee.params
    return ReferencePolicy(
        config.rl, trainee.forward, params, trainee.params_shardings, engine.mesh,
        engine.batch_sh, samples=rl_batch_size(config), temperature=config.sampler.temperature,
        group_size=config.rollout.group_size, microbatches=forward_microbatches(config),
        distill=d, arch=loaded.arch)
