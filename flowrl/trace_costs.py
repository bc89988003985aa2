"""Simulated costs drawn from a recorded run (`flowrl.run_trace`), for ``workers.sim``.

Per role, a task's time is modelled as ``base + per_row × rows``: least squares over the
recorded tasks when at least two task sizes are common in the trace (each a tenth of the
tasks, five at least), else through 0 (the time scales with the rows: a few tasks of a rare
size, often measured while something else ran, would set the fixed part badly); times
a ratio drawn from the recorded tasks' own ratios to that line, so the replay keeps the run's
spread and its long tail. A train task that ends a step draws its ratio from the recorded step
ends' own (they also run the optimizer step and write the weights). Response lengths and weight
loads are drawn from the recorded ones. All draws go through the caller's random generator, so
a seeded replay is repeatable.

``stretch`` multiplies every time, one factor or one per role (`flowrl.contention`): the
planner's account of CPU contention when a changed plan keeps more threads busy at once on the
same cores than the recorded run did. A weight load is a rollout worker's, stretched as its
tasks are.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Mapping
from dataclasses import dataclass

from flowrl.run_trace import RunTrace, TaskRecord

__all__ = ["RoleCost", "TraceCosts"]

#: a task size is common in a trace with this share of its tasks, and this many at least
COMMON_SHARE, COMMON_MIN = 0.1, 5


@dataclass(frozen=True)
class RoleCost:
    base: float
    per_row: float
    #: recorded time / modelled time of each recorded task
    ratios: tuple[float, ...]
    #: the same ratios of the recorded step ends (train only)
    end_ratios: tuple[float, ...] = ()

    def line(self, rows: int) -> float:
        return self.base + self.per_row * rows

    @classmethod
    def fit(cls, tasks: list[TaskRecord]) -> RoleCost | None:
        plain = [t for t in tasks if not t.step_end and t.rows > 0] or [
            t for t in tasks if t.rows > 0]
        if not plain:
            return None
        sizes = collections.Counter(t.rows for t in plain)
        common = {n for n, k in sizes.items() if k >= max(COMMON_MIN, len(plain) * COMMON_SHARE)}
        fitted = [t for t in plain if t.rows in common]
        if len(common) >= 2:
            base, per_row = _line([t.rows for t in fitted], [t.s for t in fitted])
        else:
            base, per_row = 0.0, sum(t.s for t in plain) / sum(t.rows for t in plain)
        cost = cls(base, per_row, ())
        ratios = tuple(t.s / cost.line(t.rows) for t in plain if cost.line(t.rows) > 0)
        ends = tuple(t.s / cost.line(t.rows) for t in tasks
                     if t.step_end and cost.line(t.rows) > 0)
        return cls(base, per_row, ratios or (1.0,), ends)

    def draw(self, rows: int, rng: random.Random, *, step_end: bool = False) -> float:
        ratios = self.end_ratios if step_end and self.end_ratios else self.ratios
        return self.line(rows) * rng.choice(ratios)


def _line(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x`` with ``a, b >= 0``; a line through 0 when ``x`` is one
    value (nothing tells the fixed part from the part per row)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0, my / mx if mx else 0.0
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    a = my - b * mx
    if b < 0:
        return my, 0.0
    if a < 0:
        return 0.0, sum(y * x for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
    return a, b


class TraceCosts:
    def __init__(self, trace: RunTrace, *, stretch: float | Mapping[str, float] = 1.0) -> None:
        self.stretch = stretch
        roles = {t.role for t in trace.tasks}
        self.roles: dict[str, RoleCost] = {}
        for role in sorted(roles):
            fitted = RoleCost.fit(trace.tasks_of(role))
            if fitted is not None:
                self.roles[role] = fitted
        self.lengths = tuple(n for t in trace.tasks for n in t.lengths)
        self.syncs = tuple(s.s for s in trace.syncs)

    def task_s(self, role: str, rows: int, rng: random.Random, *,
               step_end: bool = False) -> float | None:
        """A task's seconds; None when the trace has no task of ``role``."""
        cost = self.roles.get(role)
        if cost is None:
            return None
        return cost.draw(rows, rng, step_end=step_end) * self.stretch_of(role)

    def stretch_of(self, role: str) -> float:
        if isinstance(self.stretch, Mapping):
            return self.stretch.get(role, 1.0)
        return self.stretch

    def length(self, rng: random.Random) -> int | None:
        """A response length; None when the trace has none."""
        return rng.choice(self.lengths) if self.lengths else None

    def sync_s(self, rng: random.Random) -> float | None:
        """A weight load's seconds; None when the trace has none."""
        return rng.choice(self.syncs) * self.stretch_of("rollout") if self.syncs else None
