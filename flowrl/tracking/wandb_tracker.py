"""Weights & Biases: one W&B run per flowrl run, named by its run id. W&B's own environment
applies (``WANDB_MODE=offline``, ``WANDB_ENTITY``, ``WANDB_API_KEY``, ...); the project is
``WANDB_PROJECT``, else ``flowrl``; local files go under the output directory unless
``WANDB_DIR`` says where."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from flowrl.run_output import flat_fields
from flowrl.tracking.base import Status, TrackedRun

DEFAULT_PROJECT = "flowrl"
#: the step an evaluation round's metrics are plotted against
EVAL_STEP = "eval/step"
#: W&B's exit code per outcome (nonzero marks the W&B run failed); the launcher's own codes
_EXIT_CODES: dict[Status, int] = {"finished": 0, "failed": 1, "killed": 130}


class WandbTracker:
    """Step metrics as history (evaluation rounds' against ``eval/step``), the recipe as the
    run's config, the summary in its summary (``summary/<field>``)."""

    def __init__(self, run: TrackedRun) -> None:
        import wandb

        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT, name=run.run_id,
            config=run.recipe, dir=None if os.environ.get("WANDB_DIR") else str(run.out),
            # another W&B run of this process (a notebook's) goes on; the console is the
            # launcher's and stays unwrapped
            reinit="create_new", settings=wandb.Settings(console="off"))
        self._eval_axis = False

    def step(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def eval(self, step: int, metrics: Mapping[str, float]) -> None:
        # A round ends after later steps were logged, and W&B drops a step below its last:
        # the eval/ metrics are plotted against their own step metric instead.
        if not self._eval_axis:
            self._run.define_metric(EVAL_STEP)
            self._run.define_metric("eval/*", step_metric=EVAL_STEP)
            self._eval_axis = True
        self._run.log({**metrics, EVAL_STEP: step})

    def summary(self, summary: Mapping[str, Any]) -> None:
        self._run.summary.update({f"summary/{k}": v for k, v in flat_fields(summary).items()})

    def close(self, status: Status) -> None:
        self._run.finish(exit_code=_EXIT_CODES[status])
