"""Compiled temp memory of one SFT train step at seq 32,768: context = 1 vs context = 4, and the
per-rank attention work of the context layout, measured from its masks.

Memory: ahead-of-time only (``jax.jit(...).lower(abstract state, batch).compile()
.memory_analysis()``, per device, nothing allocated or executed) on 8 fake CPU devices: a
4-layer model (hidden 512, 8 heads, MLP 1,376, vocab 1,024, float32), one sequence per data
shard, data = 2 in both runs; context = 4 uses ``model.context_attention`` (``--strategy``,
default ring) with the balanced layout. Compiled sizes are deterministic, so one round (no
median) is the figure.

Balance: the trainer's batch (one sequence per data shard: segment ids all 1) is put in the
layout the decoder gives it (``sequence_order`` with ``model.context_balance``), sharded over
the real mesh with the specs ``context_attention`` uses, and on every device the query-key
pairs that the strategy's mask lets through (key index <= query index, same segment id) are
counted over the whole sequence's keys (what a rank computes over all ring steps, or against
the gathered K/V). ``balance_max_over_mean`` is max / mean of those counts over the devices;
``balance_formula`` is the same ratio from ``rank_work`` (the layout formula); the two
differing by more than 1% is a broken measurement (``"valid": false``, exit 1). The
contiguous split's measured figure is printed beside them.

  python benchmarks/context.py               # full: a few minutes of compiling
  python benchmarks/context.py --seq 4096    # quick

Last line: {"benchmark": "context", "temp_bytes_c1", "temp_bytes_c4", "ratio" (target
<= 0.35), "balance_max_over_mean" (target <= 1.05), "balance_formula", "estimates" (the
temp bytes and their ratio: the compiler's memory analysis), "valid"}.
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402 -- XLA_FLAGS must be set before JAX is imported
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from meshrl.benchmarks.figures import Floors, emit, estimates  # noqa: E402
from meshrl.configs.loader import base_config, from_config_dict  # noqa: E402
from meshrl.models.context_attention import AXIS, rank_work, sequence_order  # noqa: E402

QUERY_CHUNK = 512  # queries per counted mask slice: bounds the [chunk, L] mask in memory
BALANCE_RTOL = 0.01


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


def measured_rank_work(config, balanced: bool) -> np.ndarray:
    """[devices]: the query-key pairs each device's attention mask lets through, counted on the
    real mesh from the layout and segment ids the decoder feeds ``context_attention``."""
    from meshrl.mesh import create_mesh
    from meshrl.models.sharding import ShardingContext

    m, t = config.mesh, config.trainer
    B, L = t.batch_size, t.seq_len
    mesh = create_mesh(m, jax.devices()[:m.data * m.context])
    ctx = ShardingContext.for_role(mesh, "train", m.fsdp)
    order_L = sequence_order(L, m.context, balanced)
    # One sequence per row (the benchmark's batch), put in the layout as the decoder does.
    segment_ids_BxL = np.ones((B, L), np.int32)[:, order_L]
    index_BxL = np.broadcast_to(order_L, (B, L))
    spec = ctx.sharding(("batch", "length"), (B, L)).spec

    def count(idx_bxl: jax.Array, seg_bxl: jax.Array) -> jax.Array:
        kidx_bxT, kseg_bxT = (jax.lax.all_gather(x, AXIS, axis=1, tiled=True)
                              for x in (idx_bxl, seg_bxl))
        b, n = idx_bxl.shape
        chunk = min(QUERY_CHUNK, n)

        def pairs(i: jax.Array) -> jax.Array:
            q_idx, q_seg = (jax.lax.dynamic_slice_in_dim(x, i * chunk, chunk, axis=1)
                            for x in (idx_bxl, seg_bxl))
            mask_bxQxT = ((kidx_bxT[:, None, :] <= q_idx[:, :, None])
                          & (kseg_bxT[:, None, :] == q_seg[:, :, None]))
            return mask_bxQxT.sum(dtype=jax.numpy.int32)

        # Per-chunk int32 sums (each < 2^31), added in int64 on the host.
        return jax.lax.map(pairs, jax.numpy.arange(n // chunk)).reshape(1, 1, -1)

    counts = jax.jit(jax.shard_map(count, mesh=mesh, in_specs=(spec, spec),
                                   out_specs=P(spec[0], spec[1], None), check_vma=False))(
        index_BxL, segment_ids_BxL)
    return np.asarray(counts).astype(np.int64).sum(-1).reshape(-1)


def _max_over_mean(work: np.ndarray) -> float:
    return float(work.max() / work.mean())


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
              f"(compiled in {time.perf_counter() - t0:.0f} s)", flush=True)
    config = make_config(a.seq, a.context, a.strategy)
    balanced = config.model.context_balance
    measured = _max_over_mean(measured_rank_work(config, balanced))
    formula = _max_over_mean(rank_work(a.seq, a.context, balanced))
    contiguous = _max_over_mean(measured_rank_work(config, False))
    print(f"  per-device attention pairs max/mean: {'balanced' if balanced else 'contiguous'} "
          f"layout measured {measured:.4f}, formula {formula:.4f}; contiguous split measured "
          f"{contiguous:.4f}", flush=True)
    checks = Floors()
    checks.agree("balance_max_over_mean vs rank_work", measured, formula, BALANCE_RTOL)
    emit({"benchmark": "context", "temp_bytes_c1": out[1], "temp_bytes_c4": out[a.context],
          "ratio": round(out[a.context] / out[1], 4),
          "balance_max_over_mean": round(measured, 4), "balance_formula": round(formula, 4),
          # the compiler's memory analysis; the balance is counted from the real masks
          **estimates("temp_bytes_c1", "temp_bytes_c4", "ratio")}, checks)


if __name__ == "__main__":
    main()
