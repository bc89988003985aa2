"""The run as the outside sees it: the JSON snapshot ``GET /status`` serves.

Read-only: it reads the controller's parts and changes nothing. O(stages + workers + tasks in
flight); holds no secret (the monitor token is not in it).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flowrl.control.admission import Admission
from flowrl.control.assignments import Assignments
from flowrl.control.ledger import StepLedger
from flowrl.control.lost_nodes import LostNodes
from flowrl.control.step_metrics import StepFailures
from flowrl.events import EventBus
from flowrl.graph import StageGraph
from flowrl.index import Index
from flowrl.registry import Registry

if TYPE_CHECKING:
    from flowrl.monitor import LoopLag

__all__ = ["RunCounters", "status_snapshot"]


@dataclass
class RunCounters:
    """What the run counts besides the ledger's rows."""

    worker_deaths: int = 0
    started_at: float = 0.0  # perf_counter at the current run()'s start (0: not running)
    #: trained samples a stage failed on, by stage and kind (`StepFailures`), for the whole run
    failed_samples: dict[str, collections.Counter[str]] = field(default_factory=dict)

    def count_failures(self, failures: dict[str, StepFailures]) -> None:
        for stage, f in failures.items():
            self.failed_samples.setdefault(stage, collections.Counter()).update(f.counts)


def status_snapshot(*, run_id: str, graph: StageGraph, index: Index, registry: Registry,
                    assignments: Assignments, admission: Admission, ledger: StepLedger,
                    step_log: list[dict[str, Any]], steps_target: int, paused: bool,
                    stale_dropped: int, store_stats: dict[str, Any], counters: RunCounters,
                    restarts: int, errors: list[dict[str, Any]], lag: LoopLag | None,
                    events: EventBus, monitor_url: str | None,
                    eval_log: list[dict[str, Any]] | None = None,
                    lost_nodes: LostNodes | None = None,
                    leases: dict[str, Any] | None = None) -> dict[str, Any]:
    stats = index.statistics()
    wall = (time.perf_counter() - counters.started_at) if counters.started_at else 0.0
    now = time.time()
    running: dict[str, list[dict[str, Any]]] = {}
    for a in assignments:
        running.setdefault(a.worker, []).append({
            "task": a.task.id, "stage": a.task.stage, "rows": len(a.task.rows),
            "running_s": round(now - a.started_at, 4) if a.started_at else None})
    workers = []
    for w in registry.all():
        tasks = running.get(w.worker_id, [])
        started = any(t["running_s"] is not None for t in tasks)
        workers.append({
            "id": w.worker_id, "name": w.name, "role": w.role, "node": w.node, "pid": w.pid,
            "state": "busy" if started else "queued" if tasks else "idle",
            "version": w.version, "in_flight": w.in_flight, "tasks": tasks, "load": w.load,
            "done": w.done, "failed": w.failed})
    stages = {
        st.name: {"role": graph.stage(st.name).role,
                  "queue_depth": st.queue_depth, "in_flight": st.tasks_in_flight,
                  "formed": st.tasks_formed,
                  "in_flight_rows": st.in_flight, "waiting": st.waiting, "ready": st.ready,
                  "done": st.done, "stale": st.stale}
        for st in stats.stages.values()}
    last = step_log[-1] if step_log else {}
    samples = ledger.samples_trained
    backpressure = admission.store
    return {
        "run_id": run_id,
        "time": now,
        "version": ledger.version,
        "trainer": {"version": ledger.version, "next_step": ledger.train_step,
                    "steps_target": steps_target, "micro_batches_pending": ledger.pending},
        "paused": paused,
        "max_staleness": admission.gate.max_staleness,
        "stages": stages,
        "index": stats.as_dict(),
        "workers": workers,
        "staleness_histogram": {str(k): v for k, v in admission.gate.histogram().items()},
        "samples_trained": samples,
        "samples_per_s": samples / wall if wall else 0.0,
        "throughput": {"samples_per_s": samples / wall if wall else 0.0,
                       "last_step_samples_per_s": last.get("samples_per_s", 0.0),
                       "steps": len(step_log)},
        "reward_mean": last.get("reward_mean"),
        "last_step": last or None,
        "last_eval": eval_log[-1] if eval_log else None,
        "failed_samples": {stage: dict(kinds) for stage, kinds in
                           counters.failed_samples.items()},
        "stale_dropped": stale_dropped,
        "store": store_stats,
        "admission_paused_for_store": backpressure.paused,
        "store_backpressure": backpressure.statistics(time.perf_counter()),
        "worker_deaths": counters.worker_deaths,
        "nodes_lost": [] if lost_nodes is None else list(lost_nodes.nodes),
        "groups_lost": 0 if lost_nodes is None else lost_nodes.groups_dropped,
        "leases": leases,
        "restarts": restarts,
        "errors": errors,
        "loop_lag": lag.snapshot() if lag is not None else None,
        "events": {"last_seq": events.recent[-1]["seq"] if events.recent else 0,
                   "dropped": events.dropped},
        "monitor_url": monitor_url,
    }
