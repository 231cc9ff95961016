"""The layer rules of DESIGN.md hold, and would bite: import-linter's contracts (pyproject.toml), the contracts
package's allow-list, settings as a leaf over the contracts, and what importing the router and cachesvc loads
(none of the engine-only packages their images are built without)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import grimp
import kvmesh
import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
CONTRACTS_MAY_IMPORT = {"xxhash", "kvmesh.proto"}  # and the standard library


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{root / 'libs'}{os.pathsep}{root}"}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300, check=False)


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The source tree and its import-linter settings, copied to where a test may add a bad module."""
    root = tmp_path_factory.mktemp("tree")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "libs", root / "libs", ignore=ignore)
    shutil.copytree(ROOT / "services", root / "services", ignore=ignore)
    shutil.copytree(ROOT / "app", root / "app", ignore=ignore)
    shutil.copyfile(ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


def test_every_import_linter_contract_is_kept() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(("module", "source", "contract"), [
    ("services/router/_leak.py", "from kvmesh.engine import kv_cache\n", "router and cachesvc load no torch"),
    ("services/cachesvc/_leak.py", "def f():\n    import torch\n", "router and cachesvc load no torch"),
    ("services/router/_leak.py", "import services.cachesvc.store\n", "services never import each other"),
    ("services/prefill/_leak.py", "from services.decode import handoff\n", "services never import each other"),
    ("libs/kvmesh/transfer/_leak.py", "from services.cachesvc import store\n", "libraries never import services"),
    ("libs/kvmesh/instance/_leak.py", "def f():\n    from services.prefill import servicer\n",
     "libraries never import services"),
    ("libs/kvmesh/client/_leak.py", "from app import launcher\n", "libraries never import services or the application"),
    ("services/decode/_leak.py", "import app\n", "services never import the application"),
    ("libs/kvmesh/contracts/_leak.py", "import numpy\n", "contracts import only"),
    ("libs/kvmesh/settings/_leak.py", "from kvmesh.engine.eviction import online_policies\n",
     "settings import only the contracts"),
    ("libs/kvmesh/settings/_leak.py", "def f():\n    from kvmesh.routing import POLICIES\n",
     "settings import only the contracts"),
    ("libs/kvmesh/settings/_leak.py", "from kvmesh.bus.subjects import token\n",
     "settings import only the contracts"),
    ("libs/kvmesh/planning/_leak.py", "def f():\n    from kvmesh.bus.subjects import token\n",
     "the planner only decides"),
], ids=["router-via-engine", "cachesvc-lazy-torch", "service-to-service", "prefill-to-decode", "library-to-service",
        "instance-host-to-servicer", "library-to-app", "service-to-app", "contracts-numpy", "settings-engine",
        "settings-lazy-routing", "settings-bus", "planner-bus"])
def test_a_forbidden_import_breaks_its_contract(tree_copy: Path, module: str, source: str, contract: str) -> None:
    leak = tree_copy / module
    leak.write_text(source)
    try:
        result = lint_imports(tree_copy)
    finally:
        leak.unlink()
    assert result.returncode != 0
    broken = [line for line in result.stdout.splitlines() if line.endswith("BROKEN")]
    assert len(broken) == 1 and broken[0].startswith(contract), result.stdout


def test_contracts_import_only_the_standard_library_xxhash_and_the_protocol() -> None:
    graph = grimp.build_graph("kvmesh", include_external_packages=True)
    package = {"kvmesh.contracts", *graph.find_descendants("kvmesh.contracts")}
    imported = set().union(*(graph.find_modules_directly_imported_by(m) for m in package)) - package
    allowed = {m for m in imported if m.split(".")[0] in sys.stdlib_module_names or m == "__future__"
               or any(m == a or m.startswith(a + ".") for a in CONTRACTS_MAY_IMPORT)}
    assert imported - allowed == set()


def contract(name_start: str) -> dict:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    return next(c for c in contracts if c["name"].startswith(name_start))


def test_the_settings_contract_forbids_every_kvmesh_package_but_the_contracts() -> None:
    """A package added to kvmesh is forbidden to settings until someone decides otherwise (the protocol is the
    contracts' own)."""
    packages = {f"kvmesh.{p.name.removesuffix('.py')}" for p in Path(kvmesh.__path__[0]).iterdir()
                if not p.name.startswith("_") and (p.suffix == ".py" or (p / "__init__.py").is_file())}
    allowed = {"kvmesh.settings", "kvmesh.contracts", "kvmesh.proto"}
    assert "kvmesh.engine" in packages and "kvmesh.routing" in packages
    assert packages - allowed <= set(contract("settings import only")["forbidden_modules"])


def engine_only_modules() -> set[str]:
    """The top-level modules of pyproject's ``[tool.kvmesh.images] engine-only`` distributions installed here."""
    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["kvmesh"]["images"]["engine-only"]
    engine_only = {norm(n) for n in listed}
    return {module for module, dists in metadata.packages_distributions().items()
            if not module.startswith("_") and any(norm(d) in engine_only for d in dists)}


def test_importing_every_router_and_cachesvc_module_loads_no_engine_only_package() -> None:
    modules = engine_only_modules()
    assert {"torch", "transformers", "safetensors", "gguf"} <= modules  # the list is read, and installed here
    walk = ("import importlib, pkgutil, sys\n"
            "import services.router, services.cachesvc\n"
            "for pkg in (services.router, services.cachesvc):\n"
            "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
            "        importlib.import_module(m.name)\n"
            f"print(sorted(m for m in {sorted(modules)!r} if m in sys.modules))\n")
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'libs'}{os.pathsep}{ROOT}"}
    result = subprocess.run([sys.executable, "-c", walk], env=env, capture_output=True, text=True, timeout=120,
                            check=True)
    assert result.stdout.strip() == "[]"
