"""What benchmark scripts share: run the main coroutine and print its one JSON line, the
library versions a figure was measured with, and lists of integers as arguments (``--seeds``)."""

from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from flowrl.lifecycle import run_loop
from flowrl.tiny_model import installed_versions


def run_and_print(main: Coroutine[Any, Any, dict[str, Any]]) -> None:
    """Run ``main`` on the loop flowrl's processes run on (`flowrl.lifecycle.run_loop`) and
    print what it returns as one JSON line."""
    print(json.dumps(run_loop(main)))


def library_versions(names: Iterable[str]) -> dict[str, str]:
    """Python's version and each installed distribution's (``absent`` when not installed), for
    the figures a benchmark prints."""
    return {"python": platform.python_version(), **installed_versions(names)}


def int_list(least: int, what: str) -> Callable[[str], list[int]]:
    """An argparse ``type``: comma-separated integers, each >= ``least`` (``what`` they are,
    for the error)."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(s) for s in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated integers, got {text!r}") from None
        if not values or min(values) < least:
            raise argparse.ArgumentTypeError(f"expected {what} >= {least}, got {text!r}")
        return values
    return parse


#: ``--seeds 0,1,2``: comma-separated seeds, each >= 0
seed_list = int_list(0, "seeds")
