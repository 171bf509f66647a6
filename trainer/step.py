"""The pure train step and its one jitted, sharded instance.

``make_train_step`` returns ``train_step(state, batch) -> (state, metrics)``: gradient accumulation
over microbatches with ``lax.scan`` (token-weighted, so it equals one big batch), global-norm
clipping and the optax update, and a non-finite guard that keeps the old params and optimizer
state on the device (no host sync). ``jit_train_step`` compiles it once with explicit shardings and
donates the state.

The forward hands the loss either logits or (``decoder_forward``, what the jobs use) a
``Hidden``: the final hidden states and the head, whose float32 logits the loss computes
``trainer.logits_chunk`` tokens at a time, so no [B, L, V] float32 array is ever held.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshrl.algorithms.batch import TrainBatch, abstract_batch, batch_of
from meshrl.algorithms.logits import Hidden, ModelOutput
from meshrl.algorithms.losses import LossFn, add_outputs, report_aux, router_terms
from meshrl.mesh import Rules, logical_to_sharding
from meshrl.models.decoder import (
    forward_hidden,
    loss_length_axes,
    loss_vocab_axes,
    model_config,
)
from meshrl.trainer.optimizer import Schedule
from meshrl.trainer.state import TrainState

Batch = TrainBatch  # or a subclass (``RLTrainBatch``): device arrays, ``[B, L]`` each
Metrics = dict[str, jax.Array]
# forward(params, input_ids_BxL, positions_BxL, segment_ids_BxL) -> logits_BxLxV or Hidden;
# decoder_forward takes a fifth, replay_BxLxNxK (``replay_args``)
ForwardFn = Callable[[Any, jax.Array, jax.Array | None, jax.Array | None], ModelOutput]
StepFn = Callable[[TrainState, Batch], tuple[TrainState, Metrics]]
# make_step(forward, loss_fn, tx, schedule) -> the pure step (e.g. make_train_step, partial)
StepBuilder = Callable[[ForwardFn, LossFn, optax.GradientTransformation, Schedule], StepFn]
BATCH_AXES = ("batch", "length")


def decoder_forward(graphdef: Any, logits_chunk: int) -> ForwardFn:
    """The trainer's forward of a meshrl ``Decoder`` (``graphdef``): a ``Hidden`` whose logits
    the losses compute in float32, ``logits_chunk`` tokens at a time (0: all at once). Its
    optional ``replay_BxLxNxK`` (``[B, L, layers, k]`` expert ids, -1: the model's own
    routing) is MoE routing replay (``replay_args``)."""
    if logits_chunk < 0:
        raise ValueError(f"logits_chunk = {logits_chunk}: must be >= 0")

    def forward(params: Any, input_ids_BxL: jax.Array, positions_BxL: jax.Array | None,
                segment_ids_BxL: jax.Array | None,
                replay_BxLxNxK: jax.Array | None = None) -> Hidden:
        # Routing replay (``RLTrainBatch.routing``): the decoder takes the layers first.
        replay = None if replay_BxLxNxK is None else jnp.transpose(replay_BxLxNxK, (2, 0, 1, 3))
        hidden_BxLxD, head, tied, router = forward_hidden(
            graphdef, params, input_ids_BxL, positions_BxL, segment_ids_BxL, router_stats=True,
            replay_NxBxLxK=replay)
        mesh, vocab_axes, batch_axes = loss_vocab_axes(
            graphdef, params, head.shape[0 if tied else 1], hidden_BxLxD.shape[0])
        cfg = model_config(graphdef, params)
        length_axes = loss_length_axes(graphdef, params, *hidden_BxLxD.shape[:2])
        return Hidden(hidden_BxLxD, head, tied=tied, chunk=logits_chunk, mesh=mesh,
                      vocab_axes=vocab_axes, batch_axes=batch_axes, length_axes=length_axes,
                      router=router,
                      aux_loss_coef=cfg.router_aux_loss_coef, z_loss_coef=cfg.router_z_loss_coef)

    return forward


def replay_args(batch: Batch) -> tuple[jax.Array, ...]:
    """The forward's routing replay argument for ``batch``: its ``routing`` when it has one
    (an ``RLTrainBatch`` of an MoE run with ``rl.routing_replay``), else nothing, so forwards
    that do not take it (dense test models) are called as before. Positional: wrappers such
    as the LoRA forward pass ``*args`` on."""
    routing = getattr(batch, "routing", None)
    return () if routing is None else (routing,)


def split_rows(x_BxL: jax.Array, m: int) -> jax.Array:
    """[B, ...] -> [M, B/M, ...] with row i in microbatch i % M.

    Strided rather than contiguous: each data shard holds contiguous rows, so the strided split
    leaves every microbatch spread over all data shards (no resharding, full parallelism).
    """
    b = x_BxL.shape[0]
    assert b % m == 0, f"batch {b} not divisible by microbatches {m}"
    return x_BxL.reshape(b // m, m, *x_BxL.shape[1:]).swapaxes(0, 1)


def merge_rows(x_MxbxL: jax.Array) -> jax.Array:
    """The inverse of ``split_rows``: [M, B/M, ...] -> [B, ...] in row order."""
    m, b = x_MxbxL.shape[:2]
    return x_MxbxL.swapaxes(0, 1).reshape(m * b, *x_MxbxL.shape[2:])


GradsFn = Callable[[Any, Batch], tuple[jax.Array, jax.Array, dict[str, Any], Any]]


def make_grads_fn(forward_fn: ForwardFn, loss_fn: LossFn, microbatches: int = 1) -> GradsFn:
    """``(params, batch) -> (loss_sum, weight, aux, grads)``: the loss output and its gradient,
    summed over ``microbatches`` strided microbatches (``add_outputs``)."""

    def micro_loss(params: Any, mb: Batch) -> tuple[jax.Array, tuple[jax.Array, Metrics]]:
        out = forward_fn(params, mb.input_ids, mb.positions, mb.segment_ids,
                         *replay_args(mb))
        loss_sum, weight, aux = loss_fn(out, mb)
        loss_sum, aux = router_terms(out, loss_sum, weight, aux)
        return loss_sum, (weight, aux)

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def flat_grads(params: Any, mb: Batch) -> tuple[jax.Array, jax.Array, Metrics, Any]:
        (loss_sum, (weight, aux)), grads = grad_fn(params, mb)
        return loss_sum, weight, aux, grads

    def accumulate(params: Any, batch: Batch) -> tuple[jax.Array, jax.Array, Metrics, Any]:
        if microbatches == 1:
            return flat_grads(params, batch)
        mbs = jax.tree.map(lambda v: split_rows(v, microbatches), batch)

        def body(carry: Any, mb: Batch) -> tuple[Any, None]:
            return add_outputs(carry, flat_grads(params, mb)), None

        first = jax.tree.map(lambda x: x[0], mbs)
        # Sums in float32 at least: bfloat16 params would otherwise round the running sum of
        # the microbatches' gradients at every add (the callers cast back to the params').
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, _at_least_f32(s.dtype)),
                             jax.eval_shape(flat_grads, params, first))
        return jax.lax.scan(body, zeros, mbs)[0]

    return accumulate


def _at_least_f32(dtype: Any) -> Any:
    return jnp.promote_types(dtype, jnp.float32) if jnp.issubdtype(dtype, jnp.floating) else dtype


def scaled_grads(grads: Any, denom: jax.Array, params: Any) -> Any:
    """``grads / denom`` in each param's dtype (the sum may be wider: ``make_grads_fn``)."""
    return jax.tree.map(lambda g, p: (g / denom).astype(p.dtype), grads, params)


