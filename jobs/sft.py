"""The SFT job: ``python main.py --config configs/sft_synthetic.py --workdir W``.

Builds tokenizer, data iterator, mesh and model; runs the ``TrainEngine``'s SFT loop (resuming
from the newest good checkpoint); evaluates teacher-forced held-out token accuracy and exact match
(every answer token right); writes ``<workdir>/summary.json``.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshrl.algorithms.logits import token_stats
from meshrl.algorithms.losses import get_loss
from meshrl.configs.schema import Config
from meshrl.datasets import eval_examples, make_sft_iterator
from meshrl.datasets.pipeline import response_ids
from meshrl.jobs.report import sft_summary_table
from meshrl.mesh import create_mesh, initialize_distributed, logical_to_sharding, rules_for
from meshrl.models import (
    build_model,
    flops_per_token,
    param_count,
    param_shardings,
    resolve_model_config,
    split_model,
)
from meshrl.models.tokenizer import tokenizer_for
from meshrl.trainer.engine import Trainee, TrainEngine
from meshrl.trainer.state import params_checksum
from meshrl.trainer.step import ForwardFn, decoder_forward
from meshrl.trainer.stop import stop_hook
from meshrl.utils import log, paths

_log = log.get_logger("trainer.sft")


def _teacher_forced(ex: dict, tokenizer: Any) -> dict:
    """Prompt + reference response as the SFT pipeline builds them: input, target, mask."""
    full = list(ex["prompt_ids"]) + response_ids(ex, ex["prompt_text"], tokenizer)
    n_prompt = len(ex["prompt_ids"])
    return {"_input": full[:-1], "_target": full[1:],
            "_mask": [0.0] * (n_prompt - 1) + [1.0] * (len(full) - n_prompt)}


def eval_batches(examples: list[dict], seq_len: int, batch_size: int, pad_id: int
                 ) -> list[dict[str, np.ndarray]]:
    """One held-out example per row (no packing), padded to ``[batch_size, seq_len]``; padding
    rows have an all-zero loss mask."""
    rows = [ex for ex in examples if len(ex["_input"]) <= seq_len]
    if len(rows) < len(examples):
        _log.warning("eval: %d of %d held-out examples exceed trainer.seq_len = %d and are "
                     "left out", len(examples) - len(rows), len(examples), seq_len)
    out = []
    for i in range(0, len(rows), batch_size):
        chunk = rows[i:i + batch_size]
        ids = np.full((batch_size, seq_len), pad_id, np.int32)
        tgt = np.full((batch_size, seq_len), pad_id, np.int32)
        mask = np.zeros((batch_size, seq_len), np.float32)
        seg = np.zeros((batch_size, seq_len), np.int32)
        pos = np.zeros((batch_size, seq_len), np.int32)
        for r, ex in enumerate(chunk):
            n = len(ex["_input"])
            ids[r, :n], tgt[r, :n], mask[r, :n] = ex["_input"], ex["_target"], ex["_mask"]
            seg[r, :n], pos[r, :n] = 1, np.arange(n)
        out.append({"input_ids": ids, "targets": tgt, "loss_mask": mask, "positions": pos,
                    "segment_ids": seg})
    return out


def make_evaluator(forward_fn: ForwardFn, batches: list[dict[str, np.ndarray]], mesh: Mesh,
                   fsdp: bool) -> Callable[[Any], dict[str, float]]:
    """``params -> metrics``: teacher-forced token accuracy, exact match (every answer token
    right) and loss over ``batches``; compiled once, reused by periodic and final evals.
    A token is right when its target's logit is the row maximum (ties count as right); the
    logits come in float32 chunks when ``forward_fn`` returns a ``Hidden``."""
    if not batches:
        return lambda params: {}
    B, L = batches[0]["input_ids"].shape
    sh = logical_to_sharding(("batch", "length"), mesh, rules_for("train", fsdp), (B, L))
    placed = [{k: jax.make_array_from_process_local_data(sh, v) for k, v in b.items()}
              for b in batches]

    @functools.partial(jax.jit, out_shardings=NamedSharding(mesh, PartitionSpec()))
    def counts(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        out = forward_fn(params, batch["input_ids"], batch["positions"], batch["segment_ids"])
        stats = token_stats(out, batch["targets"], correct=True)
        mask_BxL = batch["loss_mask"]
        right_BxL = stats.correct_BxL
        has_B = mask_BxL.sum(-1) > 0
        exact_B = ((right_BxL * mask_BxL).sum(-1) == mask_BxL.sum(-1)) & has_B
        return jnp.stack([(right_BxL * mask_BxL).sum(), mask_BxL.sum(),
                          (-stats.logprobs_BxL * mask_BxL).sum(), exact_B.sum(),
                          has_B.sum()])

    def evaluate(params: Any) -> dict[str, float]:
        total = sum(np.asarray(jax.device_get(counts(params, b)), np.float64) for b in placed)
        right, tokens, nll, exact, seqs = total
        return {"eval_token_accuracy": float(right / max(tokens, 1)),
                "eval_exact_match": float(exact / max(seqs, 1)),
                "eval_loss": float(nll / max(tokens, 1)),
                "eval_sequences": float(seqs)}

    return evaluate


def run(config: Config, workdir: str) -> dict[str, Any]:
    """Train, evaluate, write ``summary.json``; returns the summary."""
    initialize_distributed(config.distributed)
    log.set_process_index(jax.process_index())
    mesh = create_mesh(config.mesh)
    rules = rules_for("train", config.mesh.fsdp)
    tcfg = config.trainer
    model_cfg = resolve_model_config(config.model)  # model.hf_path's architecture when set
    tokenizer = tokenizer_for(config.model, model_cfg.vocab_size)
    data = make_sft_iterator(config.data, tokenizer, batch_size=tcfg.batch_size,
                             seq_len=tcfg.seq_len, seed=tcfg.seed,
                             process_index=jax.process_index(),
                             process_count=jax.process_count(), pack=config.data.pack)
    model = build_model(config.model, mesh=mesh, rules=rules, seed=tcfg.seed)
    graphdef, params = split_model(model)
    del model
    trainee = Trainee(forward=decoder_forward(graphdef, tcfg.logits_chunk), params=params,
                      params_shardings=param_shardings(params, mesh, rules),
                      flops_per_token=flops_per_token(model_cfg, tcfg.seq_len))
    n_params = param_count(model_cfg)
    _log.info("SFT: %.2fM params, mesh %s, %d steps of %d x %d tokens", n_params / 1e6,
              dict(mesh.shape), tcfg.steps, tcfg.batch_size, tcfg.seq_len)
    held_out = eval_batches([_teacher_forced(ex, tokenizer)
                             for ex in eval_examples(config.data, tokenizer)],
                            tcfg.seq_len, tcfg.batch_size, tokenizer.pad_id)
    evaluate = make_evaluator(trainee.forward, held_out, mesh, config.mesh.fsdp)

    def periodic_eval(step: int, engine: TrainEngine) -> None:
        if tcfg.eval_every and step % tcfg.eval_every == 0 and step != tcfg.steps:
            ev = evaluate(engine.params)
            _log.info("eval at step %d: %s", step, ev)
            engine.metrics.write(step, ev)

    engine = TrainEngine(config, workdir, mesh, trainee, get_loss("sft"))
    t0 = time.perf_counter()
    try:
        engine.start(data=data)
        history = engine.run_sft(hooks=[periodic_eval, stop_hook])
        wall = time.perf_counter() - t0
        ev = evaluate(engine.params)
        if ev:
            engine.metrics.write(tcfg.steps, ev)
        checksum = params_checksum(engine.params)  # every process: a collective
    finally:
        engine.close()
    steady = [h["tokens_per_s"] for h in history[1:]] or [h["tokens_per_s"] for h in history]
    summary = {
        "job": config.job.value, "steps": tcfg.steps, "start_step": engine.start_step,
        "final_loss": history[-1]["loss"] if history else None,
        "first_loss": history[0]["loss"] if history else None,
        "tokens_per_s": float(np.median(steady)) if steady else None,
        "mfu": float(np.median([h["mfu"] for h in history[1:]])) if len(history) > 1 else None,
        "skipped_steps": int(history[-1]["skipped"]) if history else 0,
        "params": n_params, "wall_s": wall, "devices": int(mesh.devices.size),
        "processes": jax.process_count(), "params_checksum": checksum,
        **ev,
    }
    _log.info("params_checksum %.17g", checksum)  # on every process: they must agree
    if jax.process_index() == 0:
        paths.write_text_atomic(paths.as_path(workdir) / "summary.json",
                                json.dumps(summary, indent=2))
        _log.info("%s", sft_summary_table(summary, workdir))
    return summary
