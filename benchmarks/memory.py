"""Compiled temp memory of a real-size RL train step and sampler prefill: reference vs defaults.

Ahead-of-time only: every program is ``jax.jit(...).lower(abstract inputs).compile()`` and
read with ``memory_analysis()`` (per device, the SPMD-partitioned program); nothing is
allocated or executed, so it runs on 8 fake CPU devices of a laptop.

* Model: Qwen2.5-0.5B-shaped (vocab 151,936, 24 layers, hidden 896, 14 heads, 2 KV heads,
  MLP 4,864, tied embeddings, q/k/v bias), trained as ``configs/rl_gsm8k.py`` does (FSDP
  over data = 8, ``model.remat = "full"``, ``model.scan_layers``) but in float32 compute:
  on CPU, XLA upcasts bfloat16 dots through float32 copies of the weights, an artifact of
  this backend that would swamp the figures (``--dtype bfloat16`` shows it).
* Train step: the RL job's step (``trainer/rl_step.py``, decoupled PPO, AdamW) on 8 packed
  sequences of 4,096 tokens; reference = ``model.attention = "einsum"`` and
  ``trainer.logits_chunk = 0`` (full float32 [B, L, V] logits), new = the schema defaults.
* Prefill: 256 prompts x 256 tokens into a 256-slot x 1,024 cache (the sampler's jit, its
  shardings and donation, bfloat16). Baseline (``prefill_ratio``): the prefill a JAX user writes
  without meshrl's sampler, competently: einsum attention over the whole batch in one pass and
  the head on each prompt's last position only (what transformers' ``generate`` does with
  ``logits_to_keep=1``); new = the sampler's program (its attention and row passes of
  ``sampler.prefill_tokens``). ``prefill_ratio_vs_full_logits`` keeps the figure this file
  reported before as ``prefill_ratio``: the same einsum prefill with the head on every prompt
  position ([N, P, V] float logits), a baseline nobody needs to pay.

LoRA rows (``benchmarks/lora_memory.py``): a Llama-3.1-8B-shaped model (SFT step, float32,
FSDP over data = 8, full remat, scanned layers) with rank-16 adapters on every projection:
trainer state bytes (adapters + AdamW moments, global) and step temp bytes (per device) against
full fine-tuning; target lora_state_ratio <= 0.03. ``--lora_only`` runs these rows alone;
``--lora_layers`` / ``--lora_seq`` shrink them for a quick check.

Compile-only figures are deterministic for a given stack, so one round is the measurement.

  python benchmarks/memory.py
  python benchmarks/memory.py --lora_only --lora_layers 2 --lora_seq 256

Last line: {"train_temp_bytes_ref", "train_temp_bytes", "train_ratio",
"prefill_temp_bytes_ref", "prefill_temp_bytes", "prefill_ratio",
"prefill_temp_bytes_full_logits", "prefill_ratio_vs_full_logits", "lora_state_bytes",
"full_state_bytes", "lora_state_ratio", "lora_step_temp_bytes", "full_step_temp_bytes",
"lora_base_bytes", "lora_layers", "lora_seq", "lora_state_ratio_max", "estimates" (the keys
that are the compiler's estimates)}. Targets: train_ratio <= 0.25 (against full float32 logits
and einsum attention, what a plain JAX or transformers trainer computes). prefill_ratio (the
competent baseline) and prefill_ratio_vs_full_logits are reported without a target; the former
target, prefill_ratio_vs_full_logits <= 0.1, was set against a baseline nobody needs to pay.
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402 -- XLA_FLAGS must be set before JAX is imported
import time  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402

from meshrl.benchmarks.figures import emit, estimates  # noqa: E402
from meshrl.benchmarks.lora_memory import STATE_RATIO_MAX, lora_config, lora_rows  # noqa: E402
from meshrl.configs.loader import from_config_dict  # noqa: E402

TEMP_RATIOS = ("train_ratio", "prefill_ratio", "prefill_ratio_vs_full_logits")
from meshrl.configs.schema import Config  # noqa: E402

GiB = 2 ** 30
QWEN25_05B = dict(arch="qwen2", vocab_size=151_936, hidden_size=896, intermediate_size=4864,
                  num_layers=24, num_heads=14, num_kv_heads=2, tie_embeddings=True,
                  attention_bias=True, max_position_embeddings=32_768, rope_theta=1e6)


def make_config(seq: int, rows: int, prompts: int, prompt_len: int, *, reference: bool,
                dtype: str, scan: bool = True) -> Config:
    """``configs/rl_gsm8k.py`` (FSDP, remat, PPO minibatches) with the Qwen2.5-0.5B shape and
    the benchmark's sizes; ``reference``: einsum attention and unchunked logits."""
    from meshrl.configs import rl_gsm8k

    cfg = rl_gsm8k.get_config()
    cfg.mesh.update(data=8)
    cfg.model.update(**QWEN25_05B, compute_dtype=dtype, scan_layers=scan)
    cfg.data.max_prompt_len = prompt_len
    # One update's microbatch holds all 8 rows: the memory of the step as one minibatch.
    cfg.rl.ppo_minibatches = 1
    cfg.trainer.update(seq_len=seq, microbatches=1)
    cfg.rollout.update(prompts_per_step=rows, group_size=1)
    # A group of one has no GRPO advantage; the step compiles the same either way (advantages
    # are computed on the host).
    cfg.rl.advantage = "reinforce_pp"
    cfg.sampler.update(dtype=dtype, slots=prompts, max_len=4 * prompt_len,
                       prompt_buckets=(prompt_len,), max_new_tokens=3 * prompt_len - 1)
    if reference:
        cfg.model.attention = "einsum"
        cfg.trainer.logits_chunk = 0
    return from_config_dict(cfg)


