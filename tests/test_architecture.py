"""The import contract of docs/architecture.md: every package-to-package import is in its table,
and no two packages import each other, directly or round a longer cycle; nor do two modules of
one package."""

from __future__ import annotations

import ast
import collections
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
NOT_PACKAGES = {"tests", "docs", "notebooks", "meshrl.egg-info"}

Allowed = dict[str, set[str]]  # package -> entries it may import ("pkg" or "pkg.module")


def read_table(doc: pathlib.Path) -> Allowed:
    """The table between ``<!-- import-table -->`` markers: ``| `pkg` | `a`, `b.mod` |``."""
    text = doc.read_text()
    body = text.split("<!-- import-table -->", 1)[1].split("<!-- /import-table -->", 1)[0]
    allowed: Allowed = {}
    for row in body.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) != 2 or not cells[0].startswith("`"):
            continue  # header or separator row
        allowed[cells[0].strip("`")] = set(re.findall(r"`([\w.]+)`", cells[1]))
    return allowed


def package_modules(root: pathlib.Path) -> dict[str, list[pathlib.Path]]:
    """Top-level packages (folders with ``__init__.py``) and loose tool folders, plus ``main``."""
    out: dict[str, list[pathlib.Path]] = {}
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        if folder.name in NOT_PACKAGES or folder.name.startswith((".", "_")):
            continue
        files = sorted(folder.rglob("*.py"))
        if files:
            out[folder.name] = files
    if (root / "main.py").exists():
        out["main"] = [root / "main.py"]
    return out


