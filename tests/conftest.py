"""Test-suite set-up: 8 fake CPU devices, set before JAX initialises its backend."""

from __future__ import annotations

import os

# Must run before any test module imports jax and touches a backend.
# Fast-compiling XLA (tests/xla.py) for the test run; subprocesses get it through cpu_env.
from meshrl.tests.xla import xla_flags  # noqa: E402 -- plain os, imports no jax

os.environ.setdefault("XLA_FLAGS", xla_flags(8))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
from meshrl.utils.tpu_env import quiet_libtpu_probe  # noqa: E402 -- imports no jax backend

quiet_libtpu_probe()  # the TPU compiler (test extra) stays quiet here and in subprocesses
# JAX's persistent compilation cache for the test run and every subprocess it starts: many tests
# build the same tiny programs through fresh jit wrappers (a sampler per test, main.py runs), and
# the cache turns each repeat into a load. A fresh directory per run keeps the suite's time
# honest for CI (cold start); set JAX_COMPILATION_CACHE_DIR to reuse one across runs.
_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    _CACHE = tempfile.mkdtemp(prefix="meshrl-test-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import pytest  # noqa: E402


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _CACHE is not None:
        import shutil

        shutil.rmtree(_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import jax

    has_accelerator = any(d.platform != "cpu" for d in jax.devices()) if os.environ.get(
        "JAX_PLATFORMS", "") != "cpu" else False
    skip = pytest.mark.skip(reason="needs a GPU/TPU; this run has only CPU devices "
                                   "(JAX_PLATFORMS=cpu or no accelerator found)")
    for item in items:
        if "accelerator" in item.keywords and not has_accelerator:
            item.add_marker(skip)
    # Longest first: xdist hands out modules in collection order, so the 30-60 s end-to-end
    # modules go out at the start instead of leaving one worker busy at the end.
    first = {path: rank for rank, path in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))


# The default run's slowest modules (``pytest --durations``), slowest first.
LONG_MODULES = (
    "tests/test_notebook.py", "tests/inference/test_paged_cascade.py",
    "tests/jobs/test_evaluate.py", "tests/jobs/test_generate.py", "tests/inference/test_sampler.py",
    "tests/test_user_errors.py", "tests/jobs/test_rl_reference.py",
    "tests/inference/test_paged_prefix.py", "tests/models/test_properties.py",
    "tests/models/test_moe.py", "tests/trainer/test_rl_resume_kill.py", "tests/jobs/test_rl.py",
    "tests/jobs/test_compile_tpu.py", "tests/trainer/test_checkpoint.py",
    "tests/trainer/test_step.py", "tests/trainer/test_moe_step.py",
)
