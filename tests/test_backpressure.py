"""The store-backpressure policy (`flowrl.backpressure`) with plain calls and a fake clock.

The end-to-end behaviour (a small store completes with admission paused, a store too small for
a step stops the run) is in tests/test_load.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from flowrl.backpressure import StoreBackpressure, summarize

PAGE = 4096


def stats(used: int, *, capacity: int = 32 * PAGE, pooled: int = 0, waiting: int = 0,
          node: str = "node0") -> dict[str, Any]:
    """A store server's ``stats`` reply."""
    return {"node": node, "capacity_bytes": capacity, "used_bytes": used,
            "pooled_bytes": pooled, "segments": 1, "waiting_puts": waiting}


def test_summarize_sums_nodes_and_names_the_fullest() -> None:
    a = stats(8 * PAGE, capacity=16 * PAGE, pooled=4 * PAGE, waiting=1, node="a")
    b = stats(12 * PAGE, capacity=16 * PAGE, waiting=2, node="b")
    fill = summarize({**a, "nodes": {"a": a, "b": b}})
    assert fill is not None
    assert (fill.capacity, fill.held, fill.waiting) == (32 * PAGE, 16 * PAGE, 3)
    assert (fill.fullest_node, fill.fullest) == ("b", 0.75)
    assert summarize({}) is None


def test_the_next_steps_groups_are_always_admitted() -> None:
    bp = StoreBackpressure(high_water=0.8, groups_per_step=4)
    bp.observe(stats(32 * PAGE, waiting=3), landed_groups=4)  # full, puts waiting
    assert all(bp.admits(untrained, 0.0) for untrained in range(4))
    assert not bp.admits(4, 0.0)  # a later step's group waits
    assert bp.paused


def test_later_groups_wait_for_a_measurement() -> None:
    bp = StoreBackpressure(high_water=0.8, groups_per_step=4)
    assert bp.room(4) is None
    assert not bp.admits(4, 0.0)
    assert not bp.paused  # not measured is not "paused for the store"
    bp.observe(stats(0), landed_groups=0)
    assert bp.room(4) is None
    bp.observe(stats(2 * PAGE), landed_groups=1)
    assert bp.group_bytes == 2 * PAGE
    assert bp.room(4)


def test_admission_projects_the_admitted_groups_data() -> None:
    bp = StoreBackpressure(high_water=0.5, groups_per_step=2)
    bp.observe(stats(2 * PAGE, capacity=16 * PAGE), landed_groups=2)  # one page a group
    # Under the mark now, and with every admitted group's data in: up to 8 pages.
    assert bp.room(7)
    assert not bp.room(8)
    # Above the mark on the fullest node: no later group whatever the projection says.
    bp.observe(stats(9 * PAGE, capacity=16 * PAGE), landed_groups=9)
    assert not bp.room(2)
    assert bp.room(1)
    # Pooled (freed, warm) bytes are given up before a put waits: not held.
    bp.observe(stats(9 * PAGE, capacity=16 * PAGE, pooled=6 * PAGE), landed_groups=3)
    assert bp.room(5)


def test_pauses_are_counted_and_timed() -> None:
    bp = StoreBackpressure(high_water=0.8, groups_per_step=1)
    bp.observe(stats(30 * PAGE), landed_groups=1)
    assert not bp.admits(1, 10.0)
    assert not bp.admits(1, 11.0)  # still the same pause
    assert bp.paused_s(12.5) == pytest.approx(2.5)
    bp.observe(stats(PAGE), landed_groups=1)
    assert bp.admits(1, 13.0)
    assert not bp.paused
    bp.observe(stats(30 * PAGE), landed_groups=1)
    assert not bp.admits(1, 20.0)
    assert bp.pauses == 2
    st = bp.statistics(21.0)
    assert st["paused"] is True
    assert st["pauses"] == 2
    assert st["paused_s"] == pytest.approx(4.0)
    assert st["held_bytes"] == 30 * PAGE


def test_a_stall_needs_waiting_puts_only_blocked_tasks_and_no_progress() -> None:
    bp = StoreBackpressure(high_water=0.8, groups_per_step=4, stall_s=6.0)
    bp.observe(stats(32 * PAGE, waiting=2), landed_groups=4)
    assert not bp.stalled(("m", 1), started=2, now=0.0)  # suspected from now on
    assert not bp.stalled(("m", 1), started=2, now=5.9)
    assert bp.stalled(("m", 1), started=2, now=6.0)
    # Progress restarts the clock.
    assert not bp.stalled(("m", 2), started=2, now=7.0)
    assert not bp.stalled(("m", 2), started=2, now=12.9)
    # A started task that is not waiting on a put may still finish and free memory.
    assert not bp.stalled(("m", 3), started=3, now=14.0)
    assert not bp.stalled(("m", 3), started=3, now=30.0)
    # A look that finds a put between two reserve polls does not restart the clock.
    assert not bp.stalled(("m", 4), started=2, now=31.0)  # suspected from now on
    bp.observe(stats(32 * PAGE, waiting=1), landed_groups=4)
    assert not bp.stalled(("m", 4), started=2, now=34.0)
    bp.observe(stats(32 * PAGE, waiting=2), landed_groups=4)
    assert bp.stalled(("m", 4), started=2, now=37.0)
    # No put waiting: no stall, whatever else.
    bp.observe(stats(32 * PAGE, waiting=0), landed_groups=4)
    assert not bp.stalled(("m", 2), started=0, now=40.0)


def test_the_stall_error_names_capacity_need_and_the_field() -> None:
    bp = StoreBackpressure(high_water=0.8, groups_per_step=4, stall_s=6.0)
    bp.observe(stats(4 * PAGE, capacity=4 * PAGE, waiting=1), landed_groups=4)
    bp.stalled("m", started=1, now=0.0)
    msg = bp.too_small(weights_bytes=PAGE, now=6.5)
    assert "16384-byte capacity" in msg
    assert "1 put(s) have waited 6.5s or longer" in msg
    assert "4 groups x ~4096 bytes + one weight version of 4096 bytes" in msg
    assert "about 20480 bytes" in msg
    assert "placement.store_capacity_mb" in msg


def test_high_water_is_checked() -> None:
    with pytest.raises(ValueError, match="store_high_water"):
        StoreBackpressure(high_water=0.0, groups_per_step=1)
