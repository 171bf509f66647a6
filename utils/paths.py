"""Workdir paths through ``etils.epath``: local directories and gs:// (or any filesystem epath
has a backend for) with the same code.

Contract: ``as_path`` turns a str or PathLike into an ``epath.Path`` (a local path made
absolute, a URI such as ``gs://bucket/run`` left as it is). The helpers use only operations
every epath backend has: no recursive glob (refused on GCS), no ``os.stat``, no builtin
``open``, no ``shutil``. Code that touches the workdir (checkpoints, published weights,
metrics, summaries, the evaluator) goes through these. Tested on local paths only.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any, TypeAlias

from etils import epath

PathLike: TypeAlias = "str | os.PathLike[str]"


def is_uri(path: PathLike) -> bool:
    """``gs://...``, ``s3://...``: a path epath hands to a remote backend."""
    return "://" in os.fspath(path)


def as_path(path: PathLike) -> epath.Path:
    p = epath.Path(path)
    return p if is_uri(path) else p.absolute()


def files_under(root: PathLike) -> list[tuple[str, epath.Path]]:
    """Every file below ``root`` as ``(path relative to root, path)``, sorted; found by walking
    the tree, which every backend can do (``rglob`` is refused on GCS)."""
    root = epath.Path(root)
    out = []
    for directory, _, names in root.walk():
        for name in names:
            p = directory / name
            out.append((p.relative_to(root).as_posix(), p))
    return sorted(out, key=lambda item: item[0])


def size_of(path: epath.Path) -> int:
    return int(path.stat().length)


def write_text_atomic(path: epath.Path, text: str) -> None:
    """Write ``text`` beside ``path`` and move it into place: readers see the old file or the
    whole new one (a rename on local disks; a copy then delete on object stores, where a
    reader may see the object only once it is complete anyway)."""
    # A name of its own: two writers of one file must not write into each other's temp file.
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    except BaseException:
        if tmp.exists():
            tmp.unlink()
        raise


def remove_tree(path: epath.Path) -> None:
    """Remove ``path`` and everything below it; nothing to do when it is already gone."""
    try:
        path.rmtree()
    except FileNotFoundError:
        pass


def first_free(path: epath.Path, overwrite: bool) -> epath.Path:
    """``path``, or with ``overwrite`` False and ``path`` present the first absent
    ``<stem>-<n><suffix>`` (n = 1, 2, ...): an earlier output is never lost to a rerun."""
    n, out = 0, path
    while not overwrite and out.exists():
        n += 1
        out = path.with_name(f"{path.stem}-{n}{path.suffix}")
    return out


def is_jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except TypeError:
        return False
