"""Held-out evaluation of SFT: teacher-forced token accuracy, exact match (every answer token
right) and loss, compiled once and reused by the periodic and the final evaluation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshrl.algorithms.logits import token_stats
from meshrl.mesh import logical_to_sharding, rules_for
from meshrl.trainer.step import ForwardFn
from meshrl.utils import log

_log = log.get_logger("trainer.sft")


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


Counts = Callable[[Any, dict[str, jax.Array]], jax.Array]  # (params, batch) -> [K] sums


def counting_evaluator(counts: Counts, batches: list[dict[str, np.ndarray]], mesh: Mesh,
                       fsdp: bool, report: Callable[[np.ndarray], dict[str, float]]
                       ) -> Callable[[Any], dict[str, float]]:
    """``params -> report(sum over batches of counts(params, batch))``: the batches (whole, the
    same on every process) placed once on the trainer's batch sharding, ``counts`` compiled once (replicated output), so
    periodic and final evaluations reuse both. No batches: ``{}``."""
    if not batches:
        return lambda params: {}
    B, L = batches[0]["input_ids"].shape
    sh = logical_to_sharding(("batch", "length"), mesh, rules_for("train", fsdp), (B, L))
    # Every process builds the whole held-out batch: each device takes its own slice of it
    # (as process-local data, N processes would hold every example N times).
    placed = [{k: jax.make_array_from_callback(v.shape, sh, lambda idx, v=v: v[idx])
               for k, v in b.items()} for b in batches]
    jitted = jax.jit(counts, out_shardings=NamedSharding(mesh, PartitionSpec()))

    def evaluate(params: Any) -> dict[str, float]:
        return report(sum(np.asarray(jax.device_get(jitted(params, b)), np.float64)
                          for b in placed))

    return evaluate


def make_evaluator(forward_fn: ForwardFn, batches: list[dict[str, np.ndarray]], mesh: Mesh,
                   fsdp: bool) -> Callable[[Any], dict[str, float]]:
    """``params -> metrics``: teacher-forced token accuracy, exact match (every answer token
    right) and loss over ``batches``. A token is right when its target's logit is the row
    maximum (ties count as right); the logits come in float32 chunks when ``forward_fn``
    returns a ``Hidden``."""
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

    def report(total: np.ndarray) -> dict[str, float]:
        right, tokens, nll, exact, seqs = total
        return {"eval_token_accuracy": float(right / max(tokens, 1)),
                "eval_exact_match": float(exact / max(seqs, 1)),
                "eval_loss": float(nll / max(tokens, 1)),
                "eval_sequences": float(seqs)}

    return counting_evaluator(counts, batches, mesh, fsdp, report)
