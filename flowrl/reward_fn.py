"""Resolving a reward (or episode) function reference (``module:function`` or
``path/to/file.py:function``) to the callable, the same way in the launcher (its check before
workers start) and in reward (or rollout) workers.

Resolving runs the user's code: a module is imported, a file executed once per process as a
module (not as ``__main__``) and cached in ``sys.modules``. Imports only the standard library.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["MAX_ERROR_CHARS", "RewardFnError", "describe_error", "printable", "resolve_reward_fn"]

#: the longest error text said about one failure of user code
MAX_ERROR_CHARS = 500


class RewardFnError(ValueError):
    """A reward function reference that cannot be resolved to a callable."""


def printable(value: object, convert: Callable[[object], str]) -> str:
    """``convert(value)``, or a placeholder when the user's object cannot be printed (an int
    of more than 4300 digits, a ``__str__`` or ``__repr__`` that raises)."""
    try:
        return convert(value)
    except Exception:
        return f"<{type(value).__name__} that cannot be printed>"


def describe_error(e: BaseException) -> str:
    """``ValueError: what it says``, cut to `MAX_ERROR_CHARS`."""
    text = f"{type(e).__name__}: {printable(e, str)}"
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def resolve_reward_fn(ref: str, *, what: str = "reward function") -> Callable[..., Any]:
    """The callable named by ``"module:function"`` or ``"path/to/file.py:function"``.

    A file is executed once per process as a module (not as ``__main__``) and cached in
    ``sys.modules``. Every failure raises `RewardFnError` naming the reference (``what``: what
    the errors call it, such as an episode function).
    """
    target, sep, name = ref.rpartition(":")
    if not sep or not target or not all(p.isidentifier() for p in name.split(".")):
        raise RewardFnError(f"{ref!r} is not 'module:function' or 'path/to/file.py:function'")
    try:
        module = _load_file(Path(target)) if target.endswith(".py") else \
            importlib.import_module(target)
    except RewardFnError:
        raise
    except Exception as e:
        raise RewardFnError(f"{what} {ref!r}: cannot load {target!r}: "
                            f"{describe_error(e)}") from e
    obj: Any = module
    for part in name.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise RewardFnError(f"{what} {ref!r}: {target!r} has no {part!r}") from None
    if not callable(obj):
        raise RewardFnError(f"{what} {ref!r} is a {type(obj).__name__}, not callable")
    return obj  # type: ignore[no-any-return]


def _load_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise RewardFnError(f"no such file: {str(path)!r}")
    resolved = path.resolve()
    digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:12]
    name = f"_flowrl_reward_{resolved.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise RewardFnError(f"cannot load {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: dataclasses in the file look themselves up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
