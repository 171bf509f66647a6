"""utils.paths: workdir paths as etils.epath paths, with only operations every backend has."""

from __future__ import annotations

import os

import pytest
from etils import epath

from meshrl.utils import paths


def test_local_paths_become_absolute_and_uris_stay_as_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    local = paths.as_path("run")
    remote = paths.as_path("gs://bucket/runs/r1")

    assert isinstance(local, epath.Path) and os.fspath(local) == str(tmp_path / "run")
    assert str(remote) == "gs://bucket/runs/r1" and paths.is_uri("gs://bucket/runs/r1")
    assert str(remote / "checkpoints") == "gs://bucket/runs/r1/checkpoints"
    assert not paths.is_uri(tmp_path)


def test_files_under_walks_every_level_sorted_with_relative_names(tmp_path):
    root = paths.as_path(tmp_path)
    (root / "b" / "c").mkdir(parents=True)
    for rel, text in (("z.txt", "1"), ("b/y.txt", "22"), ("b/c/x.bin", "333")):
        (root / rel).write_text(text)

    found = paths.files_under(root)

    assert [rel for rel, _ in found] == ["b/c/x.bin", "b/y.txt", "z.txt"]
    assert [paths.size_of(p) for _, p in found] == [3, 2, 1]


def test_atomic_write_replaces_the_whole_file_and_leaves_no_temporary(tmp_path):
    target = paths.as_path(tmp_path) / "manifest.json"
    target.write_text("old")

    paths.write_text_atomic(target, "new")

    assert target.read_text() == "new"
    assert sorted(p.name for p in paths.as_path(tmp_path).iterdir()) == ["manifest.json"]


def test_remove_tree_removes_everything_and_tolerates_a_missing_tree(tmp_path):
    tree = paths.as_path(tmp_path) / "deleted"
    (tree / "3").mkdir(parents=True)
    (tree / "3" / "f").write_text("x")

    paths.remove_tree(tree)
    paths.remove_tree(tree)  # already gone: nothing to do

    assert not tree.exists()


def test_remove_tree_still_reports_other_errors(tmp_path):
    blocker = paths.as_path(tmp_path) / "file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError):
        paths.remove_tree(blocker / "child")


def test_concurrent_atomic_writes_of_one_file_never_clash_or_tear(tmp_path):
    import json
    import threading

    path = paths.as_path(tmp_path / "out.json")
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        try:
            for i in range(200):
                paths.write_text_atomic(path, json.dumps({"writer": n, "i": i, "pad": "x" * 999}))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    reads = 0
    while any(t.is_alive() for t in threads):
        if path.exists():
            json.loads(path.read_text())  # whole, never torn
            reads += 1
    for t in threads:
        t.join()

    assert not errors and reads > 0
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]
