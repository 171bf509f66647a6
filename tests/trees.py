"""Leaf-by-leaf comparison of pytrees (params, optimizer states, caches, gradients) for the tests.

A summed checksum is no evidence that two trees are equal: differences of opposite sign cancel,
and a missing, extra or reordered leaf goes unnoticed. These helpers check the tree structure
first, then every leaf, and name the leaf's key path when one differs. ``final_params`` reads
the params of a run's last checkpoint, for comparing runs that ended in other processes.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import numpy as np


def _paired_leaves(got: Any, want: Any) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """``(key path, got leaf, want leaf)`` for every leaf; the structures must be equal."""
    got_def, want_def = jax.tree.structure(got), jax.tree.structure(want)
    assert got_def == want_def, f"tree structures differ:\n got:  {got_def}\n want: {want_def}"
    flat, _ = jax.tree_util.tree_flatten_with_path(got)
    return [(jax.tree_util.keystr(path), np.asarray(g), np.asarray(w))
            for (path, g), w in zip(flat, jax.tree.leaves(want), strict=True)]


def assert_trees_close(got: Any, want: Any, *, rtol: float, atol: float) -> None:
    """Same structure, and every leaf of ``got`` has the shape of ``want``'s and is close to it
    (``np.testing.assert_allclose``); the message names the first leaf that is not."""
    for path, g, w in _paired_leaves(got, want):
        assert g.shape == w.shape, f"leaf {path}: shape {g.shape} != {w.shape}"
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=f"leaf {path}")


def assert_trees_equal(got: Any, want: Any) -> None:
    """Same structure, and every leaf equal bitwise in value, shape and dtype."""
    for path, g, w in _paired_leaves(got, want):
        np.testing.assert_array_equal(g, w, err_msg=f"leaf {path}", strict=True)


def unchanged_leaves(got: Any, want: Any) -> list[str]:
    """Key paths of the leaves of ``got`` equal to ``want``'s (same structure required): empty
    when every leaf moved."""
    return [path for path, g, w in _paired_leaves(got, want) if np.array_equal(g, w)]


def final_params(workdir: pathlib.Path, step: int | None = None) -> Any:
    """The params of checkpoint ``step`` under ``workdir`` (default: the newest), restored as
    host arrays: whatever process count or mesh wrote it, this process reads it alone."""
    import orbax.checkpoint as ocp

    ckpt = workdir / "checkpoints"
    if step is None:
        steps = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
        assert steps, f"no finished checkpoint under {ckpt}"
        step = steps[-1]
    state_dir = ckpt / str(step) / "state"
    checkpointer = ocp.PyTreeCheckpointer()
    tree = checkpointer.metadata(state_dir).item_metadata.tree
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    return checkpointer.restore(state_dir, args=ocp.args.PyTreeRestore(
        restore_args=as_numpy))["params"]
