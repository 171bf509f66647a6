"""``model.safetensors.index.json`` is model data: its ``weight_map`` may name only files inside
the checkpoint directory (or, in a Hugging Face hub cache, the blobs its files link to)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import numpy as np
import pytest

from meshrl.models import create_model
from meshrl.models.hf import load_hf_checkpoint, save_hf_checkpoint
from meshrl.models.hf_config import CheckpointError
from meshrl.tests.inference.tiny import TINY
from meshrl.utils.params import flat_params

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, list[str]]:
    """A tiny meshrl model exported as a HF checkpoint, and its tensor names."""
    from safetensors import safe_open

    path = tmp_path_factory.mktemp("exported")
    save_hf_checkpoint(create_model(TINY, seed=0), path)
    with safe_open(str(path / "model.safetensors"), framework="numpy") as f:
        return path, sorted(f.keys())


def _indexed(exported, root: pathlib.Path, shard: str) -> pathlib.Path:
    """A copy of the export whose index maps every tensor to ``shard`` (one entry replaced
    by a bad one where the test says)."""
    src, names = exported
    path = root / "model"
    path.mkdir(parents=True)
    shutil.copy(src / "config.json", path / "config.json")
    shutil.copy(src / "model.safetensors", path / "shard.safetensors")
    weight_map = dict.fromkeys(names, "shard.safetensors")
    weight_map[names[0]] = shard
    (path / INDEX).write_text(json.dumps({"weight_map": weight_map}))
    return path


def test_index_inside_the_directory_loads(exported, tmp_path):
    path = _indexed(exported, tmp_path, "shard.safetensors")

    model = load_hf_checkpoint(path)

    reference = flat_params(load_hf_checkpoint(exported[0]))
    for name, value in flat_params(model).items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(reference[name]), name)


@pytest.mark.parametrize("entry", ["../outside.safetensors", "{root}/outside.safetensors",
                                   "link.safetensors", "sub/../../outside.safetensors"])
def test_index_entry_outside_the_directory_is_refused_naming_it(exported, tmp_path, entry):
    shutil.copy(exported[0] / "model.safetensors", tmp_path / "outside.safetensors")
    entry = entry.replace("{root}", str(tmp_path))
    path = _indexed(exported, tmp_path, entry)
    os.symlink(tmp_path / "outside.safetensors", path / "link.safetensors")

    with pytest.raises(CheckpointError, match=rf"{INDEX}: weight_map\['{exported[1][0]}'\] = "
                       rf"'{entry}': must name a file inside {path} "):
        load_hf_checkpoint(path)


def test_hub_cache_snapshot_linking_into_its_blobs_loads(exported, tmp_path):
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    shutil.copy(exported[0] / "model.safetensors", repo / "blobs" / "0123abcd")
    snapshot = repo / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    shutil.copy(exported[0] / "config.json", snapshot / "config.json")
    os.symlink("../../blobs/0123abcd", snapshot / "model-00001-of-00001.safetensors")
    (snapshot / INDEX).write_text(json.dumps({"weight_map": dict.fromkeys(
        exported[1], "model-00001-of-00001.safetensors")}))

    model = load_hf_checkpoint(snapshot)

    reference = flat_params(load_hf_checkpoint(exported[0]))
    for name, value in flat_params(model).items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(reference[name]), name)


@pytest.mark.parametrize("keep", [100, 0.9])  # the header cut, or the last tensor's data
def test_a_safetensors_file_cut_short_is_one_checkpoint_error_naming_it(exported, tmp_path, keep):
    src, _ = exported
    path = tmp_path / "model"
    shutil.copytree(src, path)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:keep if isinstance(keep, int)
                                                  else int(len(data) * keep)])

    with pytest.raises(CheckpointError, match=r"model.safetensors.*(not a readable safetensors "
                                              r"file|unreadable).*copy"):
        load_hf_checkpoint(path)


@pytest.mark.parametrize("dtype", [np.int8, np.uint8])
def test_weights_stored_as_integer_codes_are_refused_not_cast(exported, tmp_path, dtype):
    # A quantized checkpoint whose config.json does not say so: its codes are not weights.
    from safetensors.numpy import load_file, save_file

    src, _ = exported
    path = tmp_path / "model"
    shutil.copytree(src, path)
    tensors = load_file(path / "model.safetensors")
    name = next(n for n in sorted(tensors) if n.endswith("q_proj.weight"))
    tensors[name] = np.clip(np.round(tensors[name] * 100), 0, 127).astype(dtype)
    save_file(tensors, path / "model.safetensors")

    with pytest.raises(CheckpointError, match=rf"tensor '{name}' is stored as U?I?8: only "
                                              r"BF16/F16/F32/F64 weights load"):
        load_hf_checkpoint(path)