def train_step_memory(config: Config, mesh: Any) -> Any:
    """``memory_analysis()`` of the RL job's compiled train step (abstract state and batch), as
    the compile job builds it."""
    from meshrl.jobs.compile_programs import train_program
    from meshrl.models import resolve_model_config

    return train_program(config, resolve_model_config(config.model), mesh).lowered.compile(
    ).memory_analysis()


def prefill_memory(config: Config, mesh: Any, *, all_positions: bool, one_pass: bool) -> Any:
    """``memory_analysis()`` of one sampler prefill of ``sampler.slots`` prompts of the one
    prompt bucket, as the compile job builds it; ``one_pass`` ignores ``sampler.prefill_tokens``
    (every prompt in one pass)."""
    from meshrl.jobs.compile_programs import prefill_program
    from meshrl.models import resolve_model_config

    prog = prefill_program(config, resolve_model_config(config.model), mesh,
                           all_positions=all_positions, max_tokens=0 if one_pass else None)
    return prog.lowered.compile().memory_analysis()


def _line(what: str, stats: Any, seconds: float) -> int:
    print(f"{what:<34} temp {stats.temp_size_in_bytes / GiB:8.3f} GiB  arguments "
          f"{stats.argument_size_in_bytes / GiB:7.3f} GiB  outputs "
          f"{stats.output_size_in_bytes / GiB:7.3f} GiB  (compiled in {seconds:.0f} s)",
          flush=True)
    return int(stats.temp_size_in_bytes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=4096, help="train sequence length")
    ap.add_argument("--rows", type=int, default=8, help="train sequences per step")
    ap.add_argument("--prompts", type=int, default=256, help="prefill prompts (= slots)")
    ap.add_argument("--prompt_len", type=int, default=256, help="prefill prompt bucket")
    ap.add_argument("--dtype", default="float32", choices=("bfloat16", "float32"),
                    help="compute dtype; on CPU XLA upcasts bfloat16 dots to float32 "
                         "copies of the weights, which would swamp the figures")
    ap.add_argument("--unrolled", action="store_true",
                    help="model.scan_layers = False (on CPU, XLA then schedules the remat "
                         "recompute early and keeps every layer's activations)")
    ap.add_argument("--lora_only", action="store_true", help="only the LoRA rows")
    ap.add_argument("--lora_layers", type=int, default=32, help="LoRA rows: decoder layers")
    ap.add_argument("--lora_seq", type=int, default=4096, help="LoRA rows: sequence length")
    args = ap.parse_args()
    out: dict[str, Any] = {"benchmark": "memory"}
    if not args.lora_only:
        out.update(base_rows(args))
    out.update(lora_section(args), lora_state_ratio_max=STATE_RATIO_MAX)
    # Temp bytes are the compiler's memory analysis; state bytes are counted from the shapes.
    emit({**out, **estimates(*(k for k in out if "temp_bytes" in k or k in TEMP_RATIOS))})


