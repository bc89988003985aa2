"""CPU contention as processor sharing (`flowrl.contention`): exact figures on small schedules."""

from __future__ import annotations

import pytest

from flowrl.contention import Busy, slowdowns, stretches


def test_threads_within_the_cores_run_at_full_speed() -> None:
    busy = [Busy("rollout", 0.0, 1.0), Busy("train", 0.5, 2.0)]
    assert slowdowns(busy, cores=2) == {"rollout": 1.0, "train": 1.0}
    assert slowdowns([], cores=2) == {}


def test_what_a_role_suffers_depends_on_when_the_pools_are_busy_together() -> None:
    # Two rollout workers and a trainer on 2 cores, each busy half the time: same mean demand
    # (1.5 threads) in both schedules.
    together = [Busy("rollout", 0, 1), Busy("rollout", 0, 1), Busy("train", 0, 1),
                Busy("train", 1, 2)]
    apart = [Busy("rollout", 0, 1), Busy("rollout", 1, 2), Busy("train", 0, 1),
             Busy("train", 1, 2)]
    assert slowdowns(together, cores=2) == {"rollout": 1.5, "train": pytest.approx(1.25)}
    assert slowdowns(apart, cores=2) == {"rollout": 1.0, "train": 1.0}


def test_threads_and_a_background_load_count() -> None:
    # one worker of 2 threads alone on 2 cores, with the controller's 0.5 of a core beside it
    assert slowdowns([Busy("train", 0, 4, threads=2)], cores=2,
                     background=0.5) == {"train": 1.25}
    # the background alone slows nothing: no task runs
    assert slowdowns([Busy("train", 0, 1), Busy("train", 2, 3)], cores=1,
                     background=0.5) == {"train": 1.5}


def test_stretches_are_the_plans_slowdowns_over_the_recorded_ones() -> None:
    assert stretches({"rollout": 1.5, "train": 1.2, "critic": 1.1},
                     {"rollout": 1.0, "train": 1.2}) == {
        "rollout": 1.5, "train": 1.0, "critic": 1.0}
