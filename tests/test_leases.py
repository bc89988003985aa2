"""Leases (`flowrl.control.leases`): hand-checked refusals, then a stateful check that any
interleaving of grants, completions (genuine, late, duplicated or forged), give-backs, agent
deaths and restarts, and expiries never completes a row twice and never loses one.

The machine drives a real `Index` (one row-level stage) through the table the way the
controller does: tasks are requested from the index and leased; a completion reaches the index
only when the table accepts it; returned tasks are failed back into the index.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from flowrl.control.leases import Leases, Verdict, leasable, split
from flowrl.graph import StageGraph, StageSpec
from flowrl.index import Index, Task
from flowrl.pipeline import grpo_stages, ppo_stages

NODES = ("a", "b", "c")
TTL = 10.0


def reward_graph() -> StageGraph:
    return StageGraph([StageSpec("reward", ("response",), ("reward",), micro_batch=3)],
                      source_fields=("response",))


def ready_index(rows: int) -> Index:
    ix = Index(reward_graph())
    ix.add_group(rows, fields={"response": list(range(rows))})
    return ix


def test_only_row_level_stages_are_leasable() -> None:
    stages = {s.name: leasable(s) for s in ppo_stages(group_size=4, reference=True)}
    assert stages == {"rollout": False, "reward": True, "reference": True, "critic": True,
                      "train": False}
    assert [s.name for s in grpo_stages(group_size=4) if leasable(s)] == ["reward"]


def test_a_completion_is_accepted_once_and_only_from_its_holder() -> None:
    ix = ready_index(6)
    leases = Leases(ttl_s=TTL)
    ea, _ = leases.join("a")
    eb, _ = leases.join("b")
    t1, t2 = ix.request("reward"), ix.request("reward")
    assert t1 is not None
    assert t2 is not None
    lease = leases.grant("a", ea, "reward", [t1, t2], now=0.0)
    assert leases.leased("a") == 2
    assert leases.holder(t1.id) is lease
    assert leases.complete("b", eb, lease.id, t1.id, t1.rows, 1.0) is Verdict.OTHER_NODE
    assert leases.complete("a", ea + 1, lease.id, t1.id, t1.rows, 1.0) is Verdict.STALE_EPOCH
    assert leases.complete("a", ea, lease.id + 1, t1.id, t1.rows, 1.0) is Verdict.UNKNOWN_LEASE
    assert leases.complete("a", ea, lease.id, 999, t1.rows, 1.0) is Verdict.NOT_LEASED
    assert leases.complete("a", ea, lease.id, t1.id, t2.rows, 1.0) is Verdict.WRONG_ROWS
    assert leases.complete("a", ea, lease.id, t1.id, t1.rows, 1.0) is Verdict.ACCEPTED
    assert leases.complete("a", ea, lease.id, t1.id, t1.rows, 1.0) is Verdict.ALREADY_DONE
    assert leases.give_back("a", ea, lease.id, t1.id, 1.0) is Verdict.ALREADY_DONE
    assert leases.complete("a", ea, lease.id, t2.id, t2.rows, 1.0) is Verdict.ACCEPTED
    # Its last task done, the lease is over: a duplicate now names no lease at all.
    assert len(leases) == 0
    assert leases.complete("a", ea, lease.id, t2.id, t2.rows, 1.0) is Verdict.UNKNOWN_LEASE


def test_a_dead_agents_leases_come_back_and_its_late_reports_are_refused() -> None:
    ix = ready_index(6)
    leases = Leases(ttl_s=TTL)
    ea, _ = leases.join("a")
    t1, t2 = ix.request("reward"), ix.request("reward")
    assert t1 is not None
    assert t2 is not None
    lease = leases.grant("a", ea, "reward", [t1, t2], now=0.0)
    assert leases.complete("a", ea, lease.id, t1.id, t1.rows, 1.0) is Verdict.ACCEPTED
    assert leases.node_gone("a") == [t2.id]
    assert leases.epoch("a") is None
    with pytest.raises(ValueError, match="no live agent"):
        leases.grant("a", ea, "reward", [t2], now=2.0)
    assert leases.complete("a", ea, lease.id, t2.id, t2.rows, 2.0) is Verdict.UNKNOWN_LEASE
    # A restarted agent gets a new epoch; the old one's reports stay refused.
    ea2, back = leases.join("a")
    assert ea2 == ea + 1
    assert back == []


def test_a_restarted_agent_returns_what_its_previous_incarnation_held() -> None:
    ix = ready_index(3)
    leases = Leases(ttl_s=TTL)
    ea, _ = leases.join("a")
    t = ix.request("reward")
    assert t is not None
    lease = leases.grant("a", ea, "reward", [t], now=0.0)
    ea2, back = leases.join("a")
    assert back == [t.id]
    assert leases.complete("a", ea, lease.id, t.id, t.rows, 1.0) is Verdict.UNKNOWN_LEASE
    assert leases.epoch("a") == ea2


def test_a_lease_not_renewed_expires_and_renewal_keeps_it() -> None:
    ix = ready_index(6)
    leases = Leases(ttl_s=TTL)
    ea, _ = leases.join("a")
    t1, t2 = ix.request("reward"), ix.request("reward")
    assert t1 is not None
    assert t2 is not None
    kept = leases.grant("a", ea, "reward", [t1], now=0.0)
    lost = leases.grant("a", ea, "reward", [t2], now=0.0)
    assert leases.renew("a", ea, kept.id, now=TTL - 1) is Verdict.ACCEPTED
    assert leases.expire(TTL - 0.5) == []
    assert leases.expire(TTL) == [t2.id]
    assert leases.complete("a", ea, lost.id, t2.id, t2.rows, TTL) is Verdict.UNKNOWN_LEASE
    assert leases.complete("a", ea, kept.id, t1.id, t1.rows, TTL) is Verdict.ACCEPTED


def test_a_grant_is_checked() -> None:
    ix = ready_index(6)
    leases = Leases(ttl_s=TTL)
    ea, _ = leases.join("a")
    t = ix.request("reward")
    assert t is not None
    with pytest.raises(ValueError, match="at least one task"):
        leases.grant("a", ea, "reward", [], now=0.0)
    with pytest.raises(ValueError, match="not 'reference'"):
        leases.grant("a", ea, "reference", [t], now=0.0)
    leases.grant("a", ea, "reward", [t], now=0.0)
    with pytest.raises(ValueError, match="leased already"):
        leases.grant("a", ea, "reward", [t], now=0.0)
    with pytest.raises(ValueError, match="ttl_s"):
        Leases(ttl_s=0.0)


class LeaseMachine(RuleBasedStateMachine):
    """Every report an agent ever had stays replayable: a late, duplicated or forged one must be
    refused, a genuine one accepted exactly once."""

    def __init__(self) -> None:
        super().__init__()
        self.ix = Index(reward_graph())
        self.leases = Leases(ttl_s=TTL)
        self.now = 0.0
        self.epochs: dict[str, int] = {}
        # every task ever leased: (node, epoch, lease id, task)
        self.seen: dict[int, tuple[str, int, int, Task]] = {}
        # the model: task id -> lease id, for the tasks leased and not completed or returned
        self.open: dict[int, int] = {}
        self.expiry: dict[int, float] = {}  # lease id -> its expiry, per the model
        self.rows_added = 0
        self.completed: Counter[int] = Counter()

    # ---- helpers ---------------------------------------------------------------------------

    def _fail_back(self, tids: list[int]) -> None:
        for tid in tids:
            assert tid in self.open, f"returned task {tid} that was not leased"
            del self.open[tid]
            self.ix.fail(tid)

    def _complete(self, tid: int, rows: tuple[int, ...]) -> None:
        del self.open[tid]
        self.ix.complete(tid, {"reward": [0.0] * len(rows)})
        self.completed.update(rows)
        assert all(self.completed[r] == 1 for r in rows), "a row completed twice"

    def _expected(self, tid: int, lease_id: int) -> bool:
        return self.open.get(tid) == lease_id

    # ---- rules -----------------------------------------------------------------------------

    @rule(size=st.integers(1, 5))
    def add_group(self, size: int) -> None:
        self.ix.add_group(size, fields={"response": [None] * size})
        self.rows_added += size

    @rule(node=st.sampled_from(NODES))
    def join(self, node: str) -> None:
        epoch, back = self.leases.join(node)
        assert epoch > self.epochs.get(node, 0)
        self.epochs[node] = epoch
        self._fail_back(back)

    @rule(node=st.sampled_from(NODES), n=st.integers(1, 3), up_to=st.integers(1, 4))
    def grant(self, node: str, n: int, up_to: int) -> None:
        epoch = self.leases.epoch(node)
        if epoch is None:
            return
        tasks = [t for _ in range(n) if (t := self.ix.request("reward", up_to)) is not None]
        if not tasks:
            return
        lease = self.leases.grant(node, epoch, "reward", tasks, self.now)
        self.expiry[lease.id] = self.now + TTL
        for t in tasks:
            self.seen[t.id] = (node, epoch, lease.id, t)
            self.open[t.id] = lease.id

    @precondition(lambda self: self.seen)
    @rule(data=st.data())
    def report(self, data: st.DataObject) -> None:
        """A genuine report, maybe late or a duplicate: accepted iff the task is still open
        under that lease."""
        tid = data.draw(st.sampled_from(sorted(self.seen)))
        node, epoch, lid, task = self.seen[tid]
        want = self._expected(tid, lid)
        verdict = self.leases.complete(node, epoch, lid, tid, task.rows, self.now)
        assert (verdict is Verdict.ACCEPTED) == want, verdict
        if want:
            self.expiry[lid] = self.now + TTL
            self._complete(tid, task.rows)

    @precondition(lambda self: self.seen)
    @rule(data=st.data(), how=st.sampled_from(["node", "epoch", "rows", "task", "lease"]))
    def forged(self, data: st.DataObject, how: str) -> None:
        tid = data.draw(st.sampled_from(sorted(self.seen)))
        node, epoch, lid, task = self.seen[tid]
        rows = task.rows
        if how == "node":
            node = next(n for n in NODES if n != node)
        elif how == "epoch":
            epoch += 1
        elif how == "rows":
            rows = (*rows, 10 ** 6)
        elif how == "task":
            tid = max(self.seen) + 1
        else:
            lid = max(self.expiry) + 1
        verdict = self.leases.complete(node, epoch, lid, tid, rows, self.now)
        assert verdict is not Verdict.ACCEPTED

    @precondition(lambda self: self.seen)
    @rule(data=st.data())
    def give_back(self, data: st.DataObject) -> None:
        tid = data.draw(st.sampled_from(sorted(self.seen)))
        node, epoch, lid, _ = self.seen[tid]
        want = self._expected(tid, lid)
        verdict = self.leases.give_back(node, epoch, lid, tid, self.now)
        assert (verdict is Verdict.ACCEPTED) == want, verdict
        if want:
            self.expiry[lid] = self.now + TTL
            self._fail_back_one(tid)

    def _fail_back_one(self, tid: int) -> None:
        del self.open[tid]
        self.ix.fail(tid)

    @rule(node=st.sampled_from(NODES))
    def dies(self, node: str) -> None:
        back = self.leases.node_gone(node)
        assert sorted(back) == sorted(t for t, lid in self.open.items()
                                      if self.seen[t][0] == node)
        self._fail_back(back)

    @precondition(lambda self: self.open)
    @rule(data=st.data())
    def revoked(self, data: st.DataObject) -> None:
        """The controller takes a lease back (`NodeLeases.recall`): its open tasks, once."""
        lid = self.open[data.draw(st.sampled_from(sorted(self.open)))]
        back = self.leases.revoke(lid)
        assert sorted(back) == sorted(t for t, held in self.open.items() if held == lid)
        assert self.leases.revoke(lid) == []
        self._fail_back(back)

    @precondition(lambda self: self.open)
    @rule(data=st.data())
    def renew(self, data: st.DataObject) -> None:
        tid = data.draw(st.sampled_from(sorted(self.open)))
        node, epoch, lid, _ = self.seen[tid]
        assert self.leases.renew(node, epoch, lid, self.now) is Verdict.ACCEPTED
        self.expiry[lid] = self.now + TTL

    @rule(dt=st.floats(0.0, 2 * TTL))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        back = self.leases.expire(self.now)
        assert sorted(back) == sorted(t for t, lid in self.open.items()
                                      if self.expiry[lid] <= self.now)
        self._fail_back(back)

    # ---- invariants ------------------------------------------------------------------------

    @invariant()
    def every_row_is_done_once_or_still_to_do(self) -> None:
        stats = self.ix.statistics()
        assert stats.tasks_in_flight == len(self.open) == self.leases.leased()
        assert max(self.completed.values(), default=0) <= 1
        # Nothing lost: a row not completed is live in the index, ready or held by a lease.
        assert stats.rows + len(self.completed) == self.rows_added
        reward = stats.stages["reward"]
        assert reward.in_flight == sum(len(self.seen[t][3].rows) for t in self.open)
        assert reward.ready + reward.in_flight == stats.rows
        # Each node's room is asked of counts kept as leases change: they match the leases.
        for node in NODES:
            assert self.leases.held(node, "reward") == sum(
                1 for t in self.open if self.seen[t][0] == node)

    def teardown(self) -> None:
        # Finish the run: whatever is leased completes, the rest is leased to a fresh agent.
        for tid in sorted(self.open):
            node, epoch, lid, task = self.seen[tid]
            assert self.leases.complete(node, epoch, lid, tid, task.rows,
                                        self.now) is Verdict.ACCEPTED
            self._complete(tid, task.rows)
        epoch, back = self.leases.join("z")
        assert back == []
        while (t := self.ix.request("reward", 4)) is not None:
            lease = self.leases.grant("z", epoch, "reward", [t], self.now)
            assert self.leases.complete("z", epoch, lease.id, t.id, t.rows,
                                        self.now) is Verdict.ACCEPTED
            self.ix.complete(t.id, {"reward": [0.0] * len(t.rows)})
            self.completed.update(t.rows)
        assert len(self.completed) == self.rows_added
        assert set(self.completed.values()) <= {1}
        assert len(self.leases) == 0
        assert self.ix.statistics().rows == 0


TestLeaseMachine = LeaseMachine.TestCase
TestLeaseMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


def one_at_a_time(ready: int, room: dict[str, int]) -> dict[str, int]:
    """What `split` computes, by its definition: each task to the node with the most room left
    (ties: by name)."""
    out: dict[str, int] = {}
    left = {n: r for n, r in room.items() if r > 0}
    for _ in range(ready):
        if not left:
            break
        node = min(left, key=lambda n: (-left[n], n))
        out[node] = out.get(node, 0) + 1
        left[node] -= 1
        if not left[node]:
            del left[node]
    return out


def test_scarce_work_is_spread_over_the_nodes_by_their_room() -> None:
    assert split(3, {"a": 4, "b": 4, "c": 0}) == {"a": 2, "b": 1}
    assert split(5, {"a": 1, "b": 10}) == {"b": 5}
    assert split(12, {"a": 1, "b": 10}) == {"a": 1, "b": 10}
    assert split(0, {"a": 3}) == {}
    assert split(4, {}) == {}


@settings(max_examples=300, deadline=None)
@given(ready=st.integers(0, 60),
       room=st.dictionaries(st.sampled_from("abcdef"), st.integers(-2, 20), max_size=6))
def test_a_split_never_exceeds_the_work_or_a_nodes_room_and_is_level(
        ready: int, room: dict[str, int]) -> None:
    out = split(ready, room)
    assert out == one_at_a_time(ready, room)
    assert sum(out.values()) == min(ready, sum(max(0, r) for r in room.values()))
    assert all(0 < k <= room[n] for n, k in out.items())
    # Level: each task went to a node with the most room left at the time, so a node that got
    # some is left with at most one less room than any other node.
    after = {n: r - out.get(n, 0) for n, r in room.items() if r > 0}
    for n in out:
        assert all(after[n] >= a - 1 for a in after.values())
