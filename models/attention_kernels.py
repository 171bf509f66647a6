"""Attention math in pure JAX: the einsum reference and a blockwise (flash-style) version.

Contract shared by every function here (and by ``attention_fused``):

* queries ``q_BxLxNxH``, keys/values with K kv heads, ``N % K == 0``; query head n uses kv head
  ``n // (N // K)`` (GQA; K == N is MHA).
* scores ``q . k * H ** -0.5`` and the softmax statistics are float32 whatever the input dtype.
* a masked entry's score is the finite ``MASK_VALUE``, never -inf: a row whose every entry is
  masked is the uniform average of the values, finite, exactly as ``jax.nn.softmax`` gives it.

``einsum_attention`` materialises the [B, N, L, T] float32 scores (and autodiff keeps them for
the backward). ``blockwise_attention`` / ``blockwise_cache_attention`` compute the same values
and gradients (up to float32 summation order) with an online softmax over blocks of queries and
keys: live scores are [B, N, block_q, block_k], the backward residuals are the output plus two
float32 row statistics (O(L)), and the backward recomputes each block's scores (FlashAttention-2,
arXiv:2307.08691, algorithms 1 and 2). Lengths that are not a multiple of the block are padded
internally; padded keys never receive weight, padded query rows are dropped. In causal
self-attention, key blocks wholly above the diagonal are skipped (about half the work at long
lengths). Block sizes and why: docs/attention.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

# Finite mask value: a fully masked row (padding) gives a uniform average instead of NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
# Default largest block (queries and keys); see docs/attention.md.
BLOCK = 512
_ALIGN = 8  # block sizes are shrunk to fit the length, in steps of this many rows


def causal_segment_mask(segment_ids_BxL: jax.Array) -> jax.Array:
    """[B, L, L]: causal by index and only within equal segment ids (id 0, padding, attends to
    earlier padding, so no row is empty)."""
    L = segment_ids_BxL.shape[1]
    causal_LxL = jnp.tril(jnp.ones((L, L), bool))
    same_seg_BxLxL = segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :]
    return causal_LxL[None] & same_seg_BxLxL


def einsum_attention(q_BxLxNxH: jax.Array, k_BxTxKxH: jax.Array, v_BxTxKxH: jax.Array,
                     mask_BxLxT: jax.Array) -> jax.Array:
    """Softmax attention with GQA; scores and softmax in float32 (as HF eager)."""
    B, L, N, H = q_BxLxNxH.shape
    K = k_BxTxKxH.shape[2]
    if K == N:  # no GQA: 4-D einsums; the 5-D form's unit group axis cost extra transposes
        scores_BxNxLxT = jnp.einsum("blnh,btnh->bnlt", q_BxLxNxH, k_BxTxKxH,
                                    preferred_element_type=jnp.float32) * (H ** -0.5)
        scores_BxNxLxT = jnp.where(mask_BxLxT[:, None], scores_BxNxLxT, MASK_VALUE)
        probs_BxNxLxT = jax.nn.softmax(scores_BxNxLxT, axis=-1).astype(v_BxTxKxH.dtype)
        return jnp.einsum("bnlt,btnh->blnh", probs_BxNxLxT, v_BxTxKxH)
    q_BxLxKxGxH = q_BxLxNxH.reshape(B, L, K, N // K, H)
    scores_BxKxGxLxT = jnp.einsum("blkgh,btkh->bkglt", q_BxLxKxGxH, k_BxTxKxH,
                                  preferred_element_type=jnp.float32) * (H ** -0.5)
    scores_BxKxGxLxT = jnp.where(mask_BxLxT[:, None, None], scores_BxKxGxLxT, MASK_VALUE)
    probs = jax.nn.softmax(scores_BxKxGxLxT, axis=-1).astype(v_BxTxKxH.dtype)
    out_BxLxKxGxH = jnp.einsum("bkglt,btkh->blkgh", probs, v_BxTxKxH)
    return out_BxLxKxGxH.reshape(B, L, N, H)


def blockwise_attention(q_BxLxNxH: jax.Array, k_BxLxKxH: jax.Array, v_BxLxKxH: jax.Array,
                        segment_ids_BxL: jax.Array, *, block_q: int = BLOCK,
                        block_k: int = BLOCK) -> jax.Array:
    """Causal self-attention within equal segment ids: ``einsum_attention(q, k, v,
    causal_segment_mask(segment_ids))`` in blocks of at most ``block_q`` x ``block_k``."""
    B, L, N, H = q_BxLxNxH.shape
    assert k_BxLxKxH.shape[:2] == (B, L) and v_BxLxKxH.shape == k_BxLxKxH.shape, (
        q_BxLxNxH.shape, k_BxLxKxH.shape, v_BxLxKxH.shape)
    assert segment_ids_BxL.shape == (B, L), segment_ids_BxL.shape
    index_BxL = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    return blockwise_attention_lse(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, index_BxL, segment_ids_BxL,
                                   index_BxL, segment_ids_BxL, block_q=block_q,
                                   block_k=block_k, skip="index")[0]


def blockwise_attention_lse(q_BxLxNxH: jax.Array, k_BxTxKxH: jax.Array, v_BxTxKxH: jax.Array,
                            qidx_BxL: jax.Array, qseg_BxL: jax.Array, kidx_BxT: jax.Array,
                            kseg_BxT: jax.Array, *, block_q: int = BLOCK, block_k: int = BLOCK,
                            skip: str = "data") -> tuple[jax.Array, jax.Array]:
    """(out [B, L, N, H], log-sum-exp of the scores [B, L, N] float32): query i attends to key
    t where ``kidx[t] <= qidx[i]`` and ``kseg[t] == qseg[i]``. Key indices must not decrease
    along T (key blocks past a query block's largest index are skipped). Differentiable in both
    outputs, so partial attentions over disjoint keys combine by their log-sum-exps (ring
    attention, ``context_attention``). ``skip``: see ``_Plan`` ("data" reduces the indices over
    the batch: call it where they are local, inside ``shard_map``)."""
    B, L, N, H = q_BxLxNxH.shape
    T, K = k_BxTxKxH.shape[1], k_BxTxKxH.shape[2]
    assert v_BxTxKxH.shape == k_BxTxKxH.shape and k_BxTxKxH.shape[0] == B, (
        q_BxLxNxH.shape, k_BxTxKxH.shape, v_BxTxKxH.shape)
    assert qidx_BxL.shape == qseg_BxL.shape == (B, L), (qidx_BxL.shape, qseg_BxL.shape)
    assert kidx_BxT.shape == kseg_BxT.shape == (B, T), (kidx_BxT.shape, kseg_BxT.shape)
    nq, bq = _blocks(L, block_q)
    nk, bk = _blocks(T, block_k)
    plan = _Plan(bq=bq, bk=bk, scale=H ** -0.5, skip=skip)
    out_blocks, lse_blocks = _flash(
        plan, _q_blocks(q_BxLxNxH, K, nq, bq), _kv_blocks(jnp.moveaxis(k_BxTxKxH, 1, 2), nk, bk),
        _kv_blocks(jnp.moveaxis(v_BxTxKxH, 1, 2), nk, bk), _row_blocks(qidx_BxL, nq, bq),
        _row_blocks(qseg_BxL, nq, bq), _row_blocks(kidx_BxT, nk, bk, _NO_KEY),
        _row_blocks(kseg_BxT, nk, bk))
    lse_BxLxN = lse_blocks.transpose(1, 0, 4, 2, 3).reshape(B, nq * bq, N)[:, :L]
    return _from_q_blocks(out_blocks, L, N), lse_BxLxN


def blockwise_cache_attention(q_BxLxNxH: jax.Array, k_BxKxHxT: jax.Array, v_BxKxTxH: jax.Array,
                              positions_BxL: jax.Array, *, block_q: int = BLOCK,
                              block_k: int = BLOCK) -> jax.Array:
    """Queries at ``positions`` attend to cache entries t <= position, over the KV-cache layout
    (keys [B, K, H, T], values [B, K, T, H], see ``kv_cache``): ``einsum_attention`` with mask
    ``arange(T) <= positions[..., None]``, in blocks. For long prefills; decode keeps the
    one-pass cache attention."""
    B, L, N, H = q_BxLxNxH.shape
    K, T = k_BxKxHxT.shape[1], k_BxKxHxT.shape[-1]
    assert k_BxKxHxT.shape == (B, K, H, T) and v_BxKxTxH.shape == (B, K, T, H), (
        k_BxKxHxT.shape, v_BxKxTxH.shape)
    nq, bq = _blocks(L, block_q)
    nk, bk = _blocks(T, block_k)
    plan = _Plan(bq=bq, bk=bk, scale=H ** -0.5, skip="none")
    zeros_BxL, zeros_BxT = jnp.zeros((B, L), jnp.int32), jnp.zeros((B, T), jnp.int32)
    index_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    out_blocks, _ = _flash(plan, _q_blocks(q_BxLxNxH, K, nq, bq),
                           _kv_blocks(jnp.swapaxes(k_BxKxHxT, 2, 3), nk, bk),
                           _kv_blocks(v_BxKxTxH, nk, bk), _row_blocks(positions_BxL, nq, bq),
                           _row_blocks(zeros_BxL, nq, bq),
                           _row_blocks(index_BxT, nk, bk, _NO_KEY),
                           _row_blocks(zeros_BxT, nk, bk))
    return _from_q_blocks(out_blocks, L, N)


# ---- layouts: blocks on a leading axis, (B, K) batch dims, canonical matmul operands ----------


def _blocks(n: int, max_block: int) -> tuple[int, int]:
    """(count, size) of the blocks covering n rows: as few blocks as ``max_block`` allows, each
    shrunk to the length (in steps of ``_ALIGN``) so the padding stays small."""
    count = _cdiv(n, max_block)
    return count, min(max_block, _cdiv(_cdiv(n, count), _ALIGN) * _ALIGN)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pad_axis(x: jax.Array, axis: int, length: int, value: int | float = 0) -> jax.Array:
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value) if length > x.shape[axis] else x


def _q_blocks(q_BxLxNxH: jax.Array, K: int, nq: int, bq: int) -> jax.Array:
    """[nq, B, K, G * bq, H]: the rows of one block for all G query heads of a kv head."""
    B, L, N, H = q_BxLxNxH.shape
    q = _pad_axis(q_BxLxNxH, 1, nq * bq).reshape(B, nq, bq, K, N // K, H)
    return q.transpose(1, 0, 3, 4, 2, 5).reshape(nq, B, K, (N // K) * bq, H)


def _from_q_blocks(out_QxBxKxGQxH: jax.Array, L: int, N: int) -> jax.Array:
    nq, B, K, GQ, H = out_QxBxKxGQxH.shape
    bq = GQ // (N // K)
    out = out_QxBxKxGQxH.reshape(nq, B, K, N // K, bq, H).transpose(1, 0, 4, 2, 3, 5)
    return out.reshape(B, nq * bq, N, H)[:, :L]


def _kv_blocks(x_BxKxTxH: jax.Array, nk: int, bk: int) -> jax.Array:
    """[nk, B, K, bk, H]."""
    B, K, _, H = x_BxKxTxH.shape
    x = _pad_axis(x_BxKxTxH, 2, nk * bk).reshape(B, K, nk, bk, H)
    return x.transpose(2, 0, 1, 3, 4)


def _row_blocks(x_BxL: jax.Array, n: int, b: int, pad: int = -1) -> jax.Array:
    """[n, B, b], padded with ``pad``: -1 for queries (a padding query sees no key and is
    dropped) and segment ids; ``_NO_KEY`` for key indices (a padding key is never visible)."""
    return _pad_axis(x_BxL, 1, n * b, pad).reshape(x_BxL.shape[0], n, b).transpose(1, 0, 2)


# ---- the online-softmax kernel with a recomputing backward ------------------------------------


_NO_KEY = 2 ** 30  # the key index of block padding: above every query index


@dataclasses.dataclass(frozen=True)
class _Plan:
    bq: int
    bk: int
    scale: float
    # Which key blocks a query block visits. "index": queries and keys are at their indices
    # (self-attention): those starting at or before the block's last row, a static rule that
    # reads no data (on a batch-sharded mesh a data-derived bound would need a collective).
    # "data": from the indices themselves (inside shard_map, where they are local). "none":
    # all, for the cache layout, whose fully masked rows must average every key.
    skip: str = "index"


def _kv_block_count(plan: _Plan, i: jax.Array, kidx_blocks: jax.Array, pos_BxQb: jax.Array,
                    ) -> jax.Array | int:
    """Key blocks query block ``i`` needs (``_Plan.skip``): with "data", those whose smallest
    key index is at most the block's largest query index (key indices ascend over the blocks),
    at least one, so a block of padding rows still has keys to average."""
    nk = kidx_blocks.shape[0]
    if plan.skip == "none":
        return nk
    if plan.skip == "index":
        return jnp.minimum(nk, ((i + 1) * plan.bq - 1) // plan.bk + 1)
    first_N = kidx_blocks.min(axis=(1, 2))
    return jnp.maximum(1, jnp.sum(first_N <= pos_BxQb.max()))


def _scores(plan: _Plan, q_BxKxGQxH: jax.Array, k_BxKxTbxH: jax.Array, pos_BxQb: jax.Array,
            qseg_BxQb: jax.Array, kidx_BxTb: jax.Array, kseg_BxTb: jax.Array,
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Masked float32 scores [B, K, G, bq, bk] of one block pair, the mask [B, bq, bk] and which
    keys are real [B, 1, 1, 1, bk]."""
    B, K, GQ, _ = q_BxKxGQxH.shape
    s = jnp.einsum("bkqh,bkth->bkqt", q_BxKxGQxH, k_BxKxTbxH,
                   preferred_element_type=jnp.float32) * plan.scale
    s_BxKxGxQbxTb = s.reshape(B, K, GQ // plan.bq, plan.bq, plan.bk)
    real_BxTb = kidx_BxTb < _NO_KEY
    mask_BxQbxTb = ((kidx_BxTb[:, None, :] <= pos_BxQb[:, :, None])
                    & (qseg_BxQb[:, :, None] == kseg_BxTb[:, None, :]) & real_BxTb[:, None, :])
    s_BxKxGxQbxTb = jnp.where(mask_BxQbxTb[:, None, None], s_BxKxGxQbxTb, MASK_VALUE)
    return s_BxKxGxQbxTb, mask_BxQbxTb, real_BxTb[:, None, None, None, :]


def _at(blocks: jax.Array, j: jax.Array) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(blocks, j, 0, keepdims=False)


def _forward(plan: _Plan, q_blocks: jax.Array, k_blocks: jax.Array, v_blocks: jax.Array,
             pos_blocks: jax.Array, qseg_blocks: jax.Array, kidx_blocks: jax.Array,
             kseg_blocks: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(out [nq, B, K, G*bq, H], row max and row sum [nq, B, K, G, bq] in float32)."""
    nq, B, K, GQ, H = q_blocks.shape
    G = GQ // plan.bq

    def q_step(_: None, xs: tuple[jax.Array, ...]) -> tuple[None, tuple[jax.Array, ...]]:
        q_i, pos_i, qseg_i, i = xs

        def kv_step(j: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            mx, den, acc = carry
            v_j = _at(v_blocks, j)
            s, _, real_Tb = _scores(plan, q_i, _at(k_blocks, j), pos_i, qseg_i,
                                    _at(kidx_blocks, j), _at(kseg_blocks, j))
            mx_new = jnp.maximum(mx, s.max(-1))
            # Padding keys get no weight even in a fully masked row (whose entries all equal
            # MASK_VALUE = mx): that row then averages exactly the real keys, as the reference.
            p = jnp.where(real_Tb, jnp.exp(s - mx_new[..., None]), 0.0)
            alpha = jnp.exp(mx - mx_new)
            pv = jnp.einsum("bkqt,bkth->bkqh", p.reshape(B, K, GQ, plan.bk).astype(v_j.dtype),
                            v_j, preferred_element_type=jnp.float32)
            acc = acc * alpha[..., None] + pv.reshape(B, K, G, plan.bq, H)
            return mx_new, den * alpha + p.sum(-1), acc

        init = (jnp.full((B, K, G, plan.bq), MASK_VALUE, jnp.float32),
                jnp.zeros((B, K, G, plan.bq), jnp.float32),
                jnp.zeros((B, K, G, plan.bq, H), jnp.float32))
        mx, den, acc = jax.lax.fori_loop(0, _kv_block_count(plan, i, kidx_blocks, pos_i), kv_step, init)
        out = (acc / den[..., None]).reshape(B, K, GQ, H).astype(q_i.dtype)
        return None, (out, mx, den)

    xs = (q_blocks, pos_blocks, qseg_blocks, jnp.arange(q_blocks.shape[0], dtype=jnp.int32))
    _, (out, mx, den) = jax.lax.scan(q_step, None, xs)
    return out, mx, den


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(plan: _Plan, q_blocks: jax.Array, k_blocks: jax.Array, v_blocks: jax.Array,
           pos_blocks: jax.Array, qseg_blocks: jax.Array, kidx_blocks: jax.Array,
           kseg_blocks: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(out blocks, log-sum-exp blocks [nq, B, K, G, bq] float32)."""
    out, mx, den = _forward(plan, q_blocks, k_blocks, v_blocks, pos_blocks, qseg_blocks,
                            kidx_blocks, kseg_blocks)
    return out, mx + jnp.log(den)


def _flash_fwd(plan: _Plan, q_blocks: jax.Array, k_blocks: jax.Array, v_blocks: jax.Array,
               pos_blocks: jax.Array, qseg_blocks: jax.Array, kidx_blocks: jax.Array,
               kseg_blocks: jax.Array) -> tuple[tuple[jax.Array, jax.Array], tuple]:
    out, mx, den = _forward(plan, q_blocks, k_blocks, v_blocks, pos_blocks, qseg_blocks,
                            kidx_blocks, kseg_blocks)
    return (out, mx + jnp.log(den)), (q_blocks, k_blocks, v_blocks, pos_blocks, qseg_blocks,
                                      kidx_blocks, kseg_blocks, out, mx, den)


def _flash_bwd(plan: _Plan, res: tuple[jax.Array, ...],
               cotangents: tuple[jax.Array, jax.Array]) -> tuple[jax.Array | None, ...]:
    (q_blocks, k_blocks, v_blocks, pos_blocks, qseg_blocks, kidx_blocks, kseg_blocks, out, mx,
     den) = res
    dout_blocks, dlse_blocks = cotangents
    nq, B, K, GQ, H = q_blocks.shape
    G = GQ // plan.bq
    # D = rowsum(dO * O) = sum_t p_t dp_t, the softmax backward's per-row term, minus the
    # log-sum-exp's cotangent (d lse / d s_t = p_t).
    d_blocks = jnp.sum(dout_blocks.astype(jnp.float32) * out.astype(jnp.float32), -1).reshape(
        nq, B, K, G, plan.bq) - dlse_blocks

    def q_step(carry: tuple[jax.Array, jax.Array], xs: tuple[jax.Array, ...],
               ) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
        q_i, do_i, pos_i, qseg_i, mx_i, den_i, d_i, i = xs

        def kv_step(j: jax.Array, c: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            dq, dk_acc, dv_acc = c
            k_j, v_j = _at(k_blocks, j), _at(v_blocks, j)
            s, mask_BxQbxTb, real_Tb = _scores(plan, q_i, k_j, pos_i, qseg_i,
                                               _at(kidx_blocks, j), _at(kseg_blocks, j))
            p = jnp.where(real_Tb, jnp.exp(s - mx_i[..., None]) / den_i[..., None], 0.0)
            dv_j = jnp.einsum("bkqt,bkqh->bkth", p.reshape(B, K, GQ, plan.bk).astype(do_i.dtype),
                              do_i, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bkqh,bkth->bkqt", do_i, v_j, preferred_element_type=jnp.float32)
            # Masked scores were replaced by a constant: no gradient reaches q or k through them.
            ds = jnp.where(mask_BxQbxTb[:, None, None],
                           p * (dp.reshape(p.shape) - d_i[..., None]), 0.0)
            ds = ds.reshape(B, K, GQ, plan.bk) * plan.scale
            dq = dq + jnp.einsum("bkqt,bkth->bkqh", ds.astype(k_j.dtype), k_j,
                                 preferred_element_type=jnp.float32)
            dk_j = jnp.einsum("bkqt,bkqh->bkth", ds.astype(q_i.dtype), q_i,
                              preferred_element_type=jnp.float32)
            dk_acc = jax.lax.dynamic_update_index_in_dim(dk_acc, _at(dk_acc, j) + dk_j, j, 0)
            dv_acc = jax.lax.dynamic_update_index_in_dim(dv_acc, _at(dv_acc, j) + dv_j, j, 0)
            return dq, dk_acc, dv_acc

        dk_acc, dv_acc = carry
        init = (jnp.zeros((B, K, GQ, H), jnp.float32), dk_acc, dv_acc)
        dq, dk_acc, dv_acc = jax.lax.fori_loop(0, _kv_block_count(plan, i, kidx_blocks, pos_i), kv_step,
                                               init)
        return (dk_acc, dv_acc), dq.astype(q_i.dtype)

    zeros = jnp.zeros(k_blocks.shape, jnp.float32)
    xs = (q_blocks, dout_blocks, pos_blocks, qseg_blocks, mx, den, d_blocks,
          jnp.arange(nq, dtype=jnp.int32))
    (dk, dv), dq = jax.lax.scan(q_step, (zeros, zeros), xs)
    return dq, dk.astype(k_blocks.dtype), dv.astype(v_blocks.dtype), None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def kv_repeats(num_heads: int, num_kv_heads: int, shards: int) -> int:
    """How many times to repeat each kv head so that the kv heads split over ``shards`` head
    shards as the query heads do, each device holding whole GQA groups (1: they already do).
    Repeating kv head j r times keeps it serving exactly its own query heads."""
    groups = num_heads // num_kv_heads
    return next((r for r in range(1, groups + 1)
                 if groups % r == 0 and (num_kv_heads * r) % shards == 0), groups)
