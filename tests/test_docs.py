"""docs/config.md is generated from the schema and must not go stale."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_config_reference_is_up_to_date():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_config_docs.py"), "--check"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_config_reference_lists_every_field():
    from meshrl.configs.schema import SECTIONS

    text = (ROOT / "docs" / "config.md").read_text()
    for name, cls in SECTIONS.items():
        for field in cls.__dataclass_fields__:
            assert f"`{name}.{field}`" in text
