"""Our param paths <-> Hugging Face tensor names and layouts, for every supported decoder.

An entry says how one of our params is stored in a checkpoint: a ``Tensor`` (one HF tensor,
with the layout change each way), a ``Stack`` of entries along a new leading axis (the experts
of an MoE layer; the layers of a ``scan_layers`` model), or ``Alt``: alternatives, the first one
whose tensors the checkpoint has is read, and the first is written. transformers keeps MoE
experts fused in memory ([E, 2F, D] gate_up, [E, D, F] down) and writes them one per expert on
disk; we write per expert and read both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from typing import Any, Union

import jax
import numpy as np

from meshrl.configs.schema import ModelConfig

Transform = Callable[[np.ndarray], np.ndarray]
_ident: Transform = lambda a: a  # noqa: E731


@dataclasses.dataclass(frozen=True)
class Tensor:
    name: str
    to_ours: Transform = _ident
    to_hf: Transform | None = _ident  # None: read-only (a fused layout we do not write)


@dataclasses.dataclass(frozen=True)
class Stack:
    parts: tuple[Entry, ...]


@dataclasses.dataclass(frozen=True)
class Alt:
    options: tuple[Entry, ...]


Entry = Union[Tensor, Stack, Alt]  # noqa: UP007 -- a runtime alias used in dataclass fields


def names(entry: Entry) -> list[str]:
    """Every HF tensor an entry reads (an ``Alt``: its first option's)."""
    if isinstance(entry, Tensor):
        return [entry.name]
    if isinstance(entry, Stack):
        return [n for p in entry.parts for n in names(p)]
    return names(entry.options[0])


def choose(entry: Entry, available: Collection[str]) -> Entry:
    """The entry with each ``Alt`` resolved to the first option whose tensors all exist (the
    first option when none does, so that the error names what we write)."""
    if isinstance(entry, Stack):
        return Stack(tuple(choose(p, available) for p in entry.parts))
    if isinstance(entry, Alt):
        for option in entry.options:
            if all(n in available for n in names(option)):
                return choose(option, available)
        return choose(entry.options[0], available)
    return entry


def hf_shape(entry: Tensor, ours: tuple[int, ...]) -> tuple[int, ...] | None:
    """The shape the HF tensor must have for our param (slice) of shape ``ours``."""
    if entry.to_hf is None:
        return None
    return tuple(jax.eval_shape(entry.to_hf, jax.ShapeDtypeStruct(ours, np.float32)).shape)


def split(entry: Entry, host: np.ndarray) -> dict[str, np.ndarray]:
    """Our param value -> the HF tensors of the entry (first option of each ``Alt``)."""
    if isinstance(entry, Tensor):
        assert entry.to_hf is not None, entry.name
        return {entry.name: np.ascontiguousarray(entry.to_hf(host))}
    if isinstance(entry, Stack):
        assert host.shape[0] == len(entry.parts), (host.shape, len(entry.parts))
        return {k: v for i, p in enumerate(entry.parts) for k, v in split(p, host[i]).items()}
    return split(entry.options[0], host)


def linear(in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> tuple[Transform, Transform]:
    """torch Linear stores [out, in]; our kernels are [in..., out...] with heads split out."""
    n_in, n_out = int(np.prod(in_shape)), int(np.prod(out_shape))
    return (lambda a: a.T.reshape(in_shape + out_shape), lambda a: a.reshape(n_in, n_out).T)


def _bias(out_shape: tuple[int, ...]) -> tuple[Transform, Transform]:
    return lambda a: a.reshape(out_shape), lambda a: a.reshape(-1)


def param_map(cfg: ModelConfig) -> dict[tuple[Any, ...], Entry]:
    """Our param path (per layer, unstacked) -> its entry."""
    D = cfg.hidden_size
    m: dict[tuple[Any, ...], Entry] = {
        ("embed",): Tensor("model.embed_tokens.weight"),
        ("final_norm", "scale"): Tensor("model.norm.weight"),
    }
    if not cfg.tie_embeddings:
        m[("lm_head",)] = Tensor("lm_head.weight", *linear((D,), (cfg.vocab_size,)))
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        m[("layers", i, "attn_norm", "scale")] = Tensor(p + "input_layernorm.weight")
        m[("layers", i, "mlp_norm", "scale")] = Tensor(p + "post_attention_layernorm.weight")
        m.update(_attention(cfg, i, p))
        m.update(_moe(cfg, i, p) if cfg.is_sparse_layer(i) else _mlp(cfg, i, p))
    return m


def _attention(cfg: ModelConfig, i: int, p: str) -> dict[tuple[Any, ...], Entry]:
    D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
    m: dict[tuple[Any, ...], Entry] = {}
    for ours, theirs, heads in (("q", "q_proj", N), ("k", "k_proj", K), ("v", "v_proj", K)):
        m[("layers", i, "attn", ours, "kernel")] = Tensor(f"{p}self_attn.{theirs}.weight",
                                                          *linear((D,), (heads, H)))
        if cfg.attention_bias:
            m[("layers", i, "attn", ours, "bias")] = Tensor(f"{p}self_attn.{theirs}.bias",
                                                            *_bias((heads, H)))
    m[("layers", i, "attn", "o", "kernel")] = Tensor(p + "self_attn.o_proj.weight",
                                                     *linear((N, H), (D,)))
    if cfg.qk_norm:
        m[("layers", i, "attn", "q_norm", "scale")] = Tensor(p + "self_attn.q_norm.weight")
        m[("layers", i, "attn", "k_norm", "scale")] = Tensor(p + "self_attn.k_norm.weight")
    return m


def _mlp(cfg: ModelConfig, i: int, p: str) -> dict[tuple[Any, ...], Entry]:
    D, F = cfg.hidden_size, cfg.intermediate_size
    return {("layers", i, "mlp", "gate", "kernel"): Tensor(p + "mlp.gate_proj.weight",
                                                           *linear((D,), (F,))),
            ("layers", i, "mlp", "up", "kernel"): Tensor(p + "mlp.up_proj.weight",
                                                         *linear((D,), (F,))),
            ("layers", i, "mlp", "down", "kernel"): Tensor(p + "mlp.down_proj.weight",
                                                           *linear((F,), (D,)))}


def _moe(cfg: ModelConfig, i: int, p: str) -> dict[tuple[Any, ...], Entry]:
    """Qwen3-MoE: mlp.gate (router), mlp.experts.{j}.{gate,up,down}_proj; Mixtral on disk:
    block_sparse_moe.gate, block_sparse_moe.experts.{j}.w1 (gate) / w3 (up) / w2 (down). Both
    also read in transformers' fused in-memory layout (mlp.gate, mlp.experts.gate_up_proj
    [E, 2F, D], mlp.experts.down_proj [E, D, F])."""
    D, E, F = cfg.hidden_size, cfg.num_experts, cfg.resolved_moe_intermediate_size
    fused = p + "mlp.experts."
    if cfg.arch == "mixtral":
        base, files = p + "block_sparse_moe.", {"gate": "w1", "up": "w3", "down": "w2"}
    else:
        base, files = p + "mlp.", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    router = Tensor(base + "gate.weight", *linear((D,), (E,)))
    m: dict[tuple[Any, ...], Entry] = {
        ("layers", i, "mlp", "router"): router if base == p + "mlp." else Alt(
            (router, Tensor(p + "mlp.gate.weight", router.to_ours, None)))}
    half = {"gate": slice(0, F), "up": slice(F, 2 * F)}
    for ours in ("gate", "up", "down"):
        shape = ((D,), (F,)) if ours != "down" else ((F,), (D,))
        per_expert = Stack(tuple(Tensor(f"{base}experts.{j}.{files[ours]}.weight",
                                        *linear(*shape)) for j in range(E)))
        if ours == "down":
            whole = Tensor(fused + "down_proj", lambda a: a.transpose(0, 2, 1), None)
        else:
            whole = Tensor(fused + "gate_up_proj",
                           lambda a, s=half[ours]: a[:, s, :].transpose(0, 2, 1), None)
        m[("layers", i, "mlp", ours)] = Alt((per_expert, whole))
    return m


def entry_of(mapping: dict[tuple[Any, ...], Entry], cfg: ModelConfig,
             key: tuple[Any, ...]) -> Entry:
    """The entry behind one of our params; a ``scan_layers`` param stacks its layers'."""
    if cfg.scan_layers and key[0] == "layers":
        return Stack(tuple(mapping[("layers", i, *key[1:])] for i in range(cfg.num_layers)))
    return mapping[key]
