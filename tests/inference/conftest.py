"""Fixtures of the inference tests."""

from __future__ import annotations

import pytest

from meshrl.models import create_model, split_model
from meshrl.tests.inference.tiny import TINY


@pytest.fixture(scope="session")
def tiny_params():
    """(graphdef, params) of a seeded random tiny model, unsharded."""
    return split_model(create_model(TINY, seed=0))
