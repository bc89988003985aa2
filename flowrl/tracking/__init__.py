"""Experiment tracking: a run's step metrics, evaluation rounds, recipe and summary sent to
TensorBoard, Weights & Biases or MLflow, as ``Recipe.tracking`` lists them.

One adapter per library (`tensorboard_tracker`, `wandb_tracker`, `mlflow_tracker`) behind
`flowrl.tracking.base.Tracker`; a library is imported only when its tracker opens, so nothing
else in flowrl needs it, and each is an extra (``pip install 'flowrl[wandb]'``). `Tracking` runs
in the launcher's process: `flowrl.run.run_recipe` feeds it each step's line and each
evaluation round's where the step log (``metrics.jsonl``) is written, then the summary, and
closes it when the run ends.

Guarantees:

- A tracker whose library is not installed is refused before anything starts
  (`check_installed`), in one line naming the extra to install.
- Tracking never stalls or ends a run: the controller's step callback only queues the line;
  one thread opens the trackers and makes every call. A tracker that raises (when it opens or
  later) is logged once and dropped; the others and the run go on.
- Trackers are closed at the run's end, also when it fails or is interrupted (their run then
  ends failed or killed), each with what it was sent before; closing waits at most
  `CLOSE_TIMEOUT_S` for the libraries to flush.
"""

from __future__ import annotations

import asyncio
import importlib.util
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import structlog

from flowrl.recipe import Recipe
from flowrl.recipe.inputs import InputError
from flowrl.recipe.tracking import TrackerName
from flowrl.run_output import recipe_record
from flowrl.tracking.base import Status, TrackedRun, Tracker, numbers

__all__ = ["CLOSE_TIMEOUT_S", "Status", "TrackedRun", "Tracker", "Tracking", "check_installed",
           "status_of"]

log = structlog.get_logger("flowrl.tracking")

#: how long the end of a run waits for the trackers to flush (W&B may still be uploading)
CLOSE_TIMEOUT_S = 60.0
#: the module each tracker needs (what its extra installs)
_LIBRARY: dict[TrackerName, str] = {"tensorboard": "tensorboard", "wandb": "wandb",
                                    "mlflow": "mlflow"}

_Call = Callable[[Tracker], None]


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken or half-imported module
        return False


def check_installed(names: Sequence[TrackerName]) -> None:
    """Raise `flowrl.recipe.inputs.InputError` (field ``tracking``) for the first tracker whose
    library is not installed."""
    for name in names:
        if not _installed(_LIBRARY[name]):
            raise InputError("tracking", f"{name!r} needs the {_LIBRARY[name]} package, which "
                             f"is not installed: pip install 'flowrl[{name}]'")


def _open(name: TrackerName, run: TrackedRun) -> Tracker:
    if name == "tensorboard":
        from flowrl.tracking.tensorboard_tracker import TensorBoardTracker

        return TensorBoardTracker(run)
    if name == "wandb":
        from flowrl.tracking.wandb_tracker import WandbTracker

        return WandbTracker(run)
    from flowrl.tracking.mlflow_tracker import MlflowTracker

    return MlflowTracker(run)


def status_of(error: BaseException | None) -> Status:
    """How a run that raised ``error`` (None: none) ended."""
    if error is None:
        return "finished"
    return "killed" if isinstance(error, asyncio.CancelledError | KeyboardInterrupt) else "failed"


class Tracking:
    """The trackers of one run (none when ``names`` is empty: every call is then a no-op).

    `step`, `eval` and `summary` only queue; a thread named ``flowrl-tracking`` opens the
    trackers and makes their calls in order. `close` (or `aclose`) ends them."""

    def __init__(self, names: Sequence[TrackerName] = (), run: TrackedRun | None = None) -> None:
        self.names = tuple(names) if run is not None else ()
        self._queue: queue.SimpleQueue[tuple[_Call, bool]] = queue.SimpleQueue()
        self._closed = False
        self._thread: threading.Thread | None = None
        if run is not None and self.names:
            # daemon: a tracker stuck past CLOSE_TIMEOUT_S must not keep the process alive
            self._thread = threading.Thread(target=self._serve, args=(run,),
                                            name="flowrl-tracking", daemon=True)
            self._thread.start()

    @classmethod
    def of(cls, recipe: Recipe, run_id: str, *, resumed_at: int | None = None) -> Tracking:
        """The trackers ``recipe.tracking`` names (its ``output`` is then set: the recipe
        requires it); ``resumed_at`` as `flowrl.run_output.RunRecord` has it."""
        if not recipe.tracking or recipe.output is None:
            return cls()
        return cls(recipe.tracking, TrackedRun(run_id, recipe.output, recipe_record(recipe),
                                               resumed_at))

    def step(self, entry: Mapping[str, Any]) -> None:
        """A step's line of the step log (an ``on_step`` callback of the controller)."""
        step, metrics = entry.get("step"), numbers({k: v for k, v in entry.items()
                                                    if k != "step"})
        if isinstance(step, int):
            self._put(lambda t: t.step(step, metrics))

    def eval(self, line: Mapping[str, Any]) -> None:
        """An evaluation round's line (an ``on_eval`` callback of the controller): its numbers,
        already named ``eval/...``, at the step it evaluated."""
        step, metrics = line.get("step"), numbers({k: v for k, v in line.items()
                                                   if k != "step"})
        if isinstance(step, int):
            self._put(lambda t: t.eval(step, metrics))

    def summary(self, summary: Mapping[str, Any]) -> None:
        """The run's summary."""
        record = dict(summary)
        self._put(lambda t: t.summary(record))

    def close(self, status: Status, *, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """End every tracker's run with ``status``; waits at most ``timeout`` for them."""
        if self._closed:
            return
        self._closed = True
        if self._thread is None:
            return
        self._queue.put((lambda t: t.close(status), True))
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning(f"tracking: the trackers did not finish within {timeout:.0f} s; "
                        "the run ends without waiting for them", trackers=list(self.names))

    async def aclose(self, error: BaseException | None) -> None:
        """`close` for a run that raised ``error`` (None: it ended normally), off the loop."""
        await asyncio.to_thread(self.close, status_of(error))

    def _put(self, call: _Call) -> None:
        if self._thread is not None and not self._closed:
            self._queue.put((call, False))

    def _serve(self, run: TrackedRun) -> None:
        trackers: dict[TrackerName, Tracker] = {}
        for name in self.names:
            try:
                trackers[name] = _open(name, run)
            except Exception as exc:
                _dropped(name, "could not start", exc)
        while True:
            call, last = self._queue.get()
            for name, tracker in list(trackers.items()):
                try:
                    call(tracker)
                except Exception as exc:
                    del trackers[name]
                    _dropped(name, "failed", exc)
                    if not last:
                        _close_quietly(tracker)
            if last:
                return


def _dropped(name: TrackerName, what: str, exc: Exception) -> None:
    log.error(f"tracking: {name} {what} and is dropped; the run goes on without it",
              tracker=name, error=repr(exc))


def _close_quietly(tracker: Tracker) -> None:
    try:
        tracker.close("failed")
    except Exception as exc:  # it already failed; this is only to release what it holds
        log.debug("tracking: a dropped tracker did not close", error=repr(exc))
