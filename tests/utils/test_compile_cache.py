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
