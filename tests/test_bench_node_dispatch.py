"""`bench/node_dispatch.py --polls`: every task reaches exactly one waiting poll, tasks that
need a version as well, and a figure is printed for each number of polls (the figures are
bench/README.md's, not a test's)."""

from __future__ import annotations

import pytest

from bench.node_dispatch import polls_async


@pytest.mark.timeout(60)
async def test_the_polls_mode_gives_a_cost_per_task_for_each_count() -> None:
    out = await polls_async([4, 64], tasks=200, rounds=1)  # raises if a task went astray
    assert out["agent_us_per_task_4_polls"] > 0
    assert out["agent_us_per_task_64_polls"] > 0
    assert out["agent_task_cost_ratio"] > 0
    assert out["agent_us_per_versioned_task_4_polls"] > 0
    assert out["agent_us_per_versioned_task_64_polls"] > 0
    assert out["agent_versioned_task_cost_ratio"] > 0
