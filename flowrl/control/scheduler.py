"""The scheduler: what to hand to whom, now.

One `dispatch` pass walks the stages in graph order and hands out whatever is possible:

- the **source** stage (rollout) first hands out groups given back by failed tasks, then the
  tasks formed ahead of their workers (`admit_ahead`: a step's groups are admitted and their
  tasks formed one step before any worker may generate them), then admits new prompt groups
  (`Admission`) ``micro_batch`` groups a task, each to the least-loaded worker whose policy
  version may generate for the groups' step. When node agents dispatch rollout too
  (`flowrl.control.node_leases`), every rollout task is formed instead, given-back groups
  again, and the leases' pass splits them over the nodes and this one;
- the **train** stage requests micro-batches of the current step (`StepLedger`) with the
  staleness gate's ``min_version``; rows too stale to train are evicted and their groups
  dropped and admitted again; data-parallel ranks get streamed micro-batches by fewest tokens
  and one closing micro-batch each (`flowrl.dp`);
- every **other** stage takes ready rows to the least-loaded worker of its role.

Before a stage's own work, its evaluation jobs (`flowrl.control.evaluation`: held-out prompts
to answer, answers to score) go to the least-loaded workers of its role that may run them.

Pure: no sockets and no clock. What it decides leaves through two callbacks, ``send`` (an
assignment for a worker) and ``free`` (handles to release).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from flowrl.control.admission import Admission
from flowrl.control.assignments import Assignment, Assignments
from flowrl.control.evaluation import EVAL_STAGE, SCORE_STAGE, Evaluation
from flowrl.control.ledger import StepLedger
from flowrl.dp import RankShares
from flowrl.graph import StageGraph, StageSpec
from flowrl.index import Index, Task
from flowrl.registry import Registry, WorkerInfo

__all__ = ["ADMIT_AHEAD_CHUNK", "Scheduler", "find_source_stage"]

#: groups the controller admits (`Scheduler.admit_ahead`, and a pass for its idle workers)
#: before it lets the event loop handle what waits: ~10 µs of CPU a group, so a chunk holds a
#: report back ~0.2 ms at most
ADMIT_AHEAD_CHUNK = 16


def find_source_stage(graph: StageGraph) -> StageSpec:
    """The one stage that reads only the data source's fields (rollout)."""
    src = set(graph.source_fields)
    firsts = [s for s in graph.order if set(s.needs) <= src]
    if len(firsts) != 1:
        raise ValueError(
            f"exactly one stage must read only the data source's fields {sorted(src)}; "
            f"found {[s.name for s in firsts]}")
    return firsts[0]


