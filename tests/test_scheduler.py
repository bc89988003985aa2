"""The scheduler's rollout admission on its own, with the real index, registry, gate and
ledger: groups admitted ahead of the workers that may generate them wait in tasks formed
ahead, one step a task, in order; groups given back go first, each task taking only the
groups its worker's version may generate."""

from __future__ import annotations

from dataclasses import dataclass, field

from flowrl.backpressure import StoreBackpressure
from flowrl.control.admission import Admission
from flowrl.control.assignments import Assignment, Assignments
from flowrl.control.ledger import StepLedger
from flowrl.control.scheduler import ADMIT_AHEAD_CHUNK, Scheduler
from flowrl.graph import StageGraph, StageSpec
from flowrl.index import Index
from flowrl.registry import Registry, WorkerInfo
from flowrl.staleness import StalenessGate

GROUP = 2


@dataclass
class Run:
    scheduler: Scheduler
    registry: Registry
    ledger: StepLedger
    admission: Admission
    sent: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    #: the dataset positions each task's rows sample, in the order sent
    prompts: list[list[int]] = field(default_factory=list)

    def worker(self, version: int) -> WorkerInfo:
        return self.registry.register(name="w", role="rollout", node="node0", pid=1,
                                      capacity=1, version=version, now=0.0)

    def dispatch(self, steps_target: int = 0) -> list[tuple[str, tuple[int, ...]]]:
        """The (worker, groups) of the rollout tasks one pass hands out."""
        before = len(self.sent)
        self.scheduler.dispatch(steps_target=steps_target, now=0.0)
        return self.sent[before:]

    def finish(self, *workers: WorkerInfo) -> None:
        """Each worker's tasks are done (as far as its load goes)."""
        for w in workers:
            for task_id in list(w.tasks):
                self.registry.finish(w, task_id, ok=True)

    def steps(self, groups: tuple[int, ...]) -> list[int]:
        return [self.admission.step_of(g) for g in groups]


def run(*, staleness: int, groups_per_step: int, micro_groups: int) -> Run:
    graph = StageGraph(
        [StageSpec("rollout", ("prompt",), ("response",), micro_batch=micro_groups,
                   group_level=True),
         StageSpec("train", ("response",), group_level=True, consumes_version_bound=True)],
        source_fields=("prompt",))
    index = Index(graph)
    registry = Registry(60.0, tasks_per_slot=1)
    admission = Admission(StalenessGate(staleness, groups_per_step),
                          StoreBackpressure(high_water=0.9, groups_per_step=groups_per_step))
    # a store measured with room to spare, so that only the gate holds admission back
    admission.store.observe({"node": "node0", "capacity_bytes": 1 << 30, "used_bytes": 1024},
                            landed_groups=1)
    ledger = StepLedger(index, admission)
    sent: list[tuple[str, tuple[int, ...]]] = []
    prompts: list[list[int]] = []

    def send(w: WorkerInfo, a: Assignment) -> None:
        sent.append((w.worker_id, a.task.groups))
        prompts.append(a.task.handles["prompt"])

    scheduler = Scheduler(graph, index, registry, admission, ledger, Assignments(),
                          group_size=GROUP, send=send, free=lambda handles: None)
    return Run(scheduler, registry, ledger, admission, sent, prompts)


def test_tasks_formed_ahead_wait_until_a_worker_may_generate_them() -> None:
    r = run(staleness=0, groups_per_step=4, micro_groups=2)
    a, b = r.worker(version=0), r.worker(version=0)
    assert r.dispatch() == [(a.worker_id, (0, 1)), (b.worker_id, (2, 3))]
    assert r.scheduler.may_admit_ahead  # step 1: one step past the gate, for version 1 only
    # whole tasks: 3 groups asked, 4 admitted (2 tasks of 2); step 2 is two steps past the gate
    assert r.scheduler.admit_ahead(steps_target=0, now=0.0, up_to=3) == 4
    assert r.scheduler.admit_ahead(steps_target=0, now=0.0, up_to=3) == 0
    assert (r.admission.admitted, r.scheduler.admitted_ahead) == (8, 4)
    r.finish(a, b)
    assert r.dispatch() == []  # nobody may generate step 1 before version 1
    assert not r.scheduler.may_admit_ahead
    r.ledger.version = 1  # step 0 committed
    assert r.dispatch() == []  # nobody serves version 1 yet
    assert r.scheduler.may_admit_ahead  # step 2, now one step past the gate
    a.version = 1
    assert r.dispatch() == [(a.worker_id, (4, 5))]
    b.version = 1
    assert r.dispatch() == [(b.worker_id, (6, 7))]
    assert r.admission.admitted == 8


