"""Progress lines for a launched run's long stages: building the tiny model, reading the data,
starting the workers, saving checkpoints and the final model.

A stage says one line when it starts and one when it ends; between the two, `Progress.update`
says the latest state at most once every ``every_s`` seconds, so a slow stage is never silent
and a fast one is two lines. The lines go where the step lines go (stdout: what the run shows,
the logs are on stderr), in their style: the stage's name in a column of its own, then what
happens (``workers 2 of 3 up (4.1 s); starting: trainer.0.0``). A log level above ``info``
(``FLOWRL_LOG_LEVEL=warning``) silences them, as it silences the informational log lines.

`Progress` also keeps what a run did so far (`doing`, the steps committed, the saves), which the
launcher's last line says when the run is interrupted.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowrl.logs import LEVEL_ENV

__all__ = ["STAGE_WIDTH", "Progress", "Saved", "dir_bytes", "megabytes", "seconds"]

#: the width of the stage's column (the step lines' ``step    1`` has the same)
STAGE_WIDTH = 8
#: log levels that silence progress lines
_QUIET_LEVELS = ("warning", "error", "critical")


def seconds(s: float) -> str:
    """``0.04 s``, ``4.2 s``, ``12 s``, ``3 min 05 s``: as precise as a reader of a progress
    line cares."""
    if s < 1:
        return f"{s:.2f} s"
    if s < 10:
        return f"{s:.1f} s"
    if s < 60:
        return f"{s:.0f} s"
    minutes, rest = divmod(round(s), 60)
    return f"{minutes} min {rest:02d} s"


def megabytes(n: float) -> str:
    """``3.4 MB`` (decimal megabytes, as ``ls -h --si`` and file managers say)."""
    return f"{n / 1e6:.1f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


def dir_bytes(path: Path) -> int:
    """The bytes of the files under ``path``."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@dataclass(frozen=True)
class Saved:
    """A save a run announced: ``what`` (``checkpoint`` or ``final model``) at ``path``."""

    what: str
    step: int
    path: Path


@dataclass
class Progress:
    """Writes progress lines (``write``, default: print to stdout and flush) and keeps what the
    run did (see the module docstring). ``enabled=None`` follows ``$FLOWRL_LOG_LEVEL``."""

    write: Callable[[str], None] | None = None
    every_s: float = 10.0
    clock: Callable[[], float] = time.monotonic
    enabled: bool | None = None
    #: what the run is doing now, in words (``building the tiny model``); "" before it starts
    doing: str = ""
    #: the last step committed (0: none yet), and the run's total
    step: int = 0
    steps: int = 0
    #: the checkpoints and final model this run saved, in order
    saves: list[Saved] = field(default_factory=list)
    _stage: str = ""
    _began: float = 0.0
    _said: float = 0.0

    def __post_init__(self) -> None:
        if self.enabled is None:
            level = (os.environ.get(LEVEL_ENV) or "info").lower()
            self.enabled = level not in _QUIET_LEVELS

    def line(self, stage: str, text: str) -> None:
        """One line of ``stage`` (a word that fits the column)."""
        if not self.enabled:
            return
        out = f"{stage:<{STAGE_WIDTH - 1}} {text}"
        if self.write is not None:
            self.write(out)
        else:
            print(out, flush=True)

    def begin(self, stage: str, doing: str, text: str) -> None:
        """``stage`` starts: say ``text``; the run is now ``doing`` this."""
        self._stage, self.doing = stage, doing
        self._began = self._said = self.clock()
        self.line(stage, text)

    def elapsed(self) -> float:
        """Seconds since the current stage began."""
        return self.clock() - self._began

    def update(self, text: str | Callable[[], str], *, force: bool = False) -> bool:
        """Say how the current stage goes, unless a line of it was said less than ``every_s``
        ago (``force``: say it anyway); ``text`` may be a function, called only when said.
        Whether it was said."""
        now = self.clock()
        if not force and now - self._said < self.every_s:
            return False
        self._said = now
        self.line(self._stage, text() if callable(text) else text)
        return True

    async def ticks(self, text: Callable[[], str]) -> None:
        """Say ``text()`` every ``every_s`` until cancelled: a stage that waits on others
        is never silent."""
        while True:
            await asyncio.sleep(self.every_s)  # a display timer, not a poll
            self.update(text, force=True)

    def end(self, text: str) -> None:
        """The current stage is done: say ``text``."""
        self.line(self._stage, text)
        self._said = self.clock()

    def on_step(self, entry: dict[str, Any]) -> None:
        """A step committed (a controller ``on_step`` callback): the run is training."""
        self.doing = "training"
        self.step = int(entry["step"])

    def saved(self, what: str, step: int, path: Path, nbytes: float | None,
              took_s: float | None) -> None:
        """``what`` of ``step`` is complete at ``path``: say so (its size and the seconds the
        save took, when known) and keep it for the run's last line."""
        self.saves.append(Saved(what, step, path))
        detail = [megabytes(nbytes) if nbytes is not None else "",
                  seconds(took_s) if took_s is not None else ""]
        said = ", ".join(d for d in detail if d)
        self.line("saved", f"{what} of step {step}: {path}" + (f" ({said})" if said else ""))
