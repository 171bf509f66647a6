"""Importing any meshrl module creates no mesh, no distributed client and no JAX backend."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SKIP_DIRS = {"tests", "docs", "notebooks", "scripts", ".ci", ".git", ".venv", "build"}

PROBE = r"""
import importlib, json, sys
import jax
import jax.sharding
from jax._src import xla_bridge

calls = []
def forbid(name):
    def fn(*args, **kwargs):
        calls.append(name)
        raise RuntimeError(name + " called at import time")
    return fn

jax.distributed.initialize = forbid("jax.distributed.initialize")
jax.make_mesh = forbid("jax.make_mesh")
jax.sharding.Mesh.__init__ = forbid("Mesh.__init__")
failed = {}
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
    except Exception as e:  # report every failure, not just the first
        failed[name] = repr(e)
print(json.dumps({"calls": calls, "failed": failed,
                  "backend": xla_bridge.backends_are_initialized()}))
"""


def _modules() -> list[str]:
    names = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in SKIP_DIRS or len(rel.parts) == 1:
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(["meshrl", *parts]))
    return names


def test_every_module_imports_without_mesh_distributed_or_backend():
    modules = _modules()
    assert "meshrl.mesh.mesh" in modules and len(modules) > 10
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(modules)], capture_output=True,
                         text=True, timeout=300, check=True, cwd="/")
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["failed"] == {}
    assert report["calls"] == []
    assert report["backend"] is False
