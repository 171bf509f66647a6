"""Every config file under configs/ loads, validates and documents its launch command."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from meshrl.configs import Config, load_config_file
from meshrl.configs.overrides import check_override_keys

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[2] / "configs"
# Config files define get_config(arg); the other modules (schema, loader, rules) are the library.
CONFIG_FILES = sorted(p for p in CONFIG_DIR.glob("*.py") if "\ndef get_config(" in p.read_text())


def _variants(path: pathlib.Path) -> list[str | None]:
    text = path.read_text()
    return [None] + [v for v in ("smoke",) if f"'{v}'" in text or f'"{v}"' in text]


def test_config_directory_has_config_files():
    assert any(p.name == "default.py" for p in CONFIG_FILES)


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_config_file_loads_and_validates(path):
    for variant in _variants(path):
        assert isinstance(load_config_file(path, variant), Config)


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_config_file_docstring_shows_launch_command(path):
    spec = importlib.util.spec_from_file_location("cfg_doc_probe", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert "python main.py --config configs/" in (module.__doc__ or "")


def test_unknown_variant_is_an_error():
    with pytest.raises(ValueError, match="unknown variant 'tiny'"):
        load_config_file(CONFIG_DIR / "default.py", "tiny")


@pytest.mark.parametrize("argv, expected", [
    (["--config.trainer.lerning_rate=1e-4"], "did you mean 'trainer.learning_rate'"),
    (["--config.trainr.steps=3"], "no section 'trainr'; did you mean 'trainer'"),
    (["--config.mesh.data.x=3"], "unknown config key 'mesh.data.x'"),
    (["--config.trainer.learning_rate=1e-4", "--config.job=rl", "--workdir=/tmp/x"], None),
])
def test_override_keys_are_checked_against_schema(argv, expected):
    problem = check_override_keys(argv)
    if expected is None:
        assert problem is None
    else:
        assert expected in problem
