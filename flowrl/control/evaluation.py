"""Periodic evaluation: held-out prompts answered by rollout workers, scored by reward workers.

A *round* evaluates the policy of one step. It is queued when that step commits (every
``eval.every`` steps, and the run's last step) and is made of jobs:

- **generate** jobs, tasks of the rollout role: ``prompts_per_task`` held-out prompts each,
  answered greedily (one response a prompt) or sampled at the run's temperature (``sampled``
  responses a prompt), handed only to a worker serving the round's version or a later one;
- **score** jobs, tasks of the reward role: once a generate job reports, its responses and
  positions go to a reward worker, which scores them with the run's reward.

When every score job has reported, the round's line is made: ``eval/greedy_accuracy`` and
``eval/sampled_accuracy`` (the share of responses whose reward is at least
``correct_reward``), ``eval/greedy_reward`` and ``eval/sampled_reward`` (their mean rewards),
and the versions that generated them (``eval/versions``: the round's own version unless a
worker switched to a newer one before it took a task).

Scheduling (`flowrl.control.scheduler`): in each dispatch pass a stage's evaluation jobs are
handed out before its training work, so a round starts as soon as a worker serving its
version has a free slot and ends on that version as far as it can. Its tasks are small, so they
take a worker's slots for a short while and training's tasks go on between them and on other
workers; the trainer waits on evaluation only for the rollout slots it holds (with
``max_staleness`` >= 1 it trains groups generated before meanwhile). After the last step the
run waits for the last round.

Evaluation never enters the index: its rows are never trained, never counted in a step, and
their memory is freed as soon as they are scored (the generate job's other fields at once).
Its task ids count up from `EVAL_TASK_BASE`, a range the index's ids never reach, and its row
ids likewise. A failed task is retried ``MAX_ATTEMPTS`` times; then the round is given up
(``failed`` on its line) and training goes on.

Pure: no sockets and no clock (callers pass ``now``).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from flowrl.control.reports import MalformedReport, TaskReport, check_report
from flowrl.graph import StageGraph, StageSpec
from flowrl.index import Task
from flowrl.recipe.evaluation import EvalConfig
from transport.handles import is_handle

__all__ = ["EVAL_STAGE", "EVAL_TASK_BASE", "MAX_ATTEMPTS", "SCORE_STAGE", "EvalJob",
           "Evaluation", "eval_summary", "evaluation_for", "report_handles"]

#: the first id of evaluation tasks (and rows): far above any id the index hands out
EVAL_TASK_BASE = 1 << 61
#: the stage names evaluation tasks carry (their spans on the dashboard's timeline)
EVAL_STAGE = "eval"
SCORE_STAGE = "eval_reward"
#: attempts of one job before its round is given up
MAX_ATTEMPTS = 3

Mode = Literal["greedy", "sampled"]


@dataclass
class _Round:
    step: int
    started_at: float
    jobs_left: int = 0
    rewards: dict[str, list[float]] = field(default_factory=lambda: {"greedy": [], "sampled": []})
    versions: set[int] = field(default_factory=set)
    reward_failed: int = 0
    failed: str | None = None


@dataclass
class EvalJob:
    """One task's worth of a round: generate ``n`` responses for each of ``positions``, then
    score them."""

    round: _Round
    mode: Mode
    #: held-out dataset positions, one per prompt
    positions: tuple[int, ...]
    #: responses per prompt
    n: int
    #: the responses' handles (one per row), once generated: the job is then to be scored
    responses: list[Any] | None = None
    lengths: tuple[int, ...] = ()
    attempts: int = 0

    @property
    def stage(self) -> str:
        return EVAL_STAGE if self.responses is None else SCORE_STAGE

    def row_positions(self) -> list[int]:
        return [p for p in self.positions for _ in range(self.n)]


class Evaluation:
    def __init__(self, config: EvalConfig, *, generate: StageSpec, score: StageSpec) -> None:
        """``generate``: the stage whose role answers prompts (rollout); ``score``: the stage
        whose role scores responses (reward)."""
        self.config = config
        self.generate = generate
        self.score = score
        #: the run's last step (`Controller.run` sets it): evaluated whatever ``every`` says
        self.last_step = 0
        #: one line per round evaluated, in order
        self.log: list[dict[str, Any]] = []
        #: called with each round's line
        self.on_record: list[Callable[[dict[str, Any]], None]] = []
        self._queues: dict[str, deque[EvalJob]] = {EVAL_STAGE: deque(), SCORE_STAGE: deque()}
        self._running: dict[int, tuple[EvalJob, Task]] = {}
        self._rounds: dict[int, _Round] = {}
        self._ids = itertools.count(EVAL_TASK_BASE)

    # ---- rounds ------------------------------------------------------------------------------

    def committed(self, step: int, now: float) -> None:
        """Step ``step`` committed: queue its round when it is one to evaluate."""
        if step <= 0 or step in self._rounds or not (
                step % self.config.every == 0 or step == self.last_step):
            return
        rnd = _Round(step, now)
        self._rounds[step] = rnd
        c = self.config
        chunks = [tuple(range(i, min(i + c.prompts_per_task, c.prompts)))
                  for i in range(0, c.prompts, c.prompts_per_task)]
        modes: list[tuple[Mode, int]] = [("greedy", 1)]
        if c.sampled:
            modes.append(("sampled", c.sampled))
        for mode, n in modes:
            for chunk in chunks:
                self._queues[EVAL_STAGE].append(EvalJob(rnd, mode, chunk, n))
                rnd.jobs_left += 1

    @property
    def idle(self) -> bool:
        """No round in progress."""
        return not self._rounds

    def abandon(self) -> list[Any]:
        """Give up every round (the run stops early); the handles to free. Tasks in flight
        are forgotten: their reports free what they wrote."""
        freed = [h for q in self._queues.values() for job in q for h in job.responses or ()]
        for q in self._queues.values():
            q.clear()
        self._rounds.clear()
        return freed

    # ---- dispatch (the scheduler's side) -----------------------------------------------------

    def next_job(self, stage: str) -> EvalJob | None:
        """The next job for ``stage`` (`EVAL_STAGE` or `SCORE_STAGE`), left queued."""
        q = self._queues.get(stage)
        return q[0] if q else None

    def min_version(self, job: EvalJob) -> int | None:
        """The oldest policy version a worker may run ``job`` with."""
        return job.round.step if job.responses is None else None

    def start(self, job: EvalJob, worker: str) -> tuple[Task, dict[str, Any]]:
        """Take ``job`` off its queue for ``worker``: its task and parameters."""
        taken = self._queues[job.stage].popleft()
        assert taken is job, "start() takes the job next_job() showed"
        positions = job.row_positions()
        rows = [next(self._ids) for _ in positions]
        groups: list[int] = []
        row_groups: list[int] = []
        for i, row in enumerate(rows):
            if i % job.n == 0:
                groups.append(row)
            row_groups.append(groups[-1])
        handles: dict[str, list[Any]] = {"prompt": positions}
        lengths = tuple([1] * len(rows))
        if job.responses is not None:
            handles["response_ids"] = list(job.responses)
            lengths = job.lengths or lengths
        task = Task(id=next(self._ids), stage=job.stage, rows=tuple(rows), groups=tuple(groups),
                    row_groups=tuple(row_groups), worker=worker, handles=handles,
                    lengths=lengths, versions=tuple([None] * len(rows)), tokens=sum(lengths))
        self._running[task.id] = (job, task)
        return task, {"eval": job.mode, "eval_step": job.round.step}

    def owns(self, task_id: int) -> bool:
        return task_id in self._running

    # ---- what workers report -----------------------------------------------------------------

    def reported(self, task_id: int, report: TaskReport, now: float) -> list[Any]:
        """A task of a job reported; the handles to free. A report that does not fit its task
        counts as a failure."""
        job, task = self._forget(task_id)
        stage = self.generate if job.responses is None else self.score
        try:
            check_report(report, task, stage, train=False)
            if job.responses is None:
                if report.version is None:
                    raise MalformedReport("a generate report without its policy version")
            else:
                _rewards(report)
        except MalformedReport as exc:
            return self._failed(job, report_handles(report), f"malformed report: {exc}")
        if self._rounds.get(job.round.step) is not job.round:  # given up meanwhile
            return report_handles(report) + (job.responses or [])
        if job.responses is None:  # generated: score next, keep only the responses
            job.round.versions.add(int(report.version or 0))
            job.responses = list(report.fields["response_ids"])
            job.lengths = tuple(report.lengths) if report.lengths else ()
            job.attempts = 0
            self._queues[SCORE_STAGE].append(job)
            return [h for name, values in report.fields.items() if name != "response_ids"
                    for h in values]
        rnd = job.round
        rnd.rewards[job.mode].extend(_rewards(report))
        rnd.reward_failed += sum(len(rows) for rows, _ in report.failed.values())
        freed = job.responses
        rnd.jobs_left -= 1
        if rnd.jobs_left == 0:
            self._finish(rnd, now)
        return freed

    def failed(self, task_id: int, error: str = "task failed") -> list[Any]:
        """A task of a job failed (or its worker died): retried, or its round given up; the
        handles to free."""
        job, _ = self._forget(task_id)
        return self._failed(job, [], error)

    def _forget(self, task_id: int) -> tuple[EvalJob, Task]:
        return self._running.pop(task_id)

    def _failed(self, job: EvalJob, freed: list[Any], error: str) -> list[Any]:
        rnd = job.round
        if self._rounds.get(rnd.step) is not rnd:
            return freed + (job.responses or [])
        job.attempts += 1
        if job.attempts < MAX_ATTEMPTS:
            self._queues[job.stage].appendleft(job)
            return freed
        rnd.failed = f"{job.stage} failed {job.attempts} times: {error}"
        freed += job.responses or []
        for stage, q in self._queues.items():  # the round's other jobs go too
            kept = deque(j for j in q if j.round is not rnd)
            freed += [h for j in q if j.round is rnd for h in j.responses or ()]
            self._queues[stage] = kept
        self._finish(rnd, None)
        return freed

    def _finish(self, rnd: _Round, now: float | None) -> None:
        del self._rounds[rnd.step]
        line: dict[str, Any] = {"step": rnd.step, "eval/prompts": self.config.prompts}
        if rnd.failed is not None:
            line["eval/failed"] = rnd.failed
        else:
            for mode, rewards in rnd.rewards.items():
                if rewards:
                    correct = sum(r >= self.config.correct_reward for r in rewards)
                    line[f"eval/{mode}_accuracy"] = correct / len(rewards)
                    line[f"eval/{mode}_reward"] = sum(rewards) / len(rewards)
            if self.config.sampled:
                line["eval/samples"] = self.config.sampled
            line["eval/versions"] = sorted(rnd.versions)
            if rnd.reward_failed:
                line["eval/reward_failed"] = rnd.reward_failed
            assert now is not None
            line["eval/wall_s"] = now - rnd.started_at
        self.log.append(line)
        for callback in self.on_record:
            callback(line)


def report_handles(report: TaskReport) -> list[Any]:
    """Every store handle a report names (what its task wrote)."""
    return [v for values in report.fields.values() for v in values if is_handle(v)]


def _rewards(report: TaskReport) -> list[float]:
    values = report.fields.get("reward", [])
    if not all(type(v) in (int, float) and math.isfinite(v) for v in values):
        raise MalformedReport("rewards must be finite numbers")
    return [float(v) for v in values]


def evaluation_for(settings: dict[str, Any] | None, graph: StageGraph,
                   source: StageSpec) -> Evaluation | None:
    """The evaluation of a pipeline's ``eval`` settings over its stage graph (None without
    settings): prompts answered by the role of ``source`` (the stage that reads only the data
    source's fields), scored by the role of the stage that produces ``reward``."""
    if settings is None:
        return None
    scorers = [s for s in graph.order if "reward" in s.produces]
    if not scorers:
        raise ValueError("eval: the pipeline has no stage that produces 'reward' to score "
                         "the held-out answers with")
    return Evaluation(EvalConfig.model_validate(settings), generate=source, score=scorers[0])


def eval_summary(log: list[dict[str, Any]]) -> dict[str, Any]:
    """What a run's summary says of its evaluation: the last round's figures (``eval/step``:
    the step it evaluated); empty without one."""
    if not log:
        return {}
    last = log[-1]
    return {"eval/step": last["step"], **{k: v for k, v in last.items() if k != "step"}}
