"""meshrl's 8B train step against a minimal plain-JAX one, compiled for the same TPU slice.

Ahead-of-time only (libtpu, no TPU): both steps are lowered on abstract inputs for the same
topology and the same FSDP mesh (``data`` over every chip), the same model (the config's), batch,
sequence length and microbatches, and read from the compiled programs: per-chip HBM
(arguments + outputs - aliased + temps) and collective bytes per step counted from the HLO with
loop trip counts (``aot/hlo.py``). The baseline is ``benchmarks/aot_minimal.py``: FSDP done the
usual way in plain JAX, cast before the gather, activations batch-sharded, gradients sharded.

The analytic minimum of FSDP's collective bytes: per microbatch, each layer's weights gathered
twice in bfloat16 (forward; backward, whose remat recompute shares that gather) and their
gradients reduce-scattered once in bfloat16; the embedding and the head are left out (used
vocab-sharded, they move activations instead). A compile is deterministic for a given stack,
so one round is the measurement; both sides are compiled in the same process.

  python benchmarks/aot.py [--config configs/llama3_8b.py:sft] [--topology v5p-8]

Last line: {"hbm_gib", "hbm_gib_minimal", "hbm_ratio", "collective_gb", "collective_gb_minimal",
"collective_ratio", "collective_gb_analytic", "collective_vs_analytic", ...}. Targets:
hbm_ratio <= 1.1, collective_ratio <= 1.1, collective_vs_analytic <= 1.25.
"""

from __future__ import annotations

import argparse
import pathlib
import time

from meshrl.utils.tpu_env import quiet_libtpu_probe

quiet_libtpu_probe()  # before JAX starts a backend

from meshrl.benchmarks import aot_minimal  # noqa: E402
from meshrl.benchmarks.figures import Floors, emit  # noqa: E402
from meshrl.configs import from_config_dict, load_config_file  # noqa: E402
from meshrl.configs.model_schema import ModelConfig  # noqa: E402
from meshrl.jobs.compile import compile_all, target  # noqa: E402
from meshrl.jobs.compile_analysis import analyse  # noqa: E402
from meshrl.jobs.compile_programs import Program  # noqa: E402
from meshrl.mesh import create_mesh  # noqa: E402
from meshrl.models import flops_per_token, resolve_model_config  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
GB = 1e9


def layer_params(m: ModelConfig) -> int:
    """Parameters of the decoder layers (attention, MLP, norms), embedding and head left out."""
    D, Dh = m.hidden_size, m.resolved_head_dim
    attn = D * (m.num_heads * Dh) * 2 + D * (m.num_kv_heads * Dh) * 2
    return m.num_layers * (attn + 3 * D * m.intermediate_size + 2 * D)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/llama3_8b.py:sft")
    ap.add_argument("--topology", default="v5p-8")
    args = ap.parse_args()
    path, _, variant = args.config.partition(":")
    config = load_config_file(ROOT / path, variant or None)
    d = {**config.to_dict(), "job": "compile"}
    d["compile"] = {**d["compile"], "topology": args.topology, "job": "sft", "programs": ()}
    d["mesh"] = {**d["mesh"], "data": -1, "tensor": 1, "context": 1, "expert": 1,
                 "expert_tensor": 1, "fsdp": True}
    config = from_config_dict(d)
    devices, chip, label = target(config.compile)
    t = config.trainer
    print(f"{label}: {t.batch_size} x {t.seq_len} tokens, {t.microbatches} microbatches, "
          f"FSDP over {len(devices)} chips", flush=True)
    t0 = time.perf_counter()
    (ours,) = compile_all(config, devices, chip, ("train",))
    print(f"meshrl compiled in {time.perf_counter() - t0:.0f} s", flush=True)
    model = resolve_model_config(config.model)
    mesh = create_mesh(config.mesh, devices)
    t0 = time.perf_counter()
    lowered = aot_minimal.lower(model, mesh, t.batch_size, t.seq_len, t.microbatches)
    flops = flops_per_token(model, t.seq_len) * t.batch_size * t.seq_len
    base = analyse(Program("minimal", lowered, 1, flops, flops * 8 / 6, 0.0),
                   lowered.compile(), chip, len(devices), time.perf_counter() - t0)
    print(f"minimal compiled in {base['compile_s']:.0f} s", flush=True)
    analytic = t.microbatches * 3 * layer_params(model) * 2
    floors = Floors()
    floors.check("meshrl collective bytes vs the analytic minimum", ours["collective_bytes"],
                 analytic)  # below the minimum: the HLO count is broken
    for name, e in (("meshrl", ours), ("minimal", base)):
        kinds = ", ".join(f"{k} {v['bytes'] / GB:.1f} GB" for k, v in e["collectives"].items())
        print(f"  {name:<8} HBM {e['hbm_per_chip_gib']:.2f} GiB/chip  collectives "
              f"{e['collective_bytes'] / GB:.1f} GB/step ({kinds})", flush=True)
    emit({"benchmark": "aot", "topology": args.topology, "config": args.config,
          "hbm_gib": round(ours["hbm_per_chip_gib"], 3),
          "hbm_gib_minimal": round(base["hbm_per_chip_gib"], 3),
          "hbm_ratio": round(ours["hbm_per_chip_gib"] / base["hbm_per_chip_gib"], 4),
          "collective_gb": round(ours["collective_bytes"] / GB, 3),
          "collective_gb_minimal": round(base["collective_bytes"] / GB, 3),
          "collective_ratio": round(ours["collective_bytes"] / base["collective_bytes"], 4),
          "collective_gb_analytic": round(analytic / GB, 3),
          "collective_vs_analytic": round(ours["collective_bytes"] / analytic, 4),
          "mfu_roofline": round(ours["mfu_roofline"], 4), "bound": ours["roofline"]["bound"],
          "estimate": True}, floors)


if __name__ == "__main__":
    main()
