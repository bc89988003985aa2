"""The index: hand-checked scenarios, then a stateful model check of every guarantee.

The state machine drives random interleavings of add_group / put / request / complete / fail /
drop_group / take_stale against a small reference model (plain lists, scanned linearly) and checks
after every step: each live row is in the model's state for every stage, FIFO order and stale
eviction match the model, no row is consumed twice by a stage, rows retire exactly when every stage
consumed them, every handle given to the index comes back exactly once for freeing, and the
maintained counters agree with a full recount. At the end everything is driven to completion and
the index must be empty (all internal containers at size zero).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import flowrl.index as index_module
from flowrl.graph import StageGraph, StageSpec
from flowrl.index import (
    Index,
    UnknownField,
    UnknownGroup,
    UnknownRow,
    UnknownStage,
    UnknownTask,
)


def grpo_graph() -> StageGraph:
    """rollout → reward → advantage (groups) → train (version bound); log reads prompts only."""
    return StageGraph(
        [
            StageSpec("rollout", ("prompt",), ("response",), micro_batch=2),
            StageSpec("reward", ("response",), ("reward",), micro_batch=3),
            StageSpec("advantage", ("reward",), ("advantages",), group_level=True),
            StageSpec("train", ("response", "advantages"), micro_batch=4,
                      consumes_version_bound=True),
            StageSpec("log", ("prompt",), micro_batch=8),
        ],
        source_fields=("prompt",),
    )


def group_graph() -> StageGraph:
    """Group-level rollout and group-level, version-bound train (as the GRPO pipeline uses)."""
    return StageGraph(
        [
            StageSpec("rollout", ("prompt",), ("response", "logprobs"), group_level=True),
            StageSpec("reward", ("prompt", "response"), ("reward",), micro_batch=3),
            StageSpec("train", ("response", "logprobs", "reward"), micro_batch=2,
                      group_level=True, consumes_version_bound=True),
        ],
        source_fields=("prompt",),
    )


# --- hand-checked scenarios ----------------------------------------------------------------


def test_grpo_lifecycle_by_hand() -> None:
    ix = Index(grpo_graph())
    g0 = ix.add_group(2, {"prompt": ["p0", "p1"]}, meta="item-0", lengths=[5, 7])
    g1 = ix.add_group(2, {"prompt": ["p2", "p3"]}, meta="item-1")
    assert (g0, g1) == (0, 1)
    assert ix.group_rows(g0) == (0, 1)
    assert ix.group_rows(g1) == (2, 3)
    assert ix.group_meta(g1) == "item-1"
    assert ix.row_states(0) == {"rollout": "ready", "reward": "waiting", "advantage": "waiting",
                                "train": "waiting", "log": "ready"}

    t = ix.request("rollout", worker="gen-0")  # micro_batch 2: rows 0 and 1, FIFO
    assert t is not None
    assert (t.stage, t.rows, t.groups, t.worker) == ("rollout", (0, 1), (0,), "gen-0")
    assert t.handles == {"prompt": ["p0", "p1"]}
    assert (t.lengths, t.tokens, t.versions) == ((5, 7), 12, (None, None))
    assert ix.in_flight_of("gen-0") == [t.id]
    assert ix.row_states(0)["rollout"] == "in_flight"
    assert ix.complete(t.id, {"response": ["r0", "r1"]}, version=3, lengths=[20, 30]) == []
    assert ix.in_flight_of("gen-0") == []
    assert ix.row_version(0) == 3
    assert ix.row_states(1)["rollout"] == "done"
    assert ix.row_states(1)["reward"] == "ready"

    # Reward only has rows 0 and 1 so far.
    t = ix.request("reward", 10)
    assert t is not None
    assert t.rows == (0, 1)
    assert t.tokens == 50
    # Row 0 alone does not make its group ready for the group-level stage.
    assert ix.complete(t.id, {"reward": ["w0", "w1"]}) == []
    t = ix.request("advantage")
    assert t is not None
    assert (t.rows, t.groups) == ((0, 1), (0,))
    assert t.handles == {"reward": ["w0", "w1"]}
    assert ix.complete(t.id, {"advantages": ["a0", "a1"]}) == []
    assert ix.request("advantage") is None

    t = ix.request("train", min_version=3)
    assert t is not None
    assert t.rows == (0, 1)
    assert t.versions == (3, 3)
    assert t.handles == {"response": ["r0", "r1"], "advantages": ["a0", "a1"]}
    # "log" has not consumed rows 0 and 1 yet: train completing does not retire them.
    assert ix.complete(t.id) == []
    assert ix.statistics().retired_total == 0

    t = ix.request("log")
    assert t is not None
    assert t.rows == (0, 1, 2, 3)
    freed = ix.complete(t.id)
    assert sorted(freed) == ["a0", "a1", "p0", "p1", "r0", "r1", "w0", "w1"]
    assert not ix.has_row(0)
    s = ix.statistics()
    assert (s.rows, s.groups, s.retired_total) == (2, 1, 2)
    assert s.stages["log"].done == 2
    assert s.stages["rollout"].ready == 2
    with pytest.raises(UnknownRow):
        ix.row_states(0)
    with pytest.raises(UnknownGroup):
        ix.group_rows(g0)


def test_fail_returns_rows_to_the_front_in_order() -> None:
    ix = Index(grpo_graph())
    for i in range(3):
        ix.add_group(2, {"prompt": [f"p{2 * i}", f"p{2 * i + 1}"]})
    a = ix.request("rollout", 2, worker="w")
    b = ix.request("rollout", 2, worker="w")
    assert a is not None
    assert b is not None
    assert ix.in_flight_of("w") == [a.id, b.id]
    assert ix.fail(b.id) == []
    assert ix.fail(a.id) == []
    t = ix.request("rollout", 6)
    assert t is not None
    assert t.rows == (0, 1, 2, 3, 4, 5)  # a's rows, then b's, then the never-taken ones
    for bad in (a.id, b.id, 999):
        with pytest.raises(UnknownTask):
            ix.fail(bad)
        with pytest.raises(UnknownTask):
            ix.complete(bad)
    ix.complete(t.id, {"response": list(range(6))})
    with pytest.raises(UnknownTask):
        ix.complete(t.id)
    assert ix.statistics().stages["rollout"].done == 6


def test_fail_returns_groups_to_the_front_in_order() -> None:
    ix = Index(group_graph())
    for i in range(3):
        ix.add_group(2, {"prompt": [2 * i, 2 * i + 1]})
    a = ix.request("rollout", 1)
    b = ix.request("rollout", 1)
    assert a is not None
    assert b is not None
    assert (a.groups, b.groups) == ((0,), (1,))
    ix.fail(b.id)
    ix.fail(a.id)
    t = ix.request("rollout", 3)
    assert t is not None
    assert t.groups == (0, 1, 2)
    assert t.rows == (0, 1, 2, 3, 4, 5)
    assert t.row_groups == (0, 0, 1, 1, 2, 2)


def test_group_level_stage_waits_for_the_whole_group() -> None:
    ix = Index(grpo_graph())
    ix.add_group(3, {"prompt": [0, 1, 2]})
    ix.put([0, 1], "response", ["r0", "r1"], version=0)
    ix.put([0, 1], "reward", ["w0", "w1"])
    assert ix.request("advantage") is None
    assert ix.row_states(0)["advantage"] == "waiting"
    ix.put([2], "response", ["r2"], version=0)
    ix.put([2], "reward", ["w2"])
    t = ix.request("advantage", 5)
    assert t is not None
    assert t.rows == (0, 1, 2)
    assert t.groups == (0,)


def test_stale_rows_are_evicted_reported_and_dropped() -> None:
    ix = Index(grpo_graph())
    for v in (0, 1, 2):
        gid = ix.add_group(2, {"prompt": [f"p{v}a", f"p{v}b"]}, meta=v)
        rows = ix.group_rows(gid)
        ix.put(rows, "response", [f"r{v}a", f"r{v}b"], version=v)
        ix.put(rows, "advantages", [f"a{v}a", f"a{v}b"])
    t = ix.request("train", 10, min_version=1)
    assert t is not None
    assert t.rows == (2, 3, 4, 5)  # group 0 (version 0) was evicted, not handed out
    assert ix.row_states(0)["train"] == "stale"
    s = ix.statistics()
    assert (s.stale_total, s.stages["train"].stale, s.min_version, s.max_version) == (2, 2, 0, 2)
    assert ix.take_stale() == [0]
    assert ix.take_stale() == []
    assert ix.group_meta(0) == 0  # so the caller can readmit the prompt
    freed = ix.drop_group(0)
    assert sorted(freed) == ["a0a", "a0b", "p0a", "p0b", "r0a", "r0b"]
    with pytest.raises(UnknownGroup):
        ix.drop_group(0)
    s = ix.statistics()
    assert (s.rows, s.dropped_total, s.stages["train"].stale, s.min_version) == (4, 2, 0, 1)
    ix.audit()


def test_group_level_stale_eviction_takes_the_whole_group() -> None:
    ix = Index(group_graph())
    ix.add_group(2, {"prompt": [0, 1]})
    ix.add_group(2, {"prompt": [2, 3]})
    for gid, versions in ((0, (5, 4)), (1, (5, 5))):
        for rid, v in zip(ix.group_rows(gid), versions, strict=True):
            ix.put([rid], "response", [f"r{rid}"], version=v)
            ix.put([rid], "logprobs", [f"l{rid}"])
            ix.put([rid], "reward", [f"w{rid}"])
    t = ix.request("train", 2, min_version=5)
    assert t is not None
    assert t.groups == (1,)  # group 0 has one row at version 4: evicted whole
    assert t.rows == (2, 3)
    assert ix.take_stale() == [0]
    assert {ix.row_states(r)["train"] for r in (0, 1)} == {"stale"}


def test_drop_group_defers_freeing_rows_held_by_a_task() -> None:
    ix = Index(grpo_graph())
    ix.add_group(2, {"prompt": ["p0", "p1"]})
    t = ix.request("rollout")
    assert t is not None
    assert ix.drop_group(0) == []  # in flight: the worker may still be reading p0, p1
    s = ix.statistics()
    assert (s.rows, s.draining_rows, s.groups) == (0, 2, 0)
    assert ix.request("log") is None  # dropped rows left every queue
    assert not ix.has_row(0)
    # The worker finishes anyway: its inputs and outputs are freed, nothing lands.
    assert sorted(ix.complete(t.id, {"response": ["r0", "r1"]})) == ["p0", "p1", "r0", "r1"]
    assert ix.put([0], "reward", ["late"]) == ["late"]  # a late put for a gone row is freed
    assert all(v == 0 for v in ix.audit().values())


def test_dropped_row_held_by_two_tasks_is_freed_after_the_last() -> None:
    ix = Index(grpo_graph())
    ix.add_group(1, {"prompt": ["p0"]})
    gen = ix.request("rollout")
    log = ix.request("log")
    assert gen is not None
    assert log is not None
    assert ix.drop_group(0) == []
    assert ix.complete(log.id) == []  # rollout still reads p0
    assert ix.statistics().draining_rows == 1
    assert sorted(ix.fail(gen.id)) == ["p0"]
    assert all(v == 0 for v in ix.audit().values())


def test_dropping_a_stale_group_before_take_stale_unreports_it() -> None:
    ix = Index(grpo_graph())
    ix.add_group(1, {"prompt": ["p0"]})
    ix.put([0], "response", ["r0"], version=0)
    ix.put([0], "advantages", ["a0"])
    assert ix.request("train", min_version=1) is None
    assert ix.drop_group(0) == ["p0", "r0", "a0"]
    assert ix.take_stale() == []


def test_put_replacing_a_handle_returns_the_old_one() -> None:
    ix = Index(grpo_graph())
    ix.add_group(1, {"prompt": ["p0"]})
    assert ix.put([0], "response", ["r-old"], version=1) == []
    assert ix.put([0], "response", ["r-new"], version=2) == ["r-old"]
    assert ix.row_version(0) == 2
    assert ix.statistics().stages["reward"].ready == 1  # entered the queue once, not twice
    t = ix.request("reward", 5)
    assert t is not None
    assert t.handles == {"response": ["r-new"]}


def test_errors_change_nothing() -> None:
    ix = Index(grpo_graph())
    ix.add_group(2, {"prompt": ["p0", "p1"]})
    with pytest.raises(UnknownRow, match="row 2 was never issued"):
        ix.put([0, 2], "response", ["a", "b"])
    with pytest.raises(UnknownRow):
        ix.put([-1], "response", ["a"])
    with pytest.raises(UnknownField, match="'nope'"):
        ix.put([0], "nope", ["a"])
    with pytest.raises(ValueError, match="1 handles for 2 rows"):
        ix.put([0, 1], "response", ["a"])
    with pytest.raises(UnknownStage):
        ix.request("nope")
    with pytest.raises(ValueError, match="up_to"):
        ix.request("rollout", 0)
    with pytest.raises(ValueError, match="at least one row"):
        ix.add_group(0)
    with pytest.raises(ValueError, match="field 'prompt' has 1 handles for 2 rows"):
        ix.add_group(2, {"prompt": ["x"]})
    t = ix.request("rollout")
    assert t is not None
    with pytest.raises(UnknownField, match="stage 'rollout' does not produce field 'reward'"):
        ix.complete(t.id, {"reward": ["a", "b"]})
    with pytest.raises(ValueError, match="has 1 handles for 2 rows"):
        ix.complete(t.id, {"response": ["a"]})
    assert ix.statistics().stages["rollout"].in_flight == 2  # still in flight
    assert ix.statistics().stages["reward"].ready == 0
    assert ix.row_states(0)["reward"] == "waiting"
    ix.complete(t.id, {"response": ["a", "b"]})
    ix.audit()


def test_stage_without_needs_gets_rows_on_admission() -> None:
    g = StageGraph([StageSpec("gen", (), ("response",)), StageSpec("judge", ("response",))],
                   source_fields=())
    ix = Index(g)
    ix.add_group(2, meta="seed")
    t = ix.request("gen", 5)
    assert t is not None
    assert (t.rows, t.handles) == ((0, 1), {})
    ix.complete(t.id, {"response": ["a", "b"]})
    t = ix.request("judge", 5)
    assert t is not None
    assert sorted(ix.complete(t.id)) == ["a", "b"]
    assert ix.statistics().retired_total == 2


def test_queue_of_dropped_rows_is_compacted() -> None:
    # Many dropped rows in a queue that is never popped must not keep memory alive.
    ix = Index(grpo_graph())
    for i in range(500):
        ix.add_group(1, {"prompt": [i]})
    for gid in range(499):
        ix.drop_group(gid)
    sizes = ix.audit()
    assert sizes["queue:rollout"] <= 1 + 64
    assert sizes["rows"] == 1
    ix.drop_group(499)
    assert all(v == 0 for v in ix.audit().values())


def test_statistics_counts_every_row_once_per_stage() -> None:
    ix = Index(grpo_graph())
    ix.add_group(2, {"prompt": ["a", "b"]})
    ix.add_group(2, {"prompt": ["c", "d"]})
    t = ix.request("rollout")
    assert t is not None
    s = ix.statistics()
    assert s.stages["rollout"].in_flight == 2
    assert s.stages["rollout"].ready == 2
    assert s.stages["rollout"].queue_depth == 2
    assert s.stages["rollout"].tasks_in_flight == 1
    assert s.stages["reward"].waiting == 4
    assert s.rows_by_state == {"waiting": 12, "ready": 6, "in_flight": 2, "done": 0, "stale": 0}
    assert s.tasks_in_flight == 1
    assert s.as_dict()["stages"]["rollout"]["in_flight"] == 2


# --- stateful model check ------------------------------------------------------------------


@dataclass
class MRow:
    gid: int
    fields: dict[str, int] = field(default_factory=dict)
    version: int | None = None
    length: int = 1
    state: dict[str, str] = field(default_factory=dict)
    flight: set[str] = field(default_factory=set)
    dropped: bool = False


class IndexMachine(RuleBasedStateMachine):
    """Reference model of the index; see the module docstring for what is checked."""

    GRAPH = staticmethod(grpo_graph)

    def __init__(self) -> None:
        super().__init__()
        # Compact dead queue entries as early as allowed, so compaction runs in short examples.
        self._compact_min = index_module._COMPACT_MIN
        index_module._COMPACT_MIN = 0
        self.graph = self.GRAPH()
        self.ix = Index(self.graph)
        self.stages = {s.name: s for s in self.graph.order}
        self.rows: dict[int, MRow] = {}
        self.groups: dict[int, list[int]] = {}
        self.queues: dict[str, list[int]] = {s: [] for s in self.stages}
        self.tasks: dict[int, tuple[str, tuple[int, ...], tuple[int, ...], str | None]] = {}
        self.handed: list[int] = []  # task ids in the order they got their worker
        self.formed: set[int] = set()  # task ids formed (`Index.form`), not bound yet
        self.stale: dict[int, None] = {}
        self.consumed: set[tuple[int, str]] = set()
        self.outstanding: set[int] = set()  # handles given to the index, not yet freed
        self.next_handle = 0
        self.next_row = 0

    # helpers --------------------------------------------------------------------------------

    def fresh(self, n: int) -> list[int]:
        hs = list(range(self.next_handle, self.next_handle + n))
        self.next_handle += n
        self.outstanding.update(hs)
        return hs

    def freed(self, got: list[Any], expected: list[int]) -> None:
        assert Counter(got) == Counter(expected), (got, expected)
        assert len(set(got)) == len(got), f"handle freed twice in one call: {got}"
        for h in got:
            assert h in self.outstanding, f"handle {h} freed twice"
            self.outstanding.remove(h)

    def live(self, rid: int) -> MRow | None:
        r = self.rows.get(rid)
        return None if r is None or r.dropped else r

    def model_put(self, rids: list[int], f: str, hs: list[int], version: int | None) -> list[int]:
        free: list[int] = []
        for rid, h in zip(rids, hs, strict=True):
            r = self.live(rid)
            if r is None:
                free.append(h)
                continue
            if version is not None:
                r.version = version
            if f in r.fields:
                free.append(r.fields[f])
                r.fields[f] = h
                continue
            r.fields[f] = h
            for s in self.graph.consumers_of(f):
                if all(n in r.fields for n in s.needs):
                    self.model_ready(s, rid, r)
        return free

    def model_ready(self, s: StageSpec, rid: int, r: MRow) -> None:
        if not s.group_level:
            r.state[s.name] = "ready"
            self.queues[s.name].append(rid)
            return
        members = [self.rows[x] for x in self.groups[r.gid]]
        if all(all(n in m.fields for n in s.needs) for m in members):
            for m in members:
                m.state[s.name] = "ready"
            self.queues[s.name].append(r.gid)

    def release(self, rid: int) -> list[int]:
        return list(self.rows.pop(rid).fields.values())

    # rules ----------------------------------------------------------------------------------

    @rule(size=st.integers(1, 3), lengths=st.booleans())
    def add_group(self, size: int, lengths: bool) -> None:
        hs = self.fresh(size)
        ls = [7 + i for i in range(size)] if lengths else None
        gid = self.ix.add_group(size, {"prompt": hs}, meta=("m", size), lengths=ls)
        rids = list(range(self.next_row, self.next_row + size))
        self.next_row += size
        assert self.ix.group_rows(gid) == tuple(rids)
        assert self.ix.group_meta(gid) == ("m", size)
        self.groups[gid] = rids
        for i, rid in enumerate(rids):
            self.rows[rid] = MRow(gid, length=ls[i] if ls else 1,
                                  state=dict.fromkeys(self.stages, "waiting"))
        assert self.model_put(rids, "prompt", hs, None) == []

    @precondition(lambda self: self.next_row > 0)
    @rule(data=st.data(), version=st.none() | st.integers(0, 3))
    def put(self, data: st.DataObject, version: int | None) -> None:
        f = data.draw(st.sampled_from(self.graph.fields))
        rids = data.draw(st.lists(st.integers(0, self.next_row - 1), min_size=1, max_size=4,
                                  unique=True))
        hs = self.fresh(len(rids))
        got = self.ix.put(rids, f, hs, version=version)
        self.freed(got, self.model_put(rids, f, hs, version))

    @rule(data=st.data(), up_to=st.integers(1, 4), bound=st.none() | st.integers(0, 3),
          worker=st.sampled_from(["w0", "w1", None]), form=st.booleans())
    def request(self, data: st.DataObject, up_to: int, bound: int | None,
                worker: str | None, form: bool) -> None:
        name = data.draw(st.sampled_from(sorted(self.stages)))
        self.do_request(name, up_to, bound if self.stages[name].consumes_version_bound else None,
                        worker, form=form)

    def do_request(self, name: str, up_to: int, bound: int | None,
                   worker: str | None, *, form: bool = False) -> int | None:
        form = form and worker is None and bound is None
        s = self.stages[name]
        q = self.queues[name]
        taken: list[int] = []
        gids: list[int] = []
        while q and len(gids if s.group_level else taken) < up_to:
            x = q.pop(0)
            members = self.groups[x] if s.group_level else [x]
            rs = [self.rows[m] for m in members]
            if bound is not None and any(r.version is not None and r.version < bound
                                         for r in rs):
                for r in rs:
                    r.state[name] = "stale"
                self.stale[rs[0].gid] = None
                continue
            for r in rs:
                r.state[name] = "in_flight"
                r.flight.add(name)
            taken.extend(members)
            gids.append(x)
        if form:  # a task that waits for its worker, as the scheduler forms rollout tasks
            task = self.ix.form(name, up_to)
        else:
            task = self.ix.request(name, up_to, min_version=bound, worker=worker)
        if not taken:
            assert task is None
            return None
        assert task is not None
        assert task.rows == tuple(taken)
        assert task.row_groups == tuple(self.rows[r].gid for r in taken)
        if s.group_level:
            assert task.groups == tuple(gids)
        else:
            assert task.groups == tuple(dict.fromkeys(self.rows[r].gid for r in taken))
        assert task.handles == {f: [self.rows[r].fields[f] for r in taken] for f in s.needs}
        assert task.lengths == tuple(self.rows[r].length for r in taken)
        assert task.versions == tuple(self.rows[r].version for r in taken)
        assert task.tokens == sum(task.lengths)
        assert task.worker == worker
        assert task.id not in self.tasks
        self.tasks[task.id] = (name, task.rows, task.groups, worker)
        if worker is not None:
            self.handed.append(task.id)
        elif form:
            self.formed.add(task.id)
        return task.id

    @precondition(lambda self: self.tasks)
    @rule(data=st.data(), version=st.none() | st.integers(0, 3), lengths=st.booleans())
    def complete(self, data: st.DataObject, version: int | None, lengths: bool) -> None:
        tid = data.draw(st.sampled_from(sorted(self.tasks)))
        self.do_complete(tid, version, lengths)

    def do_complete(self, tid: int, version: int | None, lengths: bool) -> None:
        name, rids, _, _ = self.tasks.pop(tid)
        self.formed.discard(tid)
        s = self.stages[name]
        produced = {f: self.fresh(len(rids)) for f in s.produces}
        ls = [100 + i for i in range(len(rids))] if lengths else None
        got = self.ix.complete(tid, produced, version=version, lengths=ls)
        expected: list[int] = []
        consumed: list[int] = []
        for rid in rids:
            r = self.rows[rid]
            r.flight.discard(name)
            if r.dropped:
                if not r.flight:
                    expected += self.release(rid)
                continue
            assert (rid, name) not in self.consumed, "consumed twice"
            self.consumed.add((rid, name))
            r.state[name] = "done"
            consumed.append(rid)
            if ls:
                r.length = ls[rids.index(rid)]
        for f, hs in produced.items():
            expected += self.model_put(list(rids), f, hs, version)
        if version is not None and not produced:
            for rid in consumed:
                self.rows[rid].version = version
        for rid in consumed:
            r = self.rows[rid]
            if all(v == "done" for v in r.state.values()):
                expected += self.release(rid)
                assert not self.ix.has_row(rid)
        self.freed(got, expected)
        # A group disappears once none of its rows is live.
        for gid in list(self.groups):
            if not any(x in self.rows and not self.rows[x].dropped for x in self.groups[gid]):
                del self.groups[gid]

    @precondition(lambda self: self.tasks)
    @rule(data=st.data())
    def fail(self, data: st.DataObject) -> None:
        tid = data.draw(st.sampled_from(sorted(self.tasks)))
        name, rids, gids, _ = self.tasks.pop(tid)
        self.formed.discard(tid)
        s = self.stages[name]
        expected: list[int] = []
        back: list[int] = []
        for rid in rids:
            r = self.rows[rid]
            r.flight.discard(name)
            if r.dropped:
                if not r.flight:
                    expected += self.release(rid)
                continue
            r.state[name] = "ready"
            back.append(rid)
        if s.group_level:
            self.queues[name][:0] = [g for g in gids if g in self.groups]
        else:
            self.queues[name][:0] = back
        self.freed(self.ix.fail(tid), expected)
        with pytest.raises(UnknownTask):
            self.ix.fail(tid)

    @precondition(lambda self: any(v[3] is None for v in self.tasks.values()))
    @rule(data=st.data(), worker=st.sampled_from(["w0", "w1"]))
    def bind(self, data: st.DataObject, worker: str) -> None:
        tid = data.draw(st.sampled_from(sorted(t for t, v in self.tasks.items() if v[3] is None)))
        name, rids, gids, _ = self.tasks[tid]
        task = self.ix.bind(tid, worker)
        assert (task.id, task.rows, task.groups, task.worker) == (tid, rids, gids, worker)
        self.tasks[tid] = (name, rids, gids, worker)
        self.formed.discard(tid)
        self.handed.append(tid)
        with pytest.raises(ValueError, match="already"):
            self.ix.bind(tid, worker)

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def drop_group(self, data: st.DataObject) -> None:
        gid = data.draw(st.sampled_from(sorted(self.groups)))
        self.do_drop(gid)

    def do_drop(self, gid: int) -> None:
        rids = self.groups.pop(gid)
        self.stale.pop(gid, None)
        expected: list[int] = []
        for name, q in self.queues.items():
            dead = {gid} if self.stages[name].group_level else set(rids)
            q[:] = [x for x in q if x not in dead]
        for rid in rids:
            r = self.live(rid)
            if r is None:
                continue
            if r.flight:
                r.dropped = True
            else:
                expected += self.release(rid)
        self.freed(self.ix.drop_group(gid), expected)

    @rule()
    def take_stale(self) -> None:
        got = self.ix.take_stale()
        assert got == list(self.stale)
        self.stale.clear()
        for gid in got:
            self.do_drop(gid)

    @rule(tid=st.integers(-2, 3))
    def unknown_task(self, tid: int) -> None:
        if tid in self.tasks:
            return
        with pytest.raises(UnknownTask):
            self.ix.complete(tid)
        with pytest.raises(UnknownTask):
            self.ix.bind(tid, "w0")

    # invariants -----------------------------------------------------------------------------

    @invariant()
    def matches_model(self) -> None:
        self.ix.audit()  # maintained counters equal a full recount
        stats = self.ix.statistics()
        live = {rid: r for rid, r in self.rows.items() if not r.dropped}
        assert stats.rows == len(live)
        assert stats.draining_rows == len(self.rows) - len(live)
        assert stats.groups == len(self.groups)
        assert stats.tasks_formed == len(self.formed)
        assert stats.tasks_in_flight == len(self.tasks) - len(self.formed)
        for rid, r in live.items():
            assert self.ix.row_states(rid) == r.state
            assert self.ix.row_version(rid) == r.version
        for name in self.stages:
            counts = Counter(r.state[name] for r in live.values())
            ss = stats.stages[name]
            assert (ss.waiting, ss.ready, ss.in_flight, ss.done, ss.stale) == (
                counts["waiting"], counts["ready"], counts["in_flight"], counts["done"],
                counts["stale"])
            assert ss.queue_depth == len(self.queues[name])
            head = self.queues[name][:3]
            assert self.ix.queued_groups(name, 3) == (
                head if self.stages[name].group_level else [self.rows[r].gid for r in head])
        versions = [r.version for r in live.values() if r.version is not None]
        assert stats.min_version == (min(versions) if versions else None)
        assert stats.max_version == (max(versions) if versions else None)
        for w in ("w0", "w1"):
            assert self.ix.in_flight_of(w) == [
                t for t in self.handed if t in self.tasks and self.tasks[t][3] == w]

    def teardown(self) -> None:
        try:
            self.drain()
        finally:
            index_module._COMPACT_MIN = self._compact_min

    def drain(self) -> None:
        # Drive everything to the end: every row retires or is dropped, every handle is freed.
        for tid in sorted(self.tasks):
            self.do_complete(tid, 3, False)
        for _ in range(len(self.stages) + 2):
            for spec in self.graph.order:
                while (new := self.do_request(spec.name, 100, None, None)) is not None:
                    self.do_complete(new, 3, False)
            self.take_stale()
        assert self.rows == {}
        assert self.outstanding == set(), "handles never freed"
        sizes = self.ix.audit()
        assert all(v == 0 for v in sizes.values()), sizes
        stats = self.ix.statistics()
        assert stats.added_total == stats.retired_total + stats.dropped_total


class GroupIndexMachine(IndexMachine):
    GRAPH = staticmethod(group_graph)


_settings = settings(max_examples=120, stateful_step_count=40, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])

TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = _settings
TestGroupIndexMachine = GroupIndexMachine.TestCase
TestGroupIndexMachine.settings = _settings
