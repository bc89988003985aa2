"""Committed steps become policy versions.

When the ledger commits a step, the new version's weights (handles the trainer wrote into its
node's store) are kept and broadcast to the rollout workers, versions no worker can still need
are released, the step's line is added to the step log (and given to every ``on_step``
callback: the launcher prints it, the monitor streams it), and the run state is written beside
the trainer's checkpoint of that version, if it wrote one. The stability guard
(`flowrl.control.stability`) judges each line before anyone sees it: what it does is on the
line (``stability``), in the log and a ``stability`` event. The failure budget
(`flowrl.control.step_metrics.FailureBudget`) reads it last: a reward function failing on too
many samples for too many steps ends the run once the line is out.

Broadcasts leave in order from one owned task (`broadcast`), never from fire-and-forget tasks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import structlog

from flowrl import messages as m
from flowrl.control.ledger import StepLedger
from flowrl.control.run_view import RunCounters
from flowrl.control.stability import GuardAction, StabilityGuard
from flowrl.control.step_metrics import FailureBudget, StageMetrics, step_entry
from flowrl.control.weights import WeightVersions
from flowrl.events import EventBus
from flowrl.index import Task
from flowrl.registry import Registry
from flowrl.resume import save_beside_checkpoint
from transport.pubsub import Publisher

__all__ = ["Versions"]

log = structlog.get_logger("flowrl.controller")


class Versions:
    def __init__(self, ledger: StepLedger, weights: WeightVersions, registry: Registry, *,
                 rollout_role: str, events: EventBus, counters: RunCounters,
                 free: Callable[[list[Any]], None], output: str | Path | None,
                 guard: StabilityGuard | None = None,
                 set_max_staleness: Callable[[int], None] = lambda n: None,
                 failure_budget: FailureBudget | None = None) -> None:
        """``free(handles)``: release store memory; ``output``: where checkpoints go;
        ``guard``: judges each step (``set_max_staleness`` carries out its tightening);
        ``failure_budget``: how many failed samples the run bears (None: any number)."""
        self.ledger = ledger
        self.weights = weights
        self.registry = registry
        self.rollout_role = rollout_role
        self.events = events
        self.counters = counters
        self._free = free
        self._output = output
        self.guard = guard
        self._set_max_staleness = set_max_staleness
        self.failure_budget = failure_budget
        #: one line per committed step
        self.step_log: list[dict[str, Any]] = []
        #: called with each step's line (the launcher prints them, the monitor streams them)
        self.on_step: list[Callable[[dict[str, Any]], None]] = []
        #: other stages' figures since the last step (reward failures, critic steps)
        self.stage_metrics = StageMetrics()
        #: when the last step committed (perf_counter; 0.0 before a run)
        self.last_step_at = 0.0
        # Unbounded, but bounded in practice: broadcasts follow steps.
        self._queue: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()

    def commit(self, tasks: Sequence[Task], report: dict[str, Any]) -> dict[str, Any]:
        """Commit a step (`StepLedger.commit`, which raises `LostTrainerState`) and publish the
        version it made; returns the step's line. Raises `TooManyFailures` once the step is
        committed and its line out, when it spent the failure budget."""
        commit = self.ledger.commit(tasks, report)
        self._free(commit.freed)
        weights = report.get("weights")
        if weights:
            self.weights.publish(commit.version, weights)
        if weights is not None:  # empty: served in place (colocated), announced all the same
            self._queue.put_nowait((m.TOPIC_VERSION, {"version": commit.version,
                                                      "weights": weights}))
        self.release_unserved()
        now = time.perf_counter()
        stages, failures = self.stage_metrics.take(tasks, self.ledger.index.has_row)
        entry = step_entry(
            commit, served_versions=sorted(self._served()),
            wall_s=now - self.counters.started_at,
            since_last_s=(now - self.last_step_at) if self.last_step_at else None,
            stages=stages, response_tokens=sum(t.tokens for t in tasks),
            max_staleness=self.ledger.admission.gate.max_staleness)
        self.counters.count_failures(failures)
        self.last_step_at = now
        if self._output is not None:
            try:  # completes the trainer's checkpoint of this version, when it wrote one
                save_beside_checkpoint(self._output, self.ledger.run_state())
            except OSError as exc:  # the step is committed; only resuming from here is lost
                log.error("run state not saved", version=commit.version, error=repr(exc))
        if self.guard is not None:
            self._judge(entry)
        self.step_log.append(entry)
        log.debug("step", **entry)
        self.events.emit("step", **entry)
        if weights is not None:
            self.events.emit("version", version=commit.version)
        for callback in self.on_step:
            callback(entry)
        if self.failure_budget is not None:
            self.failure_budget.observe(commit.version, commit.samples, failures)
        return entry

    def _judge(self, entry: dict[str, Any]) -> None:
        """The guard's verdict on a step's line, carried out and said."""
        guard = self.guard
        assert guard is not None
        gate = self.ledger.admission.gate
        actions = guard.observe(entry["step"], self.ledger.version, entry,
                                max_staleness=gate.max_staleness,
                                next_step=self.ledger.next_unplaced_step)
        for a in actions:
            self._act(a, guard)
        if actions:
            entry["stability"] = "; ".join(a.describe() for a in actions)

    def _act(self, a: GuardAction, guard: StabilityGuard) -> None:
        detail: dict[str, Any] = {"step": a.step, "signal": a.signal, "action": a.action,
                                  "value": a.value, "threshold": a.threshold,
                                  "lr_scale": guard.lr_scale}
        if a.action == "tighten_staleness":
            detail["max_staleness"] = max(0, self.ledger.admission.gate.max_staleness - 1)
            self._set_max_staleness(detail["max_staleness"])
        if a.action == "rollback":
            detail["rollback_to"] = guard.kept_version  # None: nothing kept, the rate only
        log.warning(a.describe(), **detail)
        self.events.emit("stability", **detail)

    def release_unserved(self) -> None:
        """Free the weight versions no rollout worker serves or may still load.

        Every ``served`` report calls this. It looks at no worker: the registry counts the
        workers serving each version, so a step's reports from W workers cost W looks at a few
        versions instead of W² looks at workers (a million at 1,024 workers).
        """
        current = self.ledger.version
        oldest = self.weights.oldest()
        if oldest is None or oldest >= current:
            return
        served = self._served()
        if any(v <= oldest for v in served):
            return
        self._free(self.weights.release(served, current))

    def _served(self) -> set[int]:
        return self.registry.versions(self.rollout_role)

    def announce(self, topic: str, payload: dict[str, Any]) -> None:
        """Broadcast something other than a version (a node lost), in order with them."""
        self._queue.put_nowait((topic, payload))

    async def broadcast(self, pub: Publisher) -> None:
        """Send the queued broadcasts, in order (an owned task runs this)."""
        while True:
            topic, payload = await self._queue.get()
            await pub.publish(topic, payload)
