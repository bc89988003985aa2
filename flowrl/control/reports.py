"""A worker's report of a finished task, checked completely before anything changes.

A report the controller cannot take must not cost rows: if it were accepted half-way (the
assignment removed, then the index refusing a field) its task would stay in flight forever and
its group would never train. So a report is parsed and checked against the task it names
first; only a report that passes is applied, and one that fails is treated as a failed task
(its rows go back to their stage's queue).

Pure: no sockets, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from flowrl.graph import StageSpec
from flowrl.index import Task
from transport.errors import MalformedMessage
from transport.handles import Handle, is_handle, is_run, rows_from_wire, run_rows

__all__ = ["MalformedReport", "TaskReport", "check_report", "parse_report"]

#: what a report may carry besides its fields (`flowrl.messages.DoneMsg`)
_KEYS = frozenset({"worker_id", "token", "task_id", "fields", "lengths", "version", "metrics",
                   "weights", "failed"})
_MAX_INT = 2**62
_HANDLES = {msgpack.ExtType}
_NUMBERS = {int, float, bool}
#: the longest failure kind and error text a report may carry (a longer error is cut)
_MAX_KIND, _MAX_ERROR = 64, 2000


class MalformedReport(ValueError):
    """A task report that cannot be taken; the message says what is wrong with it."""


@dataclass(frozen=True, slots=True)
class TaskReport:
    worker_id: str
    task_id: int
    #: produced field -> one value per row: a store handle (its ext form, or a run's row
    #: ``(run, i)`` where the field came as one run) or an inline number
    fields: dict[str, list[Any]]
    lengths: list[int]
    version: int | None
    metrics: dict[str, Any]
    #: the report as received (a train step end's report is committed as it is)
    raw: dict[str, Any]
    #: failure kind -> (offsets into the task's rows whose values are fallbacks, an error)
    failed: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)
    #: the fields that came as one run (`transport.handles.run_to_wire`), checked by the parse
    runs: frozenset[str] = frozenset()


def parse_report(p: Any) -> TaskReport:
    """The report's shape: raises `MalformedReport` naming the first thing wrong."""
    if not isinstance(p, dict):
        raise MalformedReport("a task report must be a map")
    unknown = sorted(map(repr, set(p) - _KEYS))
    if unknown:
        raise MalformedReport(f"unknown key(s) {', '.join(unknown)} in a task report")
    worker_id, task_id = p.get("worker_id"), p.get("task_id")
    if type(worker_id) is not str:
        raise MalformedReport("'worker_id' must be a string")
    if type(task_id) is not int:
        raise MalformedReport("'task_id' must be an integer")
    fields, runs = _parse_fields(p.get("fields"))
    lengths = p.get("lengths") or []
    if not (type(lengths) is list
            and all(type(n) is int and 0 <= n <= _MAX_INT for n in lengths)):
        raise MalformedReport("'lengths' must be a list of non-negative integers")
    version = p.get("version")
    if version is not None and not (type(version) is int and 0 <= version <= _MAX_INT):
        raise MalformedReport("'version' must be a non-negative integer or nil")
    metrics = p.get("metrics") or {}
    if not isinstance(metrics, dict):
        raise MalformedReport("'metrics' must be a map")
    return TaskReport(worker_id, task_id, fields, lengths, version, metrics, p,
                      _parse_failed(p.get("failed") or {}), runs)


def _parse_fields(fields: Any) -> tuple[dict[str, list[Any]], frozenset[str]]:
    """A report's fields, one value per row, and the names of those that came as one run:
    a run is checked here, once, and becomes its rows (`transport.handles.run_rows`)."""
    if not (isinstance(fields, dict)
            and all(type(k) is str and (type(v) is list or is_run(v))
                    for k, v in fields.items())):
        raise MalformedReport("'fields' must map field names to lists or runs")
    runs = frozenset(k for k, v in fields.items() if type(v) is not list)
    if not runs:
        return fields, runs
    out = dict(fields)
    for name in runs:
        try:
            out[name] = run_rows(fields[name])
        except MalformedMessage as exc:
            raise MalformedReport(f"field {name!r}: {exc}") from None
    return out, runs


def _parse_failed(failed: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """``failed`` (`flowrl.messages.FailedRows` by kind) in its checked shape."""
    if not isinstance(failed, dict):
        raise MalformedReport("'failed' must map failure kinds to rows")
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for kind, entry in failed.items():
        if not (type(kind) is str and 0 < len(kind) <= _MAX_KIND and kind.isidentifier()):
            raise MalformedReport(f"'failed': a kind must be a short identifier, got "
                                  f"{kind!r:.80}")
        rows = entry.get("rows") if isinstance(entry, dict) else None
        error = entry.get("error") if isinstance(entry, dict) else None
        if not (type(rows) is list and rows and all(type(i) is int for i in rows)
                and type(error) is str):
            raise MalformedReport(f"'failed' {kind!r}: expected {{rows: [offsets], error: "
                                  "text}")
        out[kind] = (tuple(rows), error[:_MAX_ERROR])
    return out


def check_report(report: TaskReport, task: Task, stage: StageSpec, *, train: bool) -> None:
    """Whether ``report`` can complete ``task`` of ``stage``: every field the stage produces,
    and only those, one well-formed value per row; lengths one per row, or none. A train
    task produces no field (its step end carries the new version and its weights instead)."""
    n = len(task.rows)
    want = set(() if train else stage.produces)
    got = set(report.fields)
    if got - want:
        raise MalformedReport(f"stage {stage.name!r} does not produce field(s) "
                              f"{sorted(got - want)}")
    if want - got:
        raise MalformedReport(f"the report of a {stage.name!r} task lacks field(s) "
                              f"{sorted(want - got)}")
    for name, values in report.fields.items():
        if len(values) != n:
            raise MalformedReport(f"field {name!r} has {len(values)} values for {n} rows")
        if name in report.runs:
            continue  # checked as it was parsed
        kinds = set(map(type, values))
        if kinds <= _NUMBERS:
            continue  # inline values (a reward a row): no handle among them
        if kinds == _HANDLES:
            # A field of handles (most are): decoded and checked as one list, column by
            # column where they are one put's rows, rather than one handle at a time.
            try:
                rows_from_wire(values)
            except (MalformedMessage, TypeError, ValueError) as exc:
                raise MalformedReport(f"field {name!r}: {exc}") from None
            continue
        for value in values:
            _check_value(name, value)
    if report.lengths and len(report.lengths) != n:
        raise MalformedReport(f"{len(report.lengths)} lengths for {n} rows")
    offsets = [i for rows, _ in report.failed.values() for i in rows]
    if any(not 0 <= i < n for i in offsets) or len(set(offsets)) != len(offsets):
        raise MalformedReport(f"'failed' must name each of the task's {n} rows at most once, "
                              "by its offset")


def _check_value(name: str, value: Any) -> None:
    if is_handle(value):
        try:
            Handle.from_wire(value)
        except (MalformedMessage, TypeError, ValueError) as exc:
            raise MalformedReport(f"field {name!r}: {exc}") from None
    elif type(value) not in _NUMBERS:
        raise MalformedReport(f"field {name!r}: a value must be a store handle or a number, "
                              f"got {type(value).__name__}")
