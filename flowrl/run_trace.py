"""The run trace: what a run's workers took, compact enough to replay (``flowrl.plan``).

A JSON-lines file, no pickle. Its first line is the header::

    {"format": "flowrl-trace", "version": 1, "recipe": {...}, "pools": {"rollout": 1, ...},
     "cpus": 2, "max_staleness": 1, "groups_per_step": 16, "group_size": 8}

(``recipe``: the recipe's fields as given, without the monitor token; None when the controller
did not start from a recipe). An optional ``controller`` map says what the controller's process
took while recording: ``{"cpu_s": ..., "wall_s": ..., "samples": ...}``, its CPU seconds (all its
threads) over that many wall seconds, in which it trained that many samples; the planner counts
that CPU with the workers' (``flowrl.plan``). Each further line is one record, by its ``k``:

- ``task``: a finished task: ``stage``, ``role``, ``worker``, ``rows``, ``t`` (when it ended,
  seconds since the run's start), ``s`` (seconds the worker spent on it: from when it took the
  task, or finished its previous one if later), ``len`` (response length of each row, a
  rollout's only, else empty), ``end`` (a train task that ended its optimizer step);
- ``sync``: a rollout worker loaded version ``version``: ``worker``, ``t``, ``s`` (seconds from
  when it could start, the version published or its last task done, to its ``served``);
- ``step``: step ``step`` committed at ``t`` with ``samples`` trained.

A reader refuses a file that is not a flowrl trace, a version it does not know, or a malformed
record, naming the line (`TraceError`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

__all__ = ["FORMAT", "VERSION", "RunTrace", "StepRecord", "SyncRecord", "TaskRecord",
           "TraceError", "TraceRecord", "read_trace", "trace_lines", "write_trace"]

FORMAT = "flowrl-trace"
VERSION = 1


class TraceError(ValueError):
    """A file that is not a readable flowrl trace; the message names the file and line."""


class TaskRecord(NamedTuple):
    stage: str
    role: str
    worker: str
    rows: int
    t: float
    s: float
    lengths: tuple[int, ...] = ()
    step_end: bool = False

    def line(self) -> dict[str, Any]:
        return {"k": "task", "stage": self.stage, "role": self.role, "worker": self.worker,
                "rows": self.rows, "t": round(self.t, 6), "s": round(self.s, 6),
                "len": list(self.lengths), "end": self.step_end}


class SyncRecord(NamedTuple):
    worker: str
    version: int
    t: float
    s: float

    def line(self) -> dict[str, Any]:
        return {"k": "sync", "worker": self.worker, "version": self.version,
                "t": round(self.t, 6), "s": round(self.s, 6)}


class StepRecord(NamedTuple):
    step: int
    t: float
    samples: int

    def line(self) -> dict[str, Any]:
        return {"k": "step", "step": self.step, "t": round(self.t, 6), "samples": self.samples}


#: one record of a trace after its header (tuples: a controller makes one a task and one a
#: worker's ``served``, and a tuple is made in half the time of a frozen dataclass)
TraceRecord = TaskRecord | SyncRecord | StepRecord


@dataclass
class RunTrace:
    header: dict[str, Any]
    tasks: list[TaskRecord] = field(default_factory=list)
    syncs: list[SyncRecord] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)

    @property
    def recipe(self) -> dict[str, Any] | None:
        recipe = self.header.get("recipe")
        return recipe if isinstance(recipe, dict) else None

    def tasks_of(self, role: str) -> list[TaskRecord]:
        return [t for t in self.tasks if t.role == role]


def header(*, recipe: dict[str, Any] | None, pools: dict[str, int], max_staleness: int,
           groups_per_step: int, group_size: int, cpus: int | None = None,
           controller: dict[str, float] | None = None) -> dict[str, Any]:
    """A version-1 header (``cpus``: this machine's usable cores when not given)."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
    head = {"format": FORMAT, "version": VERSION, "recipe": recipe, "pools": dict(pools),
            "cpus": cpus, "max_staleness": max_staleness, "groups_per_step": groups_per_step,
            "group_size": group_size}
    if controller is not None:
        head["controller"] = dict(controller)
    return head


def trace_lines(head: dict[str, Any],
                records: Iterable[TraceRecord]) -> Iterator[str]:
    """The file's lines, each ending in a newline."""
    yield json.dumps(head, separators=(",", ":")) + "\n"
    for r in records:
        yield json.dumps(r.line(), separators=(",", ":")) + "\n"


def write_trace(path: str | os.PathLike[str], head: dict[str, Any],
                records: Iterable[TraceRecord]) -> Path:
    """Write the trace to ``path`` (through a temporary file: a reader never sees half)."""
    out = Path(path)
    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.writelines(trace_lines(head, records))
    tmp.replace(out)
    return out


def read_trace(path: str | os.PathLike[str]) -> RunTrace:
    """The trace in ``path``; raises `TraceError` naming what is wrong and where."""
    name = str(path)
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{name}: cannot read the trace: {exc}") from None
    if not any(line.strip() for line in lines):
        raise TraceError(f"{name}: empty file, not a flowrl trace")
    try:
        head = json.loads(lines[0])
    except ValueError:
        head = None
    if not isinstance(head, dict) or head.get("format") != FORMAT:
        raise TraceError(f"{name}: not a flowrl trace (its first line must be a header with "
                         f'"format": "{FORMAT}")')
    version = head.get("version")
    if version != VERSION:
        raise TraceError(f"{name}: trace format version {version!r} is not supported (this "
                         f"flowrl reads version {VERSION})")
    pools = head.get("pools")
    if not (isinstance(pools, dict) and pools
            and all(type(k) is str and _count(v) for k, v in pools.items())):
        raise TraceError(f"{name}: line 1: 'pools' must map roles to worker counts")
    for key in ("cpus", "groups_per_step", "group_size"):
        if not _count(head.get(key)):
            raise TraceError(f"{name}: line 1: {key!r} must be a positive integer")
    if type(head.get("max_staleness")) is not int or head["max_staleness"] < 0:
        raise TraceError(f"{name}: line 1: 'max_staleness' must be a non-negative integer")
    if head.get("recipe") is not None and not isinstance(head["recipe"], dict):
        raise TraceError(f"{name}: line 1: 'recipe' must be a map or null")
    if "controller" in head:
        try:
            _controller(head["controller"])
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceError(f"{name}: line 1: 'controller' must map 'cpu_s', 'wall_s' and "
                             f"'samples' to non-negative numbers ({exc})") from None
    trace = RunTrace(head)
    for no, text in enumerate(lines[1:], start=2):
        if not text.strip():
            continue
        rec = _json(name, no, text)
        try:
            _add(trace, rec)
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceError(f"{name}: line {no}: malformed record ({exc})") from None
    return trace


def _json(name: str, no: int, text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise TraceError(f"{name}: line {no}: not JSON ({exc})") from None


def _count(v: Any) -> bool:
    return type(v) is int and v > 0


def _num(rec: dict[str, Any], key: str) -> float:
    v = rec[key]
    if type(v) not in (int, float) or not v >= 0 or v == float("inf"):
        raise ValueError(f"{key!r} must be a finite non-negative number")
    return float(v)


def _int(rec: dict[str, Any], key: str) -> int:
    v = rec[key]
    if type(v) is not int or v < 0:
        raise ValueError(f"{key!r} must be a non-negative integer")
    return v


def _str(rec: dict[str, Any], key: str) -> str:
    v = rec[key]
    if type(v) is not str or not v:
        raise ValueError(f"{key!r} must be a non-empty string")
    return v


def _controller(v: Any) -> None:
    if not isinstance(v, dict):
        raise TypeError("not a map")
    for key in ("cpu_s", "wall_s"):
        _num(v, key)
    _int(v, "samples")


def _add(trace: RunTrace, rec: Any) -> None:
    if not isinstance(rec, dict):
        raise TypeError("a record must be a map")
    kind = rec.get("k")
    if kind == "task":
        lengths = rec.get("len", [])
        if not (type(lengths) is list and all(type(n) is int and n >= 0 for n in lengths)):
            raise ValueError("'len' must be a list of non-negative integers")
        if type(rec.get("end", False)) is not bool:
            raise ValueError("'end' must be true or false")
        rows = _int(rec, "rows")
        if lengths and len(lengths) != rows:
            raise ValueError(f"{len(lengths)} lengths for {rows} rows")
        trace.tasks.append(TaskRecord(_str(rec, "stage"), _str(rec, "role"),
                                      _str(rec, "worker"), rows, _num(rec, "t"),
                                      _num(rec, "s"), tuple(lengths), rec.get("end", False)))
    elif kind == "sync":
        trace.syncs.append(SyncRecord(_str(rec, "worker"), _int(rec, "version"),
                                      _num(rec, "t"), _num(rec, "s")))
    elif kind == "step":
        trace.steps.append(StepRecord(_int(rec, "step"), _num(rec, "t"),
                                      _int(rec, "samples")))
    else:
        raise ValueError(f"unknown record kind {kind!r} (expected task, sync or step)")
