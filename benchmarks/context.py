"""Compiled temp memory of one SFT train step at seq 32,768: context = 1 vs context = 4.

Ahead-of-time only (``jax.jit(...).lower(abstract state, batch).compile().memory_analysis()``,
per device, nothing allocated or executed) on 8 fake CPU devices: a 4-layer model (hidden 512,
8 heads, MLP 1,376, vocab 1,024, float32), one sequence per data shard, data = 2 in both runs;
context = 4 uses ``model.context_attention`` (``--strategy``, default ring) with the balanced
layout. ``balance_max_over_mean`` is the per-rank causal attention work (query-key pairs) of
that layout, max / mean over the 4 ranks (the contiguous split's figure is printed beside it).

  python benchmarks/context.py          # a few minutes of compiling on 2 CPU cores

Last line: {"benchmark": "context", "temp_bytes_c1", "temp_bytes_c4", "ratio",
"balance_max_over_mean"}; targets ratio <= 0.35, balance_max_over_mean <= 1.05.
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402 -- XLA_FLAGS must be set before JAX is imported
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

from meshrl.configs.loader import base_config, from_config_dict  # noqa: E402
from meshrl.models.context_attention import rank_work  # noqa: E402


def make_config(seq: int, context: int, strategy: str):
    cfg = base_config("sft")
    cfg.model.update(vocab_size=1024, hidden_size=512, intermediate_size=1376, num_layers=4,
                     num_heads=8, num_kv_heads=8, max_position_embeddings=seq,
                     context_attention=strategy)
    cfg.mesh.update(data=2, context=context)
    cfg.trainer.update(seq_len=seq, batch_size=2)
    return from_config_dict(cfg)


def step_temp_bytes(config) -> int:
    from meshrl.algorithms.batch import TrainBatch, abstract_batch
    from meshrl.algorithms.losses import get_loss
    from meshrl.mesh import create_mesh, rules_for
    from meshrl.models import abstract_model, param_shardings, split_model
    from meshrl.trainer import (
        abstract_state,
        batch_shardings,
        decoder_forward,
        expand_prefix,
        jit_train_step,
        make_optimizer,
        make_train_step,
        state_shardings,
    )

    t = config.trainer
    mesh = create_mesh(config.mesh, jax.devices()[:2 * config.mesh.context])
    rules = rules_for("train", config.mesh.fsdp)
    graphdef, params = split_model(abstract_model(config.model, mesh=mesh, rules=rules))
    tx, schedule = make_optimizer(config.optimizer, t.learning_rate, t.steps)
    params_sh = expand_prefix(param_shardings(params, mesh, rules), params)
    state_sh = state_shardings(params_sh, tx, mesh, params)
    batch_sh = batch_shardings(mesh, rules, t.batch_size, t.seq_len, TrainBatch)
    step = make_train_step(decoder_forward(graphdef, t.logits_chunk), get_loss("sft"), tx,
                           schedule)
    jitted = jit_train_step(step, state_sh, batch_sh, mesh)
    lowered = jitted.lower(abstract_state(state_sh, params, tx),
                           abstract_batch(batch_sh, t.batch_size, t.seq_len))
    return int(lowered.compile().memory_analysis().temp_size_in_bytes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=32_768)
    ap.add_argument("--context", type=int, default=4)
    ap.add_argument("--strategy", default="ring", choices=("ring", "all_gather"))
    a = ap.parse_args()
    out = {}
    for c in (1, a.context):
        t0 = time.perf_counter()
        out[c] = step_temp_bytes(make_config(a.seq, c, a.strategy))
        print(f"  context={c}: temp {out[c] / 2 ** 20:.1f} MiB per device "
              f"(compiled in {time.perf_counter() - t0:.0f} s)")
    work, contiguous = rank_work(a.seq, a.context, True), rank_work(a.seq, a.context, False)
    print(f"  per-rank causal work max/mean: balanced {work.max() / work.mean():.4f}, "
          f"contiguous {contiguous.max() / contiguous.mean():.4f}")
    print(json.dumps({"benchmark": "context", "temp_bytes_c1": out[1],
                      "temp_bytes_c4": out[a.context],
                      "ratio": round(out[a.context] / out[1], 4),
                      "balance_max_over_mean": round(float(work.max() / work.mean()), 4)}))


if __name__ == "__main__":
    main()
