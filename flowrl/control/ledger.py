"""The step ledger: the policy version, and which train micro-batches make each step.

The trainer at version v takes step v, which publishes version v + 1. The train stage's
micro-batches are handed out for step `train_step` until it holds ``groups_per_step`` groups;
the last one carries ``step_end``. A trained micro-batch is not committed to the index when it is
reported, only when its whole step is: then its rows are consumed (exactly once), its groups'
dataset positions marked trained, and the version moves. A trainer that loses its accumulated
gradients (it died, or failed a micro-batch) aborts the step: every micro-batch of it is given
back and the step redone as a new ``attempt`` (a trainer that kept gradients of the failed one
drops them).

With data-parallel ranks (`flowrl.dp`) a step's micro-batches are shared among the ranks and the
step commits once every rank reported its end; ranks may train the next step meanwhile.

Pure: no sockets, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from flowrl.control.admission import Admission
from flowrl.dp import RankShares, merge_step_ends
from flowrl.graph import StageSpec
from flowrl.index import Index, Task
from flowrl.pipeline import PoolSpec
from flowrl.resume import RunState, TrainedPositions

__all__ = ["LostTrainerState", "StepCommit", "StepLedger", "rank_shares"]


def rank_shares(train: StageSpec | None, pool: PoolSpec | None,
                groups_per_step: int) -> RankShares[Task] | None:
    """How a step is shared among the train pool's data-parallel ranks (None: one trainer)."""
    if train is None or pool is None or pool.count <= 1:
        return None
    if pool.per_process != 1:
        raise ValueError("data-parallel trainer ranks need a process each "
                         f"(per_process=1), got per_process={pool.per_process}")
    return RankShares(pool.count, groups_per_step, train.micro_batch)


class LostTrainerState(RuntimeError):
    """A trainer published a version other than the next one: it lost its state."""


@dataclass
class StepCommit:
    """What one committed step did."""

    version: int
    report: dict[str, Any]
    samples: int = 0
    rewards: list[float] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    #: handles of retired rows, to free
    freed: list[Any] = field(default_factory=list)


