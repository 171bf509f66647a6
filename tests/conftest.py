"""Test-suite set-up: 8 fake CPU devices, set before JAX initialises its backend."""

from __future__ import annotations

import os

# Must run before any test module imports jax and touches a backend.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import jax

    has_accelerator = any(d.platform != "cpu" for d in jax.devices()) if os.environ.get(
        "JAX_PLATFORMS", "") != "cpu" else False
    skip = pytest.mark.skip(reason="needs a GPU/TPU; this run has only CPU devices "
                                   "(JAX_PLATFORMS=cpu or no accelerator found)")
    for item in items:
        if "accelerator" in item.keywords and not has_accelerator:
            item.add_marker(skip)
