"""LoRA adapters as a PEFT adapter directory: ``adapter_model.safetensors`` +
``adapter_config.json``, which ``peft.PeftModel.from_pretrained`` loads onto the HF base.

Layout. Our adapter of a kernel ``W: lead + in + out`` is ``A: lead + in + (r,)`` and
``B: lead + (r,) + out`` with update ``alpha / r * A @ B``. A torch ``Linear`` stores
``[n_out, n_in]`` and our kernels map to it by flattening the input and output axes in order
(``hf_names.linear``), so the HF update is ``(A2 @ B2).T = B2.T @ A2.T`` with ``A2: [n_in, r]``,
``B2: [r, n_out]``. PEFT computes ``scaling * lora_B @ lora_A`` with ``lora_A: [r, n_in]`` and
``lora_B: [n_out, r]``: ``lora_A = A2.T``, ``lora_B = B2.T``, scaling ``alpha / r``
(``use_rslora`` false). A stacked ``layers`` axis (``model.scan_layers``) is split per layer.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from meshrl.configs.fields import ConfigError
from meshrl.configs.lora_schema import LoraConfig
from meshrl.configs.schema import ModelConfig
from meshrl.models.hf_names import Stack, Tensor, entry_of, param_map
from meshrl.models.lora import Target
from meshrl.utils.log import get_logger
from meshrl.utils.params import process_local_copy

PREFIX = "base_model.model."  # PeftModel wraps the transformers model as base_model.model
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


def _key(path: str) -> tuple[Any, ...]:
    """``layers/0/attn/q/kernel`` -> ``("layers", 0, "attn", "q", "kernel")`` (hf_names' keys)."""
    return tuple(int(p) if p.isdigit() else p for p in path.split("/"))


def _modules(cfg: ModelConfig, mapping: dict[tuple[Any, ...], Any], t: Target) -> list[str]:
    """The HF module (``model.layers.0.self_attn.q_proj``) of each slice of ``t``'s lead axis
    (one module without a lead axis). LoRA targets only ``Projection`` kernels (attention and
    dense MLP), each one torch Linear; MoE experts are no ``Projection``."""
    entry = entry_of(mapping, cfg, _key(t.path))
    parts = entry.parts if isinstance(entry, Stack) and t.n_lead else (entry,)
    assert all(isinstance(p, Tensor) and p.name.endswith(".weight") for p in parts), t.path
    return [p.name.removesuffix(".weight") for p in parts]


def peft_tensors(cfg: ModelConfig, targets: Sequence[Target],
                 adapters: dict[str, dict[str, np.ndarray]]) -> tuple[dict[str, np.ndarray],
                                                                     list[str]]:
    """(PEFT's tensors ``{name: array}`` in float32, the adapted HF module names) of host
    ``adapters`` (``{path: {"a", "b"}}``)."""
    mapping = param_map(cfg)
    tensors: dict[str, np.ndarray] = {}
    modules: list[str] = []
    for t in targets:
        a, b = (np.asarray(adapters[t.path][k], np.float32) for k in ("a", "b"))
        rank = a.shape[-1]
        n_slices = int(np.prod(t.shape[:t.n_lead]))
        a3 = a.reshape(n_slices, -1, rank)   # per slice [n_in, r]
        b3 = b.reshape(n_slices, rank, -1)   # per slice [r, n_out]
        for i, module in enumerate(_modules(cfg, mapping, t)):
            tensors[f"{PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(a3[i].T)
            tensors[f"{PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(b3[i].T)
            modules.append(module)
    return tensors, modules


_DENSE_MLP = (".mlp.gate_proj", ".mlp.up_proj", ".mlp.down_proj")


def check_peft_modules(cfg: ModelConfig, modules: Sequence[str]) -> None:
    """A ``ConfigError`` for adapters PEFT cannot put back: on an MoE model type (Qwen3-MoE,
    Mixtral) peft reads ``gate_proj``/``up_proj``/``down_proj`` targets as the fused experts'
    parameters, so a dense layer's MLP adapters would be dropped and fresh ones put on the
    experts."""
    dense = [m for m in modules if m.endswith(_DENSE_MLP)]
    if cfg.num_experts and dense:
        raise ConfigError(f"export.format = 'peft': {len(dense)} adapted dense MLP modules of an "
                          f"MoE model ({dense[0]}, ...): peft reads gate_proj/up_proj/down_proj "
                          f"of an MoE model as its experts and would not load them; export the "
                          f"merged model (export.format = 'merged') or adapt attention only "
                          f"(lora.targets = 'attn/(q|k|v|o)')")


def target_modules(modules: list[str], every: list[str]) -> list[str]:
    """PEFT's ``target_modules``: the short names (``q_proj``) when the adapted modules are all
    of ``every`` (the HF modules of all projections) that end in them, else the full names (a
    short name would put fresh adapters on the modules left out)."""
    short = sorted({m.rsplit(".", 1)[-1] for m in modules})
    covered = {m for m in every if m.rsplit(".", 1)[-1] in short}
    return short if covered == set(modules) else sorted(modules)


def adapter_config(lora: LoraConfig, base: str, targets: list[str]) -> dict[str, Any]:
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
            "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
            "target_modules": targets, "bias": "none", "use_rslora": False,
            "fan_in_fan_out": False, "modules_to_save": None, "inference_mode": True,
            "init_lora_weights": True}


def save_peft_adapter(cfg: ModelConfig, lora: LoraConfig, targets: Sequence[Target],
                      every: Sequence[Target], adapters: Any, base: str,
                      path: str | pathlib.Path, write: bool = True) -> None:
    """Write the PEFT adapter of ``adapters`` (placed, any sharding) for the HF base ``base``
    at ``path``; ``every``: all projections (for ``target_modules``). Every process takes part
    in gathering the adapters; those with ``write`` write the files."""
    from safetensors.numpy import save_file

    mapping = param_map(cfg)
    check_peft_modules(cfg, [m for t in targets for m in _modules(cfg, mapping, t)])
    host = {p: {k: np.asarray(jax.device_get(process_local_copy(v))) for k, v in ab.items()}
            for p, ab in adapters.items()}
    tensors, modules = peft_tensors(cfg, targets, host)
    if not write:
        return
    everything = [m for t in every for m in _modules(cfg, mapping, t)]
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / WEIGHTS), metadata={"format": "pt"})
    config = adapter_config(lora, base, target_modules(modules, everything))
    (path / CONFIG).write_text(json.dumps(config, indent=2))
    get_logger("models").info("saved PEFT adapter %s (%d modules)", path, len(modules))


__all__ = ["CONFIG", "WEIGHTS", "adapter_config", "check_peft_modules", "peft_tensors",
           "save_peft_adapter", "target_modules"]
