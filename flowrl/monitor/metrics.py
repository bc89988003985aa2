"""Prometheus metrics of one controller, in its own `CollectorRegistry`.

Several controllers may live in one process (tests, notebooks), so nothing is registered in
prometheus_client's global registry. Values are read from the controller when scraped (a custom
collector), so the hot path pays nothing; the task-duration histogram is fed at scrape time
from the spans finished since the previous scrape.

Families (labels in braces):

- ``flowrl_version``, ``flowrl_paused``, ``flowrl_max_staleness``, ``flowrl_reward_mean``,
  ``flowrl_samples_per_second``, ``flowrl_event_loop_lag_seconds`` — gauges;
- the last committed step's figures (`STEP_GAUGES`: loss, KL, entropy, grad norm, learning
  rate, clipped-token share, reward spread, response length, observed staleness): gauges
  that appear with the first step; one whose figure the step's line lacks (``flowrl_train_kl``
  without a KL penalty, the trainer's figures in simulation) is left out;
- the last evaluation round's accuracies (`EVAL_GAUGES`): gauges that appear with the first
  round that has them;
- ``flowrl_samples_trained_total``, ``flowrl_stale_dropped_total``,
  ``flowrl_worker_deaths_total``, ``flowrl_steps_total``, ``flowrl_events_dropped_total`` —
  counters;
- ``flowrl_failed_samples_total{stage,kind}`` — trained samples a stage failed on (a reward
  function that raised, ...): they trained with a fallback value (a reward of 0);
- ``flowrl_stage_queue_depth{stage}``, ``flowrl_stage_tasks_in_flight{stage}``,
  ``flowrl_stage_tasks_formed{stage}`` (formed ahead of their workers, not assigned yet),
  ``flowrl_stage_rows{stage,state}`` — gauges;
- ``flowrl_worker_tasks_in_flight{worker,role,node}``,
  ``flowrl_worker_served_version{worker,role,node}`` — gauges;
  ``flowrl_worker_tasks_total{worker,role,node,outcome}`` — counter;
- ``flowrl_store_used_bytes{node}``, ``flowrl_store_capacity_bytes{node}`` — gauges;
- ``flowrl_sample_staleness`` — histogram of trained samples by staleness (versions);
- ``flowrl_task_duration_seconds{stage}`` — histogram of task run times.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Iterator, Reversible
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from flowrl.events import Span

if TYPE_CHECKING:
    from flowrl.monitor.view import RunView

__all__ = ["CONTENT_TYPE", "DURATION_BUCKETS", "EVAL_GAUGES", "STEP_GAUGES",
           "ControllerMetrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST

#: task run-time bucket bounds (s): sub-millisecond simulated tasks to multi-minute train steps.
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0, 120.0, 300.0)

_ROW_STATES = ("waiting", "ready", "in_flight_rows", "done", "stale")

#: (key of the step's line, gauge, help) of the last committed step's figures.
STEP_GAUGES = (
    ("train_loss", "flowrl_train_loss", "Training loss of the last step."),
    ("train_kl", "flowrl_train_kl",
     "KL of the policy from the reference model, last step (with a KL penalty only)."),
    ("train_mismatch_kl", "flowrl_train_mismatch_kl",
     "KL of the trained policy from the sampling engine's on the sampled tokens, per token "
     "(k3 estimate), last step."),
    ("train_approx_kl", "flowrl_train_approx_kl",
     "KL of the policy after the update from before it, per token (k3 estimate), last step."),
    ("train_entropy", "flowrl_train_entropy_nats",
     "Entropy of the policy on the sampled tokens, nats per token, last step."),
    ("train_grad_norm", "flowrl_train_grad_norm",
     "Gradient L2 norm before clipping, last optimizer step."),
    ("train_lr", "flowrl_train_learning_rate", "Learning rate of the last optimizer step."),
    ("train_clip_frac", "flowrl_train_clipped_tokens_ratio",
     "Share of response tokens whose clipped policy term was the active one, last step."),
    ("critic_loss", "flowrl_critic_loss", "Value loss of the critic's last step."),
    ("reward_std", "flowrl_reward_std", "Standard deviation of the last step's rewards."),
    ("response_length_mean", "flowrl_response_length_tokens",
     "Mean response length of the last step's samples, in tokens."),
    ("staleness_max", "flowrl_step_staleness_max",
     "Largest staleness (versions) among the last step's samples; the bound is "
     "flowrl_max_staleness."),
    ("staleness_mean", "flowrl_step_staleness_mean",
     "Mean staleness (versions) of the last step's samples."),
)

#: (key of an evaluation round's line, gauge, help) of the last round
#: (`flowrl.control.evaluation`); a failed round's line has neither.
EVAL_GAUGES = (
    ("eval/greedy_accuracy", "flowrl_eval_greedy_accuracy_ratio",
     "Share of the held-out prompts answered correctly greedily, last evaluation round."),
    ("eval/sampled_accuracy", "flowrl_eval_sampled_accuracy_ratio",
     "Share of the sampled answers to the held-out prompts that are correct, last evaluation "
     "round."),
)


class _Durations:
    """Per-stage cumulative bucket counts, fed from the span log without reading it twice."""

    def __init__(self) -> None:
        self.counts: dict[str, list[int]] = {}
        self.sums: dict[str, float] = {}
        self._last: Span | None = None

    def ingest(self, spans: Reversible[Span]) -> None:
        # Spans arrive appended; walk back from the newest to the last one already counted.
        fresh: list[Span] = []
        for s in reversed(spans):
            if s is self._last:
                break
            fresh.append(s)
        if fresh:
            self._last = fresh[0]
        for s in fresh:
            d = max(0.0, s.end - s.start)
            counts = self.counts.setdefault(s.stage, [0] * (len(DURATION_BUCKETS) + 1))
            counts[bisect.bisect_left(DURATION_BUCKETS, d)] += 1
            self.sums[s.stage] = self.sums.get(s.stage, 0.0) + d

    def family(self) -> HistogramMetricFamily:
        h = HistogramMetricFamily("flowrl_task_duration_seconds",
                                  "Run time of finished tasks, by stage.", labels=["stage"])
        for stage, counts in sorted(self.counts.items()):
            h.add_metric([stage], _cumulative(DURATION_BUCKETS, counts), self.sums[stage])
        return h


def _cumulative(bounds: Iterable[float], counts: list[int]) -> list[tuple[str, float]]:
    out: list[tuple[str, float]] = []
    total = 0
    for bound, c in zip([*bounds, math.inf], counts, strict=True):
        total += c
        out.append(("+Inf" if bound == math.inf else repr(float(bound)), float(total)))
    return out


def _num(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def _line_gauges(line: dict[str, Any],
                 gauges: tuple[tuple[str, str, str], ...]) -> Iterator[GaugeMetricFamily]:
    for key, name, doc in gauges:
        value = line.get(key)
        # NaN and infinities pass as such (a diverging loss must show); absent is no sample
        if isinstance(value, int | float) and not isinstance(value, bool):
            yield GaugeMetricFamily(name, doc, value=float(value))


class _Collector:
    def __init__(self, run: RunView) -> None:
        self._run = run
        self._durations = _Durations()

    def collect(self) -> Iterator[Metric]:
        run = self._run
        st = run.status()
        self._durations.ingest(run.events.spans)

        def gauge(name: str, doc: str, value: Any) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=_num(value))

        def counter(name: str, doc: str, value: Any) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=_num(value))

        yield gauge("flowrl_version", "Policy version of the trainer.", st["version"])
        yield gauge("flowrl_paused", "1 while dispatch is paused.", int(st["paused"]))
        yield gauge("flowrl_max_staleness", "Staleness budget (versions).", st["max_staleness"])
        if st["reward_mean"] is not None:
            yield gauge("flowrl_reward_mean", "Mean reward of the last step.", st["reward_mean"])
        yield gauge("flowrl_samples_per_second", "Samples trained per second in the last step.",
                    st["throughput"]["last_step_samples_per_s"])
        lag = st["loop_lag"] or {}
        yield gauge("flowrl_event_loop_lag_seconds", "Controller event-loop lag, last sample.",
                    _num(lag.get("last_ms")) / 1e3)
        yield counter("flowrl_samples_trained", "Samples trained.", st["samples_trained"])
        yield counter("flowrl_steps", "Optimizer steps completed.", st["throughput"]["steps"])
        yield counter("flowrl_stale_dropped", "Groups dropped as too stale.", st["stale_dropped"])
        yield counter("flowrl_worker_deaths", "Workers lost.", st["worker_deaths"])
        yield counter("flowrl_events_dropped", "Events a slow watcher lost.",
                      st["events"]["dropped"])
        yield from _line_gauges(st["last_step"] or {}, STEP_GAUGES)
        yield from _line_gauges(st.get("last_eval") or {}, EVAL_GAUGES)
        failed = CounterMetricFamily(
            "flowrl_failed_samples", "Trained samples a stage failed on, which trained with a "
            "fallback value (a reward of 0), by stage and failure kind.", labels=["stage", "kind"])
        for stage, kinds in sorted(st["failed_samples"].items()):
            for kind, n in sorted(kinds.items()):
                failed.add_metric([stage, kind], _num(n))
        yield failed

        depth = GaugeMetricFamily("flowrl_stage_queue_depth",
                                  "Ready units (rows or groups) queued for a stage.",
                                  labels=["stage"])
        flight = GaugeMetricFamily("flowrl_stage_tasks_in_flight",
                                   "Tasks of a stage assigned and not finished.", labels=["stage"])
        formed = GaugeMetricFamily("flowrl_stage_tasks_formed",
                                   "Tasks of a stage formed ahead of their workers, not assigned "
                                   "yet.", labels=["stage"])
        rows = GaugeMetricFamily("flowrl_stage_rows", "Live rows by stage and state.",
                                 labels=["stage", "state"])
        for name, s in st["stages"].items():
            depth.add_metric([name], _num(s["queue_depth"]))
            flight.add_metric([name], _num(s["in_flight"]))
            formed.add_metric([name], _num(s.get("formed", 0)))
            for state in _ROW_STATES:
                rows.add_metric([name, state.removesuffix("_rows")], _num(s[state]))
        yield from (depth, flight, formed, rows)

        labels = ["worker", "role", "node"]
        w_flight = GaugeMetricFamily("flowrl_worker_tasks_in_flight",
                                     "Tasks assigned to a worker and not finished.", labels=labels)
        w_version = GaugeMetricFamily("flowrl_worker_served_version",
                                      "Policy version a worker serves.", labels=labels)
        w_tasks = CounterMetricFamily("flowrl_worker_tasks", "Tasks a worker finished.",
                                      labels=[*labels, "outcome"])
        for w in st["workers"]:
            key = [w["id"], w["role"], w["node"]]
            w_flight.add_metric(key, _num(w["in_flight"]))
            w_version.add_metric(key, _num(w["version"]))
            w_tasks.add_metric([*key, "ok"], _num(w["done"]))
            w_tasks.add_metric([*key, "failed"], _num(w["failed"]))
        yield from (w_flight, w_version, w_tasks)

        store = st["store"] or {}
        if store:
            node = [str(store.get("node", run.node))]
            used = GaugeMetricFamily("flowrl_store_used_bytes", "Sample-store bytes in use.",
                                     labels=["node"])
            used.add_metric(node, _num(store.get("used_bytes")))
            cap = GaugeMetricFamily("flowrl_store_capacity_bytes", "Sample-store capacity.",
                                    labels=["node"])
            cap.add_metric(node, _num(store.get("capacity_bytes")))
            yield from (used, cap)

        hist = {int(k): int(v) for k, v in st["staleness_histogram"].items()}
        top = max(hist, default=0)
        bounds = [float(b) for b in range(top + 1)]
        counts = [hist.get(b, 0) for b in range(top + 1)] + [0]
        yield HistogramMetricFamily(
            "flowrl_sample_staleness", "Trained samples by staleness (trainer version minus "
            "generating version).", buckets=_cumulative(bounds, counts),
            sum_value=float(sum(k * v for k, v in hist.items())))
        yield self._durations.family()


class ControllerMetrics:
    """``render()`` gives the Prometheus text exposition of one controller."""

    def __init__(self, run: RunView) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(run))

    def render(self) -> bytes:
        return generate_latest(self.registry)
