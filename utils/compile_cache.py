"""JAX's persistent compilation cache, switched on by the ``runtime`` config section.

``enable(runtime)`` runs before a job's first compile: it points JAX at the cache directory
(``runtime.compile_cache_dir``, else ``$JAX_COMPILATION_CACHE_DIR``, else the user's cache
directory) and caches every program, however fast it compiled: the sampler's many small
variants are what a restart spends its first minute on. ``runtime.compile_cache = False``
turns the cache off. Returns the directory in use, or None.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import jax
from jax.experimental.compilation_cache import compilation_cache

ENV = "JAX_COMPILATION_CACHE_DIR"


def cache_dir(configured: str) -> str:
    """The directory ``enable`` uses for ``runtime.compile_cache_dir = configured``."""
    if configured:
        return configured
    if os.environ.get(ENV):
        return os.environ[ENV]
    base = os.environ.get("XDG_CACHE_HOME") or str(pathlib.Path.home() / ".cache")
    return str(pathlib.Path(base) / "meshrl" / "jax")


def enable(runtime: Any) -> str | None:
    """Apply ``runtime.compile_cache`` / ``compile_cache_dir`` (see the module docstring)."""
    if not runtime.compile_cache:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    path = cache_dir(runtime.compile_cache_dir)
    if "://" not in path:
        pathlib.Path(path).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_enable_compilation_cache", True)
    if jax.config.jax_compilation_cache_dir != path:
        # JAX opens its cache at the first compile; one already open (a notebook that ran
        # something before) would keep the old directory.
        compilation_cache.reset_cache()
        jax.config.update("jax_compilation_cache_dir", path)
    # JAX's default caches only programs that took >= 1 s to compile; most of a sampler's
    # variants take less, and together they are most of a restart's start-up.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path
