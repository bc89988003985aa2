"""What benchmark scripts share: run the main coroutine and print its one JSON line, the
library versions a figure was measured with, and the ``--seeds`` argument."""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
from collections.abc import Coroutine, Iterable
from typing import Any

from flowrl.tiny_model import installed_versions


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
    return {"python": platform.python_version(), **installed_versions(names)}


def seed_list(text: str) -> list[int]:
    """``--seeds 0,1,2``: comma-separated seeds, each >= 0 (an argparse ``type``)."""
    try:
        seeds = [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None
    if not seeds or min(seeds) < 0:
        raise argparse.ArgumentTypeError(f"expected seeds >= 0, got {text!r}")
    return seeds
