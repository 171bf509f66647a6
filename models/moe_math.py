"""Pure mixture-of-experts math: routing, grouped expert FFNs, token dispatch and combine.

``moe_ffn(x_TxD, mask_T, weights, spec)`` is the whole sparse FFN of one shard: it routes each
real token (``mask_T``) to its top-k experts (router math in float32), sorts the token copies by
expert, runs each expert's SwiGLU over exactly its rows (dropless; or at most a capacity per
expert, the rest dropped and counted) and adds the weighted outputs back per token. The copies
go into the sorted order and back by gathers through the permutation and its inverse
(``to_copies`` / ``to_tokens``, each the other's transpose, so no rows are scatter-added in the
forward or the backward). Given an ``expert`` mesh axis it runs inside ``jax.shard_map``: the
copies travel to the shard that holds their expert and back with ``all_to_all``; given
``expert_tensor``, each shard holds a slice of every local expert's FFN width and the partial
outputs are summed with ``psum``.

Grouped kernels (``impl``): ``ragged_dot`` (``jax.lax.ragged_dot``, native on TPU and GPU), and
``blocked`` (each expert's rows in row tiles, looped, ``models/moe_tiles.py``; for CPU, where
ragged_dot lowers to a dense loop over every group). ``dense_moe_ffn`` runs every expert
on every token and masks: the reference the grouped path must equal.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp

from meshrl.models.moe_tiles import tiled_swiglu

Impl = Literal["ragged_dot", "blocked"]
RouterStats = dict[str, jax.Array]  # counts [E], prob_sum [E], rows, z_sum, dropped (sums)


@dataclasses.dataclass(frozen=True)
class MoESpec:
    """Static settings of one MoE FFN shard (hashable: part of a jitted function's closure)."""

    num_experts: int
    top_k: int
    norm_topk: bool = True
    router: Literal["softmax_topk", "topk_softmax"] = "softmax_topk"
    impl: Impl = "blocked"
    capacity_factor: float = 0.0  # 0: dropless
    ep_axis: str | None = None  # mesh axis of the expert dim (inside shard_map)
    ep_size: int = 1
    et_axis: str | None = None  # mesh axis of each expert's FFN width (inside shard_map)


def route(logits_TxE: jax.Array, spec: MoESpec, replay_TxK: jax.Array | None = None,
          ) -> tuple[jax.Array, jax.Array]:
    """(weights [T, k] float32, experts [T, k] int32). ``softmax_topk`` (Qwen3-MoE): softmax
    over all experts, top-k, renormalised when ``norm_topk``; ``topk_softmax`` (Mixtral): top-k
    logits, softmax over those k.

    ``replay_TxK``: routing replay. A token whose row holds expert ids (>= 0) goes to exactly
    those experts, weighted by this router's own probabilities of them, normalised as the top-k
    is (so the router still gets gradients); a row of -1 routes as usual."""
    logits_TxE = logits_TxE.astype(jnp.float32)
    if replay_TxK is not None:
        return _replayed(logits_TxE, spec, replay_TxK)
    if spec.router == "topk_softmax":
        top_TxK, experts_TxK = jax.lax.top_k(logits_TxE, spec.top_k)
        return jax.nn.softmax(top_TxK, axis=-1), experts_TxK.astype(jnp.int32)
    weights_TxK, experts_TxK = jax.lax.top_k(jax.nn.softmax(logits_TxE, axis=-1), spec.top_k)
    if spec.norm_topk:
        weights_TxK = weights_TxK / weights_TxK.sum(-1, keepdims=True)
    return weights_TxK, experts_TxK.astype(jnp.int32)


def _replayed(logits_TxE: jax.Array, spec: MoESpec, replay_TxK: jax.Array,
              ) -> tuple[jax.Array, jax.Array]:
    assert replay_TxK.shape == (logits_TxE.shape[0], spec.top_k), replay_TxK.shape
    _, own_TxK = route(logits_TxE, spec)
    given_T = (replay_TxK >= 0).all(-1, keepdims=True)
    experts_TxK = jnp.where(given_T, replay_TxK.astype(jnp.int32), own_TxK)
    picked_TxK = jnp.take_along_axis(logits_TxE, experts_TxK, axis=-1)
    if spec.router == "topk_softmax":
        return jax.nn.softmax(picked_TxK, axis=-1), experts_TxK
    # softmax over all experts at the picked ones: exp(l - logsumexp(l)).
    weights_TxK = jnp.exp(picked_TxK - jax.nn.logsumexp(logits_TxE, axis=-1, keepdims=True))
    if spec.norm_topk:
        weights_TxK = weights_TxK / weights_TxK.sum(-1, keepdims=True)
    return weights_TxK, experts_TxK


def router_stats(logits_TxE: jax.Array, experts_TxK: jax.Array, mask_T: jax.Array,
                 dropped: jax.Array) -> RouterStats:
    """Sums over this shard's real tokens, added over layers and shards, from which
    ``algorithms.losses.moe_terms`` computes the load-balancing loss (HF's
    ``load_balancing_loss_func``), the z-loss and the load metrics."""
    E = logits_TxE.shape[-1]
    m_T = mask_T.astype(jnp.float32)
    probs_TxE = jax.nn.softmax(logits_TxE.astype(jnp.float32), axis=-1)
    k = experts_TxK.shape[-1]
    counts_E = jax.ops.segment_sum(jnp.repeat(m_T, k), experts_TxK.reshape(-1), num_segments=E)
    z_T = jax.nn.logsumexp(logits_TxE.astype(jnp.float32), axis=-1) ** 2
    return {"counts": counts_E, "prob_sum": (probs_TxE * m_T[:, None]).sum(0),
            "rows": m_T.sum(), "z_sum": (z_T * m_T).sum(),
            "dropped": dropped.astype(jnp.float32)}


def _swiglu(h_gate: jax.Array, h_up: jax.Array) -> jax.Array:
    return jax.nn.silu(h_gate) * h_up


def grouped_ffn(rows_MxD: jax.Array, group_M: jax.Array, num_groups: int, w_gate_GxDxF: jax.Array,
                w_up_GxDxF: jax.Array, w_down_GxFxD: jax.Array, impl: Impl,
                presorted: bool = False) -> jax.Array:
    """Expert ``group_M[i]``'s SwiGLU on row i; rows whose group is ``num_groups`` (or more) are
    padding and come out 0. ``presorted``: the groups are already non-decreasing."""
    M = rows_MxD.shape[0]
    sizes_G = jax.ops.segment_sum(jnp.ones((M,), jnp.int32), group_M, num_segments=num_groups)
    order_M = None if presorted else jnp.argsort(group_M, stable=True).astype(jnp.int32)
    sorted_MxD = rows_MxD if order_M is None else rows_MxD[order_M]
    if impl == "ragged_dot":
        out_MxD = _ragged(sorted_MxD, sizes_G, w_gate_GxDxF, w_up_GxDxF, w_down_GxFxD)
    elif impl == "blocked":
        out_MxD = tiled_swiglu(sorted_MxD, sizes_G, w_gate_GxDxF, w_up_GxDxF, w_down_GxFxD)
    else:
        raise ValueError(f"impl = {impl!r}: must be 'ragged_dot' or 'blocked'")
    return out_MxD if order_M is None else jnp.zeros_like(out_MxD).at[order_M].set(out_MxD)


def _ragged(sorted_MxD: jax.Array, sizes_G: jax.Array, wg: jax.Array, wu: jax.Array,
            wd: jax.Array) -> jax.Array:
    dt = sorted_MxD.dtype
    h = _swiglu(jax.lax.ragged_dot(sorted_MxD, wg.astype(dt), sizes_G),
                jax.lax.ragged_dot(sorted_MxD, wu.astype(dt), sizes_G))
    out_MxD = jax.lax.ragged_dot(h, wd.astype(dt), sizes_G)
    # Rows past the last group are not defined to be zero on every backend.
    live_M = jnp.arange(sorted_MxD.shape[0]) < sizes_G.sum()
    return jnp.where(live_M[:, None], out_MxD, 0)


@jax.custom_vjp
def to_copies(x_TxD: jax.Array, tok_A: jax.Array, slot_TxK: jax.Array) -> jax.Array:
    """Row i of the sorted copies is token ``tok_A[i]``'s row; ``slot_TxK`` is the inverse
    (where token t's j-th copy sits). ``to_tokens`` is its transpose, so the backward of each is
    a gather through the other: no scatter-add either way."""
    return x_TxD[tok_A]


@jax.custom_vjp
def to_tokens(v_AxD: jax.Array, tok_A: jax.Array, slot_TxK: jax.Array) -> jax.Array:
    """Each token's copies summed back: ``y[t] = sum_j v[slot_TxK[t, j]]``."""
    return v_AxD[slot_TxK].sum(1)


to_copies.defvjp(lambda x, tok, slot: (to_copies(x, tok, slot), (tok, slot)),
                 lambda res, g: (to_tokens(g, *res), None, None))
to_tokens.defvjp(lambda v, tok, slot: (to_tokens(v, tok, slot), (tok, slot)),
                 lambda res, g: (to_copies(g, *res), None, None))


def capacity(tokens: int, spec: MoESpec) -> int:
    """Copies each expert takes from one shard's ``tokens`` when ``capacity_factor`` > 0."""
    return max(1, math.ceil(spec.capacity_factor * tokens * spec.top_k / spec.num_experts))


def moe_ffn(x_TxD: jax.Array, mask_T: jax.Array, router_DxE: jax.Array, w_gate_ExDxF: jax.Array,
            w_up_ExDxF: jax.Array, w_down_ExFxD: jax.Array, spec: MoESpec,
            replay_TxK: jax.Array | None = None,
            ) -> tuple[jax.Array, RouterStats, jax.Array]:
    """The sparse FFN of one shard's tokens (module docstring): (y [T, D], router stats, the
    experts each token was routed to [T, k]; ``replay_TxK`` as in ``route``). The expert
    weights hold this shard's ``E / ep_size`` experts (and FFN-width slice)."""
    T, D = x_TxD.shape
    E, k = spec.num_experts, spec.top_k
    logits_TxE = jnp.dot(x_TxD.astype(jnp.float32), router_DxE.astype(jnp.float32))
    weights_TxK, experts_TxK = route(logits_TxE, spec, replay_TxK)
    A = T * k
    valid_A = jnp.repeat(mask_T.astype(bool), k)
    # Padding tokens get no copies: they cost nothing and never take an expert's capacity.
    key_A = jnp.where(valid_A, experts_TxK.reshape(A), E)
    order_A = jnp.argsort(key_A, stable=True)
    e_A, tok_A = key_A[order_A], (order_A // k).astype(jnp.int32)
    w_A = weights_TxK.reshape(A)[order_A]
    counts_E = jax.ops.segment_sum(jnp.ones((A,), jnp.int32), e_A, num_segments=E)
    rank_A = jnp.arange(A, dtype=jnp.int32) - (jnp.cumsum(counts_E) - counts_E)[
        jnp.minimum(e_A, E - 1)]
    keep_A = e_A < E
    if spec.capacity_factor > 0:
        keep_A = keep_A & (rank_A < capacity(T, spec))
    dropped = (valid_A.sum() - keep_A.sum()).astype(jnp.float32)
    # The inverse permutation: where each (token, slot) copy sits in the sorted order.
    slot_TxK = jnp.zeros((A,), jnp.int32).at[order_A].set(
        jnp.arange(A, dtype=jnp.int32), unique_indices=True).reshape(T, k)
    rows_AxD = to_copies(x_TxD, tok_A, slot_TxK)
    if spec.ep_size == 1:
        out_AxD = grouped_ffn(rows_AxD, jnp.where(keep_A, e_A, E), E, w_gate_ExDxF, w_up_ExDxF,
                              w_down_ExFxD, spec.impl,
                              # Dropped copies (group E) sit inside their expert's run.
                              presorted=spec.capacity_factor <= 0)
    else:
        out_AxD = _expert_parallel(rows_AxD, e_A, keep_A, w_gate_ExDxF, w_up_ExDxF,
                                   w_down_ExFxD, spec, T)
    y_AxD = out_AxD.astype(jnp.float32) * jnp.where(keep_A, w_A, 0.0)[:, None]
    y_TxD = to_tokens(y_AxD, tok_A, slot_TxK)
    if spec.et_axis is not None:
        y_TxD = jax.lax.psum(y_TxD, spec.et_axis)
    return (y_TxD.astype(x_TxD.dtype), router_stats(logits_TxE, experts_TxK, mask_T, dropped),
            experts_TxK)


def _expert_parallel(rows_AxD: jax.Array, e_A: jax.Array, keep_A: jax.Array, wg: jax.Array,
                     wu: jax.Array, wd: jax.Array, spec: MoESpec, tokens: int) -> jax.Array:
    """The copies (sorted by expert) to the shards of their experts and back: one all-to-all
    each way over ``ep_axis``. Each destination's chunk holds every copy this shard may send it:
    all of them when dropless (a static worst case), ``E_local * capacity`` with a capacity."""
    A, D = rows_AxD.shape
    ep, E = spec.ep_size, spec.num_experts
    El = E // ep
    C = A if spec.capacity_factor <= 0 else min(A, El * capacity(tokens, spec))
    keep_i = keep_A.astype(jnp.int32)
    dest_A = jnp.minimum(e_A, E - 1) // El
    per_dest = jax.ops.segment_sum(keep_i, jnp.where(keep_A, dest_A, ep), num_segments=ep)
    pos_A = jnp.cumsum(keep_i) - keep_i - (jnp.cumsum(per_dest) - per_dest)[dest_A]
    d_A = jnp.where(keep_A, dest_A, ep)  # out of range: dropped by the scatters below
    send_x = jnp.zeros((ep, C, D), rows_AxD.dtype).at[d_A, pos_A].set(rows_AxD, mode="drop")
    send_g = jnp.full((ep, C), El, jnp.int32).at[d_A, pos_A].set(e_A % El, mode="drop")
    recv_x = jax.lax.all_to_all(send_x, spec.ep_axis, 0, 0, tiled=True)
    recv_g = jax.lax.all_to_all(send_g, spec.ep_axis, 0, 0, tiled=True)
    out = grouped_ffn(recv_x.reshape(ep * C, D), recv_g.reshape(ep * C), El, wg, wu, wd,
                      spec.impl)
    back = jax.lax.all_to_all(out.reshape(ep, C, D), spec.ep_axis, 0, 0, tiled=True)
    return back.at[d_A, pos_A].get(mode="fill", fill_value=0)


def dense_moe_ffn(x_TxD: jax.Array, mask_T: jax.Array, router_DxE: jax.Array,
                  w_gate_ExDxF: jax.Array, w_up_ExDxF: jax.Array, w_down_ExFxD: jax.Array,
                  spec: MoESpec, replay_TxK: jax.Array | None = None,
                  ) -> tuple[jax.Array, RouterStats, jax.Array]:
    """Every expert on every token, weighted by the routing (0 off the top-k): the same
    function as ``moe_ffn`` dropless, at E / k times its FLOPs."""
    T, _ = x_TxD.shape
    logits_TxE = jnp.dot(x_TxD.astype(jnp.float32), router_DxE.astype(jnp.float32))
    weights_TxK, experts_TxK = route(logits_TxE, spec, replay_TxK)
    weights_TxK = weights_TxK * mask_T.astype(jnp.float32)[:, None]
    combine_TxE = jnp.zeros((T, spec.num_experts), jnp.float32).at[
        jnp.arange(T)[:, None], experts_TxK].add(weights_TxK)
    dt = x_TxD.dtype
    h_TxExF = _swiglu(jnp.einsum("td,edf->tef", x_TxD, w_gate_ExDxF.astype(dt)),
                      jnp.einsum("td,edf->tef", x_TxD, w_up_ExDxF.astype(dt)))
    y_TxExD = jnp.einsum("tef,efd->ted", h_TxExF, w_down_ExFxD.astype(dt))
    y_TxD = jnp.einsum("ted,te->td", y_TxExD.astype(jnp.float32), combine_TxE)
    return (y_TxD.astype(dt), router_stats(logits_TxE, experts_TxK, mask_T, jnp.zeros(())),
            experts_TxK)