class StepLedger:
    def __init__(self, index: Index, admission: Admission, *,
                 ranks: RankShares[Task] | None = None) -> None:
        self.index = index
        self.admission = admission
        self.groups_per_step = admission.gate.groups_per_step
        #: how a step is shared among data-parallel trainer ranks (None: one trainer)
        self.ranks = ranks
        self.version = 0
        #: the step the next train micro-batch belongs to
        self.train_step = 0
        self.groups_in_step = 0
        #: bumped whenever a step's micro-batches are given back
        self.attempt = 0
        self._done: list[Task] = []  # trained, not committed (one trainer)
        # step -> (its trained micro-batches, its ranks' step-end reports), until it commits
        self._rank_done: dict[int, tuple[list[Task], list[dict[str, Any]]]] = {}
        self.trained_positions = TrainedPositions()
        self.rows_trained = 0
        self.rows_trained_twice = 0
        self.samples_trained = 0
        #: the stability guard's orders for the train tasks of a step (none by default)
        self.orders: Callable[[int], dict[str, Any]] = lambda step: {}

    def resume(self, state: RunState) -> None:
        self.version = self.train_step = state.version
        self.trained_positions = TrainedPositions(state.trained_below, state.trained_above,
                                                  state.groups_trained)

    def run_state(self) -> RunState:
        """What `--resume` needs to continue from this version (see `flowrl.resume`)."""
        t = self.trained_positions
        return RunState(version=self.version, trained_below=t.below,
                        trained_above=sorted(t.above),
                        admitted_to=self.admission.next_position, groups_trained=t.count)

    # ---- handing out -----------------------------------------------------------------------

    def want(self, micro_batch: int) -> int:
        """Groups to request for the next train micro-batch of the current step."""
        if self.ranks is not None:
            return self.ranks.want(self.groups_in_step)
        return min(micro_batch, self.groups_per_step - self.groups_in_step)

    def placed(self, groups: int) -> bool:
        """A micro-batch of ``groups`` groups was handed out; True when it ends the step (the
        step in progress is then the next one)."""
        self.groups_in_step += groups
        if self.groups_in_step < self.groups_per_step:
            return False
        self.train_step += 1
        self.groups_in_step = 0
        return True

    def params(self, step: int, step_end: bool) -> dict[str, Any]:
        """What a train task tells its trainer: the step, whether it ends it, which attempt,
        the staleness in force (``tis_cap="auto"`` follows it) and the stability guard's
        orders for that step (`orders`)."""
        return {"step": step, "step_end": step_end, "attempt": self.attempt,
                "max_staleness": self.admission.gate.max_staleness, **self.orders(step)}

    @property
    def next_unplaced_step(self) -> int:
        """The first step none of whose train micro-batches was handed out yet."""
        return self.train_step + (1 if self.groups_in_step else 0)

    @property
    def pending(self) -> int:
        """Trained micro-batches waiting for their step to commit."""
        return len(self._done) + sum(len(t) for t, _ in self._rank_done.values())

    # ---- reports ---------------------------------------------------------------------------

    def trained(self, task: Task, params: dict[str, Any],
                report: dict[str, Any]) -> list[tuple[list[Task], dict[str, Any]]]:
        """A trainer trained ``task``; returns the steps now complete, in order, each with its
        micro-batches and the report to commit (one trainer: its step-end report; ranks: every
        rank's merged, `flowrl.dp.merge_step_ends`, which raises `StepDivergence`)."""
        if self.ranks is None:
            self._done.append(task)
            if not params.get("step_end"):
                return []
            step_tasks, self._done = self._done, []
            return [(step_tasks, report)]
        tasks, ends = self._rank_done.setdefault(int(params["step"]), ([], []))
        tasks.append(task)
        if params.get("step_end"):
            ends.append(report)
        ready = []
        step = self.version
        while (got := self._rank_done.get(step)) and len(got[1]) == self.ranks.ranks:
            del self._rank_done[step]
            ready.append((got[0], merge_step_ends(got[1])))
            step += 1
        return ready

    def commit(self, tasks: Sequence[Task], report: dict[str, Any]) -> StepCommit:
        """Consume the step's rows and move to the version the trainer published."""
        new_version = int(report["version"])
        if new_version != self.version + 1:
            raise LostTrainerState(
                f"trainer {report.get('worker_id')} published version {new_version} while the "
                f"controller is at version {self.version}: the trainer lost its state")
        out = StepCommit(new_version, report)
        gate = self.admission.gate
        for task in tasks:
            out.staleness.extend(self.version - (v or 0) for v in task.versions)
            gate.record_trained(task.versions, self.version)
            for gid in task.groups:
                pos = self.admission.trained(gid)
                # A group's dataset position trains once in a run (resumes included).
                if pos is None or not self.trained_positions.add(pos):
                    self.rows_trained_twice += task.row_groups.count(gid)
            self.rows_trained += len(task.rows)
            out.rewards.extend(float(r) for r in task.handles.get("reward", ()))
            out.samples += len(task.rows)
            out.freed.extend(self.index.complete(task.id))
        self.samples_trained += out.samples
        self.version = new_version
        return out

    def abort(self) -> list[Task]:
        """The trainer(s) lost the step's gradients: start it again as a new attempt. Returns
        the micro-batches trained or held but not committed (to give back to the index)."""
        back = list(self._done)
        self._done.clear()
        if self.ranks is not None:  # held for the closing round, or done on some ranks
            back += self.ranks.new_step()
            back += [t for tasks, _ in self._rank_done.values() for t in tasks]
            self._rank_done.clear()
        self.train_step = self.version
        self.groups_in_step = 0
        self.attempt += 1
        return back
