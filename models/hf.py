"""Hugging Face safetensors import/export for Llama 3.x, Qwen2/2.5, Qwen3, Qwen3-MoE and Mixtral.

Import builds the model abstractly, then reads one tensor at a time (numpy, on the host) and
places it straight into its target NamedSharding with ``jax.make_array_from_callback``: each
device receives only its own slice. Export writes ``model.safetensors`` + ``config.json`` that
``transformers.AutoModelForCausalLM.from_pretrained`` loads. No pickle, no remote code, no network.
config.json itself is read and written by ``models/hf_config.py``.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from meshrl.configs.schema import ModelConfig
from meshrl.mesh.rules import Rules
from meshrl.models.decoder import Decoder, abstract_model
from meshrl.models.hf_config import CheckpointError, hf_config_from_model, load_hf_config
from meshrl.models.hf_names import Entry, Stack, Tensor, choose, entry_of, hf_shape, param_map
from meshrl.models.hf_names import split as split_entry
from meshrl.models.sharding import param_shardings
from meshrl.utils.log import get_logger
from meshrl.utils.params import process_local_copy


def _flat_params(state: nnx.State) -> dict[tuple[Any, ...], nnx.Variable]:
    return {tuple(path): var for path, var in nnx.to_flat_state(state)}


# ---- import ---------------------------------------------------------------------------------


def _shard_roots(path: pathlib.Path) -> list[pathlib.Path]:
    """Where an index's files may resolve to: the directory and, in a Hugging Face hub cache
    (``models--org--name/snapshots/<rev>``), the repo's ``blobs``, which its files link into."""
    roots = [path.resolve()]
    blobs = path.parent.parent / "blobs"
    if path.parent.name == "snapshots" and blobs.is_dir():
        roots.append(blobs.resolve())
    return roots


def _index_files(path: pathlib.Path, index: pathlib.Path) -> dict[str, pathlib.Path]:
    """The index's ``weight_map`` as paths, each confined to the checkpoint directory: the
    index is model data, and must not make the loader read files elsewhere."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        items = list(weight_map.items())
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{index}: unreadable ({e!r}): it must be JSON with a "
                              f"'weight_map' object of tensor name -> file name") from None
    roots, checked = _shard_roots(path), dict[str, pathlib.Path]()
    for name, file in items:
        if isinstance(file, str) and file in checked:
            continue
        pure = pathlib.PurePosixPath(file) if isinstance(file, str) else None
        if (pure is None or pure.is_absolute() or not pure.parts or ".." in pure.parts
                or not any((path / pure).resolve().is_relative_to(r) for r in roots)):
            raise CheckpointError(f"{index}: weight_map[{name!r}] = {file!r}: must name a file "
                                  f"inside {path} (a relative path without '..' that does not "
                                  f"link out of the directory)")
        checked[file] = path / pure
    return {name: checked[file] for name, file in items}


def _tensor_files(path: pathlib.Path) -> dict[str, pathlib.Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        return _index_files(path, index)
    single = path / "model.safetensors"
    if not single.exists():
        raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json: "
                              f"save the weights as safetensors (pickled *.bin is not read)")
    with open_safetensors(single) as f:
        return dict.fromkeys(f.keys(), single)


# safetensors' names of the dtypes a checkpoint's weights may be stored in.
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")


def open_safetensors(file: pathlib.Path) -> Any:
    """``safe_open`` of ``file``; a file cut short or not safetensors at all (an interrupted
    copy) is one ``CheckpointError`` naming it, not the library's traceback."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(file), framework="numpy")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({e}): copy it again "
                              f"from the model's release") from None