def test_groups_given_back_go_first_and_keep_their_order() -> None:
    r = run(staleness=1, groups_per_step=2, micro_groups=4)
    w = r.worker(version=0)
    assert r.dispatch() == [(w.worker_id, (0, 1, 2, 3))]  # steps 0 and 1
    r.ledger.version = 1
    assert r.dispatch() == []
    # step 2's (w is busy) and step 3's (one step past the gate), one step a task
    assert r.scheduler.admit_ahead(steps_target=0, now=0.0, up_to=16) == 4
    (task_id,) = w.tasks
    r.scheduler.fail_task(task_id)
    r.registry.finish(w, task_id, ok=False)
    newer = r.worker(version=1)
    # the newest idle worker takes the oldest groups; w may generate none of step 2's
    assert r.dispatch() == [(newer.worker_id, (0, 1, 2, 3))]
    r.finish(newer)
    assert r.dispatch() == [(newer.worker_id, (4, 5))]  # not step 3's: it needs version 2
    r.finish(newer)
    assert r.dispatch() == []
    assert r.admission.admitted == 8


def test_a_worker_takes_only_the_groups_its_version_may_generate() -> None:
    r = run(staleness=1, groups_per_step=2, micro_groups=3)
    w = r.worker(version=0)
    assert r.dispatch() == [(w.worker_id, (0, 1, 2))]  # steps 0, 0, 1
    assert r.scheduler.may_admit_ahead  # step 1's last group: w is busy
    r.ledger.version = 1
    assert r.scheduler.admit_ahead(steps_target=0, now=0.0, up_to=16) == 5  # steps 1, 2, 2, 3, 3
    r.finish(w)
    assert r.dispatch() == [(w.worker_id, (3,))]  # not step 2's: version 0 is too old
    r.finish(w)
    assert r.dispatch() == []
    newer = r.worker(version=1)
    assert r.dispatch() == [(newer.worker_id, (4, 5))]
    r.finish(newer)
    assert r.dispatch() == []  # step 3's need version 2


def test_nothing_is_admitted_ahead_past_the_steps_target() -> None:
    r = run(staleness=0, groups_per_step=4, micro_groups=2)
    a, b = r.worker(version=0), r.worker(version=0)
    assert len(r.dispatch(steps_target=1)) == 2
    r.finish(a, b)
    r.ledger.version = 1
    assert r.dispatch(steps_target=1) == []
    assert not r.scheduler.may_admit_ahead
    assert r.scheduler.admit_ahead(steps_target=1, now=0.0, up_to=16) == 0
    assert r.scheduler.admit_ahead(steps_target=2, now=0.0, up_to=16) == 4


def test_groups_admitted_ahead_past_a_lowered_bound_are_admitted_again_within_it() -> None:
    r = run(staleness=1, groups_per_step=2, micro_groups=2)
    w = r.worker(version=0)
    assert r.dispatch() == [(w.worker_id, (0, 1))]  # step 0
    assert r.scheduler.admit_ahead(steps_target=0, now=0.0, up_to=16) == 4  # steps 1 and 2
    r.admission.gate.set_max_staleness(0)  # step 1 needs version 1 now, which needs step 0
    assert r.scheduler.withdraw_beyond_gate() == 4
    assert r.scheduler.withdraw_beyond_gate() == 0
    assert r.admission.admitted == 2
    assert r.scheduler.admit_ahead(steps_target=0, now=0.0, up_to=16) == 2  # step 1 again
    r.finish(w)
    r.ledger.version = 1
    w.version = 1
    assert r.dispatch() == [(w.worker_id, (6, 7))]
    assert r.prompts == [[0, 0, 1, 1], [2, 2, 3, 3]]  # the withdrawn positions, in order


