"""No pickle anywhere: a source scan of the packages for every way to (un)pickle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("flowrl", "workers", "transport", "bench", "recipes")

BANNED_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve"}
BANNED_NAMES = {"__reduce__", "__reduce_ex__", "cloudpickle", "dill", "pickle", "marshal"}


def _keyword_is_true(call: ast.Call, name: str) -> bool:
    return any(
        k.arg == name and isinstance(k.value, ast.Constant) and k.value.value is True
        for k in call.keywords
    )


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def violations(source: str, filename: str = "<source>") -> list[str]:
    """Every use of pickle-based serialization in `source`, as 'file:line: what'."""
    found = []

    def flag(node: ast.AST, what: str) -> None:
        found.append(f"{filename}:{getattr(node, 'lineno', 0)}: {what}")

    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in BANNED_MODULES:
                    flag(node, f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] in BANNED_MODULES:
                flag(node, f"from {node.module} import ...")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if node.name in BANNED_NAMES:
                flag(node, f"defines {node.name}")
        elif isinstance(node, ast.Attribute | ast.Name):
            name = node.attr if isinstance(node, ast.Attribute) else node.id
            if name in BANNED_NAMES:
                flag(node, f"uses {name}")
        if isinstance(node, ast.Call):
            func = _dotted(node.func)
            if func == "torch.load" and not _keyword_is_true(node, "weights_only"):
                flag(node, "torch.load without weights_only=True")
            if func in {"np.load", "numpy.load"} and _keyword_is_true(node, "allow_pickle"):
                flag(node, f"{func} with allow_pickle=True")
            if func in {"importlib.import_module", "__import__"} and any(
                isinstance(a, ast.Constant) and str(a.value).split(".")[0] in BANNED_MODULES
                for a in node.args
            ):
                flag(node, f"{func} of a pickle module")
    return found


def test_no_pickle_in_any_package() -> None:
    files = [p for pkg in PACKAGES if (ROOT / pkg).is_dir() for p in (ROOT / pkg).rglob("*.py")]
    assert len(files) >= 5, "the scan found too few files to mean anything"
    found = [v for p in files for v in violations(p.read_text(), str(p.relative_to(ROOT)))]
    assert found == []


@pytest.mark.parametrize(
    "source",
    [
        "import pickle",
        "import cloudpickle as cp",
        "from pickle import loads",
        "from dill import dumps",
        "import marshal",
        "import shelve",
        "import torch\ntorch.load('x')",
        "import torch\ntorch.load('x', weights_only=False)",
        "import numpy as np\nnp.load('x', allow_pickle=True)",
        "class A:\n    def __reduce__(self):\n        return (A, ())",
        "x = obj.__reduce_ex__(2)",
        "import importlib\nm = importlib.import_module('pickle')\nm.loads(b'')",
    ],
)
def test_scanner_flags_each_pattern(source: str) -> None:
    assert violations(source)


@pytest.mark.parametrize(
    "source",
    [
        "import torch\ntorch.load('x', weights_only=True)",
        "'''No pickle on the wire.'''",
        "import numpy as np\nnp.load('x')",
        "import msgpack",
    ],
)
def test_scanner_accepts_safe_code(source: str) -> None:
    assert violations(source) == []
