"""The frozen reference of preference training: the policy the run starts from.

``PreferenceReference`` holds its own copy of the starting params on the trainer's shardings
(the train step donates the state, so its buffers cannot be shared) and one jitted, sharded
``apply(batch)`` that the SFT loop runs before each step (``run_sft(prepare=...)``): it scores
the batch's targets with ``trainer.reference.reference_logprobs`` (temperature 1, microbatched
like the step, 0 off the loss mask) and returns the batch with ``ref_logprobs`` set. Cost: one
more copy of the params and one forward pass per step, no activations kept for a backward.
With LoRA (``base``) the reference is the adapter-disabled forward over the engine's frozen
base as the step holds it (cast or quantised): the policy at step 0, and no copy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh

from meshrl.algorithms.batch import PreferenceBatch
from meshrl.trainer.reference import frozen_copy, reference_logprobs
from meshrl.trainer.step import ForwardFn


class PreferenceReference:
    """Frozen starting params and the per-step function that puts their logprobs in the batch."""

    def __init__(self, forward_fn: ForwardFn, params: Any, params_sh: Any, mesh: Mesh,
                 batch_sh: PreferenceBatch, *, microbatches: int = 1,
                 base: Callable[[], Any] | None = None) -> None:
        del mesh  # the shardings carry it
        # ``base``: read at each apply (the train step donates and returns the frozen base).
        self._base = base
        self.params = frozen_copy(params, params_sh) if base is None else None

        def apply(ref_params: Any, batch: PreferenceBatch
                  ) -> tuple[PreferenceBatch, dict[str, jax.Array]]:
            ref_BxL = reference_logprobs(forward_fn, ref_params, batch, temperature=1.0,
                                         microbatches=microbatches)
            return batch.replace(ref_logprobs=ref_BxL), {}

        in_sh = batch_sh.replace(ref_logprobs=None)
        self._apply = jax.jit(apply, in_shardings=(params_sh, in_sh),
                              out_shardings=(batch_sh, {}))

    def apply(self, batch: PreferenceBatch) -> tuple[PreferenceBatch, dict[str, jax.Array]]:
        """(the train step's batch, no metrics); no host sync."""
        return self._apply(self.params if self._base is None else self._base(), batch)