def test_a_group_dropped_while_the_next_step_is_admitted_is_replaced_in_the_current_one() -> None:
    """A dropped group's prompt takes the newest admitted step's slot: with the next step
    admitted ahead that would be a step no worker may generate before the trainer commits the
    current one, which needs that very group. The groups past the gate go back first."""
    r = run(staleness=0, groups_per_step=2, micro_groups=2)
    w = r.worker(version=0)
    assert r.dispatch() == [(w.worker_id, (0, 1))]  # step 0
    assert r.scheduler.admit_ahead(steps_target=0, now=0.0, up_to=16) == 2  # step 1
    r.scheduler.drop_group(0)  # say, its data was lost with a node
    assert r.admission.admitted == 1
    assert r.steps(tuple(sorted(r.admission._step))) == [0]
    (task_id,) = w.tasks
    r.scheduler.fail_task(task_id)  # the task that held it ends
    r.registry.finish(w, task_id, ok=False)
    assert r.dispatch() == [(w.worker_id, (1,))]  # given back
    r.finish(w)
    # position 0 again, for step 0, which version 0 may generate
    assert r.dispatch() == [(w.worker_id, (4,))]
    assert r.steps((4,)) == [0]
    assert r.prompts[-1] == [0, 0]


def test_no_group_is_admitted_ahead_past_the_gate_without_room_in_the_store() -> None:
    r = run(staleness=0, groups_per_step=2, micro_groups=2)
    r.admission.store.observe({"node": "node0", "capacity_bytes": 1 << 30,
                               "used_bytes": 1 << 30}, landed_groups=1)
    w = r.worker(version=0)
    assert r.dispatch() == [(w.worker_id, (0, 1))]  # the next step's: always admitted
    assert not r.scheduler.may_admit_ahead
    assert r.scheduler.admit_ahead(steps_target=0, now=0.0, up_to=16) == 0
    assert r.admission.store.pauses == 0  # an early group waiting is not a pause


def test_a_stale_group_dropped_by_the_train_stage_is_replaced_in_the_same_pass() -> None:
    """The train stage comes after the source in a pass: a group it drops as stale has its
    prompt admitted again before the pass ends, not at the next report (there may be none:
    the rollout workers idle, the trainer waiting for that very group)."""
    r = run(staleness=0, groups_per_step=1, micro_groups=1)
    a = r.worker(version=0)
    assert r.dispatch(steps_target=4) == [(a.worker_id, (0,))]  # step 0
    (task_id,) = a.tasks
    r.scheduler.index.complete(task_id, {"response": [7, 7]}, version=0)
    r.finish(a)
    # the trainer moves on without it (as if its step had been trained by others meanwhile)
    r.ledger.version = r.ledger.train_step = 1
    a.version = 1
    b = r.worker(version=1)
    r.registry.register(name="t", role="train", node="node0", pid=2, capacity=1, version=1,
                        now=0.0)
    # one pass: step 1's group goes out; the train stage drops group 0 as stale (version
    # 0 < 1), and its prompt is admitted again, in the gate's step, which b may generate
    sent = r.dispatch(steps_target=4)
    assert r.scheduler.stale_dropped == 1
    assert sent == [(a.worker_id, (1,)), (b.worker_id, (2,))]
    assert r.prompts[-2:] == [[1, 1], [0, 0]]


def test_a_pass_admits_at_most_a_chunk_and_the_rest_follows_in_chunks() -> None:
    """A run's start finds a step's worth of idle workers: one pass admits a chunk of groups
    (whole tasks) and leaves the rest to `admit_ahead`, whose tasks the next passes hand out;
    every group of the step is admitted once, to a worker of its own."""
    r = run(staleness=0, groups_per_step=40, micro_groups=4)
    workers = [r.worker(version=0) for _ in range(10)]
    first = r.dispatch()
    assert sum(len(groups) for _, groups in first) == ADMIT_AHEAD_CHUNK
    assert r.scheduler.may_admit_ahead
    sent = list(first)
    while r.scheduler.admit_ahead(steps_target=0, now=0.0, up_to=ADMIT_AHEAD_CHUNK):
        sent += r.dispatch()
    sent += r.dispatch()
    assert sorted(g for _, groups in sent for g in groups) == list(range(40))
    assert sorted(w for w, _ in sent) == sorted(w.worker_id for w in workers)
    # and the next step ahead, formed for the version that may generate it
    assert (r.admission.admitted, r.scheduler.formed_waiting()) == (80, 10)
