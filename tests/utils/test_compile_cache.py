"""``runtime.compile_cache``: where JAX's persistent compilation cache goes, that a job's
programs land in it, and that one field turns it off."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.compilation_cache import compilation_cache

from meshrl.configs.runtime_schema import RuntimeConfig
from meshrl.utils import compile_cache


@pytest.fixture
def restore_jax_cache():
    """The test run's cache settings (tests/conftest.py) back after the test."""
    keys = ("jax_enable_compilation_cache", "jax_compilation_cache_dir",
            "jax_persistent_cache_min_compile_time_secs")
    saved = {k: getattr(jax.config, k) for k in keys}
    yield
    compilation_cache.reset_cache()
    for k, v in saved.items():
        jax.config.update(k, v)


def test_cache_dir_prefers_the_config_then_the_environment_then_the_user_cache(monkeypatch,
                                                                                tmp_path):
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/env/cache")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache.cache_dir("gs://bucket/cache") == "gs://bucket/cache"
    assert compile_cache.cache_dir("") == "/env/cache"
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    assert compile_cache.cache_dir("") == str(tmp_path / "meshrl" / "jax")


def test_enabled_cache_stores_a_jitted_program_in_the_configured_directory(tmp_path,
                                                                           restore_jax_cache):
    path = compile_cache.enable(RuntimeConfig(compile_cache_dir=str(tmp_path / "cache")))

    jax.jit(lambda x: jnp.sin(x) * 3.25 + 0.5)(jnp.arange(7.0)).block_until_ready()

    assert path == str(tmp_path / "cache")
    assert any((tmp_path / "cache").iterdir())  # the program, however fast it compiled


def test_compile_cache_false_turns_the_cache_off(restore_jax_cache):
    assert compile_cache.enable(RuntimeConfig(compile_cache=False)) is None
    assert jax.config.jax_enable_compilation_cache is False


def test_turning_the_cache_off_takes_effect_in_a_process_that_already_used_it(
        tmp_path, restore_jax_cache):
    # JAX decides once per process whether to use the cache: off must make it decide again.
    cache = tmp_path / "cache"
    compile_cache.enable(RuntimeConfig(compile_cache_dir=str(cache)))
    jax.jit(lambda x: x * 1.5)(jnp.ones(3)).block_until_ready()
    before = len(list(cache.iterdir()))

    compile_cache.enable(RuntimeConfig(compile_cache=False))
    jax.jit(lambda x: x * 2.5 - 1.0)(jnp.ones(5)).block_until_ready()

    assert before > 0 and len(list(cache.iterdir())) == before


@pytest.mark.parametrize("mode", [0o777, 0o775])
def test_a_cache_directory_of_ones_own_that_others_may_write_loses_that_write(
        tmp_path, mode, restore_jax_cache):
    # A umask of 002 gave earlier versions 0775: the run goes on, the directory is tightened.
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)

    compile_cache.enable(RuntimeConfig(compile_cache_dir=str(shared)))

    assert shared.stat().st_mode & 0o022 == 0


def test_another_users_cache_directory_is_refused(tmp_path, restore_jax_cache):
    import os

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    os.chown(shared, 12345, 12345)

    with pytest.raises(compile_cache.CacheDirError,
                       match=rf"compile cache {shared}: owned by uid 12345 with mode 0777"):
        compile_cache.enable(RuntimeConfig(compile_cache_dir=str(shared)))


def test_a_missing_cache_directory_is_created_private(tmp_path, restore_jax_cache):
    compile_cache.enable(RuntimeConfig(compile_cache_dir=str(tmp_path / "new")))
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o700
