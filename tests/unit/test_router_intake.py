"""The router's intake as a structure: error kinds in one enum whose table the README lists (generated, not
copied), and no import cycle between the router's modules at run time (checked on the real tree, and shown to
bite on a copy with one planted)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc

from services.router.errors import STATUS, ErrorKind, RequestError, table

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "services" / "router" / "README.md"

# run in a fresh interpreter on the tree at argv[1]: the router's runtime import graph, its cycles as JSON
CYCLES = """
import json, sys
import grimp

graph = grimp.build_graph("services", exclude_type_checking_imports=True)
modules = {m for m in graph.find_descendants("services.router")}
edges = {m: sorted(i for i in graph.find_modules_directly_imported_by(m) if i in modules) for m in modules}
cycles, state = [], {}

def visit(m, path):
    state[m] = "open"
    for n in edges[m]:
        if state.get(n) == "open":
            cycles.append(path[path.index(n):] + [n])
        elif n not in state:
            visit(n, path + [n])
    state[m] = "done"

for m in sorted(modules):
    if m not in state:
        visit(m, [m])
print(json.dumps(cycles))
"""


def router_cycles(root: Path) -> list[list[str]]:
    env = {**os.environ, "PYTHONPATH": f"{root / 'libs'}{os.pathsep}{root}"}
    out = subprocess.run([sys.executable, "-c", CYCLES], cwd=root, env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    return json.loads(out.stdout)


def test_every_error_kind_has_an_http_status_a_grpc_code_and_a_type():
    assert set(STATUS) == set(ErrorKind)
    for kind in ErrorKind:
        assert 400 <= kind.http < 600 and isinstance(kind.grpc, grpc.StatusCode) and kind.error_type
    assert RequestError(ErrorKind.TOO_LARGE, "x").kind.http == 413


def test_the_readme_lists_the_error_kinds_of_the_enum():
    """The table between the markers is ``python -m services.router.errors``'s output."""
    text = README.read_text()
    listed = text.split("<!-- error kinds: python -m services.router.errors -->\n", 1)[1].split("<!-- end -->", 1)[0]
    assert listed == table(), "regenerate the table: python -m services.router.errors"


def test_the_readmes_error_examples_name_only_kinds_of_the_enum():
    examples = README.read_text().split("## Errors", 1)[1].split("\n## ", 1)[0]
    named = {cell.strip("` ") for line in examples.splitlines() if line.startswith("| `")
             for cell in [line.split("|")[1]]}
    assert named and named <= {str(k) for k in ErrorKind}, named - {str(k) for k in ErrorKind}


def test_no_router_module_imports_another_in_a_cycle():
    assert router_cycles(ROOT) == []


def test_a_planted_cycle_is_found(tmp_path):
    shutil.copytree(ROOT / "libs", tmp_path / "libs", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "services", tmp_path / "services", ignore=shutil.ignore_patterns("__pycache__"))
    errors = tmp_path / "services" / "router" / "errors.py"
    errors.write_text(errors.read_text() + "\n\ndef _late():\n    from services.router import core  # noqa\n")
    cycles = router_cycles(tmp_path)
    assert any({"services.router.errors", "services.router.core"} <= set(c) for c in cycles), cycles
