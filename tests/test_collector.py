"""The run's garbage collector (`flowrl.control.collector`), on the process's real collector.

Automatic collections are disabled around each test, so whether a cycle is freed depends only
on what `RunCollector` does."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from flowrl.control.collector import FULL_COLLECTION_SHARE, RUN_GC_THRESHOLD, RunCollector

pytestmark = pytest.mark.timeout(30)


class _Node:
    """A cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def _garbage_cycle() -> weakref.ref[_Node]:
    return weakref.ref(_Node())


@pytest.fixture
def quiet_collector() -> Iterator[None]:
    assert gc.get_freeze_count() == 0, "another test left objects frozen"
    threshold = gc.get_threshold()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()
        gc.set_threshold(*threshold)


def test_a_run_freezes_what_lives_and_gives_the_collector_back(quiet_collector: None) -> None:
    before = gc.get_threshold()
    c = RunCollector()
    c.start(now=0.0)
    assert c.owned
    assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == (RUN_GC_THRESHOLD, *before[1:])
    c.close()
    assert not c.owned
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == before


def test_a_commit_freezes_what_lives_and_restarts_the_young_count(
        quiet_collector: None) -> None:
    c = RunCollector(full_every_s=60.0)
    c.start(now=0.0)
    held = [[i] for i in range(5_000)]  # lists in flight across the commit
    frozen = gc.get_freeze_count()
    assert gc.get_count()[0] > 1_000  # the step's objects, young
    c.committed(now=1.0)
    assert gc.get_freeze_count() >= frozen + 5_000
    assert gc.get_count()[0] < 100  # a step starts with none of its threshold used
    assert c.full_collections == 0
    c.close()
    del held


def test_a_cycle_frozen_at_a_commit_is_freed_by_the_next_full_collection(
        quiet_collector: None) -> None:
    """A freeze keeps garbage too (it cannot tell): a minute later it is collected."""
    c = RunCollector(full_every_s=60.0)
    c.start(now=0.0)
    cycle = _garbage_cycle()
    c.committed(now=30.0)  # frozen with the step's live objects
    gc.collect()
    assert cycle() is not None, "frozen: no collection reaches it"
    c.committed(now=59.0)
    assert cycle() is not None
    assert c.full_collections == 0
    c.committed(now=60.0)
    assert cycle() is None
    assert c.full_collections == 1
    assert c.last_freed >= 1
    assert gc.get_freeze_count() > 0  # frozen again after the collection
    c.close()


def test_a_collector_frozen_before_the_run_is_left_alone(quiet_collector: None) -> None:
    gc.freeze()
    before = (gc.get_threshold(), gc.get_freeze_count())
    c = RunCollector(full_every_s=0.0)
    c.start(now=0.0)
    assert not c.owned
    cycle = _garbage_cycle()
    c.committed(now=100.0)
    assert cycle() is not None
    assert c.full_collections == 0
    c.close()
    assert gc.get_threshold() == before[0]
    # Not unfrozen (that empties the permanent generation). A frozen object may still die
    # meanwhile (a thread of an earlier test ending), so the count is not compared exactly.
    assert gc.get_freeze_count() > before[1] // 2
    gc.collect()
    assert cycle() is None


def test_a_long_full_collection_puts_off_the_next(quiet_collector: None) -> None:
    """Full collections take at most `FULL_COLLECTION_SHARE` of the time: with no minimum
    interval, the next is due after 100 times the last one's length, not at the next commit."""
    c = RunCollector(full_every_s=0.0)
    c.start(now=0.0)
    held = [[i] for i in range(200_000)]  # something to scan
    c.committed(now=0.0)
    assert c.full_collections == 1
    took = c.last_full_s
    assert took > 0
    assert c.next_full_at == pytest.approx(took / FULL_COLLECTION_SHARE)
    c.committed(now=c.next_full_at / 2)
    assert c.full_collections == 1
    c.committed(now=c.next_full_at)
    assert c.full_collections == 2
    c.close()
    del held
