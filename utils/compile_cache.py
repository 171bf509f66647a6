"""JAX's persistent compilation cache, switched on by the ``runtime`` config section.

``enable(runtime)`` runs before a job's first compile: it points JAX at the cache directory
(``runtime.compile_cache_dir``, else ``$JAX_COMPILATION_CACHE_DIR``, else the user's cache
directory) and caches every program, however fast it compiled: the sampler's many small
variants are what a restart spends its first minute on. ``runtime.compile_cache = False``
turns the cache off (``disable``). A local directory another user owns is refused (root's
only when nobody else may write it); one of this user's that group or others may write loses
that write (``check_dir``). Returns the directory in use, or None.
"""

from __future__ import annotations

import os
import pathlib
import stat
from typing import Any

import jax
from jax.experimental.compilation_cache import compilation_cache

from meshrl.utils.errors import UserError
from meshrl.utils.log import get_logger

_log = get_logger("compile_cache")

ENV = "JAX_COMPILATION_CACHE_DIR"


def cache_dir(configured: str) -> str:
    """The directory ``enable`` uses for ``runtime.compile_cache_dir = configured``."""
    if configured:
        return configured
    if os.environ.get(ENV):
        return os.environ[ENV]
    base = os.environ.get("XDG_CACHE_HOME") or str(pathlib.Path.home() / ".cache")
    return str(pathlib.Path(base) / "meshrl" / "jax")


class CacheDirError(UserError, ValueError):
    """A compile cache directory others may write: JAX runs whatever executable it finds."""


def disable() -> None:
    """No persistent cache from now on in this process (JAX decides once per process whether
    to use it; ``reset_cache`` makes it decide again)."""
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()


def check_dir(path: str) -> None:
    """Create a missing local cache directory (mode 0700); refuse one that another user owns,
    and take group/other write away from one of this user's (a umask of 002 gave earlier
    versions 0775): JAX loads the executable stored under a program's key, so whoever can
    write there chooses the program this run executes."""
    p = pathlib.Path(path)
    p.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = p.stat()
    writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if st.st_uid == os.geteuid() and writable:
        p.chmod(stat.S_IMODE(st.st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))
        _log.warning("compile cache %s: mode %04o let group or others write: now %04o", path,
                     stat.S_IMODE(st.st_mode), stat.S_IMODE(p.stat().st_mode))
        return
    # Another user's directory only when root keeps it and nobody else may write (a cache
    # baked into an image): root may change anything this run executes anyway.
    if st.st_uid != os.geteuid() and (st.st_uid != 0 or writable):
        raise CacheDirError(
            f"compile cache {path}: owned by uid {st.st_uid} with mode "
            f"{stat.S_IMODE(st.st_mode):04o}: others could plant the programs this run executes; "
            f"use a directory of your own without group/other write (runtime.compile_cache_dir "
            f"or ${ENV}), or runtime.compile_cache = false")


def enable(runtime: Any) -> str | None:
    """Apply ``runtime.compile_cache`` / ``compile_cache_dir`` (see the module docstring)."""
    if not runtime.compile_cache:
        disable()
        return None
    path = cache_dir(runtime.compile_cache_dir)
    if "://" not in path:
        check_dir(path)
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