def guarded_update(tx: optax.GradientTransformation, params: Any, opt_state: Any, grads: Any,
                   loss: jax.Array) -> tuple[Any, Any, jax.Array, jax.Array]:
    """``(params, opt_state, grad_norm, finite)`` after one optax update of ``grads`` (already
    divided by the loss weight); a non-finite loss or gradient norm keeps the old params and
    optimizer moments (the schedule's count still advances)."""
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, new_opt = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    # A non-finite step never reaches the params or moments: the select is fused into the
    # update, costs no host sync, and protects checkpoints even in on_nonfinite="raise" mode
    # (where the loop raises when it reads this step's metrics one step later).
    keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
    kept = jax.tree.map(keep, new_opt, opt_state)
    # The schedule's count advances even so: the rate stays indexed by the update's place in
    # the run, not by how many updates were applied (a skip would delay the rest of the run).
    is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)  # noqa: E731
    kept = jax.tree.map(lambda k, n: n if is_schedule(k) else k, kept, new_opt,
                        is_leaf=is_schedule)
    return jax.tree.map(keep, new_params, params), kept, grad_norm, finite


def make_train_step(forward_fn: ForwardFn, loss_fn: LossFn, tx: optax.GradientTransformation,
                    schedule: Schedule, *, microbatches: int = 1) -> StepFn:
    """The pure step. Loss and aux metrics are token-weighted over the whole batch."""
    accumulate = make_grads_fn(forward_fn, loss_fn, microbatches)

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        loss_sum, weight, aux, grads = accumulate(state.params, batch)
        # An all-masked batch has no tokens; dividing by 1 keeps loss and grads at exactly 0.
        denom = jnp.maximum(weight, 1.0)
        grads = scaled_grads(grads, denom, state.params)
        loss = loss_sum / denom
        params, opt_state, grad_norm, finite = guarded_update(tx, state.params, state.opt_state,
                                                              grads, loss)
        new_state = state.replace(
            step=state.step + 1, params=params, opt_state=opt_state,
            weight_version=state.weight_version + finite.astype(jnp.int32),
            skipped=state.skipped + (~finite).astype(jnp.int32))
        metrics = {"loss": loss, "grad_norm": grad_norm, "learning_rate": schedule(state.step),
                   "tokens": weight, "finite": finite, "skipped": new_state.skipped,
                   "step": state.step, **report_aux(aux, denom)}
        return new_state, metrics

    return train_step


