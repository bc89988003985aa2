"""The run's trace, kept as the controller sees it (`flowrl.run_trace` says the format).

Fed from what the controller handles anyway: a task's report (its worker, rows, the response
lengths it carries), a step's commit and a worker's ``served``, so recording asks nothing new of
the workers. A worker may hold a task in its queue while it runs the one before (prefetch), so a
task's time is counted from when the worker took it or finished its previous task, whichever is
later. The newest ``keep`` records are kept (bounded memory on a long run). The header also says
how much CPU the controller's process took over the run, per trained sample (the planner counts
it with the workers' when it judges a plan's CPU contention).

Pure: no sockets; callers pass ``now`` (wall-clock seconds) and ``cpu`` (the process's CPU
seconds, `time.process_time`).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from flowrl.run_trace import StepRecord, SyncRecord, TaskRecord, TraceRecord, header

__all__ = ["TraceRecorder"]


class _Worker(Protocol):
    @property
    def worker_id(self) -> str: ...


class TraceRecorder:
    def __init__(self, *, stage_roles: Mapping[str, str], pools: Mapping[str, int],
                 max_staleness: int, groups_per_step: int, group_size: int,
                 rollout_role: str, now: float, cpu: float, keep: int = 200_000) -> None:
        self.stage_roles = dict(stage_roles)
        self.pools = dict(pools)
        self.max_staleness = max_staleness
        self.groups_per_step = groups_per_step
        self.group_size = group_size
        self.rollout_role = rollout_role
        #: the recipe's fields as given (set by whoever started the run from a recipe)
        self.recipe: dict[str, Any] | None = None
        self.t0 = now
        self.cpu0 = cpu
        #: samples trained while recording (every step's, kept records or not)
        self.samples = 0
        self.records: collections.deque[TraceRecord] = (
            collections.deque(maxlen=keep))
        self._last_end: dict[str, float] = {}
        self._published: dict[int, float] = {}

    def task(self, worker: str, stage: str, rows: int, started_at: float,
             lengths: list[int], step_end: bool, now: float) -> None:
        """A task reported done; ``started_at``: when its worker took it (0.0: unknown)."""
        role = self.stage_roles.get(stage, stage)
        begun = max(started_at or now, self._last_end.get(worker, 0.0))
        self._last_end[worker] = now
        self.records.append(TaskRecord(
            stage, role, worker, rows, now - self.t0, max(0.0, now - begun),
            tuple(lengths) if role == self.rollout_role else (), step_end))

    def step(self, entry: Mapping[str, Any], now: float) -> None:
        """A step's line (an ``on_step`` callback): its version is published now."""
        version = int(entry["step"])
        self._published[version] = now
        # Versions every worker has long loaded are no longer needed to time a sync.
        for v in [v for v in self._published if v < version - 8]:
            del self._published[v]
        samples = int(entry.get("samples", 0))
        self.samples += samples
        self.records.append(StepRecord(version, now - self.t0, samples))

    def served(self, served: Iterable[tuple[_Worker, int]], now: float) -> None:
        """Each ``(worker, version)``: the worker loaded the version (a node's gathered
        ``served``, one ``now`` for all); it could start once the version was published and
        its last task was done."""
        published_at = self._published.get
        last_end = self._last_end.get
        append = self.records.append
        t = now - self.t0
        for worker, version in served:
            published = published_at(version)
            if published is None:  # the start's version, or one published before recording
                continue
            wid = worker.worker_id
            begun = max(published, last_end(wid, 0.0))
            append(SyncRecord(wid, version, t, max(0.0, now - begun)))

    def header(self, *, now: float, cpu: float) -> dict[str, Any]:
        controller = {"cpu_s": round(max(0.0, cpu - self.cpu0), 6),
                      "wall_s": round(max(0.0, now - self.t0), 6), "samples": self.samples}
        return header(recipe=self.recipe, pools=self.pools, max_staleness=self.max_staleness,
                      groups_per_step=self.groups_per_step, group_size=self.group_size,
                      controller=controller)
