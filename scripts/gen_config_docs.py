"""Generate docs/config.md from the schema: ``python scripts/gen_config_docs.py [--check]``."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import pathlib
import sys
import typing

from meshrl.configs.fields import describe_type
from meshrl.configs.schema import SECTIONS, Job

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "config.md"


def render() -> str:
    lines = [
        "# Config reference",
        "",
        "Generated from the schema (`configs/*_schema.py`, `configs/schema.py`) by `python scripts/gen_config_docs.py`; do not edit.",
        "Override any field on the command line: `--config.<section>.<field>=<value>`.",
        "",
        "## job",
        "",
        "| value | meaning |",
        "|---|---|",
    ]
    lines += [f"| `{j.value}` | {j.name.lower()} |" for j in Job]
    for name, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        lines += ["", f"## {name}", "", inspect.cleandoc(cls.__doc__) if cls.__doc__ and
                  not cls.__doc__.startswith(cls.__name__ + "(") else "", "",
                  "| field | type | default | constraint | doc |", "|---|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            constraint = f.metadata.get("constraint")
            lines.append(f"| `{name}.{f.name}` | `{describe_type(hints[f.name])}` | "
                         f"`{f.default!r}` | {constraint[0] if constraint else ''} | "
                         f"{f.metadata.get('doc', '')} |")
    return "\n".join(line for line in lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/config.md is stale")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not DOC.exists() or DOC.read_text() != text:
            sys.stderr.write(f"{DOC} is stale; run python scripts/gen_config_docs.py\n")
            return 1
        return 0
    DOC.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
