"""The trace-driven planner: the trace file format, its recorder, the costs drawn from it, and
one replay checked against a run (simulated workers: real controller, processes, transport)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from flowrl import plan as planner
from flowrl.contention import Busy
from flowrl.control.trace_recorder import TraceRecorder
from flowrl.events import Span
from flowrl.recipe import (
    AlgorithmConfig,
    PlacementConfig,
    Recipe,
    RolloutConfig,
    SimConfig,
    TrainerConfig,
)
from flowrl.run import run_recipe
from flowrl.run_trace import (
    RunTrace,
    StepRecord,
    SyncRecord,
    TaskRecord,
    TraceError,
    TraceRecord,
    header,
    read_trace,
    write_trace,
)
from flowrl.trace_costs import RoleCost, TraceCosts


def small_trace() -> tuple[dict[str, object], list[TraceRecord]]:
    head = header(recipe={"steps": 3}, pools={"rollout": 1, "train": 1}, max_staleness=1,
                  groups_per_step=2, group_size=4, cpus=2)
    return head, [TaskRecord("rollout", "rollout", "rollout-0", 4, 0.5, 0.25, (3, 1, 4, 1)),
                  TaskRecord("train", "train", "train-1", 8, 0.9, 0.125, (), True),
                  SyncRecord("rollout-0", 1, 1.0, 0.01), StepRecord(1, 0.9, 8)]


def test_a_trace_reads_back_what_was_written(tmp_path: Path) -> None:
    head, records = small_trace()
    path = write_trace(tmp_path / "t.jsonl", head, records)
    first = json.loads(path.read_text().splitlines()[0])
    assert (first["format"], first["version"]) == ("flowrl-trace", 1)
    trace = read_trace(path)
    assert trace.header == head
    assert trace.tasks == [r for r in records if isinstance(r, TaskRecord)]
    assert trace.syncs == [records[2]]
    assert trace.steps == [records[3]]


@pytest.mark.parametrize(("first", "rest", "said"), [
    ("", "", "empty file, not a flowrl trace"),
    ('{"traceEvents": []}', "", "not a flowrl trace"),
    ('{"format": "flowrl-trace", "version": 2}', "", "trace format version 2 is not supported "
                                                      "(this flowrl reads version 1)"),
    ("HEADER", '{"k": "task", "stage": "rollout"}', "line 2: malformed record"),
    ("HEADER", '{"k": "task", "stage": "g", "role": "r", "worker": "w", "rows": 2, "t": 1, '
               '"s": -1}', "line 2: malformed record ('s' must be a finite non-negative"),
    ("HEADER", '{"k": "task", "stage": "g", "role": "r", "worker": "w", "rows": 2, "t": 1, '
               '"s": 1, "len": [1]}', "line 2: malformed record (1 lengths for 2 rows)"),
    ("HEADER", '{"k": "pickle"}', "unknown record kind 'pickle'"),
    (json.dumps({**small_trace()[0], "controller": {"cpu_s": -1, "wall_s": 2, "samples": 8}}),
     "", "line 1: 'controller' must map 'cpu_s', 'wall_s' and 'samples' to non-negative"),
    ("HEADER", "{not json", "line 2: not JSON"),
])
def test_a_malformed_trace_is_refused_naming_what_and_where(
        tmp_path: Path, first: str, rest: str, said: str) -> None:
    head, _ = small_trace()
    path = tmp_path / "bad.jsonl"
    path.write_text(first.replace("HEADER", json.dumps(head)) + "\n" + rest)
    with pytest.raises(TraceError) as err:
        read_trace(path)
    assert said in str(err.value)
    assert str(path) in str(err.value)


def test_the_planner_refuses_a_malformed_trace_with_its_reason(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "old.jsonl"
    path.write_text('{"format": "flowrl-trace", "version": 0}\n')
    assert planner.main([str(path), "--set", "max_staleness=0,1"]) == planner.EXIT_INPUT
    assert "trace format version 0 is not supported" in capsys.readouterr().err


def test_the_recorder_times_a_task_from_when_its_worker_could_start_it() -> None:
    rec = TraceRecorder(stage_roles={"rollout": "rollout", "train": "train"},
                        pools={"rollout": 1, "train": 1}, max_staleness=1, groups_per_step=1,
                        group_size=2, rollout_role="rollout", now=100.0, cpu=5.0)
    rec.task("rollout-0", "rollout", 2, 101.0, [5, 7], False, now=102.0)
    # taken (prefetched) at 101.5 while the first ran: its own time starts at 102.0
    rec.task("rollout-0", "rollout", 2, 101.5, [1, 2], False, now=102.5)
    rec.task("train-1", "train", 2, 102.5, [9, 9], True, now=103.0)
    rec.step({"step": 1, "samples": 2}, now=103.0)
    worker = SimpleNamespace(worker_id="rollout-0")
    rec.served([(worker, 1)], now=103.25)  # published at 103.0 after its last task ended
    tasks = [r for r in rec.records if isinstance(r, TaskRecord)]
    assert [t.s for t in tasks] == [1.0, 0.5, 0.5]
    assert tasks[0].lengths == (5, 7)
    assert tasks[2].lengths == ()  # lengths of rollouts only
    assert tasks[2].step_end
    syncs = [r for r in rec.records if isinstance(r, SyncRecord)]
    assert syncs == [SyncRecord("rollout-0", 1, 3.25, 0.25)]
    rec.task("rollout-0", "rollout", 2, 103.25, [1, 1], False, now=104.0)
    rec.step({"step": 2, "samples": 2}, now=104.0)
    rec.served([(worker, 2)], now=104.5)  # it finished its task at 104.0: loaded in 0.5 s
    assert [r for r in rec.records if isinstance(r, SyncRecord)][-1].s == 0.5
    rec.served([(worker, 7)], now=104.0)  # a version never published here: not timed
    assert len([r for r in rec.records if isinstance(r, SyncRecord)]) == 2
    # The controller's CPU over the recording, and the samples it trained meanwhile.
    assert rec.header(now=110.0, cpu=5.5)["controller"] == {"cpu_s": 0.5, "wall_s": 10.0,
                                                             "samples": 4}


def test_the_planner_counts_the_controllers_cpu_per_sample(tmp_path: Path) -> None:
    head, records = small_trace()
    old = read_trace(write_trace(tmp_path / "old.jsonl", head, records))
    assert planner.controller_cpu_per_sample(old) == 0.0  # a trace that does not say
    head["controller"] = {"cpu_s": 0.004, "wall_s": 2.0, "samples": 8}
    trace = read_trace(write_trace(tmp_path / "t.jsonl", head, records))
    assert planner.controller_cpu_per_sample(trace) == pytest.approx(0.0005)


def test_role_costs_fit_the_recorded_times_and_draw_repeatably() -> None:
    def task(rows: int, s: float, end: bool = False) -> TaskRecord:
        return TaskRecord("train", "train", "t", rows, 0.0, s, (), end)

    two_sizes = RoleCost.fit([task(2, 0.3), task(4, 0.5)] * 5)
    assert two_sizes is not None
    assert (round(two_sizes.base, 6), round(two_sizes.per_row, 6)) == (0.1, 0.1)
    # Two tasks of a rare size do not set the fixed part: the time scales with the rows.
    rare = RoleCost.fit([task(4, 0.4)] * 18 + [task(1, 0.4)] * 2)
    assert rare is not None
    assert rare.base == 0.0
    assert rare.per_row == pytest.approx(8.0 / 74)
    one_size = RoleCost.fit([task(8, 0.4), task(8, 0.8), task(8, 1.0, end=True)])
    assert one_size is not None
    assert (one_size.base, one_size.per_row) == (0.0, pytest.approx(0.075))  # through 0
    assert one_size.end_ratios == pytest.approx((1.0 / 0.6,))  # a step end's own ratio
    assert one_size.draw(8, random.Random(0), step_end=True) == pytest.approx(1.0)
    assert one_size.draw(4, random.Random(0)) in (pytest.approx(0.2), pytest.approx(0.4))
    costs = TraceCosts(RunTrace({}, [task(8, 0.4), task(8, 0.8)]), stretch=2.0)
    draws = [costs.task_s("train", 8, random.Random(7)) for _ in range(2)]
    assert draws[0] == draws[1]
    assert draws[0] in (pytest.approx(0.8), pytest.approx(1.6))
    assert costs.task_s("reward", 8, random.Random(0)) is None  # the model's costs then
    # One stretch per role (the planner's contention model): a role not named keeps its times.
    trace = RunTrace({}, [task(8, 0.4), TaskRecord("rollout", "rollout", "r", 8, 0.0, 0.2)],
                     [SyncRecord("r", 1, 0.0, 0.5)])
    by_role = TraceCosts(trace, stretch={"rollout": 1.5})
    assert by_role.task_s("rollout", 8, random.Random(0)) == pytest.approx(0.3)
    assert by_role.task_s("train", 8, random.Random(0)) == pytest.approx(0.4)
    assert by_role.sync_s(random.Random(0)) == pytest.approx(0.75)  # a rollout worker's load


def test_a_replays_spans_count_a_prefetched_task_from_when_the_one_before_ended() -> None:
    recipe = Recipe(steps=1, rollout=RolloutConfig(threads=2))
    spans = [Span("r-0", "rollout", "rollout", 1, 4, 10.0, 11.0),
             Span("r-0", "rollout", "rollout", 2, 4, 10.5, 12.0),  # taken while 1 ran
             Span("t-1", "train", "train", 3, 4, 10.5, 11.5)]
    assert planner.replayed_busy(spans, recipe) == [
        Busy("rollout", 10.0, 11.0, 2), Busy("rollout", 11.0, 12.0, 2),
        Busy("train", 10.5, 11.5, 1)]


def test_knob_values_and_their_combinations() -> None:
    assert planner.knob_values("max_staleness=0,1,2") == (("max_staleness",), [0, 1, 2])
    assert planner.knob_values("placement.roles={\"train\": [\"a\"]}")[1] == [
        {"train": ["a"]}]
    knobs = [planner.knob_values("max_staleness=0,1"), planner.knob_values("rollout.workers=2")]
    assert planner.plans_of(knobs) == [{"max_staleness": 0, "rollout.workers": 2},
                                       {"max_staleness": 1, "rollout.workers": 2}]


# Costs large against the controller's own (tens of ms a task) so that a replay on busy cores
# times what the workers did, not the scheduling around it.
SLOW = SimConfig(prompt_len=8, log_mean=2.0, log_sigma=0.5, rollout_base_s=0.04,
                 rollout_token_s=0.002, reward_token_s=0.0, reference_token_s=0.0,
                 train_token_s=0.0004, train_step_s=0.03, weight_numel=1024)


def sim_recipe(max_staleness: int) -> Recipe:
    return Recipe(steps=12, max_staleness=max_staleness, seed=3,
                  algorithm=AlgorithmConfig(group_size=4),
                  rollout=RolloutConfig(engine="sim", workers=2, max_new_tokens=32),
                  trainer=TrainerConfig(groups_per_step=4, micro_batch_groups=2),
                  sim=SLOW, placement=PlacementConfig(store_capacity_mb=64))


class CoreShare:
    """How shared the cores were while a block ran: the mean count of runnable tasks
    (``procs_running`` in ``/proc/stat``, sampled every 50 ms) per core, at least 1. A run on
    cores shared k ways takes about k times as long, whatever it runs."""

    def __init__(self) -> None:
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            with open("/proc/stat") as f:
                for line in f:
                    if line.startswith("procs_running"):
                        self.samples.append(int(line.split()[1]))

    def __enter__(self) -> CoreShare:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def ways(self) -> float:
        mean = sum(self.samples) / len(self.samples) if self.samples else 1.0
        return max(1.0, mean / (os.cpu_count() or 1))


#: tries of a prediction against its run before the test says the planner is wrong: under
#: the worst load measured, a third of the pairs at max_staleness 0 missed (see the test)
TRIES = 5


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_replayed_trace_predicts_a_run_under_another_staleness(tmp_path: Path) -> None:
    """Recorded at max_staleness 1, predicted at 0 and checked against a run at 0: within 25%
    (the replay draws the recorded times; the run draws its own from the cost model), and the
    replay at 1 against the recorded run itself.

    A replay runs in real time, so it predicts the run only on cores shared as the run's were.
    A try whose replay and run saw the cores shared more than a quarter again as much (or
    less) one than the other is not compared (and says so); the test is skipped if no try
    could be. Under outside load that comes and goes, one pair is not enough either: each
    step of a synchronous run waits on a dozen hand-offs, and a burst of load during one run
    and not the other moves a prediction. With five busy loops switched on and off at random
    beside two default jobs (load average ~10 on 2 cores), 3 of the 9 pairs at max_staleness 0
    that the guard let through were 29-46% off, the mean load of both within 19% of each
    other; at 1, none of 9. Beside two default jobs alone, 16 of 16 were within 15%.
    So a prediction gets `TRIES` tries (at 0, each a new run and its replay back to back; at
    1, a new replay of the recorded run), and fails only if every try it could compare missed:
    a planner that is wrong misses them all."""
    path = tmp_path / "run.trace.jsonl"
    with CoreShare() as recording:
        recorded = asyncio.run(run_recipe(sim_recipe(1), monitor=False, record_trace=path))
    trace = read_trace(path)
    assert len(trace.steps) == 12
    assert trace.recipe is not None
    by: dict[int, planner.Plan] = {}
    not_compared: list[str] = []  # said in the skip, or on stderr when another try was compared
    for staleness in (0, 1):
        missed = []
        for attempt in range(TRIES):
            if staleness == 1:  # the recorded run is the one to predict
                run, during = recorded, recording
            else:
                with CoreShare() as during:
                    run = asyncio.run(run_recipe(sim_recipe(0), monitor=False))
            with CoreShare() as replaying:
                (by[staleness],) = asyncio.run(planner.plan(
                    path, [planner.knob_values(f"max_staleness={staleness}")]))
            shared = replaying.ways / during.ways
            if not 1 / 1.25 <= shared <= 1.25:
                not_compared.append(f"max_staleness {staleness}, try {attempt + 1}: the cores "
                                    f"were shared {replaying.ways:.1f} ways during the replay, "
                                    f"{during.ways:.1f} during the run")
                continue
            error = by[staleness].samples_per_s / run["samples_per_s"] - 1
            if abs(error) < 0.25:
                break
            missed.append((round(by[staleness].samples_per_s, 1), round(run["samples_per_s"], 1),
                           round(replaying.ways, 2), round(during.ways, 2)))
        else:  # no try within 25%: the planner is wrong if any try was compared
            assert not missed, (staleness, "predicted, measured, ways shared", missed)
    if len(not_compared) == 2 * TRIES:  # a machine whose load swings: nothing here says the
        pytest.skip("no replay ran on cores shared as its run's were: "  # planner is wrong
                    + "; ".join(not_compared))
    for line in not_compared:
        print(f"not compared: {line}", file=sys.stderr)
    assert set(by[0].staleness) == {0}  # synchronous: every sample on-policy
    assert set(by[0].idle) == {"rollout", "reward", "train"}
    assert by[0].stretch == {}  # simulated workers wait, they do not take the cores
    assert "recommended:" in planner.recommend(list(by.values()))


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_plan_that_crowds_the_cores_has_its_tasks_stretched(tmp_path: Path) -> None:
    """The contention loop end to end: a trace whose header says 1 core, replayed with 4
    rollout workers where it recorded 2. (Its simulated workers wait instead of computing, so
    contention is asked for: the figures are the model's, which is the point here.)"""
    path = tmp_path / "run.trace.jsonl"
    asyncio.run(run_recipe(sim_recipe(1), monitor=False, record_trace=path))
    lines = path.read_text().splitlines()
    head = json.loads(lines[0])
    head["cpus"] = 1
    path.write_text("\n".join([json.dumps(head), *lines[1:]]) + "\n")
    knobs = [planner.knob_values("rollout.workers=4")]
    (crowded,) = asyncio.run(planner.plan(path, knobs, steps=6, contention=True))
    # Two rollout workers already crowded the one core; four, busy together, crowd it more.
    assert crowded.stretch["rollout"] > 1.2, crowded.row()
    assert crowded.samples_per_s > 0
    assert "rollout" in crowded.stretch_text()
