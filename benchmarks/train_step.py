"""Train-step throughput on this machine: meshrl's trainer vs a minimal JAX step vs transformers.

One decoder for all three: vocab 8192, hidden 512, SwiGLU MLP 1376, 6 layers, 8 heads (no GQA),
RMSNorm, RoPE, untied embeddings, float32, AdamW with global-norm clipping, batch 8 x seq 512
(27.4M params). Each system gets warm-up steps, then best-of-N timed steps; the spread is printed.

  python benchmarks/train_step.py            # ~3 minutes on 2 CPU cores
  python benchmarks/train_step.py --quick    # fewer timed steps

Last line: one JSON object (see ``main``). MFU = 6 * N * tokens/s / measured f32 matmul peak,
N = all parameters (the convention the targets were set with).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

VOCAB, HIDDEN, MLP, LAYERS, HEADS, BATCH, SEQ = 8192, 512, 1376, 6, 8, 8, 512
HEAD_DIM = HIDDEN // HEADS
LR, EPS_NORM, THETA = 1e-4, 1e-6, 10000.0


def _time(step: Callable[[], Any], warmup: int, repeats: int) -> list[float]:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return times


def _report(name: str, times: list[float]) -> float:
    tok = BATCH * SEQ
    best = tok / min(times)
    print(f"{name:<12} best {best:8.1f} tok/s  median {tok / statistics.median(times):8.1f}  "
          f"worst {tok / max(times):8.1f}  (step s: {', '.join(f'{t:.3f}' for t in times)})",
          flush=True)
    return best


def _batch_np(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, VOCAB, (BATCH, SEQ + 1), dtype=np.int32)
    return {"input_ids": ids[:, :-1], "targets": ids[:, 1:],
            "loss_mask": np.ones((BATCH, SEQ), np.float32),
            "positions": np.broadcast_to(np.arange(SEQ, dtype=np.int32), (BATCH, SEQ)).copy(),
            "segment_ids": np.ones((BATCH, SEQ), np.int32)}


# ---- meshrl: the real trainer (config -> mesh -> model -> state -> jitted train_step) --------


def build_meshrl() -> tuple[Callable[[], None], int]:
    """One train step of the real trainer as a blocking callable, and the param count."""
    from meshrl.algorithms.batch import TrainBatch
    from meshrl.algorithms.losses import get_loss
    from meshrl.configs.loader import base_config, from_config_dict
    from meshrl.mesh import create_mesh, rules_for
    from meshrl.models import create_model, param_count, param_shardings, split_model
    from meshrl.trainer import (
        batch_shardings,
        decoder_forward,
        expand_prefix,
        init_state,
        jit_leaf_step,
        make_optimizer,
        make_train_step,
        put_batch,
        state_shardings,
    )

    cfg = base_config("sft")
    cfg.mesh.data = 1
    cfg.model.update(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP,
                     num_layers=LAYERS, num_heads=HEADS, num_kv_heads=HEADS,
                     tie_embeddings=False, param_dtype="float32", compute_dtype="float32")
    cfg.trainer.update(batch_size=BATCH, seq_len=SEQ, learning_rate=LR, steps=1000)
    cfg.optimizer.update(name="adamw", warmup_steps=0, schedule="constant", weight_decay=0.1)
    config = from_config_dict(cfg)
    mesh = create_mesh(config.mesh, jax.devices()[:1])
    rules = rules_for("train", config.mesh.fsdp)
    graphdef, params = split_model(create_model(config.model, mesh=mesh, rules=rules))
    tx, schedule = make_optimizer(config.optimizer, LR, config.trainer.steps)
    state_sh = state_shardings(expand_prefix(param_shardings(params, mesh, rules), params), tx,
                               mesh, params)
    state = jax.jit(lambda p: init_state(p, tx, 0), out_shardings=state_sh)(params)
    del params
    batch_sh = batch_shardings(mesh, rules, BATCH, SEQ)
    # The jobs' forward: the loss computes float32 logits in trainer.logits_chunk-token chunks.
    forward = decoder_forward(graphdef, config.trainer.logits_chunk)
    # The engine's step: over the state's leaves (TrainEngine.dispatch).
    step = jit_leaf_step(make_train_step(forward, get_loss("sft"), tx, schedule), state_sh,
                         batch_sh, mesh)
    batch = put_batch(TrainBatch.from_mapping(_batch_np()), batch_sh)
    holder = {"leaves": jax.tree.leaves(state)}

    def one() -> None:
        holder["leaves"], metrics = step(holder["leaves"], batch)
        jax.block_until_ready(metrics["loss"])

    return one, param_count(config.model)


# ---- minimal hand-written JAX step of the same model ---------------------------------------


def _init_minimal(key: jax.Array) -> dict[str, Any]:
    ks = iter(jax.random.split(key, 4 + 7 * LAYERS))
    normal = lambda shape: 0.02 * jax.random.normal(next(ks), shape, jnp.float32)  # noqa: E731
    layers = [{"attn_norm": jnp.ones(HIDDEN), "mlp_norm": jnp.ones(HIDDEN),
               "wq": normal((HIDDEN, HIDDEN)), "wk": normal((HIDDEN, HIDDEN)),
               "wv": normal((HIDDEN, HIDDEN)), "wo": normal((HIDDEN, HIDDEN)),
               "gate": normal((HIDDEN, MLP)), "up": normal((HIDDEN, MLP)),
               "down": normal((MLP, HIDDEN))} for _ in range(LAYERS)]
    return {"embed": normal((VOCAB, HIDDEN)), "final_norm": jnp.ones(HIDDEN),
            "head": normal((HIDDEN, VOCAB)), "layers": layers}


def _rms(x: jax.Array, w: jax.Array) -> jax.Array:
    return w * x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + EPS_NORM)


def _rope(x_BxLxNxH: jax.Array) -> jax.Array:
    inv = 1.0 / THETA ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    ang_LxH2 = np.arange(SEQ)[:, None] * inv[None]
    cos, sin = jnp.asarray(np.cos(ang_LxH2))[:, None], jnp.asarray(np.sin(ang_LxH2))[:, None]
    x1, x2 = x_BxLxNxH[..., : HEAD_DIM // 2], x_BxLxNxH[..., HEAD_DIM // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _minimal_loss(params: dict[str, Any], ids_BxL: jax.Array, tgt_BxL: jax.Array) -> jax.Array:
    x = params["embed"][ids_BxL]
    causal = jnp.tril(jnp.ones((SEQ, SEQ), bool))
    for p in params["layers"]:
        h = _rms(x, p["attn_norm"])
        q = _rope((h @ p["wq"]).reshape(BATCH, SEQ, HEADS, HEAD_DIM))
        k = _rope((h @ p["wk"]).reshape(BATCH, SEQ, HEADS, HEAD_DIM))
        v = (h @ p["wv"]).reshape(BATCH, SEQ, HEADS, HEAD_DIM)
        s = jnp.einsum("blnh,btnh->bnlt", q, k) * HEAD_DIM ** -0.5
        a = jax.nn.softmax(jnp.where(causal, s, -1e30), -1)
        x = x + jnp.einsum("bnlt,btnh->blnh", a, v).reshape(BATCH, SEQ, HIDDEN) @ p["wo"]
        h = _rms(x, p["mlp_norm"])
        x = x + (jax.nn.silu(h @ p["gate"]) * (h @ p["up"])) @ p["down"]
    logits = _rms(x, params["final_norm"]) @ params["head"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tgt_BxL[..., None], -1))


def build_minimal() -> Callable[[], None]:
    params = _init_minimal(jax.random.key(0))
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(LR, b1=0.9, b2=0.95, weight_decay=0.1,
                                 mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)))
    opt = tx.init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params: Any, opt: Any, ids: jax.Array, tgt: jax.Array) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(_minimal_loss)(params, ids, tgt)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    b = _batch_np()
    ids, tgt = jnp.asarray(b["input_ids"]), jnp.asarray(b["targets"])
    holder = {"p": params, "o": opt}

    def one() -> None:
        holder["p"], holder["o"], loss = step(holder["p"], holder["o"], ids, tgt)
        loss.block_until_ready()

    return one


# ---- transformers (torch CPU) --------------------------------------------------------------


def bench_transformers(warmup: int, repeats: int) -> float:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP,
                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      num_key_value_heads=HEADS, max_position_embeddings=SEQ,
                      rms_norm_eps=EPS_NORM, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    b = _batch_np()
    ids = torch.from_numpy(b["input_ids"].astype(np.int64))
    tgt = torch.from_numpy(b["targets"].astype(np.int64))

    def one() -> None:
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tgt.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _report("transformers", _time(one, warmup, repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 warm-up + 3 timed steps each")
    parser.add_argument("--skip_baseline", action="store_true", help="skip transformers")
    args = parser.parse_args()
    warmup, repeats = (2, 3) if args.quick else (2, 6)

    from meshrl.trainer.metrics import measure_matmul_peak

    peak = measure_matmul_peak(n=2048, repeats=5)
    print(f"f32 matmul peak: {peak / 1e9:.1f} GFLOP/s ({jax.devices()[0].device_kind})",
          flush=True)
    ours_step, n_params = build_meshrl()
    minimal_step = build_minimal()
    # Interleaved rounds: background load drifts, and both JAX steps should see the same drift.
    for _ in range(warmup):
        ours_step()
        minimal_step()
    ours_t, minimal_t = [], []
    for _ in range(repeats):
        ours_t += _time(ours_step, 0, 1)
        minimal_t += _time(minimal_step, 0, 1)
    ours, minimal = _report("meshrl", ours_t), _report("minimal_jax", minimal_t)
    baseline = float("nan") if args.skip_baseline else bench_transformers(warmup, repeats)
    mfu = 6 * n_params * ours / peak
    print(f"params {n_params / 1e6:.2f}M  tokens/step {BATCH * SEQ}", flush=True)
    print(json.dumps({
        "benchmark": "train_step", "ours_tok_s": round(ours, 1),
        "minimal_jax_tok_s": round(minimal, 1), "baseline_tok_s": round(baseline, 1),
        "ratio": round(ours / baseline, 3), "ratio_vs_minimal_jax": round(ours / minimal, 3),
        "mfu": round(mfu, 3), "peak_gflops": round(peak / 1e9, 1)}))


if __name__ == "__main__":
    main()
