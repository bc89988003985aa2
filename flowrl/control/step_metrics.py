"""One line of the step log: what a committed step did, with the stages' figures since the
last one."""

from __future__ import annotations

import math
from typing import Any

from flowrl.control.ledger import StepCommit

__all__ = ["StageMetrics", "step_entry"]


class StageMetrics:
    """What the step log shows of other stages' task metrics: reward failures
    (``reward_failed``, ``reward_failed_<kind>``) summed over the step, and the critic's step
    figures (``critic_*``, reported by the task whose rows completed a critic step) as last
    reported. Values that are not finite numbers are ignored."""

    def __init__(self) -> None:
        self._acc: dict[str, float] = {}

    def fold(self, metrics: Any) -> None:
        if not isinstance(metrics, dict):
            return
        acc = self._acc
        for key, value in metrics.items():
            if type(key) is not str or type(value) not in (int, float) or not math.isfinite(value):
                continue
            if key.startswith("reward_failed"):
                acc[key] = acc.get(key, 0.0) + value
            elif key.startswith("critic_"):
                acc[key] = float(value)

    def take(self) -> dict[str, float]:
        """The figures since the last step, forgotten here."""
        out, self._acc = self._acc, {}
        return out


def step_entry(commit: StepCommit, *, served_versions: list[int], wall_s: float,
               since_last_s: float | None, stages: dict[str, float]) -> dict[str, Any]:
    rewards, staleness = commit.rewards, commit.staleness
    return {
        "step": commit.version,
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,
        "samples": commit.samples,
        "samples_per_s": commit.samples / since_last_s if since_last_s else 0.0,
        "staleness_max": max(staleness, default=0),
        "staleness_mean": sum(staleness) / len(staleness) if staleness else 0.0,
        "served_versions": served_versions,
        "wall_s": wall_s,
        "reward_failed": 0.0,
        **stages,
        **{f"train_{k}": v for k, v in (commit.report.get("metrics") or {}).items()},
    }
