"""The engine seam holds: the code that hosts an engine (the prefill and decode services, the instance host)
touches an engine only through ``kvmesh.engines.Engine``'s members, and no module imports back into one that
imports it at run time (a cycle). Both checks are shown to bite on a planted violation."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import grimp
import pytest
from kvmesh.engines import Engine

ROOT = Path(__file__).resolve().parents[2]
HOSTING = [ROOT / "services" / "prefill", ROOT / "services" / "decode", ROOT / "libs" / "kvmesh" / "instance"]
SEAM = {name for name in [*dir(Engine), *Engine.__annotations__] if not name.startswith("_")}


def engine_attributes(source: str) -> list[tuple[int, str]]:
    """``(line, attribute)`` of every attribute read off an engine: ``<anything>.engine.X`` or ``engine.X``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        if ((isinstance(base, ast.Attribute) and base.attr == "engine")
                or (isinstance(base, ast.Name) and base.id == "engine")):
            found.append((node.lineno, node.attr))
    return found


def off_seam(source: str) -> list[tuple[int, str]]:
    return [(line, attr) for line, attr in engine_attributes(source) if attr not in SEAM]


def test_the_engine_hosting_code_uses_only_the_seams_members():
    files = [f for d in HOSTING for f in sorted(d.rglob("*.py"))]
    assert len(files) > 10
    bad = {str(f.relative_to(ROOT)): found for f in files if (found := off_seam(f.read_text()))}
    assert bad == {}, f"outside kvmesh.engines.Engine: {bad}"


@pytest.mark.parametrize("source", [
    "def f(w):\n    return w.engine.engine.blocks.pin('l', 0, [], 1)\n",
    "def f(self):\n    return self.w.engine.kv.landing_arrays()\n",
    "def f(engine):\n    return engine.scheduler.running\n",
])
def test_reaching_past_the_seam_is_caught(source):
    assert off_seam(source)


def test_the_seams_own_calls_pass():
    assert off_seam("async def f(w, r):\n    await w.engine.pin('l', w.engine.namespace(), [], 1)\n"
                    "    w.engine.release('l')\n    return w.engine.layout\n") == []


def runtime_cycles(*packages: str) -> list[list[str]]:
    """Strongly connected groups of modules that import each other at run time (imports under
    ``TYPE_CHECKING`` excluded; a function-level import counts: it runs)."""
    graph = grimp.build_graph(*packages, exclude_type_checking_imports=True, cache_dir=None)  # a stale cache lies
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in graph.modules:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for module in sorted(graph.modules):
            if module not in index:
                visit(module)
    finally:
        sys.setrecursionlimit(limit)
    return groups


def test_no_module_imports_back_into_one_that_imports_it():
    """Among others the router's core and its structured-output checks, which did until the router's intake
    became one pipeline."""
    assert runtime_cycles("kvmesh", "services", "app") == []


def test_a_planted_cycle_is_found(tmp_path, monkeypatch):
    pkg = tmp_path / "cyc"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from cyc import b\n")
    (pkg / "b.py").write_text("def f():\n    from cyc import a\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cyc import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert runtime_cycles("cyc") == [["cyc.a", "cyc.b"]]