def batch_shardings(mesh: Mesh, rules: Rules, batch_size: int, seq_len: int,
                    batch_type: type[TrainBatch] = TrainBatch, *optional: str) -> TrainBatch:
    """A ``batch_type`` of the one ``[batch, length]`` sharding, in every required field and in
    the ``optional`` ones (e.g. ``"ref_logprobs"``); other optional fields stay ``None``."""
    sh = logical_to_sharding(BATCH_AXES, mesh, rules, (batch_size, seq_len))
    return batch_of(batch_type, sh, *optional)


def jit_train_step(step_fn: StepFn, state_sh: TrainState, batch_sh: TrainBatch,
                   mesh: Mesh) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
    """Compile-once step: explicit in/out shardings, the incoming state's buffers donated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.jit(step_fn, in_shardings=(state_sh, batch_sh),
                   out_shardings=(state_sh, replicated), donate_argnames=("state",))


def jit_leaf_step(step_fn: StepFn, state_sh: TrainState, batch_sh: TrainBatch, mesh: Mesh
                  ) -> Callable[[list[jax.Array], Batch], tuple[list[jax.Array], Metrics]]:
    """``jit_train_step`` over the state's leaves: ``step(leaves, batch) -> (leaves, metrics)``
    with ``leaves = jax.tree.leaves(state)`` in ``state_sh``'s structure, donated.

    Why: a list of arrays is flattened and rebuilt in JAX's C++ dispatch, while a state of NNX
    Variables calls back into Python for every Variable, in and out (about 0.6 ms of host time
    a step at the default job's size on 2 CPU cores, with 69 leaves)."""
    treedef = jax.tree.structure(state_sh)

    def leaf_step(leaves: list[jax.Array], batch: Batch) -> tuple[list[jax.Array], Metrics]:
        state, metrics = step_fn(jax.tree.unflatten(treedef, leaves), batch)
        return jax.tree.leaves(state), metrics

    # The compile log and the cache key's readable part keep the step's own name.
    leaf_step.__name__ = leaf_step.__qualname__ = getattr(step_fn, "__name__", "train_step")
    leaves_sh = jax.tree.leaves(state_sh)
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.jit(leaf_step, in_shardings=(leaves_sh, batch_sh),
                   out_shardings=(leaves_sh, replicated), donate_argnames=("leaves",))


def row_buckets(batch_size: int, multiple: int) -> tuple[int, ...]:
    """Row counts of a packed batch: each quarter of ``batch_size``, rounded up to ``multiple``
    (data shards x microbatches, which the rows must divide), at most ``batch_size``."""
    quarters = (-(-batch_size * k // 4) for k in range(1, 5))
    return tuple(sorted({min(batch_size, -(-q // multiple) * multiple) for q in quarters}))


class BucketedStep:
    """A jitted step compiled once per row count (packed batches vary in rows, not in length):
    ``step(state, batch)`` runs the executable of ``batch``'s row count, compiled on first use
    or by ``precompile``; ``state`` is whatever the jitted step takes (the engine passes the
    state's leaves, see ``jit_leaf_step``)."""

    def __init__(self, jitted: Callable, batch_sh: TrainBatch, seq_len: int,
                 buckets: Sequence[int],
                 trailing: Mapping[str, tuple[int, ...]] | None = None) -> None:
        self.jitted, self.batch_sh, self.seq_len = jitted, batch_sh, seq_len
        self.trailing = dict(trailing or {})
        self.buckets = tuple(sorted(buckets))
        self._compiled: dict[int, Any] = {}

    def compiled(self, state: Any, rows: int) -> Any:
        fn = self._compiled.get(rows)
        if fn is None:
            batch = abstract_batch(self.batch_sh, rows, self.seq_len, self.trailing)
            fn = self._compiled[rows] = self.jitted.lower(state, batch).compile()
        return fn

    def precompile(self, state: Any) -> None:
        for rows in self.buckets:
            self.compiled(state, rows)

    def __call__(self, state: Any, batch: Batch) -> tuple[Any, Metrics]:
        rows = batch.rows
        if rows not in self.buckets:
            raise ValueError(f"batch of {rows} rows: the step is compiled for {self.buckets}")
        return self.compiled(state, rows)(state, batch)
