"""CPU contention as processor sharing: how much slower each role's tasks run on shared cores.

When more threads are busy than there are cores, each runs at ``cores / busy`` of its speed.
What a role's tasks suffer is that factor averaged over the time they were busy, so it depends
on *when* the pools are busy together, not only on how busy each is on average: two rollout
workers that start together after every commit slow each other and the trainer far more than
their mean busy shares say (bench/README.md, the planner). The planner (`flowrl.plan`) computes
it on a replay of the recorded settings and on a replay of a plan, and stretches each role's
times by the ratio.

``background`` is CPU demand that is not a task (the controller's process), counted as that
many busy threads all the time.

Pure: intervals in, factors out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["Busy", "slowdowns", "stretches"]


@dataclass(frozen=True, slots=True)
class Busy:
    """``threads`` threads of a ``role`` worker busy from ``start`` to ``end`` (seconds)."""

    role: str
    start: float
    end: float
    threads: int = 1


def slowdowns(busy: Iterable[Busy], cores: float, background: float = 0.0) -> dict[str, float]:
    """Per role, the mean of ``max(1, (busy threads + background) / cores)`` over the role's
    busy thread-time (1.0 for a role never busy)."""
    edges: list[tuple[float, int, str]] = []
    for b in busy:
        if b.end > b.start:
            edges += [(b.start, b.threads, b.role), (b.end, -b.threads, b.role)]
    edges.sort(key=lambda e: (e[0], e[1]))  # ends before starts at the same instant
    running: dict[str, int] = {}
    total = 0
    weighted: dict[str, float] = {}
    weight: dict[str, float] = {}
    last = edges[0][0] if edges else 0.0
    for t, delta, role in edges:
        dt = t - last
        if dt > 0 and total > 0:
            factor = max(1.0, (total + background) / cores)
            for r, k in running.items():
                if k:
                    weighted[r] = weighted.get(r, 0.0) + k * dt * factor
                    weight[r] = weight.get(r, 0.0) + k * dt
        last = t
        running[role] = running.get(role, 0) + delta
        total += delta
    return {r: weighted[r] / w for r, w in weight.items() if w > 0}


def stretches(planned: Mapping[str, float], recorded: Mapping[str, float]) -> dict[str, float]:
    """Per role of the plan: how much longer its tasks take than recorded (a role the recorded
    run did not time keeps its times)."""
    return {r: x / recorded[r] if r in recorded else 1.0 for r, x in planned.items()}
