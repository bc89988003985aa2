"""One line of the step log: what a committed step did, with the stages' figures since the
last one; and the failure budget that ends a run whose reward function keeps failing."""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from flowrl.control.ledger import StepCommit
from flowrl.control.reports import TaskReport
from flowrl.index import Task

__all__ = ["FALLBACK_KINDS", "FailureBudget", "StageMetrics", "StepFailures", "TooManyFailures",
           "step_entry"]

#: failure kinds that are a grader's deliberate fallback (a judge's verdict without a score):
#: counted like the others, never held against the failure budget
FALLBACK_KINDS = frozenset({"unparsable"})
#: task-report counters summed into the step log as ``<stage>_<key>`` (an episode rollout's
#: tool calls, tool failures by kind, episodes cut by a limit, turns, decode forwards and the
#: sequences they carried)
COUNTED_PREFIXES = ("tool_", "episodes_cut_", "interrupted_", "turns", "decode_")


@dataclass
class StepFailures:
    """The samples of one step a stage failed on: how many of each kind, and one error each."""

    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    errors: dict[str, str] = field(default_factory=dict)


class StageMetrics:
    """What the step log shows of other stages' task reports.

    Failed rows (a report's ``failed``: rows whose values are fallbacks, such as rewards of 0
    where the reward function raised) are counted for the step that trains them, as
    ``<stage>_failed`` and ``<stage>_failed_<kind>``: a step's count never exceeds its samples,
    whichever tasks scored its rows (a reward task may hold rows of two steps, and rows of later
    steps are scored before this one commits). The critic's step figures (``critic_*``,
    reported by the task whose rows completed a critic step) are shown as last reported;
    counters (`COUNTED_PREFIXES`, such as ``rollout_tool_calls``) are summed over the tasks
    reported since the last step; values that are not finite numbers are ignored.
    """

    def __init__(self) -> None:
        self._acc: dict[str, float] = {}
        # row -> (stage, kind, error) for rows whose value is a fallback, until they train
        self._failed: dict[int, tuple[str, str, str]] = {}

    def fold(self, task: Task, report: TaskReport) -> None:
        """A task of a stage other than train was reported."""
        failed = self._failed
        for kind, (offsets, error) in report.failed.items():
            for i in offsets:
                failed[task.rows[i]] = (task.stage, kind, error)
        metrics = report.metrics
        for key, value in metrics.items():
            if type(key) is not str or type(value) not in (int, float) or not math.isfinite(value):
                continue
            if key.startswith("critic_"):
                self._acc[key] = float(value)
            elif key.startswith(COUNTED_PREFIXES):
                name = f"{task.stage}_{key}"
                self._acc[name] = self._acc.get(name, 0.0) + float(value)

    def take(self, tasks: Sequence[Task], alive: Callable[[int], bool]
             ) -> tuple[dict[str, float], dict[str, StepFailures]]:
        """The figures of the step that trained ``tasks`` (and the stages' figures since the
        last step), forgotten here; ``alive(row)``: whether a row may still train (rows
        dropped as too stale never do, and are forgotten)."""
        out, self._acc = self._acc, {}
        failures: dict[str, StepFailures] = {}
        failed = self._failed
        for task in tasks:
            for rid in task.rows:
                hit = failed.pop(rid, None)
                if hit is None:
                    continue
                stage, kind, error = hit
                f = failures.setdefault(stage, StepFailures())
                f.counts[kind] += 1
                f.errors.setdefault(kind, error)
        for rid in [r for r in failed if not alive(r)]:
            del failed[rid]
        for stage, f in failures.items():
            out[f"{stage}_failed"] = float(f.counts.total())
            out.update({f"{stage}_failed_{kind}": float(n) for kind, n in f.counts.items()})
        return out, failures


class TooManyFailures(RuntimeError):
    """A stage failed on more than the allowed share of several steps' samples in a row."""


class FailureBudget:
    """Ends a run whose stage (its reward function) fails on more than ``max_share`` of a
    step's samples for ``max_steps`` steps in a row: a grader that is down or a function that
    never works would otherwise train on zeros. Fallback kinds (`FALLBACK_KINDS`) are counted
    in the step log but not here."""

    def __init__(self, max_share: float, max_steps: int) -> None:
        self.max_share = max_share
        self.max_steps = max_steps
        self._streak: collections.Counter[str] = collections.Counter()

    def observe(self, step: int, samples: int, failures: dict[str, StepFailures]) -> None:
        """Count step ``step``; raises `TooManyFailures` naming the stage, the failures' kinds
        and one error when its budget is spent."""
        for stage in list(self._streak):
            if stage not in failures:
                del self._streak[stage]
        for stage, f in failures.items():
            counted = {k: n for k, n in f.counts.items() if k not in FALLBACK_KINDS}
            failed = sum(counted.values())
            if not samples or failed / samples <= self.max_share:
                self._streak.pop(stage, None)
                continue
            self._streak[stage] += 1
            if self._streak[stage] < self.max_steps:
                continue
            kind = max(counted, key=lambda k: counted[k])
            kinds = ", ".join(f"{k} {n}" for k, n in sorted(counted.items()))
            raise TooManyFailures(
                f"{stage} failed on {failed} of {samples} samples of step {step} ({kinds}), "
                f"more than max_failure_share = {self.max_share:g} of a step's samples for "
                f"max_failure_steps = {self.max_steps} steps in a row (the recipe's "
                f"{stage}.max_failure_share and {stage}.max_failure_steps); {kind}: "
                f"{f.errors[kind]}")


def _std(values: Sequence[float]) -> float:
    """Population standard deviation; NaN (not an error, as `statistics.pstdev` raises) when a
    value is not finite."""
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def step_entry(commit: StepCommit, *, served_versions: list[int], wall_s: float,
               since_last_s: float | None, stages: dict[str, float], response_tokens: int = 0,
               max_staleness: int | None = None) -> dict[str, Any]:
    """``response_tokens``: the step's samples' response tokens (their mean length is on the
    line); ``max_staleness``: the staleness bound in force when the step committed, so the line
    tells the bound from the staleness it observed (``staleness_max``)."""
    rewards, staleness = commit.rewards, commit.staleness
    return {
        "step": commit.version,
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,
        "reward_std": _std(rewards) if rewards else None,
        "samples": commit.samples,
        "samples_per_s": commit.samples / since_last_s if since_last_s else 0.0,
        "response_length_mean": response_tokens / commit.samples if commit.samples else 0.0,
        "staleness_max": max(staleness, default=0),
        "staleness_mean": sum(staleness) / len(staleness) if staleness else 0.0,
        "max_staleness": max_staleness,
        "served_versions": served_versions,
        "wall_s": wall_s,
        "reward_failed": 0.0,
        **stages,
        **{f"train_{k}": v for k, v in (commit.report.get("metrics") or {}).items()},
    }
