"""Import layering: the contracts are declared, hold on the code, and do catch a violation."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"

# Layers (DESIGN.md §1): what each package may never import (contracts may forbid more).
REQUIRED = {
    ("transport",): {"flowrl", "workers"},
    ("workers",): {"flowrl.controller"},
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


def test_contracts_are_declared() -> None:
    config = _config()
    assert set(config["root_packages"]) == {"flowrl", "workers", "transport"}
    declared = {
        tuple(c["source_modules"]): set(c["forbidden_modules"])
        for c in config["contracts"]
        if c["type"] == "forbidden"
    }
    for source, forbidden in REQUIRED.items():
        assert forbidden <= declared.get(source, set()), source


def test_the_code_keeps_the_contracts() -> None:
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert ", 0 broken." in result.stdout


def test_the_contracts_catch_a_violation(tmp_path: Path) -> None:
    """The same contracts, run on a tiny tree where transport imports flowrl, must fail."""
    named = {"transport.codec", "workers.main", "flowrl.controller"}
    for contract in _config()["contracts"]:
        named.update(contract.get("source_modules", ()), contract.get("forbidden_modules", ()))
    for module in sorted(named):  # every module a contract names must exist
        parts = module.split(".")
        for depth in range(1, len(parts) + 1):
            path = tmp_path.joinpath(*parts[:depth])
            path.mkdir(exist_ok=True)
            (path / "__init__.py").touch()
    (tmp_path / "transport" / "codec" / "__init__.py").write_text("import flowrl.controller\n")
    (tmp_path / "workers" / "main" / "__init__.py").write_text("from flowrl import controller\n")
    (tmp_path / "pyproject.toml").write_bytes((ROOT / "pyproject.toml").read_bytes())
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = _lint(tmp_path, env)
    assert result.returncode != 0
    assert "BROKEN" in result.stdout, result.stdout + result.stderr
    assert "transport.codec -> flowrl.controller" in result.stdout
    assert "workers.main -> flowrl.controller" in result.stdout
