"""The controller's pure parts on their own: task reports checked before use, the step ledger's
commit and abort, published weight versions kept while served."""

from __future__ import annotations

from typing import Any

import pytest

from flowrl.backpressure import StoreBackpressure
from flowrl.control.admission import Admission
from flowrl.control.ledger import LostTrainerState, StepLedger
from flowrl.control.reports import MalformedReport, check_report, parse_report
from flowrl.control.weights import WeightVersions
from flowrl.graph import StageGraph, StageSpec
from flowrl.index import Index, Task
from flowrl.staleness import StalenessGate
from transport.handles import Handle, handle_to_wire

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
    return Task(id=7, stage="reward", rows=tuple(range(rows)), groups=(0,), worker="w",
                handles={}, lengths=(1,) * rows, versions=(None,) * rows, tokens=rows)


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
])
def test_a_report_of_the_wrong_shape_is_refused(changes: dict[str, Any], says: str) -> None:
    with pytest.raises(MalformedReport) as info:
        parse_report(report(**changes))
    assert says in str(info.value)


def test_a_train_report_produces_no_field() -> None:
    check(report(fields={}), train=True)
    with pytest.raises(MalformedReport, match="does not produce"):
        check(report(), train=True)


def test_a_bad_handle_is_refused() -> None:
    bad = handle_to_wire(Handle("node0", SEGMENT, 0, "float32", (3,)))._replace(data=b"\xc1")
    with pytest.raises(MalformedReport, match="field 'score'"):
        check(report(fields={"reward": [1.0, 0.5], "score": [bad, bad]}))


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
