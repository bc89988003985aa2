"""TensorBoard: event files in ``<output>/tensorboard`` (torch's ``SummaryWriter``, which needs
the ``tensorboard`` package). A run resumed in the same directory writes beside the old files
and hides their steps after its checkpoint, which it trains again."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from flowrl.run_output import TENSORBOARD_DIR
from flowrl.tracking.base import Status, TrackedRun, summary_numbers


def _json_block(data: Any) -> str:
    """``data`` as a JSON code block (TensorBoard's text tab renders Markdown)."""
    return "```json\n" + json.dumps(data, indent=2, default=str) + "\n```"


class TensorBoardTracker:
    """Scalars per step under their step-log names, the recipe and the summary as text."""

    def __init__(self, run: TrackedRun) -> None:
        from torch.utils.tensorboard import SummaryWriter

        purge = None if run.resumed_at is None else run.resumed_at + 1
        self._writer = SummaryWriter(log_dir=str(run.out / TENSORBOARD_DIR), purge_step=purge)
        self._writer.add_text("recipe", _json_block(run.recipe), 0)
        self._writer.flush()

    def step(self, step: int, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step)
        self._writer.flush()  # a step is seen as it commits

    def eval(self, step: int, metrics: Mapping[str, float]) -> None:
        self.step(step, metrics)  # scalars may come out of step order

    def summary(self, summary: Mapping[str, Any]) -> None:
        version = int(summary.get("version") or 0)
        self._writer.add_text("summary", _json_block(summary), version)
        for name, value in summary_numbers(summary).items():
            self._writer.add_scalar(name, value, version)

    def close(self, status: Status) -> None:
        self._writer.add_text("status", status)
        self._writer.close()
