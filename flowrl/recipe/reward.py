"""The ``reward`` section, and references to reward functions that worker processes resolve."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import Field, field_serializer, field_validator

from flowrl.recipe.section import _Section


def _lookup(obj: Any, qualname: str) -> Any:
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


def _is_dotted_name(s: str) -> bool:
    return bool(s) and all(p.isidentifier() for p in s.split("."))


def callable_ref(fn: Callable[..., Any]) -> str:
    """A reference worker processes can resolve: ``module:qualname`` or ``/abs/file.py:name``.

    An importable module is preferred. A function defined in a file run as a script or as a
    recipe (``runpy``: no importable module) is referred to by its file, which the worker
    executes as a module. Lambdas, nested functions and callable objects cannot be located and
    raise ValueError.
    """
    qualname = getattr(fn, "__qualname__", None)
    module = getattr(fn, "__module__", None)
    if not isinstance(qualname, str) or not isinstance(module, str):
        raise ValueError(f"cannot locate {fn!r} from another process; give a module-level "
                         "function or a 'module:function' string")
    if "<" in qualname:
        raise ValueError(f"{qualname!r} is a lambda or a nested function; worker processes "
                         "can only load module-level functions")
    mod = sys.modules.get(module)
    spec = getattr(mod, "__spec__", None)
    if mod is not None and spec is not None and _lookup(mod, qualname) is fn:
        return f"{spec.name if module == '__main__' else module}:{qualname}"
    code = getattr(fn, "__code__", None)
    filename = getattr(code, "co_filename", "")
    globals_ = getattr(fn, "__globals__", {})
    if (filename.endswith(".py") and Path(filename).is_file() and "." not in qualname
            and globals_.get(qualname) is fn):
        return f"{Path(filename).resolve()}:{qualname}"
    raise ValueError(f"cannot locate {module}.{qualname} from another process: its module is "
                     "not importable and it is not defined at the top of a .py file")


def check_fn_ref(ref: str) -> tuple[str, str]:
    """Split ``"module:function"`` or ``"path/file.py:function"`` into (target, name).

    Checks the syntax only (no import); ValueError says what is wrong.
    """
    target, sep, name = ref.rpartition(":")
    if not sep or not target or not _is_dotted_name(name):
        raise ValueError(f"{ref!r} is not 'module:function' or 'path/to/file.py:function'")
    if not target.endswith(".py") and not _is_dotted_name(target):
        raise ValueError(f"{target!r} is neither a dotted module name nor a .py file")
    return target, name


class RewardConfig(_Section):
    """The reward function and the workers that call it."""

    fn: str | Callable[..., Any] = "workers.roles.builtin_rewards:exact_match"
    """``"module:function"``, ``"path/to/file.py:function"``, or a module-level function.
    Per sample: ``fn(prompt, response, **row_meta) -> float`` (row_meta holds ``answer``);
    batched: ``fn(prompts, responses, metas) -> list[float]``. Sync or async."""
    batched: bool = False
    """Call `fn` once per micro-batch with lists instead of once per sample."""
    timeout_s: float = Field(default=10.0, gt=0.0, le=3600.0)
    """Per call; a call that takes longer scores 0 and is counted as failed."""
    workers: int = Field(default=1, ge=1, le=1024)
    """Reward worker processes."""
    concurrency: int = Field(default=8, ge=1, le=1024)
    """Calls in flight per worker (also the size of its thread pool for sync functions)."""

    @field_validator("fn")
    @classmethod
    def _locatable(cls, v: str | Callable[..., Any]) -> str | Callable[..., Any]:
        try:
            if isinstance(v, str):
                check_fn_ref(v)
            else:
                callable_ref(v)
        except ValueError as e:
            raise ValueError(str(e)) from None
        return v

    @field_serializer("fn", when_used="json")
    def _fn_as_ref(self, v: str | Callable[..., Any]) -> str:
        return self.ref

    @property
    def ref(self) -> str:
        """`fn` as a reference string that worker processes resolve."""
        return self.fn if isinstance(self.fn, str) else callable_ref(self.fn)
