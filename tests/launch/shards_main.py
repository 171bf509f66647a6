"""Test-only entry point: ``main.py``, and where the RL loop computes its final params checksum
every process also writes the param blocks it holds to ``$MESHRL_TEST_SHARDS/p<index>.npz``.

A checkpoint keeps one copy of a replicated array, so it cannot show that the processes'
replicas agree, and equal checksums are sums in which differences can cancel; these files let
the test compare every replica of every block bitwise (``load_blocks``).
"""

from __future__ import annotations

import os
import pathlib
import runpy
import sys
from typing import Any

import jax
import numpy as np

ENV = "MESHRL_TEST_SHARDS"
Blocks = dict[tuple[str, str], list[np.ndarray]]  # (key path, block) -> every copy of it


def _block(index: tuple[slice, ...], shape: tuple[int, ...]) -> str:
    return ",".join("{}:{}".format(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))


def write_blocks(params: Any, out: pathlib.Path) -> None:
    """``<key path>@<block>@<device id>`` -> that device's copy, for this process's devices."""
    blocks = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = jax.tree_util.keystr(path)
        for shard in leaf.addressable_shards:
            blocks[f"{name}@{_block(shard.index, leaf.shape)}@{shard.device.id}"] = np.asarray(
                shard.data)
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / f"p{jax.process_index()}.npz", **blocks)


def load_blocks(out: pathlib.Path) -> dict[str, Blocks]:
    """Per process file name (``p0``, ...): ``(key path, block)`` -> every device's copy."""
    processes: dict[str, Blocks] = {}
    for f in sorted(out.glob("p*.npz")):
        copies: Blocks = {}
        with np.load(f) as data:
            for key in data.files:
                path, block, _ = key.rsplit("@", 2)
                copies.setdefault((path, block), []).append(data[key])
        processes[f.stem] = copies
    return processes


def _main() -> None:
    from meshrl.trainer import rl_loop

    out, checksum = pathlib.Path(os.environ[ENV]), rl_loop.params_checksum

    def write_then_checksum(params: Any) -> float:
        write_blocks(params, out)
        return checksum(params)

    rl_loop.params_checksum = write_then_checksum
    main = pathlib.Path(__file__).resolve().parents[2] / "main.py"
    sys.argv = [str(main), *sys.argv[1:]]
    runpy.run_path(str(main), run_name="__main__")


if __name__ == "__main__":
    _main()