def imported_names(path: pathlib.Path) -> list[tuple[str, int]]:
    """``meshrl.*`` names imported anywhere in ``path`` (function bodies included), with lines;
    ``from meshrl.pkg import mod`` yields ``meshrl.pkg.mod`` so module-level entries match."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [(f"{node.module}.{a.name}", node.lineno) for a in node.names]
    return [(name, line) for name, line in out if name.startswith("meshrl.")]


def edges(root: pathlib.Path) -> dict[tuple[str, str], list[str]]:
    """``(importer package, imported meshrl name without the prefix) -> ["file:line", ...]``
    for imports between different packages."""
    found: dict[tuple[str, str], list[str]] = {}
    for pkg, files in package_modules(root).items():
        for path in files:
            for name, line in imported_names(path):
                target = name.split(".", 1)[1]
                if target.split(".")[0] != pkg:
                    found.setdefault((pkg, target), []).append(
                        f"{path.relative_to(root)}:{line}")
    return found


def _allows(entries: set[str], target: str) -> bool:
    parts = target.split(".")
    return parts[0] in entries or ".".join(parts[:2]) in entries


def violations(root: pathlib.Path, allowed: Allowed) -> list[str]:
    """Every import missing from ``allowed``, every cycle between packages and every cycle
    between the modules of one package."""
    problems, graph = [], {}
    for (pkg, target), where in sorted(edges(root).items()):
        graph.setdefault(pkg, set()).add(target.split(".")[0])
        if pkg not in allowed:
            problems.append(f"package {pkg!r} is not in the import table ({where[0]})")
        elif not _allows(allowed[pkg], target):
            problems.append(f"{pkg} -> meshrl.{target} is not allowed ({', '.join(where)})")
    problems += [f"cycle: {' -> '.join(c)}" for c in cycles(graph)]
    problems += [f"module cycle: {' -> '.join(c)}" for c in cycles(module_graph(root))]
    return sorted(set(problems))


def module_name(root: pathlib.Path, path: pathlib.Path) -> str:
    """``models/hf.py`` -> ``models.hf``; a package's ``__init__.py`` is the package itself."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """Module -> the modules of its own package it imports (function-level and type-checking
    imports included: each can close a cycle). ``from meshrl.pkg import name`` is an import of
    ``pkg.name`` when that is a module, else of the package's ``__init__``."""
    graph: dict[str, set[str]] = {}
    for pkg, files in package_modules(root).items():
        modules = {module_name(root, path) for path in files}
        for path in files:
            source = module_name(root, path)
            for name, _ in imported_names(path):
                parts = name.split(".")[1:]
                if parts[0] != pkg:
                    continue
                target = next(".".join(parts[:n]) for n in range(len(parts), 0, -1)
                              if ".".join(parts[:n]) in modules or n == 1)
                if target != source:
                    graph.setdefault(source, set()).add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle through each strongly connected group of nodes, from its first node
    by name: ``[a, b, a]``."""
    return sorted(_shortest_cycle(graph, min(group), group)
                  for group in _strongly_connected(graph) if len(group) > 1)


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components (linear time: module graphs are large)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while node not in group:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
            groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def _shortest_cycle(graph: dict[str, set[str]], start: str, group: set[str]) -> list[str]:
    """Breadth-first search inside ``group`` from ``start`` back to ``start``."""
    came_from: dict[str, str] = {}
    queue = collections.deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph.get(node, ()) & group):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if nxt not in came_from:
                came_from[nxt] = node
                queue.append(nxt)
    raise AssertionError(f"{start} is in a strongly connected group but on no cycle")


def _fake_repo(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_every_cross_package_import_is_in_the_architecture_table_and_there_is_no_cycle():
    allowed = read_table(DOC)

    assert violations(ROOT, allowed) == []


def test_table_names_every_package_and_only_known_ones():
    allowed = read_table(DOC)
    packages = set(package_modules(ROOT))

    assert packages <= set(allowed), packages - set(allowed)
    for pkg, entries in allowed.items():
        assert {e.split(".")[0] for e in entries} <= set(allowed), (pkg, entries)


def test_checker_flags_a_workflows_module_importing_trainer(tmp_path):
    repo = _fake_repo(tmp_path, {
        "trainer/__init__.py": "",
        "trainer/step.py": "from meshrl.configs import Config\n",
        "configs/__init__.py": "",
        "workflows/__init__.py": "",
        "workflows/runner.py": "def f():\n    from meshrl.trainer.step import train_step\n",
    })

    problems = violations(repo, read_table(DOC))

    assert problems == ["workflows -> meshrl.trainer.step.train_step is not allowed "
                        "(workflows/runner.py:2)"]


def test_checker_flags_a_cycle_and_a_module_outside_an_allowed_module_entry(tmp_path):
    allowed = {"a": {"b"}, "b": {"a"}, "c": {"a.tok"}}
    repo = _fake_repo(tmp_path, {
        "a/__init__.py": "import meshrl.b\n",
        "b/__init__.py": "from meshrl import a\n",
        "c/x.py": "from meshrl.a.tok import T\nfrom meshrl.a import model\n",
    })

    problems = violations(repo, allowed)

    assert "cycle: a -> b -> a" in problems
    assert "c -> meshrl.a.model is not allowed (c/x.py:2)" in problems
    assert len(problems) == 2


def test_checker_flags_a_module_cycle_inside_a_package_closed_by_a_function_level_import(
        tmp_path):
    repo = _fake_repo(tmp_path, {
        "models/__init__.py": "",
        "models/build.py": "from meshrl.models.hf import load\n",
        "models/hf.py": "def alias():\n    from meshrl.models.build import build\n",
        "models/decoder.py": "from meshrl.models import hf\n",  # one way only: no cycle
    })

    problems = violations(repo, {"models": set()})

    assert problems == ["module cycle: models.build -> models.hf -> models.build"]


def test_checker_flags_a_type_checking_import_and_an_import_of_the_package_init(tmp_path):
    repo = _fake_repo(tmp_path, {
        "configs/__init__.py": "from meshrl.configs.schema import Config\n",
        "configs/schema.py": "from meshrl.configs.rules import check\n",
        "configs/rules.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                             "    from meshrl.configs.schema import Config\n"),
        "rewards/__init__.py": "from meshrl.rewards.pool import Pool\n",
        "rewards/pool.py": "def start():\n    from meshrl.rewards import names\n",
    })

    problems = violations(repo, {"configs": set(), "rewards": set()})

    assert problems == ["module cycle: configs.rules -> configs.schema -> configs.rules",
                        "module cycle: rewards -> rewards.pool -> rewards"]


def test_cycles_gives_one_shortest_cycle_per_strongly_connected_group():
    graph = {"a": {"b"}, "b": {"c", "a"}, "c": {"a"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}

    assert cycles(graph) == [["a", "b", "a"], ["d", "e", "d"]]
