"""Import layering: the contracts are declared, hold on the code, and do catch a violation."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"

# The layers (docs/architecture.md), top to bottom: workers, flowrl, transport; the monitor
# sees a run through its view, never the controller; workers never reach the controller.
PACKAGE_LAYERS = ["workers", "flowrl", "transport"]
FORBIDDEN = {
    ("workers",): {"flowrl.controller", "flowrl.node", "flowrl.node_hub", "flowrl.monitor"},
    ("flowrl.monitor",): {"flowrl.controller"},
}


def _config() -> dict[str, Any]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        config: dict[str, Any] = tomllib.load(f)["tool"]["importlinter"]
    return config


def _lint(cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )


def _layer_modules(contract: dict[str, Any]) -> set[str]:
    """Every module a layers contract names, with its container."""
    tails = {t for layer in contract["layers"] for t in re.split(r"[|:\s]+", layer) if t}
    containers = contract.get("containers") or [""]
    return {f"{c}.{t}" if c else t for c in containers for t in tails}


def test_contracts_are_declared() -> None:
    config = _config()
    assert set(config["root_packages"]) == {"flowrl", "workers", "transport"}
    contracts = config["contracts"]
    assert [c["layers"] for c in contracts
            if c["type"] == "layers" and not c.get("containers")] == [PACKAGE_LAYERS]
    declared = {
        tuple(c["source_modules"]): set(c["forbidden_modules"])
        for c in contracts
        if c["type"] == "forbidden"
    }
    for source, forbidden in FORBIDDEN.items():
        assert forbidden <= declared.get(source, set()), source


def test_the_code_keeps_the_contracts() -> None:
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert ", 0 broken." in result.stdout


VIOLATIONS = {
    "transport.codec": "flowrl.controller",  # the bottom layer reaching up
    "flowrl.node": "workers.main",  # flowrl reaching up into workers
    "workers.main": "flowrl.controller",  # a worker reaching the controller
    "flowrl.monitor": "flowrl.controller",  # the monitor bypassing its view
    "flowrl.index": "flowrl.controller",  # flowrl's core reaching up
}


def test_the_contracts_catch_a_violation(tmp_path: Path) -> None:
    """The same contracts, run on a tiny tree that breaks each layer once, must fail."""
    named = set(VIOLATIONS) | set(VIOLATIONS.values())
    for contract in _config()["contracts"]:
        named.update(contract.get("source_modules", ()), contract.get("forbidden_modules", ()))
        if contract["type"] == "layers":
            named |= _layer_modules(contract)
    for module in sorted(named):  # every module a contract names must exist
        parts = module.split(".")
        for depth in range(1, len(parts) + 1):
            path = tmp_path.joinpath(*parts[:depth])
            path.mkdir(exist_ok=True)
            (path / "__init__.py").touch()
    for importer, imported in VIOLATIONS.items():
        (tmp_path.joinpath(*importer.split(".")) / "__init__.py").write_text(
            f"import {imported}\n")
    (tmp_path / "pyproject.toml").write_bytes((ROOT / "pyproject.toml").read_bytes())
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = _lint(tmp_path, env)
    assert result.returncode != 0
    assert "BROKEN" in result.stdout, result.stdout + result.stderr
    for importer, imported in VIOLATIONS.items():
        assert f"{importer} -> {imported}" in result.stdout, (importer, result.stdout)


def _cycles(imports: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(imports):
        if root in index:
            continue
        work = [(root, iter(sorted(imports[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next((c for c in children if c in imports), None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(imports[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_no_module_imports_itself_through_others() -> None:
    import grimp

    graph = grimp.build_graph("flowrl", "workers", "transport")
    imports = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles(imports) == []
