"""torch, imported the first time one of its names is used.

A node agent keeps its node's store (segments, reference counts, frees) and relays messages: it
handles no tensor unless another node reads through it. Importing torch costs a process ~1.8 s
of CPU and ~200 MB of resident memory, most of an agent's start. The transport modules
therefore name torch through `torch` below; mypy sees the real module
(``if TYPE_CHECKING: import torch``).

Only attribute access imports: nothing in the transport layer calls it at import time, and
`flowrl.node` is checked to load without torch (tests/test_lazy_torch.py). The first read from
another node imports it in a thread (`load`, from `StoreServer`), never on the agent's event loop.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

__all__ = ["load", "loaded", "torch"]


class _Torch:
    __slots__ = ("_module",)

    def __init__(self) -> None:
        self._module: ModuleType | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module or load(), name)


torch: Any = _Torch()


def loaded() -> bool:
    """Whether `torch` holds the module: imported to the end. (A thread still importing it has
    put it in ``sys.modules`` already; a second import there waits for the first.)"""
    return torch._module is not None


def load() -> ModuleType:
    """Import torch now (blocking: ~1-2 s of CPU the first time; see `StoreServer` for why it
    runs in a thread there)."""
    module: ModuleType = torch._module or importlib.import_module("torch")
    torch._module = module
    return module