def load_hf_checkpoint(path: str | pathlib.Path, *, mesh: Mesh | None = None,
                       rules: Rules | None = None, dtype: Any = jnp.float32,
                       cfg: ModelConfig | None = None, **overrides: Any) -> Decoder:
    """Load a local HF checkpoint into a Decoder, each param placed in its target sharding.

    ``dtype`` sets the stored params and, unless overridden, the compute dtype; ``overrides``
    sets other runtime fields (e.g. remat). ``rules`` default to the train role. ``cfg``: this
    checkpoint's config as ``load_hf_config`` already read it (then ``overrides`` are unused),
    so that a caller that needed the architecture first reads config.json once.
    """
    from safetensors import SafetensorError

    path = pathlib.Path(path)
    dtype_name = jnp.dtype(dtype).name
    overrides = {"param_dtype": dtype_name, "compute_dtype": dtype_name, **overrides}
    cfg = cfg if cfg is not None else load_hf_config(path, **overrides)
    model = abstract_model(cfg, mesh=mesh, rules=rules)
    params = nnx.state(model, nnx.Param)
    shardings = (_flat_params(param_shardings(params, mesh, model.sharding.rules))
                 if mesh is not None else None)
    files = _tensor_files(path)
    log = get_logger("models")
    mapping = param_map(cfg)
    handles: dict[pathlib.Path, Any] = {}

    def read(name: str, where: str) -> np.ndarray:
        if name not in files:
            raise CheckpointError(f"{path}: tensor {name!r} (for param {where}) is missing from "
                                  f"the checkpoint: its weights do not match its config.json")
        if files[name] not in handles:
            handles[files[name]] = open_safetensors(files[name]).__enter__()
        stored = handles[files[name]].get_slice(name).get_dtype()
        if stored not in FLOAT_DTYPES:
            # Integer or float8 codes are a quantized model's, not weights: never cast them.
            raise CheckpointError(f"{files[name]}: tensor {name!r} is stored as {stored}: "
                                  f"only {'/'.join(FLOAT_DTYPES)} weights load (a quantized "
                                  f"checkpoint?): use the model's bf16/fp16/fp32 release")
        try:
            return handles[files[name]].get_tensor(name)
        except SafetensorError as e:  # a header that reads, data cut short
            raise CheckpointError(f"{files[name]}: tensor {name!r} unreadable ({e}): copy the "
                                  f"file again from the model's release") from None

    def read_entry(entry: Entry, shape: tuple[int, ...], where: str) -> np.ndarray:
        if isinstance(entry, Stack):
            return np.stack([read_entry(part, shape[1:], where) for part in entry.parts])
        assert isinstance(entry, Tensor), entry
        raw = read(entry.name, where)
        try:
            host = np.asarray(entry.to_ours(raw))
        except ValueError:
            host = None
        if host is None or host.shape != shape:
            want = hf_shape(entry, shape)
            raise CheckpointError(
                f"{path}: tensor {entry.name!r} has shape {tuple(raw.shape)}; param {where} "
                f"needs " + (f"shape {want}" if want else f"{shape} after the layout change") +
                ": its weights do not match its config.json")
        return host

    try:
        for key, var in _flat_params(params).items():
            where = "/".join(map(str, key))
            entry = choose(entry_of(mapping, cfg, key), files)
            host = read_entry(entry, tuple(var.get_value().shape), where)
            host = host.astype(jnp.dtype(dtype))
            sharding = (shardings[key] if shardings is not None
                        else SingleDeviceSharding(jax.devices()[0]))
            var.set_value(_place(host, sharding))
        if cfg.tie_embeddings and "lm_head.weight" in files:
            _check_tied_head(path, read("lm_head.weight", "lm_head"),
                             read("model.embed_tokens.weight", "embed"))
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    log.info("loaded %s (%s, %d params)", path, cfg.arch, len(mapping))
    nnx.update(model, params)
    return model


def _check_tied_head(path: pathlib.Path, head: np.ndarray, embed: np.ndarray) -> None:
    """A tied config whose files hold their own ``lm_head.weight``: the same values are a
    redundant copy; others are a head that transformers 4.x drops (it ties) and 5.x uses."""
    if head.shape != embed.shape or not np.array_equal(head, embed):
        raise CheckpointError(
            f"{path}: config.json says tie_word_embeddings = true, but the checkpoint holds an "
            f"lm_head.weight that differs from model.embed_tokens.weight (transformers 4.x "
            f"would tie them, 5.x uses the file's head): set tie_word_embeddings to false to "
            f"load the head, or remove lm_head.weight to tie")


def _place(host: np.ndarray, sharding: NamedSharding | SingleDeviceSharding) -> jax.Array:
    # Each device's callback copies only its own index window of the host tensor.
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


# ---- export ---------------------------------------------------------------------------------


def save_hf_checkpoint(model: Decoder, path: str | pathlib.Path, write: bool = True,
                       special_ids: dict[str, int | None] | None = None) -> None:
    """Write ``model.safetensors`` + ``config.json``. Params sharded over several processes are
    gathered tensor by tensor, so every process calls this; only those with ``write`` (process
    0) write files. ``special_ids`` (``eos_token_id``, ``bos_token_id``, ``pad_token_id``: the
    tokenizer's) go into config.json and a ``generation_config.json``, so that transformers'
    ``generate`` stops at EOS with either file."""
    from safetensors.numpy import save_file

    path = pathlib.Path(path)
    cfg = model.cfg
    mapping = param_map(cfg)
    tensors: dict[str, np.ndarray] = {}
    for key, var in _flat_params(nnx.state(model, nnx.Param)).items():
        # Sharded across processes: every process takes part, each gets the whole tensor.
        host = np.asarray(jax.device_get(process_local_copy(var.get_value())))
        if write:
            tensors.update(split_entry(entry_of(mapping, cfg, key), host))
    if not write:
        return
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    ids = {k: v for k, v in (special_ids or {}).items() if v is not None}
    (path / "config.json").write_text(json.dumps({**hf_config_from_model(cfg), **ids}, indent=2))
    if ids:
        (path / "generation_config.json").write_text(json.dumps(ids, indent=2))
    get_logger("models").info("saved %s (%d tensors)", path, len(tensors))

