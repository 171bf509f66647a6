"""The preference job (DPO, IPO, SimPO): ``python main.py --config configs/dpo.py --workdir W``.

Wires the tokenizer, the preference pairs (``dpo.path`` or the synthetic task), the model and
the frozen reference into the SFT loop (``trainer.sft_loop``, the
reference scoring each batch before its step), evaluates held-out preference accuracy before and
after, and writes ``<workdir>/summary.json``. Design and formulas: docs/dpo.md.
"""

from __future__ import annotations

import time
from typing import Any

import jax

from meshrl.algorithms.preference import NEEDS_REFERENCE
from meshrl.configs.schema import Config
from meshrl.datasets import PreferenceIterator, eval_pair_batches, load_pairs, tokenize_pairs
from meshrl.datasets.pipeline import mix_seed
from meshrl.mesh import create_mesh
from meshrl.models import load, param_count
from meshrl.models.load import with_weights
from meshrl.trainer.engine import Trainee, TrainEngine
from meshrl.trainer.preference_eval import make_preference_evaluator
from meshrl.trainer.preference_ref import PreferenceReference
from meshrl.trainer.sft_loop import train_and_evaluate
from meshrl.trainer.spec import dpo_spec
from meshrl.trainer.summary import write_summary
from meshrl.utils import log

_log = log.get_logger("trainer.dpo")


def _pairs(config: Config, tokenizer: Any, held_out: bool) -> list[dict]:
    pairs = load_pairs(config.dpo, config.data, held_out)
    if not pairs:
        return []
    return tokenize_pairs(pairs, tokenizer, config.trainer.seq_len, config.data.on_overlong,
                          config.data.max_prompt_len)


def training_pairs(config: Config, tokenizer: Any) -> PreferenceIterator:
    """This process's stream of training pairs, shuffled by ``trainer.seed`` mixed with
    ``data.shuffle_seed`` (as the SFT pipeline shuffles)."""
    t = config.trainer
    return PreferenceIterator(_pairs(config, tokenizer, held_out=False),
                              pairs_per_step=t.batch_size // 2, seq_len=t.seq_len,
                              pad_id=tokenizer.pad_id,
                              seed=mix_seed(t.seed, config.data.shuffle_seed),
                              process_index=jax.process_index(),
                              process_count=jax.process_count())


def run(config: Config, workdir: str) -> dict[str, Any]:
    """Train on preference pairs, evaluate before/after, write ``summary.json``; returns the
    summary. Distributed start-up is ``jobs.dispatch``'s."""
    mesh = create_mesh(config.mesh)
    t = config.trainer
    # The tokenizer and the data first: a bad file fails before any weights are read.
    skeleton = load(config, mesh, "train", abstract=True)
    tokenizer = skeleton.tokenizer
    data = training_pairs(config, tokenizer)
    held_out = eval_pair_batches(_pairs(config, tokenizer, held_out=True), t.batch_size,
                                 t.seq_len, tokenizer.pad_id)
    trainee = Trainee.of(with_weights(skeleton, t.seed), config)
    n_params = param_count(skeleton.arch)
    _log.info("%s: %.2fM params, mesh %s, %d steps of %d pairs x %d tokens", config.dpo.loss,
              n_params / 1e6, dict(mesh.shape), t.steps, t.batch_size // 2, t.seq_len)
    evaluate = make_preference_evaluator(trainee.forward, held_out, mesh, config.mesh.fsdp)
    engine = TrainEngine(config, workdir, mesh, trainee, dpo_spec(config, mesh))
    t0 = time.perf_counter()
    try:
        # The reference is the policy the run started from: the model as loaded (a resumed
        # run loads it the same way: model.hf_path, or the random init of trainer.seed).
        params = trainee.params
        # With LoRA the policy at step 0 is the base as the step stores it (cast or
        # quantised): evaluated once the engine holds it, below.
        before = evaluate(params) if engine.lora is None else None
        reference = None
        if config.dpo.loss in NEEDS_REFERENCE:
            # With LoRA: the adapter-disabled forward over the base the step trains on (cast
            # or quantised), not the float params it was made from.
            lora = engine.lora
            reference = PreferenceReference(
                trainee.forward if lora is None else lora.reference_forward(trainee.forward),
                params, engine.params_sh if lora is None else lora.frozen_sh, mesh,
                engine.batch_sh, microbatches=t.microbatches,
                base=None if lora is None else engine.frozen_base)
        engine.start(params, data=data)
        del params
        if before is None:
            before = evaluate(engine.lora.merged(engine.frozen_base(), None))
        summary, history, after = train_and_evaluate(
            engine, evaluate, n_params, t0,
            prepare=None if reference is None else reference.apply)
    finally:
        engine.close()
    summary.update({"loss_name": config.dpo.loss,
                    **{f"{k}_before": v for k, v in before.items()},
                    **{k: history[-1][k] for k in ("reward_margin", "reward_accuracy")
                       if history}})
    write_summary(summary, workdir)
    if jax.process_index() == 0 and "eval_preference_accuracy" in after:  # none: no held-out
        _log.info("held-out preference accuracy %.3f -> %.3f",
                  before["eval_preference_accuracy"], after["eval_preference_accuracy"])
    return summary
