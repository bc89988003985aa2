"""Chrome trace-event / Perfetto export of the controller's activity spans.

One complete event (``ph: "X"``) per finished task: ``pid`` is the worker's role (one process
track per role, in pipeline order), ``tid`` the worker (one thread track per worker), ``name`` the
stage, ``ts``/``dur`` in microseconds since the event bus started. One instant event
(``ph: "i"``, thread scope) per mark on its worker's track (``name``: ``interrupted``). Metadata
events (``ph: "M"``) name the tracks. Every event carries ``name, ph, ts, dur, pid, tid`` so
that strict readers accept the file; open it at https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from typing import Any

from flowrl.events import Mark, Span

__all__ = ["chrome_trace", "recent_marks", "recent_spans", "worker_tid"]


def worker_tid(worker_id: str) -> int:
    """A stable thread id for a worker: registry ids are ``<role>-<n>`` with a global ``n``."""
    _, _, n = worker_id.rpartition("-")
    return int(n) + 1 if n.isdigit() else zlib.crc32(worker_id.encode()) | (1 << 31)


def recent_spans(spans: Sequence[Span], since: float | None) -> list[Span]:
    """Spans that ended at or after wall time ``since`` (all when None), oldest first.

    Spans are appended as tasks end, so the scan stops at the first older one: O(result).
    """
    if since is None:
        return list(spans)
    out: list[Span] = []
    for s in reversed(spans):
        if s.end < since:
            break
        out.append(s)
    out.reverse()
    return out


def recent_marks(marks: Sequence[Mark], since: float | None) -> list[Mark]:
    """Marks made at or after wall time ``since`` (all when None), oldest first."""
    if since is None:
        return list(marks)
    out: list[Mark] = []
    for mk in reversed(marks):
        if mk.time < since:
            break
        out.append(mk)
    out.reverse()
    return out


def chrome_trace(
    spans: Iterable[Span], *, t0: float, roles: Sequence[str] = (),
    workers: Iterable[tuple[str, str]] = (), marks: Iterable[Mark] = (),
) -> dict[str, Any]:
    """The trace-event JSON object for ``spans`` (wall-clock seconds; ``t0`` becomes ts 0).

    ``roles`` fixes the order of the process tracks; ``workers`` ((worker id, role) pairs) adds
    tracks for workers that have no span yet, so an idle worker still shows as a lane.
    """
    pids: dict[str, int] = {role: i + 1 for i, role in enumerate(roles)}
    tracks: dict[str, tuple[int, int]] = {}
    events: list[dict[str, Any]] = []

    def track(worker: str, role: str) -> tuple[int, int]:
        found = tracks.get(worker)
        if found is None:
            pid = pids.setdefault(role, len(pids) + 1)
            found = tracks[worker] = (pid, worker_tid(worker))
        return found

    for worker, role in workers:
        track(worker, role)
    for s in spans:
        pid, tid = track(s.worker, s.role)
        events.append({
            "name": s.stage, "cat": s.role, "ph": "X",
            "ts": round((s.start - t0) * 1e6, 1), "dur": round(max(0.0, s.end - s.start) * 1e6, 1),
            "pid": pid, "tid": tid, "args": {"task": s.task, "rows": s.rows, "worker": s.worker},
        })
    for mk in marks:
        pid, tid = track(mk.worker, mk.role)
        events.append({
            "name": mk.name, "cat": mk.role, "ph": "i", "s": "t",
            "ts": round((mk.time - t0) * 1e6, 1), "dur": 0, "pid": pid, "tid": tid,
            "args": {**mk.args, "worker": mk.worker},
        })
    meta: list[dict[str, Any]] = []
    for role, pid in pids.items():
        meta.append({"name": "process_name", "ph": "M", "ts": 0, "dur": 0, "pid": pid, "tid": 0,
                     "args": {"name": role}})
        meta.append({"name": "process_sort_index", "ph": "M", "ts": 0, "dur": 0, "pid": pid,
                     "tid": 0, "args": {"sort_index": pid}})
    for worker, (pid, tid) in sorted(tracks.items(), key=lambda kv: kv[1]):
        meta.append({"name": "thread_name", "ph": "M", "ts": 0, "dur": 0, "pid": pid, "tid": tid,
                     "args": {"name": worker}})
    return {"traceEvents": meta + events, "displayTimeUnit": "ms"}
