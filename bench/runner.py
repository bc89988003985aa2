"""What every benchmark script ends with: run its main coroutine, print its one JSON line."""

from __future__ import annotations

import asyncio
import json
import platform
from collections.abc import Coroutine, Iterable
from importlib import metadata
from typing import Any


def run_and_print(main: Coroutine[Any, Any, dict[str, Any]]) -> None:
    """Run ``main`` on uvloop when it is installed (as flowrl's processes do), else on asyncio,
    and print what it returns as one JSON line."""
    try:
        import uvloop
    except ImportError:
        result = asyncio.run(main)
    else:
        result = uvloop.run(main)
    print(json.dumps(result))


def library_versions(names: Iterable[str]) -> dict[str, str]:
    """Python's version and each installed distribution's (``absent`` when not installed), for
    the figures a benchmark prints."""
    out = {"python": platform.python_version()}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out
