"""Early check of ``--config.a.b=v`` command-line overrides against the schema.

ml_collections would reject an unknown key too, but deep inside flag parsing with a traceback;
checking first gives one line naming the key and the closest valid key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from meshrl.configs.fields import closest
from meshrl.configs.schema import SECTIONS


def check_override_keys(argv: Sequence[str], flag: str = "config") -> str | None:
    """Return an error message for the first override naming an unknown key, else None."""
    prefix = f"--{flag}."
    for arg in argv:
        if not arg.startswith(prefix):
            continue
        path = arg[len(prefix):].split("=", 1)[0]
        parts = path.split(".")
        if parts == ["job"]:
            continue
        section = parts[0]
        if section not in SECTIONS:
            options = ["job", *SECTIONS]
            return (f"unknown config key '{path}': no section '{section}'; did you mean "
                    f"'{closest(section, options)}'?")
        names = [f.name for f in dataclasses.fields(SECTIONS[section])]
        if len(parts) != 2 or parts[1] not in names:
            key = ".".join(parts[1:])
            return (f"unknown config key '{path}'; did you mean "
                    f"'{section}.{closest(key, names)}'? (valid keys in '{section}': "
                    f"{', '.join(names)})")
    return None
