"""Train-step throughput on this machine: meshrl's trainer vs a minimal JAX step vs transformers.

One decoder for all three: vocab 8192, hidden 512, SwiGLU MLP 1376, 6 layers, 8 heads (no GQA),
RMSNorm, RoPE, untied embeddings, float32, AdamW with global-norm clipping, batch 8 x seq 512
(27.4M params). Baselines: transformers' ``LlamaForCausalLM`` (torch, SDPA attention, its own
AdamW), the framework a user would otherwise train this model with; and a minimal hand-written
JAX step of the same model (plain ``jnp`` + optax), which is meshrl's floor: meshrl's step
faster than it by more than 5% is a broken measurement (``"valid": false``, exit 1).

All three sides get the same warm-up passes and are timed in the same interleaved rounds (the
order rotates each round); in a round each side times ``--steps`` steps and keeps their median.
torch runs on as many threads as JAX's CPU client (every core this process may use; printed as
``threads``). A figure is the median over the rounds with ``[min, max]`` beside it
(``_spread``); a ratio is paired round by round before its median is taken.

MFU = the model's training FLOPs per token (``models.flops_per_token``: 6 x the matmul
parameters, the LM head included and the embedding lookup not, plus the attention
score/value matmuls) x meshrl's tokens/s / one device's peak FLOP/s. The peak is the float32
spec-sheet peak of the device kind (``trainer.metrics.table_peak``; ``"peak_source": "table"``)
or, on CPU, a 2048^2 float32 matmul timed as another side of the same rounds
(``"measured_cpu_matmul"``), MFU then paired round by round. ``mfu`` used to be 6 x all
parameters (the embedding table counted as a matmul) over a best-of-5 measured peak.

  python benchmarks/train_step.py                            # full
  python benchmarks/train_step.py --quick --skip_baseline    # 3 rounds of one step, no torch

Last line: {"benchmark": "train_step", "ours_tok_s", "minimal_jax_tok_s", "baseline_tok_s"
(transformers), "ratio" (ours / transformers), "ratio_vs_minimal_jax" (target >= 0.9; > 1.05
is invalid), "mfu" (target >= 0.25), each with its ``_spread``, "flops_per_token",
"peak_gflops", "peak_source", "threads", "valid"}.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from meshrl.benchmarks.figures import (
    Floors,
    cpu_threads,
    emit,
    interleave,
    paired_ratios,
    spread,
)

VOCAB, HIDDEN, MLP, LAYERS, HEADS, BATCH, SEQ = 8192, 512, 1376, 6, 8, 8, 512
HEAD_DIM = HIDDEN // HEADS
LR, EPS_NORM, THETA = 1e-4, 1e-6, 10000.0
PEAK_N = 2048


def _per_round(step: Callable[[], None], steps: int) -> Callable[[], float]:
    """One round of a side: the median seconds of ``steps`` timed steps."""
    def one_round() -> float:
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    return one_round


def _batch_np(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, VOCAB, (BATCH, SEQ + 1), dtype=np.int32)
    return {"input_ids": ids[:, :-1], "targets": ids[:, 1:],
            "loss_mask": np.ones((BATCH, SEQ), np.float32),
            "positions": np.broadcast_to(np.arange(SEQ, dtype=np.int32), (BATCH, SEQ)).copy(),
            "segment_ids": np.ones((BATCH, SEQ), np.int32)}


# ---- meshrl: the real trainer (config -> mesh -> model -> state -> jitted train_step) --------


def build_meshrl() -> tuple[Callable[[], None], float]:
    """One train step of the real trainer as a blocking callable, and the model's training
    FLOPs per token."""
    from meshrl.algorithms.batch import TrainBatch
    from meshrl.algorithms.losses import get_loss
    from meshrl.configs.loader import base_config, from_config_dict
    from meshrl.mesh import create_mesh, rules_for
    from meshrl.models import create_model, flops_per_token, param_shardings, split_model
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

    return one, flops_per_token(config.model, SEQ)


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


def build_transformers(threads: int) -> Callable[[], None]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(threads)
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

    return one


def _peak() -> tuple[float | None, str]:
    """(the table's float32 peak FLOP/s of this device kind or None, its source)."""
    from meshrl.trainer.metrics import table_peak

    device = jax.local_devices()[0]
    peak = table_peak(device.device_kind, "float32")
    if peak is not None:
        return peak, "table"
    return None, "measured_cpu_matmul" if device.platform == "cpu" else "measured_matmul"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of one step per side")
    parser.add_argument("--skip_baseline", action="store_true", help="skip transformers")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (>= 3)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per side per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed passes of every side")
    args = parser.parse_args()
    rounds, steps, warmup = (3, 1, 1) if args.quick else (args.rounds, args.steps, args.warmup)
    if rounds < 3:
        parser.error(f"--rounds = {rounds}: a median needs >= 3 rounds")
    threads = cpu_threads()
    ours_step, flops_tok = build_meshrl()
    sides = {"meshrl": _per_round(ours_step, steps),
             "minimal_jax": _per_round(build_minimal(), steps)}
    if not args.skip_baseline:
        sides["transformers"] = _per_round(build_transformers(threads), steps)
    peak, source = _peak()
    if peak is None:
        from meshrl.trainer.metrics import measure_matmul_peak
        # The peak as seconds per 2 n^3 FLOPs, so that it sees the same rounds as the steps.
        sides["peak"] = lambda: 2 * PEAK_N**3 / measure_matmul_peak(n=PEAK_N, repeats=3)
    print(f"{jax.devices()[0].device_kind}: {threads} threads for JAX and torch", flush=True)
    times = interleave(sides, rounds, warmup)
    report(times, flops_tok, peak, source, threads)


def report(times: dict[str, list[float]], flops_tok: float, peak: float | None, source: str,
           threads: int) -> None:
    tok = BATCH * SEQ
    peaks = ([2 * PEAK_N**3 / t for t in times["peak"]] if peak is None
             else [peak] * len(times["meshrl"]))
    mfu = [flops_tok * tok / t / p for t, p in zip(times["meshrl"], peaks, strict=True)]
    out: dict[str, Any] = {"benchmark": "train_step"}
    for name, key in (("meshrl", "ours"), ("minimal_jax", "minimal_jax"),
                      ("transformers", "baseline")):
        out |= (spread(f"{key}_tok_s", [tok / t for t in times[name]], 1) if name in times
                else {f"{key}_tok_s": None})
    out |= (spread("ratio", paired_ratios(times["transformers"], times["meshrl"]), 3)
            if "transformers" in times else {"ratio": None})
    out |= spread("ratio_vs_minimal_jax", paired_ratios(times["minimal_jax"], times["meshrl"]), 3)
    out |= spread("mfu", mfu, 3)
    out |= {"flops_per_token": flops_tok, "peak_gflops": round(statistics.median(peaks) / 1e9, 1),
            "peak_source": source, "threads": threads}
    floors = Floors()
    # The headline's own pairing: meshrl / minimal seconds, median over the rounds.
    floors.check_ratio("meshrl train step vs the minimal JAX step",
                       statistics.median(paired_ratios(times["meshrl"], times["minimal_jax"])))
    emit(out, floors)


if __name__ == "__main__":
    main()
