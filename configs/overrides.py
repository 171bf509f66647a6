"""Early checks of the ``--config`` flag: the config file and ``--config.a.b=v`` overrides.

ml_collections would reject a missing file, an unknown variant or an unknown key too, but deep
inside flag parsing with a traceback; checking first gives one line naming the file or key (and
the closest valid key).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import traceback
import warnings
from collections.abc import Sequence

from meshrl.configs.fields import closest
from meshrl.configs.renames import SECTIONS as RENAMED
from meshrl.configs.schema import SECTIONS, Config


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
        section = parts[0] = RENAMED.get(parts[0], parts[0])
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


def _flag_value(argv: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{flag}="):
            return arg.split("=", 1)[1]
        if arg == f"--{flag}" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def check_config_file(argv: Sequence[str], flag: str = "config") -> str | None:
    """Return an error message when the ``--config=path[:arg]`` file is missing, is no config
    file, or its ``get_config(arg)`` rejects ``arg`` (a ``ValueError``), else None. ml_collections would
    report both inside flag parsing, with a traceback."""
    spec = _flag_value(argv, flag)
    if spec is None:
        return None
    path, *arg = spec.split(":", 1)  # as ml_collections splits it
    if not os.path.isfile(path):
        return (f"--{flag} = {spec!r}: no such file {path!r}: give a config file such as "
                f"configs/default.py (optionally with ':<variant>')")
    module_spec = importlib.util.spec_from_file_location(f"_meshrl_check_{pathlib.Path(path).stem}",
                                                         path)
    if module_spec is None or module_spec.loader is None:
        return f"--{flag} = {spec!r}: cannot be imported: give a Python config file"
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
        module.get_config(*arg)
    except ValueError as e:  # config files reject unknown variants with ValueError
        return f"--{flag} = {spec!r}: {' '.join(str(e).split())}"
    except Exception as e:  # not a config file (no get_config, another signature), or its bug
        lines = [f.lineno for f in traceback.extract_tb(e.__traceback__)
                 if os.path.abspath(f.filename) == os.path.abspath(path)]
        where = f" at {os.path.basename(path)}:{lines[-1]}" if lines else ""
        hint = ("" if lines else ": a config file defines get_config(arg) (arg: the text after "
                "':', optional)")
        return (f"--{flag} = {spec!r}: loading it raised {type(e).__name__}{where}: "
                f"{' '.join(str(e).split())}{hint}")
    return None


def config_from_argv(argv: Sequence[str], flag: str = "config") -> Config:
    """The ``Config`` that ``main.py`` would run for ``argv`` (``--config path[:arg]`` and
    ``--config.a.b=v`` overrides, deprecated keys renamed), parsed by the same ml_collections
    flag; a value the flag or the schema rejects is a ``ValueError`` of one line."""
    from absl import flags
    from ml_collections import config_flags

    from meshrl.configs.loader import from_config_dict
    from meshrl.configs.renames import rename_argv

    args = ["main.py", *rename_argv(argv, flag)]
    problem = check_config_file(args[1:], flag) or check_override_keys(args[1:], flag)
    if problem:
        raise ValueError(problem)
    values = flags.FlagValues()
    config_flags.DEFINE_config_file(flag, None, flag_values=values, sys_argv=args)
    try:
        with warnings.catch_warnings():  # ml_collections loads the file with load_module()
            warnings.filterwarnings("ignore", "the load_module", DeprecationWarning)
            values(args)
    except flags.Error as e:  # a value of the wrong type: "flag --config.x=v: why"
        raise ValueError(" ".join(str(e).split())) from None
    return from_config_dict(getattr(values, flag))
