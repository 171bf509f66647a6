"""Hugging Face safetensors import/export for Llama 3.x, Qwen2/2.5 and Qwen3.

Import builds the model abstractly, then reads one tensor at a time (numpy, on the host) and
places it straight into its target NamedSharding with ``jax.make_array_from_callback``: each
device receives only its own slice. Export writes ``model.safetensors`` + ``config.json`` that
``transformers.AutoModelForCausalLM.from_pretrained`` loads. No pickle, no remote code, no network.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from meshrl.configs.fields import ConfigError
from meshrl.configs.schema import ModelConfig
from meshrl.mesh.rules import Rules
from meshrl.models.decoder import Decoder, abstract_model
from meshrl.models.sharding import param_shardings
from meshrl.utils.errors import MissingFileError, UserError
from meshrl.utils.log import get_logger

_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_ROPE_TYPES = {None: "none", "default": "none", "linear": "linear", "llama3": "llama3"}


class CheckpointError(UserError, ValueError):
    """A checkpoint directory that cannot be read (no weights, unreadable config.json, a missing
    or misshapen tensor); names the directory and the file or tensor."""


# ---- config ---------------------------------------------------------------------------------


def model_config_from_hf(hf: dict[str, Any], **overrides: Any) -> ModelConfig:
    """ModelConfig from a HF ``config.json`` dict; unsupported features raise ConfigError.

    ``overrides`` sets runtime-only fields (param_dtype, compute_dtype, remat, hf_path, ...).
    """
    model_type = hf.get("model_type")
    if model_type not in _ARCHS:
        raise ConfigError(f"HF config model_type = {model_type!r}: unsupported; supported: "
                          f"{sorted(_ARCHS)}")
    archs = hf.get("architectures") or [_ARCHS[model_type]]
    if archs != [_ARCHS[model_type]]:
        raise ConfigError(f"HF config architectures = {archs}: unsupported; for model_type "
                          f"{model_type!r} only {[_ARCHS[model_type]]} is supported")
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if hf.get(key):
            raise ConfigError(f"HF config {key} = {hf[key]}: mixture-of-experts is unsupported")
    if hf.get("use_sliding_window"):
        raise ConfigError("HF config use_sliding_window = True: sliding-window attention is "
                          "unsupported")
    bad_layers = sorted({t for t in hf.get("layer_types") or () if t != "full_attention"})
    if bad_layers:
        raise ConfigError(f"HF config layer_types contains {bad_layers}: only full_attention is "
                          f"supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"HF config hidden_act = {hf['hidden_act']!r}: only 'silu' is supported")
    if hf.get("mlp_bias"):
        raise ConfigError("HF config mlp_bias = True: unsupported")
    if model_type != "qwen2" and hf.get("attention_bias"):
        # Llama/Qwen3 put the bias on o_proj too; we only model q/k/v biases (Qwen2).
        raise ConfigError(f"HF config attention_bias = True for model_type {model_type!r}: "
                          f"unsupported (o_proj bias)")
    rope = _rope_fields(hf)
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or 0
    if head_dim * heads == hf["hidden_size"]:
        head_dim = 0  # canonical: 0 means hidden_size // num_heads
    values: dict[str, Any] = dict(
        arch=model_type, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
        num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2", qk_norm=model_type == "qwen3", **rope)
    values.update(overrides)
    return ModelConfig(**values)


def _rope_fields(hf: dict[str, Any]) -> dict[str, Any]:
    # transformers >= 5 writes rope_parameters (theta inside); 4.x wrote rope_theta + rope_scaling.
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    spec = params if params.get("rope_type") or not scaling else scaling
    rope_type = spec.get("rope_type", spec.get("type"))
    if rope_type not in _ROPE_TYPES:
        raise ConfigError(f"HF config rope_scaling type = {rope_type!r}: unsupported; supported: "
                          f"{[k for k in _ROPE_TYPES if k]}")
    out: dict[str, Any] = dict(rope_theta=float(theta), rope_scaling=_ROPE_TYPES[rope_type])
    needed = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                                "original_max_position_embeddings")}
    missing = [k for k in needed.get(rope_type, ()) if k not in spec]
    if missing:
        raise ConfigError(f"HF config rope_scaling type {rope_type!r} is missing {missing}")
    if rope_type in ("linear", "llama3"):
        out["rope_scaling_factor"] = float(spec["factor"])
    if rope_type == "llama3":
        out.update(rope_low_freq_factor=float(spec["low_freq_factor"]),
                   rope_high_freq_factor=float(spec["high_freq_factor"]),
                   rope_original_max_position=int(spec["original_max_position_embeddings"]))
    return out


def hf_config_from_model(cfg: ModelConfig) -> dict[str, Any]:
    """A HF ``config.json`` dict for ``cfg`` (read by transformers 4.x and 5.x)."""
    if cfg.arch == "qwen2" and not cfg.attention_bias:
        raise ConfigError("model.attention_bias = False: HF Qwen2 always has q/k/v biases")
    if cfg.arch != "qwen2" and cfg.attention_bias:
        raise ConfigError(f"model.attention_bias = True with model.arch = {cfg.arch!r}: HF "
                          f"{_ARCHS[cfg.arch]} would also need an o_proj bias")
    if cfg.qk_norm != (cfg.arch == "qwen3"):
        raise ConfigError(f"model.qk_norm = {cfg.qk_norm}: HF {_ARCHS[cfg.arch]} requires "
                          f"{cfg.arch == 'qwen3'}")
    rope: dict[str, Any] = {"rope_type": "default" if cfg.rope_scaling == "none"
                            else cfg.rope_scaling}
    if cfg.rope_scaling != "none":
        rope["factor"] = cfg.rope_scaling_factor
    if cfg.rope_scaling == "llama3":
        rope.update(low_freq_factor=cfg.rope_low_freq_factor,
                    high_freq_factor=cfg.rope_high_freq_factor,
                    original_max_position_embeddings=cfg.rope_original_max_position)
    out: dict[str, Any] = {
        "architectures": [_ARCHS[cfg.arch]], "model_type": cfg.arch,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.resolved_head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if cfg.rope_scaling == "none" else dict(rope),
        "rope_parameters": {**rope, "rope_theta": cfg.rope_theta},
        "torch_dtype": cfg.param_dtype, "dtype": cfg.param_dtype,
    }
    if cfg.arch == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    if cfg.arch == "qwen3":
        out["attention_bias"] = False
    if cfg.arch in ("qwen2", "qwen3"):
        out["use_sliding_window"] = False
    return out


def load_hf_config(path: str | pathlib.Path, **overrides: Any) -> ModelConfig:
    file = pathlib.Path(path) / "config.json"
    if not file.is_file():
        raise MissingFileError(f"{file}: not found: a Hugging Face checkpoint directory needs "
                               f"config.json next to its *.safetensors")
    try:
        hf = json.loads(file.read_text())
    except ValueError as e:
        raise CheckpointError(f"{file}: not valid JSON ({e}): restore the file from the "
                              f"model's original release") from None
    try:
        return model_config_from_hf(hf, hf_path=str(path), **overrides)
    except KeyError as e:
        raise CheckpointError(f"{file}: has no {e} entry: not a decoder config.json that meshrl "
                              f"can read") from None
    except ConfigError as e:  # name the file: the message names only the HF field
        raise ConfigError(f"{file}: {e}") from e


# ---- name and layout mapping ----------------------------------------------------------------

Transform = Callable[[np.ndarray], np.ndarray]


def _param_map(cfg: ModelConfig) -> dict[tuple[Any, ...], tuple[str, Transform, Transform]]:
    """Our param path -> (HF tensor name, HF->ours, ours->HF).

    torch Linear stores [out, in]; our kernels are [in..., out...] with heads split out.
    """
    D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
    ident: Transform = lambda a: a  # noqa: E731

    def linear(in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> tuple[Transform,
                                                                                 Transform]:
        n_in, n_out = int(np.prod(in_shape)), int(np.prod(out_shape))
        return (lambda a: a.T.reshape(in_shape + out_shape),
                lambda a: a.reshape(n_in, n_out).T)

    def bias(out_shape: tuple[int, ...]) -> tuple[Transform, Transform]:
        return lambda a: a.reshape(out_shape), lambda a: a.reshape(-1)

    m: dict[tuple[Any, ...], tuple[str, Transform, Transform]] = {
        ("embed",): ("model.embed_tokens.weight", ident, ident),
        ("final_norm", "scale"): ("model.norm.weight", ident, ident),
    }
    if not cfg.tie_embeddings:
        m[("lm_head",)] = ("lm_head.weight", *linear((D,), (cfg.vocab_size,)))
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        m[("layers", i, "attn_norm", "scale")] = (p + "input_layernorm.weight", ident, ident)
        m[("layers", i, "mlp_norm", "scale")] = (p + "post_attention_layernorm.weight", ident,
                                                 ident)
        for ours, theirs, heads in (("q", "q_proj", N), ("k", "k_proj", K), ("v", "v_proj", K)):
            m[("layers", i, "attn", ours, "kernel")] = (f"{p}self_attn.{theirs}.weight",
                                                        *linear((D,), (heads, H)))
            if cfg.attention_bias:
                m[("layers", i, "attn", ours, "bias")] = (f"{p}self_attn.{theirs}.bias",
                                                          *bias((heads, H)))
        m[("layers", i, "attn", "o", "kernel")] = (p + "self_attn.o_proj.weight",
                                                   *linear((N, H), (D,)))
        if cfg.qk_norm:
            m[("layers", i, "attn", "q_norm", "scale")] = (p + "self_attn.q_norm.weight", ident,
                                                           ident)
            m[("layers", i, "attn", "k_norm", "scale")] = (p + "self_attn.k_norm.weight", ident,
                                                           ident)
        for name in ("gate", "up"):
            m[("layers", i, "mlp", name, "kernel")] = (f"{p}mlp.{name}_proj.weight",
                                                       *linear((D,), (cfg.intermediate_size,)))
        m[("layers", i, "mlp", "down", "kernel")] = (p + "mlp.down_proj.weight",
                                                     *linear((cfg.intermediate_size,), (D,)))
    return m


def _entries(mapping: dict[tuple[Any, ...], tuple[str, Transform, Transform]],
             cfg: ModelConfig, key: tuple[Any, ...],
             ) -> tuple[list[tuple[str, Transform, Transform]], bool]:
    """HF entries behind one of our params, and whether it stacks them over layers (scan)."""
    if cfg.scan_layers and key[0] == "layers":
        return [mapping[("layers", i, *key[1:])] for i in range(cfg.num_layers)], True
    return [mapping[key]], False


def _flat_params(state: nnx.State) -> dict[tuple[Any, ...], nnx.Variable]:
    return {tuple(path): var for path, var in nnx.to_flat_state(state)}


# ---- import ---------------------------------------------------------------------------------


def _tensor_files(path: pathlib.Path) -> dict[str, pathlib.Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    single = path / "model.safetensors"
    if not single.exists():
        raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json: "
                              f"save the weights as safetensors (pickled *.bin is not read)")
    from safetensors import safe_open

    with safe_open(str(single), framework="numpy") as f:
        return dict.fromkeys(f.keys(), single)


def load_hf_checkpoint(path: str | pathlib.Path, *, mesh: Mesh | None = None,
                       rules: Rules | None = None, dtype: Any = jnp.float32,
                       **overrides: Any) -> Decoder:
    """Load a local HF checkpoint into a Decoder, each param placed in its target sharding.

    ``dtype`` sets the stored params and, unless overridden, the compute dtype; ``overrides``
    sets other runtime fields (e.g. remat). ``rules`` default to the train role.
    """
    from safetensors import safe_open

    path = pathlib.Path(path)
    dtype_name = jnp.dtype(dtype).name
    overrides = {"param_dtype": dtype_name, "compute_dtype": dtype_name, **overrides}
    cfg = load_hf_config(path, **overrides)
    model = abstract_model(cfg, mesh=mesh, rules=rules)
    params = nnx.state(model, nnx.Param)
    shardings = (_flat_params(param_shardings(params, mesh, model.sharding.rules))
                 if mesh is not None else None)
    files = _tensor_files(path)
    log = get_logger("models")
    mapping = _param_map(cfg)
    handles: dict[pathlib.Path, Any] = {}

    def read(name: str, where: str) -> np.ndarray:
        if name not in files:
            raise CheckpointError(f"{path}: tensor {name!r} (for param {where}) is missing from "
                                  f"the checkpoint: its weights do not match its config.json")
        if files[name] not in handles:
            handles[files[name]] = safe_open(str(files[name]), framework="numpy").__enter__()
        return handles[files[name]].get_tensor(name)

    try:
        for key, var in _flat_params(params).items():
            where = "/".join(map(str, key))
            entries, stacked = _entries(mapping, cfg, key)
            layers = [np.asarray(to_ours(read(name, where))) for name, to_ours, _ in entries]
            host = np.stack(layers) if stacked else layers[0]
            if host.shape != var.get_value().shape:
                names = ", ".join(repr(e[0]) for e in entries)
                raise CheckpointError(f"{path}: tensor {names} has shape {layers[0].shape} after "
                                      f"layout change; param {where} needs "
                                      f"{var.get_value().shape}: its weights do not match its "
                                      f"config.json")
            host = host.astype(jnp.dtype(dtype))
            sharding = (shardings[key] if shardings is not None
                        else SingleDeviceSharding(jax.devices()[0]))
            var.set_value(_place(host, sharding))
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    log.info("loaded %s (%s, %d params)", path, cfg.arch, len(mapping))
    nnx.update(model, params)
    return model


def _place(host: np.ndarray, sharding: NamedSharding | SingleDeviceSharding) -> jax.Array:
    # Each device's callback copies only its own index window of the host tensor.
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


# ---- export ---------------------------------------------------------------------------------


def save_hf_checkpoint(model: Decoder, path: str | pathlib.Path) -> None:
    """Write ``model.safetensors`` + ``config.json`` (single process: params must be fully
    addressable from this host)."""
    from safetensors.numpy import save_file

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    mapping = _param_map(cfg)
    tensors: dict[str, np.ndarray] = {}
    for key, var in _flat_params(nnx.state(model, nnx.Param)).items():
        entries, stacked = _entries(mapping, cfg, key)
        host = np.asarray(jax.device_get(var.get_value()))
        for i, (name, _, to_hf) in enumerate(entries):
            tensors[name] = np.ascontiguousarray(to_hf(host[i] if stacked else host))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config_from_model(cfg), indent=2))
    get_logger("models").info("saved %s (%d tensors)", path, len(tensors))


def model_from_config(cfg: ModelConfig, *, mesh: Mesh | None = None, rules: Rules | None = None,
                      seed: int = 0) -> Decoder:
    """Deprecated alias of ``meshrl.models.build.build_model`` (kept for existing callers)."""
    from meshrl.models.build import build_model

    return build_model(cfg, mesh=mesh, rules=rules, seed=seed)
