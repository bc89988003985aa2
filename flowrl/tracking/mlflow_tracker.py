"""MLflow: one MLflow run per flowrl run, named by its run id, through ``MlflowClient`` (so no
process-wide active run is touched). MLflow's own environment applies: the store is
``MLFLOW_TRACKING_URI`` (else MLflow's default), the experiment ``MLFLOW_EXPERIMENT_ID`` or
``MLFLOW_EXPERIMENT_NAME``, else ``flowrl``."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import Any

from flowrl.run_output import flat_fields
from flowrl.tracking.base import Status, TrackedRun, summary_numbers

DEFAULT_EXPERIMENT = "flowrl"
#: the longest parameter value every MLflow store takes; the whole recipe is in recipe.json
_PARAM_CHARS = 500
_STATUS: dict[Status, str] = {"finished": "FINISHED", "failed": "FAILED", "killed": "KILLED"}


def _param(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= _PARAM_CHARS else f"{text[:_PARAM_CHARS - 3]}..."


class MlflowTracker:
    """Step metrics, the recipe as parameters (flattened: ``trainer.lr``) and as the artifact
    ``recipe.json``, the summary as ``summary/<field>`` metrics and the artifact
    ``summary.json``; the MLflow run ends FINISHED, FAILED or KILLED."""

    def __init__(self, run: TrackedRun) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self._client = client = MlflowClient()
        experiment = os.environ.get("MLFLOW_EXPERIMENT_ID") or self._experiment(
            os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT)
        created = client.create_run(experiment, run_name=run.run_id, tags={
            "flowrl.run_id": run.run_id, "flowrl.output": str(run.out)})
        self._id: str = created.info.run_id
        client.log_batch(self._id, params=[
            Param(k, _param(v)) for k, v in flat_fields(run.recipe).items()])
        client.log_dict(self._id, run.recipe, "recipe.json")

    def _experiment(self, name: str) -> str:
        from mlflow.exceptions import MlflowException

        found = self._client.get_experiment_by_name(name)
        if found is not None:
            return str(found.experiment_id)
        try:
            return str(self._client.create_experiment(name))
        except MlflowException:  # another run created it meanwhile
            found = self._client.get_experiment_by_name(name)
            if found is None:
                raise
            return str(found.experiment_id)

    def _metrics(self, values: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self._id, metrics=[
            Metric(k, v, now, step) for k, v in values.items()])

    def step(self, step: int, metrics: Mapping[str, float]) -> None:
        self._metrics(metrics, step)

    def eval(self, step: int, metrics: Mapping[str, float]) -> None:
        self._metrics(metrics, step)  # a metric's steps may come out of order

    def summary(self, summary: Mapping[str, Any]) -> None:
        self._metrics(summary_numbers(summary), int(summary.get("version") or 0))
        self._client.log_dict(self._id, dict(summary), "summary.json")

    def close(self, status: Status) -> None:
        self._client.set_terminated(self._id, status=_STATUS[status])