def lora_section(args: argparse.Namespace) -> dict[str, Any]:
    from meshrl.mesh import create_mesh

    config = lora_config(args.lora_seq, args.rows, args.lora_layers, 16, args.dtype,
                         "float32")
    t0 = time.perf_counter()
    rows = lora_rows(config, create_mesh(config.mesh, jax.devices()))
    print(f"LoRA rank 16, Llama-3.1-8B shape ({args.lora_layers} layers, seq {args.lora_seq}): "
          f"state {rows['lora_state_bytes'] / GiB:.3f} GiB vs full "
          f"{rows['full_state_bytes'] / GiB:.3f} GiB ({rows['lora_state_ratio']:.4f}); step "
          f"temp {rows['lora_step_temp_bytes'] / GiB:.3f} vs "
          f"{rows['full_step_temp_bytes'] / GiB:.3f} GiB per device (compiled in "
          f"{time.perf_counter() - t0:.0f} s)", flush=True)
    return {**rows, "lora_layers": args.lora_layers, "lora_seq": args.lora_seq}


def base_rows(args: argparse.Namespace) -> dict[str, Any]:
    from meshrl.mesh import create_mesh

    temps: dict[str, int] = {}
    for reference in (True, False):
        config = make_config(args.seq, args.rows, args.prompts, args.prompt_len,
                             reference=reference, dtype=args.dtype, scan=not args.unrolled)
        mesh = create_mesh(config.mesh, jax.devices())
        name = "reference" if reference else "defaults"
        knobs = (f"attention={config.model.attention}, "
                 f"logits_chunk={config.trainer.logits_chunk}")
        t0 = time.perf_counter()
        temps[f"train_{name}"] = _line(f"train step, {name}", train_step_memory(config, mesh),
                                       time.perf_counter() - t0)
        print(f"  ({knobs})", flush=True)
        variants = ({"reference": (False, True), "full_logits": (True, True)} if reference
                    else {"defaults": (False, False)})
        for what, (all_positions, one_pass) in variants.items():
            t0 = time.perf_counter()
            temps[f"prefill_{what}"] = _line(
                f"prefill, {what}",
                prefill_memory(config, mesh, all_positions=all_positions, one_pass=one_pass),
                time.perf_counter() - t0)
    return {"train_temp_bytes_ref": temps["train_reference"],
           "train_temp_bytes": temps["train_defaults"],
           "train_ratio": round(temps["train_defaults"] / temps["train_reference"], 4),
           "prefill_temp_bytes_ref": temps["prefill_reference"],
           "prefill_temp_bytes": temps["prefill_defaults"],
           "prefill_ratio": round(temps["prefill_defaults"] / temps["prefill_reference"], 4),
           "prefill_temp_bytes_full_logits": temps["prefill_full_logits"],
           "prefill_ratio_vs_full_logits": round(
               temps["prefill_defaults"] / temps["prefill_full_logits"], 4)}


if __name__ == "__main__":
    main()
