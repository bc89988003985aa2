"""Building a tiny model for a run in a child process, with progress lines and a clean stop.

`flowrl.run` builds a tiny model that the recipe asks for and the cache lacks in a child
process (``python -m flowrl.tiny_model``): its imports alone (torch, transformers) take seconds
and its warm-up minutes on busy cores, and a child stops at once when the run is interrupted,
removing its half-built directory, where a thread would run on to the end of the build. The
child says what it does as JSON lines on stderr; they become the run's ``model`` progress lines.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from flowrl.interrupts import Interrupts
from flowrl.lifecycle import PARENT_ENV
from flowrl.progress import Progress, seconds
from flowrl.spawn import start_child, stop_child

__all__ = ["BuildFailed", "build_in_child", "cli_args"]

#: the lines of a failed build's output its error quotes
_ERROR_LINES = 20
#: how long a stopped build has to remove its temporary directory before it is killed
_STOP_GRACE_S = 30.0


class BuildFailed(RuntimeError):
    """The tiny model's build failed (the message quotes the end of its output)."""


def cli_args(settings: dict[str, Any]) -> list[str]:
    """``python -m flowrl.tiny_model``'s options for `build_tiny_model`'s keyword arguments
    ``settings`` (those the recipe's ``tiny`` section sets)."""
    names = {"corpus_kind": "corpus"}
    return [a for k, v in settings.items() if v is not None
            for a in (f"--{names.get(k, k).replace('_', '-')}", str(v))]


def _said(progress: Progress, line: str, what: str, steps: int, *, at_most: bool = False) -> bool:
    """Turn one line of the child's stderr into a progress line; whether it was progress.
    ``at_most``: the warm-up has a target and may end before ``steps``."""
    try:
        record = json.loads(line)
    except ValueError:
        return False
    if not isinstance(record, dict) or "stage" not in record:
        return False
    stage, took = record["stage"], seconds(progress.elapsed())
    if stage == "tokenizer":
        progress.update(f"tokenizer trained: {record['tokens']} tokens ({took})", force=True)
    elif stage == "model":
        millions = record["parameters"] / 1e6
        warm = f"; {'at most ' if at_most else ''}{steps} warm-up steps next" if steps else ""
        progress.update(f"{what} made: {millions:.2f}M parameters ({took}){warm}", force=True)
    elif stage == "warmup":
        step, total = record["step"], record["steps"]
        known = record.get("known")
        if known is None:
            progress.update(lambda: f"warm-up step {step} of {total} ({took})")
        else:  # a warm-up with a target: what the model knows, at most every 100 steps
            progress.update(f"warm-up step {step} of at most {total}: {known:.0%} of the "
                            f"corpus's questions answered ({took})", force=True)
    elif stage == "save":
        progress.update(f"saving ({took})", force=True)
    return True


async def build_in_child(out: Path, settings: dict[str, Any], *, what: str,
                         progress: Progress, interrupts: Interrupts) -> Path:
    """Build the tiny model of ``settings`` (`build_tiny_model`'s keyword arguments) into
    ``out`` in a child process, saying how it goes; ``what`` names it in the lines (``tiny
    model``). Cancelled, even while it starts, the child is stopped (SIGTERM: it removes its
    temporary directory) and waited for; a forced stop (`Interrupts.force`) kills it. Raises
    `BuildFailed` with the end of its output when it fails."""
    steps = int(settings.get("pretrain_steps", 0))
    until = settings.get("pretrain_until")
    warm = (f" ({steps} warm-up steps)" if until is None else
            f" (warm-up until it answers {until:.0%} of its corpus's questions, at most "
            f"{steps} steps)") if steps else ""
    progress.begin("model", f"building the {what}", f"building the {what}{warm} into the "
                   f"cache, where later runs find it: {out}")
    proc = await start_child(
        sys.executable, "-m", "flowrl.tiny_model", str(out), *cli_args(settings),
        "--json-progress", grace_s=_STOP_GRACE_S, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, PARENT_ENV: str(os.getpid())})
    untrack = interrupts.track(lambda: [proc.pid] if proc.returncode is None else [])
    other: list[str] = []  # what is not progress: a traceback, warnings
    try:
        assert proc.stderr is not None
        assert proc.stdout is not None
        async for raw in proc.stderr:
            line = raw.decode(errors="replace").rstrip("\n")
            if not _said(progress, line, what, steps, at_most=until is not None) and line:
                other = [*other[-_ERROR_LINES + 1:], line]
        await proc.stdout.read()
        code = await proc.wait()
    except BaseException:  # cancelled (interrupted): the child removes what it began
        await asyncio.shield(stop_child(proc, _STOP_GRACE_S))
        raise
    finally:
        untrack()
    if code != 0:
        said = "\n".join(other)
        raise BuildFailed(f"building the {what} into {out} failed (exit code {code}):\n{said}")
    progress.end(f"{what} built in {seconds(progress.elapsed())}, cached: {out}")
    return out
