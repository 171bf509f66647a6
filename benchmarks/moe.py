"""Forward + backward tokens/s of one MoE layer: meshrl's dropless grouped routing against the
MoE a user would write in plain JAX without meshrl, in the same run.

Shape: 16 experts, top-2 (softmax over all experts, top-k renormalised), hidden 256, expert
SwiGLU FFN 512, 4,096 tokens, float32, one device. Every path is ``jax.jit`` of
``jax.value_and_grad`` of the mean square of the layer's output w.r.t. the input, the router and
the three expert weights; each path's loss and gradients are checked against the every-expert
reference before anything is timed.

Paths:

* ``grouped``: ``moe_ffn`` with ``--impl`` (``blocked`` on CPU, where ``jax.lax.ragged_dot``
  lowers to a loop over every expert; ``ragged_dot`` on TPU/GPU).
* ``ragged_dot``: ``moe_ffn`` with ``impl="ragged_dot"``, reported beside it.
* ``capacity_sort`` (baseline candidate, plain JAX, written here): the (token, slot) copies
  sorted by expert and scattered into static ``[E, capacity]`` buckets, one batched matmul per
  SwiGLU weight, gathered back and weighted.
* ``capacity_gather`` (baseline candidate, plain JAX, written here): the same buckets filled
  and emptied by gathers alone (each bucket slot reads its token, each copy reads its slot back),
  no scatter in the forward.
* ``capacity_einsum`` (baseline candidate, plain JAX, written here): GShard-style one-hot
  ``[T, E, capacity]`` dispatch and combine tensors contracted with einsums.
* ``dense``: ``dense_moe_ffn``, every expert on every token (experts / top-k times the FLOPs).
* ``floor``: the same expert FLOPs as one expert's SwiGLU over all T x k rows (one plain matmul
  chain, no routing); every real path is checked not to beat it.

The baseline is whichever of the three capacity paths has the lowest median in this run.
Capacity: the largest expert load at this seed rounded up to a multiple of 8 (the tightest
buckets that drop nothing; ``--capacity_factor`` sets ``ceil(T * k / E * factor)`` instead); it
is asserted that nothing drops.

Timing: after one untimed pass of every path, ``--rounds`` interleaved rounds (the order
rotates); in a round each path times ``--repeats`` steps and keeps their median. A figure is
the median over the rounds with ``[min, max]`` beside it (``_spread``); a ratio is paired round
by round before its median is taken.

  python benchmarks/moe.py                      # full
  python benchmarks/moe.py --tokens 1024 --rounds 3 --repeats 2   # quick

Last line: {"benchmark": "moe", "ratio" (grouped tok/s / baseline tok/s; target >= 1.2),
"ratio_vs_dense", "ragged_dot_ratio" (ragged_dot tok/s / baseline tok/s), "<path>_tok_s" for
grouped, ragged_dot, baseline, capacity_sort, capacity_gather, capacity_einsum, dense and floor,
each with its ``_spread``, "baseline", "capacity", "valid"}. ``ratio`` used to be grouped vs
dense; that comparison is now ``ratio_vs_dense``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from meshrl.benchmarks.figures import Floors, emit, interleave, paired_ratios, spread
from meshrl.models.moe_math import MoESpec, dense_moe_ffn, moe_ffn

Weights = tuple[jax.Array, jax.Array, jax.Array, jax.Array]  # router, gate, up, down
CANDIDATES = ("capacity_sort", "capacity_gather", "capacity_einsum")  # the baseline: the fastest


def _inputs(tokens: int, hidden: int, experts: int, ffn: int, seed: int = 0):
    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], (tokens, hidden))
    router = 0.1 * jax.random.normal(ks[1], (hidden, experts))
    wg, wu = (0.05 * jax.random.normal(k, (experts, hidden, ffn)) for k in ks[2:4])
    wd = 0.05 * jax.random.normal(ks[4], (experts, ffn, hidden))
    return x, router, wg, wu, wd


# ---- plain-JAX MoE, the way a user writes it without meshrl -----------------------------------


def _route(x_TxD: jax.Array, router_DxE: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """(weights [T, k], experts [T, k]): softmax over all experts, top-k, renormalised."""
    probs_TxE = jax.nn.softmax(x_TxD @ router_DxE, axis=-1)
    w_TxK, e_TxK = jax.lax.top_k(probs_TxE, k)
    return w_TxK / w_TxK.sum(-1, keepdims=True), e_TxK


def _expert_swiglu(x_ExCxD: jax.Array, wg: jax.Array, wu: jax.Array, wd: jax.Array) -> jax.Array:
    h_ExCxF = (jax.nn.silu(jnp.einsum("ecd,edf->ecf", x_ExCxD, wg))
               * jnp.einsum("ecd,edf->ecf", x_ExCxD, wu))
    return jnp.einsum("ecf,efd->ecd", h_ExCxF, wd)


def capacity_sort_ffn(x_TxD: jax.Array, w: Weights, k: int, cap: int) -> jax.Array:
    """Copies sorted by expert into ``[E, cap]`` buckets (copies past ``cap`` drop), batched
    expert matmuls, gathered back and summed per token with their routing weights."""
    T, D = x_TxD.shape
    E = w[0].shape[1]
    weights_TxK, experts_TxK = _route(x_TxD, w[0], k)
    order_A = jnp.argsort(experts_TxK.reshape(-1), stable=True)
    e_A, tok_A = experts_TxK.reshape(-1)[order_A], order_A // k
    counts_E = jnp.bincount(e_A, length=E)
    rank_A = jnp.arange(T * k) - (jnp.cumsum(counts_E) - counts_E)[e_A]
    x_ExCxD = jnp.zeros((E, cap, D), x_TxD.dtype).at[e_A, rank_A].set(x_TxD[tok_A], mode="drop")
    y_ExCxD = _expert_swiglu(x_ExCxD, *w[1:])
    y_AxD = y_ExCxD.at[e_A, rank_A].get(mode="fill", fill_value=0)
    return jnp.zeros((T, D), y_AxD.dtype).at[tok_A].add(
        y_AxD * weights_TxK.reshape(-1)[order_A][:, None])


def capacity_gather_ffn(x_TxD: jax.Array, w: Weights, k: int, cap: int) -> jax.Array:
    """The buckets of ``capacity_sort_ffn`` filled and emptied by gathers alone: each bucket slot
    reads its token, each copy reads its slot back (a copy past ``cap`` reads zeros: dropped)."""
    T, _ = x_TxD.shape
    E = w[0].shape[1]
    weights_TxK, experts_TxK = _route(x_TxD, w[0], k)
    e_A = experts_TxK.reshape(-1)
    order_A = jnp.argsort(e_A, stable=True)
    counts_E = jnp.bincount(e_A, length=E)
    c_C = jnp.arange(cap)
    pos_ExC = jnp.minimum((jnp.cumsum(counts_E) - counts_E)[:, None] + c_C, T * k - 1)
    tok_ExC = jnp.where(c_C < counts_E[:, None], order_A[pos_ExC] // k, T)  # T: no token
    y_ExCxD = _expert_swiglu(x_TxD.at[tok_ExC].get(mode="fill", fill_value=0), *w[1:])
    onehot_AxE = jax.nn.one_hot(e_A, E, dtype=jnp.int32)
    rank_TxK = ((jnp.cumsum(onehot_AxE, axis=0) - 1) * onehot_AxE).sum(-1).reshape(T, k)
    y_TxKxD = y_ExCxD.at[experts_TxK, rank_TxK].get(mode="fill", fill_value=0)
    return jnp.einsum("tkd,tk->td", y_TxKxD, weights_TxK)


def capacity_einsum_ffn(x_TxD: jax.Array, w: Weights, k: int, cap: int) -> jax.Array:
    """GShard: each copy's bucket slot from a running count per expert; one-hot dispatch and
    combine ``[T, E, cap]`` tensors (a copy past ``cap`` has an all-zero slot: dropped)."""
    T, _ = x_TxD.shape
    E = w[0].shape[1]
    weights_TxK, experts_TxK = _route(x_TxD, w[0], k)
    # Slot-major order (every token's first choice before any second), as in GShard.
    onehot_KxTxE = jax.nn.one_hot(experts_TxK.T, E, dtype=jnp.int32)
    pos_KxTxE = (jnp.cumsum(onehot_KxTxE.reshape(k * T, E), axis=0).reshape(k, T, E) - 1)
    slot_KxT = (pos_KxTxE * onehot_KxTxE).sum(-1)
    dispatch_KxTxExC = (onehot_KxTxE[..., None]
                        * jax.nn.one_hot(slot_KxT, cap, dtype=jnp.int32)[:, :, None, :])
    dispatch_TxExC = dispatch_KxTxExC.sum(0).astype(x_TxD.dtype)
    combine_TxExC = jnp.einsum("ktec,tk->tec", dispatch_KxTxExC.astype(x_TxD.dtype), weights_TxK)
    y_ExCxD = _expert_swiglu(jnp.einsum("tec,td->ecd", dispatch_TxExC, x_TxD), *w[1:])
    return jnp.einsum("tec,ecd->td", combine_TxExC, y_ExCxD)


def floor_ffn(x_AxD: jax.Array, wg_DxF: jax.Array, wu_DxF: jax.Array,
              wd_FxD: jax.Array) -> jax.Array:
    """The expert FLOPs of the layer in their cheapest form: one SwiGLU over all copies."""
    return (jax.nn.silu(x_AxD @ wg_DxF) * (x_AxD @ wu_DxF)) @ wd_FxD


# ---- steps, checks, timing --------------------------------------------------------------------


def _grad_step(layer: Callable[..., jax.Array]) -> Callable:
    def loss(*args: jax.Array) -> jax.Array:
        return jnp.mean(layer(*args).astype(jnp.float32) ** 2)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))


def _steps(spec: MoESpec, impls: list[str], cap: int) -> dict[str, Callable]:
    def meshrl(fn: Callable, s: MoESpec) -> Callable:
        return lambda x, *w: fn(x, jnp.ones((x.shape[0],), bool), *w, s)[0]

    k = spec.top_k
    steps = {name: _grad_step(meshrl(moe_ffn, MoESpec(spec.num_experts, k, impl=impl)))
             for name, impl in zip(("grouped", "ragged_dot"), impls)}
    steps["capacity_sort"] = _grad_step(lambda x, *w: capacity_sort_ffn(x, w, k, cap))
    steps["capacity_gather"] = _grad_step(lambda x, *w: capacity_gather_ffn(x, w, k, cap))
    steps["capacity_einsum"] = _grad_step(lambda x, *w: capacity_einsum_ffn(x, w, k, cap))
    steps["dense"] = _grad_step(meshrl(dense_moe_ffn, spec))
    return steps


def pick_capacity(x_TxD: jax.Array, router_DxE: jax.Array, k: int, factor: float) -> int:
    """Bucket size per expert; asserts that no copy is dropped at these inputs."""
    T, E = x_TxD.shape[0], router_DxE.shape[1]
    load_E = np.bincount(np.asarray(jax.jit(_route, static_argnums=2)(x_TxD, router_DxE, k)[1])
                         .reshape(-1), minlength=E)
    cap = (math.ceil(T * k / E * factor) if factor > 0 else -(-int(load_E.max()) // 8) * 8)
    assert load_E.max() <= cap, (f"capacity {cap} drops copies: the largest expert load is "
                                 f"{load_E.max()} (raise --capacity_factor)")
    print(f"  expert load max {load_E.max()} / mean {T * k / E:.1f}: capacity {cap}", flush=True)
    return cap


def check_against_dense(steps: dict[str, Callable], args: tuple[jax.Array, ...]) -> None:
    d_loss, d_grads = steps["dense"](*args)
    for name, step in steps.items():
        loss, grads = step(*args)
        np.testing.assert_allclose(float(loss), float(d_loss), rtol=1e-4, err_msg=name)
        for g, d in zip(grads, d_grads, strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(d), rtol=1e-3, atol=1e-5,
                                       err_msg=name)


def _timed(step: Callable, args: tuple[jax.Array, ...], repeats: int) -> Callable[[], float]:
    """One round of a path: the median of ``repeats`` timed steps."""
    def one_round() -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(step(*args))
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return one_round


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (>= 3)")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per path per round")
    ap.add_argument("--capacity_factor", type=float, default=0.0,
                    help="0: the tightest capacity that drops nothing at this seed")
    ap.add_argument("--impl", default="blocked" if jax.default_backend() == "cpu"
                    else "ragged_dot", choices=("blocked", "ragged_dot"))
    a = ap.parse_args()
    if a.rounds < 3:
        ap.error(f"--rounds = {a.rounds}: a median needs >= 3 rounds")
    args = _inputs(a.tokens, a.hidden, a.experts, a.ffn)
    cap = pick_capacity(args[0], args[1], a.top_k, a.capacity_factor)
    impls = [a.impl] + ([] if a.impl == "ragged_dot" else ["ragged_dot"])
    steps = _steps(MoESpec(a.experts, a.top_k, impl=a.impl), impls, cap)
    check_against_dense(steps, args)
    sides = {name: _timed(step, args, a.repeats) for name, step in steps.items()}
    copies = 0.1 * jax.random.normal(jax.random.key(1), (a.tokens * a.top_k, a.hidden))
    floor_args = (copies, args[2][0], args[3][0], args[4][0])
    floor_step = jax.jit(jax.value_and_grad(lambda *w: jnp.mean(floor_ffn(*w) ** 2),
                                            argnums=(0, 1, 2, 3)))
    sides["floor"] = _timed(floor_step, floor_args, a.repeats)
    times = interleave(sides, a.rounds, warmup=1)
    times.setdefault("ragged_dot", times["grouped"])
    report(times, a.tokens, a.impl, cap)


def report(times: dict[str, list[float]], tokens: int, impl: str, cap: int) -> None:
    base = min(CANDIDATES, key=lambda n: statistics.median(times[n]))
    times["baseline"] = times[base]
    floors = Floors()
    for name in ("grouped", "ragged_dot", *CANDIDATES, "dense"):
        floors.check(name, statistics.median(times[name]), statistics.median(times["floor"]))
    out: dict = {"benchmark": "moe", "grouped_impl": impl, "baseline": base, "capacity": cap}
    out |= spread("ratio", paired_ratios(times[base], times["grouped"]), 3)
    out |= spread("ratio_vs_dense", paired_ratios(times["dense"], times["grouped"]), 3)
    out |= spread("ragged_dot_ratio", paired_ratios(times[base], times["ragged_dot"]), 3)
    for name in ("grouped", "ragged_dot", "baseline", *CANDIDATES, "dense", "floor"):
        out |= spread(f"{name}_tok_s", [tokens / t for t in times[name]], 1)
    emit(out, floors)


if __name__ == "__main__":
    main()
