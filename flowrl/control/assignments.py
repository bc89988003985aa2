"""Tasks handed to workers and not yet reported: what each was asked to do, and since when.

The index knows which rows a task holds and the registry how loaded each worker is; this table
adds what only the controller's dispatch decided: the task's parameters (a train task's step,
whether it ends it, which attempt) and its timestamps (queued, started by the worker).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from flowrl import messages as m
from flowrl.index import Task

__all__ = ["Assignment", "Assignments"]


@dataclass(slots=True)
class Assignment:
    task: Task
    worker: str
    params: dict[str, Any]
    #: when it was queued for the worker (controller clock, perf_counter)
    ready_at: float
    #: when the worker took it (wall clock; 0.0 while it waits in the worker's queue)
    started_at: float = 0.0

    def message(self) -> m.TaskMsg:
        """The task as its worker receives it. Its ``inputs`` are the task's own handles, not
        a copy: a message is only ever packed for the wire, and a task's handles never change."""
        t = self.task
        return {"task_id": t.id, "stage": t.stage, "rows": list(t.rows),
                "groups": list(t.groups), "row_groups": list(t.row_groups),
                "inputs": t.handles, "params": self.params}


class Assignments:
    def __init__(self) -> None:
        self._by_id: dict[int, Assignment] = {}

    def add(self, a: Assignment) -> None:
        self._by_id[a.task.id] = a

    def get(self, task_id: int) -> Assignment | None:
        return self._by_id.get(task_id)

    def pop(self, task_id: int) -> Assignment | None:
        return self._by_id.pop(task_id, None)

    def of_stage(self, stage: str) -> list[int]:
        """Ids of the tasks of ``stage`` in flight."""
        return [t for t, a in self._by_id.items() if a.task.stage == stage]

    def started(self) -> int:
        """Tasks a worker has taken (not merely queued for it)."""
        return sum(1 for a in self._by_id.values() if a.started_at)

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Assignment]:
        return iter(list(self._by_id.values()))
