"""The package's layout rules (docs/architecture.md), read from the source's imports.

- engines/ and trainer/ never import the loop (they are parts the loop drives, usable alone);
- store/ imports only the base vocabulary (pipeline/*.py) and itself;
- no import cycles between modules, counting imports inside functions too (a lazy import is a
  dependency all the same);
- every module sits in a folder that names its role, besides the base vocabulary;
- test modules have names unique across tests/ folders (conftest puts every folder on sys.path).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pipeline"
BASE = {"pipeline.errors", "pipeline.types", "pipeline.protocols", "pipeline.faults", "pipeline.devices",
        "pipeline.threads"}  # the base vocabulary: what every folder may use
FOLDERS = {"config", "data", "models", "loop", "envs", "engines", "trainer", "store", "observe"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path) -> set[str]:
    """The package's modules `path` imports anywhere in its body, by their module names
    (`from pipeline.loop import buffer` counts pipeline.loop.buffer)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found.update(n for n in names if n in MODULES)
    found.discard(_module_name(path))
    return found


GRAPH = {name: _imports(path) for name, path in MODULES.items()}


def _in(folder: str, module: str) -> bool:
    return module == f"pipeline.{folder}" or module.startswith(f"pipeline.{folder}.")


def test_the_graph_sees_lazy_and_from_imports():
    """The walk is not vacuous: it finds a module-level import, a `from pipeline.x import module` and one inside a function."""
    assert "pipeline.loop.buffer" in GRAPH["pipeline.loop.orchestrator"]
    assert "pipeline.models.builtin" in GRAPH["pipeline.engines.transformers"]  # from pipeline.models import builtin
    assert "pipeline.envs.protocol" in GRAPH["pipeline.loop.build"]  # inside a function


@pytest.mark.parametrize("folder", ["engines", "trainer"])
def test_engines_and_the_trainer_never_import_the_loop(folder):
    bad = {m: sorted(d for d in deps if _in("loop", d)) for m, deps in GRAPH.items() if _in(folder, m)}
    assert not {m: d for m, d in bad.items() if d}, "these import the loop, which drives them"


def test_the_store_imports_only_the_base_vocabulary():
    bad = {m: sorted(d for d in deps if d not in BASE and not _in("store", d))
           for m, deps in GRAPH.items() if _in("store", m)}
    assert not {m: d for m, d in bad.items() if d}


def test_no_import_cycles():
    """Tarjan's strongly connected components of the import graph: every one is a single module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_every_module_sits_in_a_folder_that_names_its_role():
    loose = {m for m in MODULES if m.count(".") == 1} - BASE - {f"pipeline.{f}" for f in FOLDERS}
    assert not loose, f"modules outside the folders and the base vocabulary: {sorted(loose)}"
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == FOLDERS, "a folder was added or removed: say what it holds in docs/architecture.md and here"


def test_test_module_names_are_unique_across_folders():
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
