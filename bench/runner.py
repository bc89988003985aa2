"""What every benchmark script ends with: run its main coroutine, print its one JSON line."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
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
