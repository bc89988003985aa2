"""The controller's pure parts on their own: task reports checked before use, the step ledger's
commit and abort, published weight versions kept while served."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest

from flowrl.backpressure import StoreBackpressure
from flowrl.control.admission import Admission
from flowrl.control.ledger import LostTrainerState, StepLedger
from flowrl.control.reports import MalformedReport, check_report, parse_report
from flowrl.control.run_view import RunCounters
from flowrl.control.step_metrics import FailureBudget, StageMetrics, TooManyFailures
from flowrl.control.versions import Versions
from flowrl.control.weights import WeightVersions
from flowrl.events import EventBus
from flowrl.graph import StageGraph, StageSpec
from flowrl.index import Index, Task
from flowrl.registry import Registry, WorkerInfo
from flowrl.staleness import StalenessGate
from transport.codec import RUN_EXT
from transport.handles import Handle, handle_to_wire, run_to_wire

REWARD = StageSpec("reward", ("response",), ("reward", "score"))
SEGMENT = "flowrl-run1-10-20-10-1"


def graph() -> StageGraph:
    return StageGraph(
        [StageSpec("rollout", ("prompt",), ("response",), group_level=True),
         REWARD,
         StageSpec("train", ("response", "reward", "score"), group_level=True,
                   consumes_version_bound=True)],
        source_fields=("prompt",))


def task(rows: int = 2) -> Task:
    return Task(id=7, stage="reward", rows=tuple(range(rows)), groups=(0,),
                row_groups=(0,) * rows, worker="w", handles={}, lengths=(1,) * rows,
                versions=(None,) * rows, tokens=rows)


def report(**changes: Any) -> dict[str, Any]:
    handle = handle_to_wire(Handle("node0", SEGMENT, 0, "float32", (3,)))
    base = {"worker_id": "w", "task_id": 7, "fields": {"reward": [1.0, 0.5],
                                                      "score": [handle, handle]},
            "lengths": [], "version": None, "metrics": {}}
    return {**base, **changes}


def check(p: dict[str, Any], *, rows: int = 2, train: bool = False) -> None:
    check_report(parse_report(p), task(rows), REWARD, train=train)


def test_a_well_formed_report_passes() -> None:
    check(report())
    check(report(lengths=[3, 4]))


@pytest.mark.parametrize(("changes", "says"), [
    ({"fields": {"reward": [1.0, 0.5]}}, "lacks field(s) ['score']"),
    ({"fields": {"reward": [1.0, 0.5], "score": [1, 2], "bogus": [1, 2]}},
     "does not produce field(s) ['bogus']"),
    ({"fields": {"reward": [1.0], "score": [1, 2]}}, "'reward' has 1 values for 2 rows"),
    ({"lengths": [1, 2, 3]}, "3 lengths for 2 rows"),
    ({"fields": {"reward": [[1, 2], 0.5], "score": [1, 2]}}, "a store handle or a number"),
    ({"fields": {"reward": ["x", 0.5], "score": [1, 2]}}, "a store handle or a number"),
    ({"failed": {"error": {"rows": [2], "error": "boom"}}}, "each of the task's 2 rows"),
    ({"failed": {"error": {"rows": [0], "error": "a"}, "timeout": {"rows": [0], "error": "b"}}},
     "at most once"),
])
def test_a_malformed_report_is_refused_naming_what_is_wrong(changes: dict[str, Any],
                                                            says: str) -> None:
    with pytest.raises(MalformedReport) as info:
        check(report(**changes))
    assert says in str(info.value)


@pytest.mark.parametrize(("changes", "says"), [
    ({"surprise": 1}, "unknown key(s) 'surprise'"),
    ({"fields": [1, 2]}, "'fields' must map"),
    ({"lengths": [-1, 2]}, "'lengths' must be a list of non-negative"),
    ({"version": "1"}, "'version' must be"),
    ({"task_id": "7"}, "'task_id' must be an integer"),
    ({"failed": [0]}, "'failed' must map"),
    ({"failed": {"no kind": {"rows": [0], "error": ""}}}, "a kind must be a short identifier"),
    ({"failed": {"error": {"rows": [], "error": ""}}}, "expected {rows: [offsets], error"),
    ({"failed": {"error": {"rows": [0], "error": None}}}, "expected {rows: [offsets], error"),
])
def test_a_report_of_the_wrong_shape_is_refused(changes: dict[str, Any], says: str) -> None:
    with pytest.raises(MalformedReport) as info:
        parse_report(report(**changes))
    assert says in str(info.value)


def _run(rows: int, segment: str = SEGMENT, lens: list[Any] | None = None) -> Any:
    wire = run_to_wire([Handle("node0", SEGMENT, 12 * i, "float32", (3,)) for i in range(rows)])
    if lens is None and segment == SEGMENT:
        return wire
    fields = msgpack.unpackb(wire.data)
    return msgpack.ExtType(wire.code, msgpack.packb(
        [fields[0], segment, fields[2], fields[3], fields[4] if lens is None else lens]))


def test_a_field_sent_as_one_run_is_checked_once_and_kept_a_value_a_row() -> None:
    parsed = parse_report(report(fields={"reward": [1.0, 0.5], "score": _run(2)}))
    check_report(parsed, task(), REWARD, train=False)
    assert parsed.runs == {"score"}
    assert [Handle.from_wire(v) for v in parsed.fields["score"]] == [
        Handle("node0", SEGMENT, 0, "float32", (3,)), Handle("node0", SEGMENT, 12, "float32", (3,))]


@pytest.mark.parametrize(("score", "says"), [
    (_run(3), "'score' has 3 values for 2 rows"),
    (_run(2, segment="nope"), "field 'score': bad segment name"),
    (_run(2, lens=[3, 0]), "field 'score': a run's lengths are positive"),
    (_run(2, lens=[]), "field 'score': a run's lengths are a non-empty list"),
    (msgpack.ExtType(RUN_EXT, b"\xc1"), "field 'score': undecodable run"),
])
def test_a_malformed_run_is_refused_naming_its_field(score: Any, says: str) -> None:
    with pytest.raises(MalformedReport) as info:
        check(report(fields={"reward": [1.0, 0.5], "score": score}))
    assert says in str(info.value)


def test_a_report_names_the_rows_whose_values_are_fallbacks() -> None:
    parsed = parse_report(report(failed={"error": {"rows": [1], "error": "x" * 3000},
                                         "timeout": {"rows": [0], "error": "slow"}}))
    check_report(parsed, task(), REWARD, train=False)
    assert parsed.failed == {"error": ((1,), "x" * 2000), "timeout": ((0,), "slow")}


def test_a_train_report_produces_no_field() -> None:
    check(report(fields={}), train=True)
    with pytest.raises(MalformedReport, match="does not produce"):
        check(report(), train=True)


GOOD = handle_to_wire(Handle("node0", SEGMENT, 0, "float32", (3,)))


@pytest.mark.parametrize("second", [
    GOOD._replace(data=b"\xc1"),  # undecodable
    handle_to_wire(Handle("node0", SEGMENT + ".tmp", 12, "float32", (3,))),  # unpublished
    handle_to_wire(Handle("node0", SEGMENT, 13, "float32", (3,))),  # misaligned
    GOOD._replace(code=GOOD.code + 1),  # another ext type
])
def test_a_bad_handle_is_refused(second: Any) -> None:
    # Behind a good one, as the second row of a put: a field's handles are checked together.
    with pytest.raises(MalformedReport, match="field 'score'"):
        check(report(fields={"reward": [1.0, 0.5], "score": [GOOD, second]}))
    check(report(fields={"reward": [1.0, 0.5], "score": [
        GOOD, handle_to_wire(Handle("node0", SEGMENT, 12, "float32", (5,)))]}))


def ledger_with_groups(groups: int) -> tuple[StepLedger, Index, list[Task]]:
    ix = Index(graph())
    admission = Admission(StalenessGate(1, groups),
                          StoreBackpressure(high_water=0.9, groups_per_step=groups))
    ledger = StepLedger(ix, admission)
    tasks = []
    for _ in range(groups):
        pos = admission.take_position()
        gid = ix.add_group(2, {"prompt": [pos, pos]})
        admission.admit(gid)
        t = ix.request("rollout", 1)
        assert t is not None
        ix.complete(t.id, {"response": [1, 2]}, version=0)
        t = ix.request("reward", 2)
        assert t is not None
        ix.complete(t.id, {"reward": [1.0, 0.0], "score": [1, 2]})
        t = ix.request("train", 1, min_version=0)
        assert t is not None
        tasks.append(t)
    return ledger, ix, tasks


def test_a_step_commits_once_its_end_is_reported() -> None:
    ledger, ix, tasks = ledger_with_groups(2)
    first = ledger.trained(tasks[0], ledger.params(0, False), {})
    assert first == []
    assert ledger.pending == 1
    [(done, end)] = ledger.trained(tasks[1], ledger.params(0, True), {"version": 1})
    commit = ledger.commit(done, end)
    assert (commit.version, commit.samples, ledger.version) == (1, 4, 1)
    assert commit.rewards == [1.0, 0.0, 1.0, 0.0]
    assert ledger.rows_trained == 4
    assert ledger.rows_trained_twice == 0
    assert ledger.run_state().trained_below == 2
    ix.audit()


def test_a_trainer_that_lost_its_state_is_caught() -> None:
    ledger, _, tasks = ledger_with_groups(1)
    [(done, end)] = ledger.trained(tasks[0], ledger.params(0, True), {"version": 5})
    with pytest.raises(LostTrainerState, match="published version 5"):
        ledger.commit(done, end)


def test_an_aborted_step_gives_back_what_it_trained_and_starts_a_new_attempt() -> None:
    ledger, _, tasks = ledger_with_groups(2)
    assert ledger.placed(1) is False
    ledger.trained(tasks[0], ledger.params(0, False), {})
    back = ledger.abort()
    assert back == [tasks[0]]
    assert (ledger.train_step, ledger.groups_in_step, ledger.attempt) == (0, 0, 1)
    assert ledger.params(0, True)["attempt"] == 1


def test_weight_versions_are_kept_while_any_rollout_worker_may_serve_them() -> None:
    weights = WeightVersions()
    for v in (1, 2, 3):
        weights.publish(v, {"w": (handle_to_wire(Handle("n", SEGMENT, 16 * v, "float32",
                                                        (4,))), [4])})
    assert weights.nbytes(2) == 16
    assert weights.release(served=[1, 3], current=3) == []  # a worker still serves 1
    freed = weights.release(served=[2, 3], current=3)
    assert [Handle.from_wire(h).offset for h in freed] == [16]
    assert weights.get(1) is None
    assert weights.get(2) is not None


class CountingRegistry(Registry):
    """Counts the workers a caller looks at: what a scan costs with many workers."""

    looks = 0

    def of_role(self, role: str) -> list[WorkerInfo]:
        workers = super().of_role(role)
        self.looks += len(workers)
        return workers

    def iter_role(self, role: str) -> Iterator[WorkerInfo]:
        for w in super().iter_role(role):
            self.looks += 1
            yield w


def test_served_reports_free_the_old_version_with_the_last_and_look_at_few_workers() -> None:
    ledger, _, _ = ledger_with_groups(1)
    registry = CountingRegistry(60.0)
    freed: list[Any] = []
    weights = WeightVersions()
    versions = Versions(ledger, weights, registry, rollout_role="rollout", events=EventBus(),
                        counters=RunCounters(), free=freed.extend, output=None)
    n = 1024
    workers = [registry.register(name=f"rollout.0.{i}", role="rollout", node="n", pid=1,
                                 capacity=1, version=1, now=0.0) for i in range(n)]
    for v in (1, 2):
        weights.publish(v, {"w": (handle_to_wire(Handle("n", SEGMENT, 16 * v, "float32",
                                                        (4,))), [4])})
    ledger.version = 2
    random.Random(0).shuffle(workers)
    for i, w in enumerate(workers):  # each switches to 2 and says so (`served`)
        w.version = 2
        versions.release_unserved()
        assert (weights.get(1) is None) == (i == n - 1)
    assert [Handle.from_wire(h).offset for h in freed] == [16]
    assert weights.get(2) is not None
    # One look per worker per report would be n * n (about a million).
    assert registry.looks < 20 * n


# ---- failed samples: counted for the step that trains them; the failure budget -------------


def rows_task(stage: str, rows: tuple[int, ...], task_id: int = 1) -> Task:
    return Task(id=task_id, stage=stage, rows=rows, groups=(0,), row_groups=(0,) * len(rows),
                worker="w", handles={}, lengths=(1,) * len(rows), versions=(None,) * len(rows),
                tokens=len(rows))


def test_failed_samples_count_for_the_step_that_trains_them() -> None:
    metrics = StageMetrics()
    # One reward task scores rows of two steps (0-3: step 1; 4-5: step 2); its failures are
    # on rows 1 and 4 (error) and 5 (a judge's fallback).
    metrics.fold(rows_task("reward", (0, 1, 2, 3, 4, 5)), parse_report(report(failed={
        "error": {"rows": [1, 4], "error": "ValueError: x"},
        "unparsable": {"rows": [5], "error": "no score"}}, metrics={"critic_loss": 0.5})))
    metrics.fold(rows_task("reward", (6, 7, 8)), parse_report(report(failed={
        "timeout": {"rows": [0], "error": "slow"}})))
    figures, failures = metrics.take([rows_task("train", (0, 1)), rows_task("train", (2, 3))],
                                     alive=lambda row: True)
    assert figures == {"critic_loss": 0.5, "reward_failed": 1.0, "reward_failed_error": 1.0}
    assert failures["reward"].errors == {"error": "ValueError: x"}
    # Row 6 was dropped (too stale): it never trains, and is forgotten.
    figures, failures = metrics.take([rows_task("train", (4, 5))], alive=lambda row: row != 6)
    assert figures == {"reward_failed": 2.0, "reward_failed_error": 1.0,
                       "reward_failed_unparsable": 1.0}
    assert metrics.take([rows_task("train", (6, 7, 8))], alive=lambda row: True) == ({}, {})


def test_the_step_log_counts_episodes_generated_across_a_weight_swap() -> None:
    metrics = StageMetrics()
    for task_id, n in ((1, 2.0), (2, 1.0), (3, 0.0)):
        metrics.fold(rows_task("rollout", (task_id,), task_id),
                     parse_report(report(task_id=task_id, metrics={"interrupted_episodes": n})))
    figures, _ = metrics.take([rows_task("train", (1, 2, 3))], alive=lambda row: True)
    assert figures == {"rollout_interrupted_episodes": 3.0}
    assert metrics.take([rows_task("train", (5,))], alive=lambda row: True) == ({}, {})


def test_the_failure_budget_ends_the_run_after_steps_in_a_row_over_the_share() -> None:
    metrics = StageMetrics()
    budget = FailureBudget(max_share=0.5, max_steps=2)

    def step(n: int, failed: list[int], kind: str = "error") -> None:
        rows = tuple(range(n * 4, n * 4 + 4))
        if failed:
            metrics.fold(rows_task("reward", rows), parse_report(report(failed={
                kind: {"rows": failed, "error": f"{kind} at step {n}"}})))
        _, failures = metrics.take([rows_task("train", rows)], alive=lambda row: True)
        budget.observe(n, 4, failures)

    step(1, [0, 1, 2])  # 3 of 4: over the share
    step(2, [0, 1])  # 2 of 4: not over it, so the count starts again
    step(3, [0, 1, 2, 3], kind="unparsable")  # a judge's fallbacks are never held against it
    step(4, [0, 1, 2])
    with pytest.raises(TooManyFailures) as info:
        step(5, [0, 1, 2, 3])
    assert str(info.value).startswith("reward failed on 4 of 4 samples of step 5 (error 4)")
    assert str(info.value).endswith("; error: error at step 5")
