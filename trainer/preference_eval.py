"""Held-out evaluation of preference training: how often the policy prefers the chosen
completion, compiled once and reused by the periodic and the final evaluation.

A pair counts as preferred when the policy's summed log p(chosen completion) exceeds its log
p(rejected completion) (the quantity the DPO family's implicit reward compares, without the
reference, so the score of the starting policy is meaningful too)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from meshrl.algorithms.logits import token_stats
from meshrl.algorithms.preference import pair_sums
from meshrl.trainer.sft_eval import counting_evaluator
from meshrl.trainer.step import ForwardFn


def make_preference_evaluator(forward_fn: ForwardFn, batches: list[dict[str, np.ndarray]],
                              mesh: Mesh, fsdp: bool) -> Callable[[Any], dict[str, float]]:
    """``params -> {"eval_preference_accuracy", "eval_logp_margin", "eval_pairs"}`` over
    ``batches`` of adjacent (chosen, rejected) rows (``datasets.preference.pair_arrays``);
    all-padding pairs are not counted. No batches: ``{}``."""
    def counts(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        out = forward_fn(params, batch["input_ids"], batch["positions"], batch["segment_ids"])
        mask_BxL = batch["loss_mask"]
        pc_P, pr_P = pair_sums(token_stats(out, batch["targets"]).logprobs_BxL, mask_BxL)
        real_P = (mask_BxL.sum(-1)[0::2] > 0).astype(jnp.float32)
        return jnp.stack([((pc_P > pr_P) * real_P).sum(), ((pc_P - pr_P) * real_P).sum(),
                          real_P.sum()])

    def report(total: np.ndarray) -> dict[str, float]:
        right, margin, pairs = total
        return {"eval_preference_accuracy": float(right / max(pairs, 1)),
                "eval_logp_margin": float(margin / max(pairs, 1)), "eval_pairs": float(pairs)}

    return counting_evaluator(counts, batches, mesh, fsdp, report)
