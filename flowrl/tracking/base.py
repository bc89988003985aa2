"""What every tracker adapter shares: the run it tracks, the interface, and the numbers a
tracker can plot."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from flowrl.run_output import flat_fields

__all__ = ["Status", "TrackedRun", "Tracker", "numbers", "summary_numbers"]

#: how a run ended: ran to its end (or was stopped by the monitor), raised, or was interrupted
Status = Literal["finished", "failed", "killed"]


@dataclass(frozen=True)
class TrackedRun:
    """What a tracker is opened with."""

    run_id: str
    out: Path
    """The run's output directory; a tracker's local files go under it."""
    recipe: dict[str, Any]
    """The recipe as ``recipe.json`` holds it (`flowrl.run_output.recipe_record`)."""
    resumed_at: int | None = None
    """The checkpoint version a resumed run continues from, in this output directory: the
    steps after it are trained again."""


class Tracker(Protocol):
    """One library's adapter. Its calls come from one thread, in order; any of them may raise
    (the tracker is then dropped, `flowrl.tracking.Tracking`)."""

    def step(self, step: int, metrics: Mapping[str, float]) -> None:
        """A committed step's numbers."""

    def eval(self, step: int, metrics: Mapping[str, float]) -> None:
        """An evaluation round's numbers (``eval/...``), of the policy of ``step``; it may
        come after later steps' (a round ends while training goes on)."""

    def summary(self, summary: Mapping[str, Any]) -> None:
        """The run's summary (as ``summary.json`` holds it), once, at its end."""

    def close(self, status: Status) -> None:
        """Flush and end the tracked run."""


def numbers(values: Mapping[str, Any]) -> dict[str, float]:
    """The values that are numbers (not flags, not None), as floats."""
    return {k: float(v) for k, v in values.items() if type(v) in (int, float)}


def summary_numbers(summary: Mapping[str, Any]) -> dict[str, float]:
    """A summary's numbers, nested ones flattened, as ``summary/<field>``."""
    return {f"summary/{k}": v for k, v in numbers(flat_fields(summary)).items()}
