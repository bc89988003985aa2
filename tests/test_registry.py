"""Scheduler decisions of the worker registry, driven by plain calls and a fake clock."""

from __future__ import annotations

from flowrl.registry import Registry


def make(n: int, *, capacity: int = 1, tasks_per_slot: int = 2) -> tuple[Registry, list[str]]:
    reg = Registry(heartbeat_timeout_s=10.0, tasks_per_slot=tasks_per_slot)
    ids = [reg.register(name=f"w{i}", role="reward", node="n0", pid=100 + i,
                        capacity=capacity, version=0, now=0.0).worker_id for i in range(n)]
    return reg, ids


def test_dispatch_goes_to_the_least_loaded_worker_by_tokens() -> None:
    reg, (a, b, c) = make(3)
    wa, wb, wc = (reg.get(x) for x in (a, b, c))
    assert wa
    assert wb
    assert wc
    reg.assign(wa, 1, load=500)
    reg.assign(wb, 2, load=100)
    reg.assign(wc, 3, load=300)
    assert reg.least_loaded("reward") is wb
    reg.finish(wa, 1, ok=True)  # a is idle again: nothing beats an idle worker
    assert reg.least_loaded("reward") is wa


def test_a_worker_holds_at_most_capacity_times_tasks_per_slot() -> None:
    reg, (a,) = make(1, capacity=2, tasks_per_slot=2)
    w = reg.get(a)
    assert w is not None
    for task in range(4):
        assert reg.least_loaded("reward") is w
        reg.assign(w, task, load=1)
    assert reg.least_loaded("reward") is None  # full: the next task waits in the index
    reg.finish(w, 0, ok=False)
    assert reg.least_loaded("reward") is w
    assert (w.done, w.failed) == (0, 1)


def test_version_bound_excludes_workers_serving_old_weights() -> None:
    reg, (a, b) = make(2)
    wa, wb = reg.get(a), reg.get(b)
    assert wa
    assert wb
    wb.version = 3
    assert reg.least_loaded("reward", min_version=2) is wb
    assert reg.least_loaded("reward", min_version=4) is None


def test_missed_heartbeats_expire_on_the_fake_clock() -> None:
    reg, (a, b) = make(2)
    assert reg.next_deadline() == 10.0
    reg.heartbeat(a, now=8.0)
    assert [w.worker_id for w in reg.expired(now=10.5)] == [b]
    assert reg.expired(now=17.9) != []
    assert reg.get(a) is not None
    reg.remove(b)
    assert reg.least_loaded("reward") is reg.get(a)
    assert reg.expired(now=17.9) == []
    assert [w.worker_id for w in reg.expired(now=18.1)] == [a]


def test_a_removed_worker_is_never_chosen_again() -> None:
    reg, (a,) = make(1)
    w = reg.get(a)
    assert w is not None
    reg.assign(w, 1, load=5)
    reg.remove(a)
    reg.finish(w, 1, ok=False)  # a late report after removal must not resurrect it
    assert reg.least_loaded("reward") is None
    assert len(reg) == 0


def test_the_worker_idle_longest_gets_the_next_task() -> None:
    """Idle workers are kept apart, longest idle first: dispatch takes one without scanning
    the busy ones (a thousand of them ahead of it in registration order)."""
    reg, ids = make(1001)
    workers = [reg.get(x) for x in ids]
    for i, w in enumerate(workers):
        assert w is not None
        reg.assign(w, i, load=1)
    first, last = workers[0], workers[-1]
    assert first is not None
    assert last is not None
    reg.finish(last, 1000, ok=True)
    reg.finish(first, 0, ok=True)
    assert reg.least_loaded("reward") is last
    reg.assign(last, 1001, load=1)
    assert reg.least_loaded("reward") is first
    assert reg.least_loaded("reward", min_version=1) is None


def test_versions_are_indexed_as_workers_switch_work_and_leave() -> None:
    """The registry counts the workers of each version and keeps idle ones by version: a
    worker's version set on it moves it in both, idle or busy."""
    reg, ids = make(3)
    a, b, c = (reg.get(x) for x in ids)
    assert a is not None
    assert b is not None
    assert c is not None
    reg.assign(a, 1, load=1)
    b.version = 2  # idle
    a.version = 1  # busy
    assert reg.versions("reward") == {0, 1, 2}
    assert reg.least_loaded("reward") is b  # the newest version an idle worker serves
    assert reg.least_loaded("reward", min_version=1) is b
    reg.assign(b, 2, load=5)
    assert reg.least_loaded("reward") is c
    assert reg.least_loaded("reward", min_version=1) is a  # busy, with a free slot, less load
    assert reg.least_loaded("reward", min_version=2) is b  # the only one of version 2
    assert reg.least_loaded("reward", min_version=3) is None
    reg.finish(a, 1, ok=True)
    assert reg.least_loaded("reward", min_version=1) is a  # idle again, at its new version
    reg.remove(a.worker_id)
    a.version = 5  # a removed worker's version counts no more
    assert reg.versions("reward") == {0, 2}
    assert reg.least_loaded("reward", min_version=1) is b
    c.version = 2
    reg.finish(b, 2, ok=True)
    assert reg.versions("reward") == {2}
    assert reg.least_loaded("reward", min_version=2) is c  # idle longest at version 2
