"""Forward + backward tokens/s of one MoE layer: dropless grouped routing vs every expert on
every token (masked), in the same run.

Shape (issue 23): 16 experts, top-2, hidden 256, expert FFN 512, 4,096 tokens, float32, one
device. Grouped = ``model.moe_impl = "auto"`` (``blocked`` on CPU, where ``jax.lax.ragged_dot``
lowers to a loop over every expert; ``ragged_dot`` on TPU/GPU); dense = ``"dense"``, the same
function at experts / top-k times the FLOPs. Both are ``jax.grad`` of a scalar of the layer's
output w.r.t. the input and all four weights, jitted; best of ``--repeats`` after a warm-up,
spread printed. The two paths are checked to agree before timing.

  python benchmarks/moe.py            # ~1 minute on 2 CPU cores

Last line: {"benchmark": "moe", "grouped_tok_s", "dense_tok_s", "ratio"}; target ratio >= 2.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from meshrl.models.moe_math import MoESpec, dense_moe_ffn, moe_ffn


def _inputs(tokens: int, hidden: int, experts: int, ffn: int, seed: int = 0):
    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], (tokens, hidden))
    router = 0.1 * jax.random.normal(ks[1], (hidden, experts))
    wg, wu = (0.05 * jax.random.normal(k, (experts, hidden, ffn)) for k in ks[2:4])
    wd = 0.05 * jax.random.normal(ks[4], (experts, ffn, hidden))
    return x, router, wg, wu, wd


def _step(fn, spec: MoESpec):
    def loss(x, router, wg, wu, wd):
        y, _ = fn(x, jnp.ones((x.shape[0],), bool), router, wg, wu, wd, spec)
        return jnp.mean(y.astype(jnp.float32) ** 2)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))


def _time(step, args, repeats: int) -> list[float]:
    jax.block_until_ready(step(*args))  # compile + warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(step(*args))
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--impl", default="blocked" if jax.default_backend() == "cpu"
                    else "ragged_dot", choices=("blocked", "ragged_dot"))
    a = ap.parse_args()
    args = _inputs(a.tokens, a.hidden, a.experts, a.ffn)
    spec = MoESpec(a.experts, a.top_k, impl=a.impl)
    grouped, dense = _step(moe_ffn, spec), _step(dense_moe_ffn, spec)

    g_loss, g_grads = grouped(*args)
    d_loss, d_grads = dense(*args)
    np.testing.assert_allclose(float(g_loss), float(d_loss), rtol=1e-4)
    for g, d in zip(g_grads, d_grads, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(d), rtol=1e-3, atol=1e-5)

    results = {}
    # Interleave the two so that a noisy neighbour slows both alike.
    for _ in range(2):
        for name, step in (("grouped", grouped), ("dense", dense)):
            results.setdefault(name, []).extend(_time(step, args, a.repeats))
    for name, times in results.items():
        print(f"  {name} ({a.impl if name == 'grouped' else 'dense'}): best {min(times):.4f}s "
              f"spread {max(times) - min(times):.4f}s over {len(times)} steps")
    g_tok_s = a.tokens / min(results["grouped"])
    d_tok_s = a.tokens / min(results["dense"])
    print(json.dumps({"benchmark": "moe", "grouped_tok_s": round(g_tok_s, 1),
                      "dense_tok_s": round(d_tok_s, 1), "ratio": round(g_tok_s / d_tok_s, 3)}))


if __name__ == "__main__":
    main()
