"""Params trees: the ``a/b/c`` names published weights are stored under, and the local copy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshrl.utils.params import flat_params, path_name, process_local_copy


class _Block(nnx.Module):
    def __init__(self) -> None:
        self.kernel = nnx.Param(jnp.ones((2, 3)))
        self.count = nnx.BatchStat(jnp.zeros(()))  # not a Param: left out of a Module's names


class _Net(nnx.Module):
    def __init__(self) -> None:
        self.layers = nnx.List([_Block(), _Block()])
        self.norm = nnx.Param(jnp.zeros((3,)))


def test_flat_params_of_a_module_names_its_params_without_the_variable_value_level():
    flat = flat_params(_Net())

    assert sorted(flat) == ["layers/0/kernel", "layers/1/kernel", "norm"]
    assert flat["layers/1/kernel"].shape == (2, 3)


def test_flat_params_names_a_state_and_its_pure_dict_alike():
    state = nnx.state(_Net(), nnx.Param)

    assert list(flat_params(state)) == list(flat_params(nnx.to_pure_dict(state)))


def test_flat_params_of_nested_dicts_and_lists_keeps_leaf_order():
    tree = {"b": [np.zeros(1), np.ones(2)], "a": {"x": np.zeros(3)}}

    flat = flat_params(tree)

    assert list(flat) == ["a/x", "b/0", "b/1"]  # jax's key order: sorted dict keys
    assert [v.shape for v in flat.values()] == [(3,), (1,), (2,)]


def test_path_name_joins_a_key_path():
    (path, _), = jax.tree_util.tree_flatten_with_path({"Embed": [0, {"Norm": 1}]})[0][1:]

    assert path_name(path) == "Embed/1/Norm"


def test_process_local_copy_of_a_fully_addressable_tree_is_the_same_tree():
    tree = {"w": jnp.arange(4.0), "b": np.zeros(2)}

    assert process_local_copy(tree) is tree