class Scheduler:
    def __init__(self, graph: StageGraph, index: Index, registry: Registry,
                 admission: Admission, ledger: StepLedger, assignments: Assignments, *,
                 group_size: int, send: Callable[[WorkerInfo, Assignment], None],
                 free: Callable[[list[Any]], None],
                 evaluation: Evaluation | None = None) -> None:
        self.graph = graph
        self.index = index
        self.registry = registry
        self.admission = admission
        self.ledger = ledger
        self.assignments = assignments
        self.group_size = group_size
        self.source = find_source_stage(graph)
        self.train = next((s for s in graph.order if s.consumes_version_bound), None)
        self._send = send
        self._free = free
        self.evaluation = evaluation
        #: groups dropped because their rows were too stale to train
        self.stale_dropped = 0
        #: the last pass left a group that `admit_ahead` may admit: the gate and the store
        #: would admit it but no worker may generate it yet, or it is one step past the gate
        self.may_admit_ahead = False
        #: groups `admit_ahead` admitted
        self.admitted_ahead = 0
        #: rollout tasks `admit_ahead` formed, not handed out yet (in flight in the index with
        #: no worker), oldest first, each with the oldest version that may generate it
        self._formed: collections.deque[tuple[Task, int]] = collections.deque()
        #: a group was dropped since the source stage's last turn (its prompt waits to be
        #: admitted again)
        self._requeued = False
        #: node agents dispatch rollout tasks too (`flowrl.control.node_leases`): every rollout
        #: task is formed (`_formed`) and split over the nodes, and ``recall(version)`` takes
        #: back the leased ones no worker may run before a newer version than ``version``
        #: (their ids, to fail back)
        self.recall: Callable[[int], list[int]] | None = None

    def formed_for(self, version: int) -> bool:
        """Whether a task formed ahead waits that a worker serving ``version`` may take."""
        return bool(self._formed) and self._formed[0][1] <= version

    def formed_waiting(self) -> int:
        """Tasks formed ahead that wait for a worker."""
        return len(self._formed)

    def take_formed(self, keep: int, n: int) -> list[tuple[Task, int]]:
        """Up to ``n`` tasks formed ahead, each with its need, after the first ``keep`` (those
        stay for this node's workers), oldest first: for node agents' leases."""
        formed = self._formed
        kept = [formed.popleft() for _ in range(min(keep, len(formed)))]
        out = [formed.popleft() for _ in range(min(n, len(formed)))]
        formed.extendleft(reversed(kept))
        return out

    def is_train(self, task: Task) -> bool:
        return self.train is not None and task.stage == self.train.name

    def dispatch(self, *, steps_target: int, now: float) -> None:
        """Hand out everything possible (``steps_target``: admit and train no step past it)."""
        for stage in self.graph.order:
            if self.evaluation is not None:
                self._dispatch_eval(stage, now)
            if stage is self.source:
                self._dispatch_source(stage, steps_target, now)
            elif stage is self.train:
                if self.ledger.ranks is not None:
                    self._dispatch_ranks(stage, self.ledger.ranks, steps_target, now)
                else:
                    self._dispatch_train(stage, steps_target, now)
            else:
                self._dispatch_rows(stage, now)
        if self._requeued:  # the train stage dropped stale groups: their prompts go now, not
            self._dispatch_source(self.source, steps_target, now)  # at the next report

    def fail_task(self, task_id: int) -> None:
        """Give the task's rows back to its stage's queue (an evaluation task's job to its
        evaluation)."""
        if self.evaluation is not None and self.evaluation.owns(task_id):
            freed = self.evaluation.failed(task_id)
        else:
            freed = self.index.fail(task_id)
        if freed:
            self._free(freed)

    # ---- stages ----------------------------------------------------------------------------

    def _dispatch_eval(self, stage: StageSpec, now: float) -> None:
        ev = self.evaluation
        assert ev is not None
        kind = (EVAL_STAGE if stage is ev.generate else SCORE_STAGE if stage is ev.score
                else None)
        if kind is None:
            return
        while (job := ev.next_job(kind)) is not None:
            w = self.registry.least_loaded(stage.role, ev.min_version(job))
            if w is None:
                return
            task, params = ev.start(job, w.worker_id)
            self._assign(w, task, params, now)

    def _dispatch_rows(self, stage: StageSpec, now: float) -> None:
        # Most passes find nothing ready: asking the index first spares the worker search.
        while (self.index.ready_units(stage.name)
               and (w := self.registry.least_loaded(stage.role)) is not None):
            task = self.index.request(stage.name, stage.micro_batch, worker=w.worker_id)
            if task is None:
                return
            self._assign(w, task, {}, now)

    def _dispatch_source(self, stage: StageSpec, steps_target: int, now: float) -> None:
        """Several groups per task let an engine sample them in one batched call; a task's
        groups are admitted together, so each must be one the worker's version may generate."""
        self._requeued = False
        adm = self.admission
        version = self.ledger.version
        if self.recall is not None:
            # Node agents dispatch rollout tasks too: every task is formed (`admit_ahead`), and
            # `NodeLeases` splits them over the nodes and this one (`dispatch_formed`).
            self._form_given_back(stage)
            self.may_admit_ahead = (not steps_target or version < steps_target) and (
                (adm.open(version) and adm.store_admits(version, now))
                or self._looks_ahead(version, steps_target))
            return
        self._dispatch_admitted(stage, now)
        self.dispatch_formed(now)
        k = stage.micro_batch
        self.may_admit_ahead = False
        if steps_target and version >= steps_target:
            return
        chunk = 0
        while adm.open(version) and adm.store_admits(version, now):
            if chunk >= ADMIT_AHEAD_CHUNK:
                # A run's start finds a step's worth of idle workers: admitting it all in one
                # pass would hold every report back for the whole pass (a step of 256 groups:
                # ~3 ms of CPU); the rest is admitted a chunk at a time between them.
                self.may_admit_ahead = True
                return
            w = self.registry.least_loaded(stage.role,
                                           adm.min_generation_version(adm.next_step))
            if w is None:
                self.may_admit_ahead = True
                return
            admitted = 0
            while admitted < k and (adm.open(version)
                                    and adm.gate.can_generate(w.version, adm.next_step)
                                    and adm.store_admits(version, now)):
                self._admit_group()
                admitted += 1
            task = self.index.request(stage.name, admitted, worker=w.worker_id)
            assert task is not None
            self._assign(w, task, {}, now)
            chunk += admitted
        self.may_admit_ahead = self._looks_ahead(version, steps_target)

    def _looks_ahead(self, version: int, steps_target: int) -> bool:
        """Whether the next group is one step past the gate, for a step the run trains, with
        room in the store: `admit_ahead` may admit it (no worker may generate it before the
        trainer's next version). Asks the store without counting a pause: the group is early."""
        adm = self.admission
        step = adm.next_step
        return (adm.gate.admits_step(step, version + 1)
                and (not steps_target or step < steps_target)
                and adm.store.room(adm.untrained(version)) is True)

    def _dispatch_admitted(self, stage: StageSpec, now: float) -> None:
        """Groups given back go first (by failed tasks, or by the tasks formed ahead when the
        staleness bound was lowered). Each task takes the queue's first groups that its
        worker's version may generate (those of the oldest steps)."""
        adm = self.admission
        gate = adm.gate
        while self.index.ready_units(stage.name):
            heads = self.index.queued_groups(stage.name, stage.micro_batch)
            w = self.registry.least_loaded(
                stage.role, adm.min_generation_version(adm.step_of(heads[0])))
            if w is None:
                return
            n = 1
            while n < len(heads) and gate.can_generate(w.version, adm.step_of(heads[n])):
                n += 1
            task = self.index.request(stage.name, n, worker=w.worker_id)
            assert task is not None
            self._assign(w, task, {}, now)

    def _form_given_back(self, stage: StageSpec) -> None:
        """The groups given back become tasks formed for the agents' leases and this node's
        workers, ahead of those formed ahead (theirs are the older steps). A task's need is the
        newest its groups' steps need."""
        adm = self.admission
        tasks: list[tuple[Task, int]] = []
        while self.index.ready_units(stage.name):
            task = self.index.form(stage.name, stage.micro_batch)
            assert task is not None
            tasks.append((task, max(adm.min_generation_version(adm.step_of(g))
                                    for g in task.groups)))
        self._formed.extendleft(reversed(tasks))

    def dispatch_formed(self, now: float, up_to: int | None = None) -> None:
        """Tasks formed ahead (`admit_ahead`) go to their workers here in the order formed (at
        most ``up_to``: this node's share when node agents take the others)."""
        formed = self._formed
        role = self.source.role
        n = len(formed) if up_to is None else min(up_to, len(formed))
        while n:
            task, need = formed[0]
            w = self.registry.least_loaded(role, need)
            if w is None:
                return
            formed.popleft()
            n -= 1
            self._assign(w, self.index.bind(task.id, w.worker_id), {}, now)

    def admit_ahead(self, *, steps_target: int, now: float, up_to: int) -> int:
        """Admit about ``up_to`` groups (whole tasks of them) that the staleness gate and the
        store allow now, with no worker yet that may generate them, and form their rollout
        tasks: the pass that finds the workers only hands the tasks out. Returns how many
        groups.

        A step's groups are admitted one step before the gate lets any worker generate them:
        while the trainer at version v trains, those of step v + max_staleness + 1, which need
        version v + 1 (`_looks_ahead`). The pass that sees the first worker load v + 1 then
        only hands their tasks out, and the step's admission is never in that burst (admitted
        when the step before commits, it lost the race to workers that load weights at once).
        Only the generation waits for the gate (rules 2 and 3 of `flowrl.staleness`); a
        group dropped meanwhile first gives the groups past the gate back (`drop_group`)."""
        adm = self.admission
        version = self.ledger.version
        if steps_target and version >= steps_target:
            return 0
        n = 0
        while n < up_to:
            got = 0
            step = adm.next_step  # one step a task, so each goes to the oldest version it may
            while (got < self.source.micro_batch and adm.next_step == step
                   and ((adm.open(version) and adm.store_admits(version, now))
                        or self._looks_ahead(version, steps_target))):
                self._admit_group()
                got += 1
            if not got:
                break
            task = self.index.form(self.source.name, got)
            assert task is not None  # given-back groups at the queue's head may come first
            step = max(adm.step_of(g) for g in task.groups)
            self._formed.append((task, adm.min_generation_version(step)))
            n += got
        self.admitted_ahead += n
        return n

    def withdraw_beyond_gate(self) -> int:
        """Give back the queued groups that the staleness gate does not admit now (admitted one
        step ahead, or its bound was lowered since): their prompts are admitted again, for the
        steps the gate allows now. Kept, they would wait for a policy version that the
        trainer cannot reach without the groups they hold back. Returns how many."""
        self._give_back_ahead()
        adm = self.admission
        name = self.source.name
        version = self.ledger.version
        beyond = [g for g in self.index.queued_groups(name, self.index.ready_units(name))
                  if not adm.gate.admits_step(adm.step_of(g), version)]
        for gid in reversed(beyond):  # newest first: the positions go back in their order
            self._drop(gid)
        return len(beyond)

    def recall_leased(self) -> int:
        """Take back the rollout tasks leased to node agents that no worker may run before the
        trainer's next version (`pause`: they would never drain); their groups wait in the
        queue, first. Returns how many tasks."""
        if self.recall is None:
            return 0
        ids = self.recall(self.ledger.version)
        self._fail_in_order(ids)
        return len(ids)

    def _give_back_ahead(self) -> None:
        """Every task formed ahead, and every leased one no worker may run yet, gives its groups
        back to the queue, in their order."""
        ids = [task.id for task, _ in self._formed]
        self._formed.clear()
        if self.recall is not None:
            ids += self.recall(self.ledger.version)
        self._fail_in_order(ids)

    def _fail_in_order(self, task_ids: list[int]) -> None:
        # Newest groups first: each goes back to the queue's front, so they end in order.
        tasks = sorted((self.index.task(tid) for tid in task_ids),
                       key=lambda t: min(t.groups), reverse=True)
        for task in tasks:
            self.fail_task(task.id)

    def _admit_group(self) -> None:
        pos = self.admission.take_position()
        self.admission.admit(self.index.add_group(self.group_size,
                                                  fields={"prompt": [pos] * self.group_size}))

    def _dispatch_train(self, stage: StageSpec, steps_target: int, now: float) -> None:
        ledger = self.ledger
        while ledger.train_step < steps_target:
            w = self.registry.least_loaded(stage.role)
            if w is None:
                return
            task = self._request_train(stage, ledger.want(stage.micro_batch), w.worker_id)
            if task is None:
                return
            step = ledger.train_step
            end = ledger.placed(len(task.groups))
            self._assign(w, task, ledger.params(step, end), now)

    def _dispatch_ranks(self, stage: StageSpec, ranks: RankShares[Task], steps_target: int,
                        now: float) -> None:
        """Streamed micro-batches go to the rank given the fewest tokens this step; the step's
        last groups go one to every rank, each ending that rank's step."""
        ledger = self.ledger
        slots = self.registry.tasks_per_slot
        while ledger.train_step < steps_target:
            workers = self.registry.of_role(stage.role)
            if len(workers) < ranks.ranks:
                return  # every rank takes part in every step
            w: WorkerInfo | None = None
            if not ranks.closing(ledger.groups_in_step):
                room = {r.worker_id: r for r in workers if len(r.tasks) < r.capacity * slots}
                chosen = ranks.choose(list(room))
                if chosen is None:
                    return
                w = room[chosen]
            task = self._request_train(stage, ledger.want(stage.micro_batch),
                                       None if w is None else w.worker_id)
            if task is None:
                return
            step = ledger.train_step
            passes = ranks.passes()
            ledger.placed(len(task.groups))
            if w is not None:
                ranks.add(w.worker_id, task.tokens)
                self._assign(w, task, ledger.params(step, False), now)
                continue
            placed = ranks.hold(task, task.tokens, [r.worker_id for r in workers])
            if placed is None:
                continue
            for worker_id, held in placed:
                info = self.registry.get(worker_id)
                assert info is not None  # listed above, in this same pass
                self._assign(info, held, {**ledger.params(step, True), "passes": passes}, now)

    def _request_train(self, stage: StageSpec, want: int, worker: str | None) -> Task | None:
        min_version = self.admission.gate.min_train_version(self.ledger.train_step)
        task = self.index.request(stage.name, want, min_version=min_version, worker=worker)
        self._drop_stale()
        return task

    def _drop_stale(self) -> None:
        for gid in self.index.take_stale():
            self.drop_group(gid)
            self.stale_dropped += 1

    def drop_group(self, gid: int) -> None:
        """Drop live group ``gid`` (stale, or its data lost with a node): its prompt is sampled
        again, and its memory freed (a row a task still holds, once that task ends).

        Its prompt is admitted again in the newest admitted step's slot (`Admission.dropped`).
        Groups admitted past the gate (`admit_ahead`) are given back first, so that slot is one
        the workers may generate now: the step the trainer is at may need that very group. A
        dropped group was generated (stale) or has data in a store (lost), so it is never one
        of those."""
        adm = self.admission
        if adm.admitted and not adm.gate.can_admit(adm.admitted - 1, self.ledger.version):
            self.withdraw_beyond_gate()
        self._drop(gid)

    def _drop(self, gid: int) -> None:
        self._requeued = True
        handles = self.index.drop_group(gid)
        self.admission.dropped(gid)
        if handles:
            self._free(handles)

    def _assign(self, w: WorkerInfo, task: Task, params: dict[str, Any], now: float) -> None:
        self.registry.assign(w, task.id, max(1, task.tokens))
        a = Assignment(task, w.worker_id, params, now)
        self.assignments.add(a)
        self._send(w, a)
