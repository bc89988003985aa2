"""The controller's metadata index: which fields of which rows are ready, and who consumed what.

The index is a pure state machine: no sockets, no clock, no tasks. Events go in as method calls
(`add_group`, `put`, `complete`, `fail`, `drop_group`) and decisions come out (`request` returns a
`Task`, the mutators return the store handles the caller must free). It never touches sample
tensors, only opaque, msgpack-able handles to them.

Model. A row is one sample; it has a global id, belongs to a group (the responses to one prompt),
carries the policy version that last produced one of its fields, a token length, and per field a
handle once that field is ready. For every stage a live row is in exactly one state:

    waiting   -- a needed field is missing (or, for a group-level stage, the group is incomplete)
    ready     -- in the stage's FIFO ready queue
    in_flight -- handed out in a task that has not completed or failed yet
    done      -- consumed by the stage (a task holding it completed)
    stale     -- evicted from the queue because it was older than the requested min_version

Guarantees.

- Consumption is exactly once: a row moves to `done` for a stage only when a task holding it
  completes, and a row is never handed out to a stage that is holding or has consumed it.
- Nothing is lost: `fail` (for example of a dead worker's tasks, see `in_flight_of`) puts the rows
  back at the front of the stage's queue in their original order; a row leaves the index only by
  retirement or `drop_group`.
- Retirement: a row retires, and its handles are returned for freeing, exactly when every stage has
  consumed it (`StageGraph.stages_needing_row_retirement`).
- Every handle given to the index is returned exactly once for freeing: on retirement, on
  `drop_group`, when `put` replaces it, or when it is produced for a row that is gone. A dropped
  row that some task still holds is freed only once that task completes or fails, so a worker
  never reads freed memory.
- Readiness is pushed, not searched: when a field lands, each consumer stage's ready queue is
  updated (O(rows x consumers)); `request` pops from the front in O(returned) amortized and never
  scans the table. Group-level stages receive whole groups only, once every row of the group is
  ready for them.
- Stale rows (version < min_version) are evicted from the queue, never handed out, and reported
  by group through `take_stale`; the caller drops (and may readmit) those groups.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Final

from flowrl.graph import StageGraph, StageSpec

__all__ = [
    "Index",
    "IndexStats",
    "StageStats",
    "Task",
    "UnknownField",
    "UnknownGroup",
    "UnknownRow",
    "UnknownStage",
    "UnknownTask",
]

STATES: Final = ("waiting", "ready", "in_flight", "done", "stale")

# Marks a field slot with no handle yet; handles themselves are opaque and may be None.
_UNSET: Final[Any] = object()
# Compact a queue only past this many dead entries, so small queues are never rebuilt.
_COMPACT_MIN = 64
# Rebuild the row table only past this many rows, so small indexes never pay for it.
_SHRINK_MIN = 4096


class UnknownTask(LookupError):
    """A task id that is not in flight: never issued, or already completed or failed."""


class UnknownRow(LookupError):
    """A row id that was never issued."""


class UnknownGroup(LookupError):
    """A group id that is not live: never issued, dropped, or fully retired."""


class UnknownStage(LookupError):
    """A stage name the graph does not declare."""


class UnknownField(LookupError):
    """A field name the graph does not know, or one the completing stage does not produce."""


@dataclass(slots=True, eq=False)
class Task:
    """A micro-batch handed to one stage: its rows and the handles of the fields it needs.

    Not frozen: `Index.bind` gives a task formed without a worker its worker in place (a copy
    cost more than the rest of handing it out). Nothing else changes a task. Compared and
    hashed by identity (``eq=False``), as a mutable one must be to stay hashable."""

    id: int
    stage: str
    rows: tuple[int, ...]
    groups: tuple[int, ...]
    """Group ids of `rows` in first-seen order (whole groups for a group-level stage)."""
    row_groups: tuple[int, ...]
    """The group id of each row, aligned with `rows`."""
    worker: str | None
    handles: dict[str, list[Any]]
    """For each needed field, one handle per row, aligned with `rows`."""
    lengths: tuple[int, ...]
    """Token length of each row (1 where no length was given)."""
    versions: tuple[int | None, ...]
    """Policy version of each row (None where no versioned field has landed)."""
    tokens: int
    """Sum of `lengths`."""


@dataclass(frozen=True, slots=True)
class StageStats:
    """Row counts of one stage; `waiting + ready + in_flight + done + stale == live rows`."""

    name: str
    waiting: int
    ready: int
    in_flight: int
    done: int
    stale: int
    queue_depth: int
    """Ready units in the queue: rows, or groups for a group-level stage."""
    tasks_in_flight: int
    tasks_formed: int
    """Tasks formed ahead of their workers (`Index.form`), not in `tasks_in_flight`; their
    rows count as in flight (a task holds them)."""


@dataclass(frozen=True, slots=True)
class IndexStats:
    """A snapshot of the index, cheap to take (counters are maintained incrementally)."""

    rows: int
    """Live rows (admitted, neither retired nor dropped)."""
    draining_rows: int
    """Dropped rows still held by an in-flight task; freed when that task ends."""
    groups: int
    rows_by_state: dict[str, int]
    """(row, stage) pairs in each state, summed over stages."""
    stages: dict[str, StageStats]
    min_version: int | None
    max_version: int | None
    tasks_in_flight: int
    tasks_formed: int
    added_total: int
    retired_total: int
    dropped_total: int
    stale_total: int
    """Rows evicted as stale since the start."""

    def as_dict(self) -> dict[str, Any]:
        """Plain nested dicts and numbers, ready for JSON (`/status`)."""
        return asdict(self)


class _Row:
    # Per-row state as small ints: one bit per field (ready) or per stage (the others).
    __slots__ = ("done", "dropped", "flight", "gid", "handles", "length", "queued", "ready",
                 "stale", "version")

    def __init__(self, gid: int, nfields: int) -> None:
        self.gid = gid
        self.version: int | None = None
        self.length = 1
        self.ready = 0
        self.queued = 0
        self.flight = 0
        self.done = 0
        self.stale = 0
        self.dropped = False
        self.handles: list[Any] = [_UNSET] * nfields


class _Group:
    __slots__ = ("first", "live", "meta", "ready", "size")

    def __init__(self, first: int, size: int, meta: Any, ngroup_stages: int) -> None:
        self.first = first
        self.size = size
        self.meta = meta
        self.live = size  # rows not yet retired
        # Per group-level stage: rows of this group whose needs for that stage are ready.
        self.ready = [0] * ngroup_stages

    @property
    def rows(self) -> range:
        return range(self.first, self.first + self.size)


class _Stage:
    __slots__ = ("bit", "done_rows", "flight_rows", "formed", "garbage", "gidx", "group_level",
                 "micro_batch", "name", "need", "need_fields", "produces", "queue", "ready_rows",
                 "stale_rows", "tasks", "units")

    def __init__(self, spec: StageSpec, bit: int, need: int,
                 need_fields: tuple[tuple[str, int], ...], gidx: int) -> None:
        self.name = spec.name
        self.micro_batch = spec.micro_batch
        self.produces = frozenset(spec.produces)
        self.group_level = spec.group_level
        self.bit = bit
        self.need = need
        self.need_fields = need_fields
        self.gidx = gidx
        # Row ids (or group ids) in FIFO order. Entries of dropped rows stay until popped or
        # compacted ("garbage"); `units` counts the live entries.
        self.queue: deque[int] = deque()
        self.units = 0
        self.garbage = 0
        self.ready_rows = 0
        self.flight_rows = 0
        self.done_rows = 0
        self.stale_rows = 0
        self.tasks = 0
        self.formed = 0  # of `tasks`: formed, no worker yet (`Index.form`)


class Index:
    """Per-row field readiness and per-stage consumption over a `StageGraph`. See module doc."""

    def __init__(self, graph: StageGraph) -> None:
        self._graph = graph
        self._field_ids: dict[str, int] = {f: i for i, f in enumerate(graph.fields)}
        self._field_names: tuple[str, ...] = graph.fields
        self._stages: list[_Stage] = []
        self._by_name: dict[str, _Stage] = {}
        ngroup = 0
        for i, spec in enumerate(graph.order):
            need_fields = tuple((f, self._field_ids[f]) for f in spec.needs)
            need = sum(1 << fid for _, fid in need_fields)
            st = _Stage(spec, 1 << i, need, need_fields, ngroup if spec.group_level else -1)
            ngroup += spec.group_level
            self._stages.append(st)
            self._by_name[spec.name] = st
        self._ngroup_stages = ngroup
        self._all_stages = (1 << len(self._stages)) - 1
        # consumers[field id] = stages needing that field.
        self._consumers: list[tuple[_Stage, ...]] = [
            tuple(self._by_name[s.name] for s in graph.consumers_of(f)) for f in graph.fields
        ]
        #: `_admission_plan`'s answers by the field ids a group is admitted with
        self._plans: dict[tuple[int, ...], tuple[int, tuple[_Stage, ...], int]] = {}

        self._rows: dict[int, _Row] = {}
        self._groups: dict[int, _Group] = {}
        self._rows_peak = 0  # most rows held since `_rows` was last rebuilt (see _shrink)
        self._tasks: dict[int, tuple[Task, _Stage]] = {}
        self._formed: set[int] = set()  # tasks formed, not bound to a worker yet
        self._by_worker: dict[str, dict[int, None]] = {}
        self._stale: dict[int, None] = {}  # ordered set of group ids with stale rows
        self._versions: dict[int, int] = {}  # version -> live rows carrying it
        self._next_row = 0
        self._next_group = 0
        self._next_task = 0
        self._live = 0
        self._draining = 0
        self._added = 0
        self._retired = 0
        self._dropped = 0
        self._stale_total = 0

    @property
    def graph(self) -> StageGraph:
        return self._graph

    # --- admission -----------------------------------------------------------------------------

    def add_group(
        self,
        size: int,
        fields: Mapping[str, Sequence[Any]] | None = None,
        meta: Any = None,
        *,
        lengths: Sequence[int] | None = None,
    ) -> int:
        """Admit a group of `size` rows; `fields` (one handle per row) are ready at once."""
        if size < 1:
            raise ValueError(f"a group needs at least one row, got size {size}")
        given = fields or {}
        fids = self._check_fields(given, size)
        if lengths is not None and len(lengths) != size:
            raise ValueError(f"{len(lengths)} lengths for a group of {size} rows")
        gid = self._next_group
        first = self._next_row
        self._next_group += 1
        self._next_row += size
        ready, stages, queued = self._admission_plan(tuple(fids))
        g = self._groups[gid] = _Group(first, size, meta, self._ngroup_stages)
        # Fresh rows: each field lands once and each stage it makes ready is known up front,
        # so rows are built ready and queued, with no per-row readiness pass (`_put`). A
        # step's admission is the largest dispatch pass.
        nf = len(self._field_names)
        rows = self._rows
        columns = tuple(zip(fids, given.values(), strict=True))
        for i in range(size):
            row = _Row(gid, nf)
            row.ready = ready
            row.queued = queued
            handles = row.handles
            for fid, column in columns:
                handles[fid] = column[i]
            if lengths is not None:
                row.length = lengths[i]
            rows[first + i] = row
        for st in stages:
            if st.group_level:
                g.ready[st.gidx] = size
                st.queue.append(gid)
                st.units += 1
            else:
                st.queue.extend(range(first, first + size))
                st.units += size
            st.ready_rows += size
        self._rows_peak = max(self._rows_peak, len(rows))
        self._live += size
        self._added += size
        return gid

    def _admission_plan(self, fids: tuple[int, ...]) -> tuple[int, tuple[_Stage, ...], int]:
        """For rows admitted holding fields ``fids``: their ``ready`` bits, the stages that
        are ready for them at once, and those stages' bits (the rows' ``queued``)."""
        plan = self._plans.get(fids)
        if plan is None:
            ready = 0
            for fid in fids:
                ready |= 1 << fid
            stages = tuple(st for st in self._stages if (ready & st.need) == st.need)
            queued = 0
            for st in stages:
                queued |= st.bit
            plan = self._plans[fids] = (ready, stages, queued)
        return plan

    def group_rows(self, gid: int) -> tuple[int, ...]:
        """The row ids of group `gid` (retired ones included, while the group is live)."""
        return tuple(self._group(gid).rows)

    def group_meta(self, gid: int) -> Any:
        """The `meta` given to `add_group` (e.g. the dataset index, to readmit a stale prompt)."""
        return self._group(gid).meta

    def groups_holding(self, holds: Callable[[Any], bool]) -> list[int]:
        """Ids of the live groups with a row holding a handle for which ``holds`` is true
        (e.g. one on a lost node's store). A scan of every live row: for rare events only."""
        unset = _UNSET
        out: dict[int, None] = {}
        for row in self._rows.values():
            if row.gid in out or row.dropped:
                continue
            if any(h is not unset and holds(h) for h in row.handles):
                out[row.gid] = None
        return list(out)

    def group_in_flight(self, gid: int) -> bool:
        """Whether a task holds a row of live group ``gid`` (a trained micro-batch stays in
        flight until its step commits)."""
        rows = self._rows
        return any((row := rows.get(rid)) is not None and row.flight
                   for rid in self._group(gid).rows)

    def has_group(self, gid: int) -> bool:
        return gid in self._groups

    def row_group(self, rid: int) -> int:
        return self._row(rid).gid

    def row_version(self, rid: int) -> int | None:
        return self._row(rid).version

    def has_row(self, rid: int) -> bool:
        """True while `rid` is live (admitted, neither retired nor dropped)."""
        row = self._rows.get(rid)
        return row is not None and not row.dropped

    def row_states(self, rid: int) -> dict[str, str]:
        """The state of live row `rid` for every stage, e.g. {"reward": "ready", ...}."""
        row = self._row(rid)
        out: dict[str, str] = {}
        for st in self._stages:
            b = st.bit
            if row.queued & b:
                out[st.name] = "ready"
            elif row.flight & b:
                out[st.name] = "in_flight"
            elif row.done & b:
                out[st.name] = "done"
            elif row.stale & b:
                out[st.name] = "stale"
            else:
                out[st.name] = "waiting"
        return out

    # --- fields --------------------------------------------------------------------------------

    def put(
        self,
        rows: Sequence[int],
        field: str,
        handles: Sequence[Any],
        *,
        version: int | None = None,
        lengths: Sequence[int] | None = None,
    ) -> list[Any]:
        """Record that `field` of `rows` is ready at `handles` (one per row).

        `version`, when given, becomes the rows' policy version; `lengths` their token lengths.
        Rows whose needs for a stage are now all ready enter that stage's queue. Returns the
        handles the caller must free: ones this put replaced, and ones for rows that have
        retired or been dropped meanwhile. Unknown field or never-issued row ids raise, and
        then nothing has changed.
        """
        fid = self._field_id(field)
        self._check_put(rows, handles, lengths)
        free: list[Any] = []
        if lengths is not None:
            self._set_lengths(rows, lengths)
        self._put(rows, fid, handles, version, free)
        return free

    def _check_put(self, rows: Sequence[int], handles: Sequence[Any],
                   lengths: Sequence[int] | None) -> None:
        if len(handles) != len(rows):
            raise ValueError(f"{len(handles)} handles for {len(rows)} rows")
        if lengths is not None and len(lengths) != len(rows):
            raise ValueError(f"{len(lengths)} lengths for {len(rows)} rows")
        if rows and (min(rows) < 0 or max(rows) >= self._next_row):
            bad = next(r for r in rows if r < 0 or r >= self._next_row)
            raise UnknownRow(f"row {bad} was never issued")

    def _set_lengths(self, rids: Sequence[int], lengths: Sequence[int]) -> None:
        rows = self._rows
        for rid, n in zip(rids, lengths, strict=True):
            row = rows.get(rid)
            if row is not None:
                row.length = n

    def _put(self, rids: Sequence[int], fid: int, handles: Sequence[Any], version: int | None,
             free: list[Any]) -> None:
        # Hot path: one pass over the rows, one check per consumer stage of this field.
        fbit = 1 << fid
        consumers = self._consumers[fid]
        rows = self._rows
        versions = self._versions
        for rid, h in zip(rids, handles, strict=True):
            row = rows.get(rid)
            if row is None or row.dropped:
                free.append(h)  # retired or dropped meanwhile: nobody will read it
                continue
            if version is not None and row.version != version:
                old = row.version
                if old is not None:
                    self._forget_version(old)
                versions[version] = versions.get(version, 0) + 1
                row.version = version
            if row.ready & fbit:
                free.append(row.handles[fid])
                row.handles[fid] = h
                continue  # readiness unchanged: the row entered its queues when it first landed
            row.handles[fid] = h
            ready = row.ready | fbit
            row.ready = ready
            for st in consumers:
                if (ready & st.need) == st.need:  # once per (row, stage): its last field
                    if st.group_level:
                        self._group_row_ready(st, row)
                    else:
                        st.queue.append(rid)
                        row.queued |= st.bit
                        st.units += 1
                        st.ready_rows += 1

    def _group_row_ready(self, st: _Stage, row: _Row) -> None:
        """``row`` became ready for group-level ``st``: its group enters the queue with its
        last row."""
        g = self._groups[row.gid]
        n = g.ready[st.gidx] + 1
        g.ready[st.gidx] = n
        if n == g.size:
            self._enqueue_group(st, row.gid, g)

    def _enqueue_group(self, st: _Stage, gid: int, g: _Group) -> None:
        rows = self._rows
        bit = st.bit
        for rid in g.rows:
            rows[rid].queued |= bit
        st.queue.append(gid)
        st.units += 1
        st.ready_rows += g.size

    def _forget_version(self, v: int) -> None:
        n = self._versions[v] - 1
        if n:
            self._versions[v] = n
        else:
            del self._versions[v]

    # --- tasks ---------------------------------------------------------------------------------

    def request(
        self,
        stage: str,
        up_to: int | None = None,
        *,
        min_version: int | None = None,
        worker: str | None = None,
    ) -> Task | None:
        """Hand out up to `up_to` ready rows (groups, for a group-level stage) in FIFO order.

        `up_to` defaults to the stage's `micro_batch`. With `min_version`, rows older than it
        (for a group: any row older) are evicted from the queue as stale instead of handed out
        and their groups reported by `take_stale`; rows with no version are never stale.
        Returns None when nothing is ready.
        """
        st = self._stage(stage)
        n = st.micro_batch if up_to is None else up_to
        if n < 1:
            raise ValueError(f"up_to must be >= 1, got {up_to}")
        if st.group_level:
            return self._request_groups(st, n, min_version, worker)
        q = st.queue
        rows = self._rows
        bit = st.bit
        taken: list[int] = []
        objs: list[_Row] = []
        while q and len(taken) < n:
            rid = q.popleft()
            row = rows.get(rid)
            if row is None or not row.queued & bit:
                st.garbage -= 1
                continue
            row.queued ^= bit
            v = row.version
            if min_version is not None and v is not None and v < min_version:
                row.stale |= bit
                st.units -= 1
                st.ready_rows -= 1
                st.stale_rows += 1
                self._stale_total += 1
                self._stale[row.gid] = None
                continue
            row.flight |= bit
            taken.append(rid)
            objs.append(row)
        if not taken:
            return None
        k = len(taken)
        st.units -= k
        st.ready_rows -= k
        st.flight_rows += k
        return self._new_task(st, taken, objs, None, worker)

    def _request_groups(self, st: _Stage, n: int, min_version: int | None,
                        worker: str | None) -> Task | None:
        q = st.queue
        rows = self._rows
        groups = self._groups
        bit = st.bit
        taken: list[int] = []
        objs: list[_Row] = []
        gids: list[int] = []
        while q and len(gids) < n:
            gid = q.popleft()
            g = groups.get(gid)
            if g is None:
                st.garbage -= 1
                continue
            grows = [rows[r] for r in g.rows]
            st.units -= 1
            st.ready_rows -= g.size
            if min_version is not None and any(
                o.version is not None and o.version < min_version for o in grows
            ):
                for o in grows:
                    o.queued ^= bit
                    o.stale |= bit
                st.stale_rows += g.size
                self._stale_total += g.size
                self._stale[gid] = None
                continue
            for o in grows:
                o.queued ^= bit
                o.flight |= bit
            st.flight_rows += g.size
            gids.append(gid)
            taken.extend(g.rows)
            objs.extend(grows)
        if not gids:
            return None
        return self._new_task(st, taken, objs, tuple(gids), worker)

    def _new_task(self, st: _Stage, rids: list[int], objs: list[_Row],
                  groups: tuple[int, ...] | None, worker: str | None) -> Task:
        """``groups``: None for a row-level stage (the rows' groups in first-seen order)."""
        tid = self._next_task
        self._next_task += 1
        lengths = tuple([o.length for o in objs])
        row_groups = tuple([o.gid for o in objs])
        task = Task(
            id=tid,
            stage=st.name,
            rows=tuple(rids),
            groups=tuple(dict.fromkeys(row_groups)) if groups is None else groups,
            row_groups=row_groups,
            worker=worker,
            handles={f: [o.handles[fid] for o in objs] for f, fid in st.need_fields},
            lengths=lengths,
            versions=tuple([o.version for o in objs]),
            tokens=sum(lengths),
        )
        self._tasks[tid] = (task, st)
        st.tasks += 1
        if worker is not None:
            self._by_worker.setdefault(worker, {})[tid] = None
        return task

    def form(self, stage: str, up_to: int | None = None) -> Task | None:
        """`request` for a task that waits for its worker (`bind`): it holds its rows, and
        counts as formed, not in flight (`StageStats.tasks_formed`), until it is bound."""
        task = self.request(stage, up_to)
        if task is not None:
            self._formed.add(task.id)
            self._tasks[task.id][1].formed += 1
        return task

    def bind(self, task_id: int, worker: str) -> Task:
        """Task `task_id`, requested with no worker, now runs on `worker` (whose death fails
        it, `in_flight_of`); returns it as `worker`'s. Raises `UnknownTask` for a task that is
        not in flight, ValueError for one that has a worker already."""
        try:
            task, st = self._tasks[task_id]
        except KeyError:
            raise UnknownTask(f"task {task_id} is not in flight") from None
        if task.worker is not None:
            raise ValueError(f"task {task_id} runs on {task.worker} already")
        task.worker = worker
        if task_id in self._formed:
            self._formed.discard(task_id)
            st.formed -= 1
        self._by_worker.setdefault(worker, {})[task_id] = None
        return task

    def _pop_task(self, task_id: int) -> tuple[Task, _Stage]:
        try:
            rec = self._tasks.pop(task_id)
        except KeyError:
            raise UnknownTask(f"task {task_id} is not in flight") from None
        task, st = rec
        st.tasks -= 1
        if task_id in self._formed:
            self._formed.discard(task_id)
            st.formed -= 1
        if task.worker is not None:
            mine = self._by_worker[task.worker]
            del mine[task_id]
            if not mine:
                del self._by_worker[task.worker]
        return rec

    def complete(
        self,
        task_id: int,
        produced: Mapping[str, Sequence[Any]] | None = None,
        *,
        version: int | None = None,
        lengths: Sequence[int] | None = None,
    ) -> list[Any]:
        """The task's stage consumed its rows; `produced` fields (aligned with `Task.rows`) land.

        `version` and `lengths` apply to the rows as in `put`. Returns the handles the caller must
        free: those of rows that retired (every stage has consumed them), of dropped rows this task
        was the last to hold, and any produced for rows that are gone. Raises `UnknownTask` for a
        task that is not in flight, `UnknownField` for a field the stage does not produce; then
        nothing has changed.
        """
        rec = self._tasks.get(task_id)
        if rec is None:
            raise UnknownTask(f"task {task_id} is not in flight")
        task, st = rec
        produced = produced or {}
        for f in produced:
            if f not in st.produces:
                raise UnknownField(f"stage {st.name!r} does not produce field {f!r}")
        fids = self._check_fields(produced, len(task.rows))
        if lengths is not None and len(lengths) != len(task.rows):
            raise ValueError(f"{len(lengths)} lengths for {len(task.rows)} rows")
        self._pop_task(task_id)

        free: list[Any] = []
        rows = self._rows
        bit = st.bit
        consumed: list[tuple[int, _Row]] = []
        for rid in task.rows:
            row = rows[rid]
            row.flight ^= bit
            if row.dropped:
                if not row.flight:
                    self._release(rid, row, free)
                continue
            row.done |= bit
            consumed.append((rid, row))
        st.flight_rows -= len(consumed)
        st.done_rows += len(consumed)
        if lengths is not None:
            self._set_lengths(task.rows, lengths)
        for fid, handles in zip(fids, produced.values(), strict=True):
            self._put(task.rows, fid, handles, version, free)
        if version is not None and not produced:
            self._put_version(task.rows, version)
        everyone = self._all_stages
        retired = 0
        for rid, row in consumed:
            if row.done == everyone:
                self._retire(rid, row, free)
                retired += 1
        if retired:
            for s in self._stages:
                s.done_rows -= retired
            self._live -= retired
            self._retired += retired
            self._shrink()
        return free

    def _shrink(self) -> None:
        # A dict never gives back its table when entries are deleted. Once the rows have fallen
        # to a quarter of their peak, rebuild the row and group tables at their live size, so
        # memory follows the rows held (a burst does not pin its peak); O(1) amortized.
        n = len(self._rows)
        if self._rows_peak > _SHRINK_MIN and 4 * n < self._rows_peak:
            self._rows = dict(self._rows)
            self._groups = dict(self._groups)
            self._rows_peak = n

    def _put_version(self, rids: Sequence[int], version: int) -> None:
        for rid in rids:
            row = self._rows.get(rid)
            if row is not None and not row.dropped and row.version != version:
                if row.version is not None:
                    self._forget_version(row.version)
                self._versions[version] = self._versions.get(version, 0) + 1
                row.version = version

    def _retire(self, rid: int, row: _Row, free: list[Any]) -> None:
        unset = _UNSET
        free.extend([h for h in row.handles if h is not unset])
        g = self._groups[row.gid]
        g.live -= 1
        if not g.live:
            del self._groups[row.gid]
        if row.version is not None:
            self._forget_version(row.version)
        del self._rows[rid]

    def _release(self, rid: int, row: _Row, free: list[Any]) -> None:
        # A dropped row that no task holds any more: its handles can finally be freed.
        unset = _UNSET
        free.extend([h for h in row.handles if h is not unset])
        del self._rows[rid]
        self._draining -= 1

    def fail(self, task_id: int) -> list[Any]:
        """The task did not run to completion: its rows return to the front of the queue.

        They keep their order and are not consumed. Returns handles to free: those of dropped rows
        this task was the last to hold. Raises `UnknownTask` for a task that is not in flight.
        """
        task, st = self._pop_task(task_id)
        free: list[Any] = []
        rows = self._rows
        bit = st.bit
        back = 0
        for rid in task.rows:
            row = rows[rid]
            row.flight ^= bit
            if row.dropped:
                if not row.flight:
                    self._release(rid, row, free)
                continue
            row.queued |= bit
            back += 1
        st.flight_rows -= back
        st.ready_rows += back
        q = st.queue
        if st.group_level:
            for gid in reversed(task.groups):
                if gid in self._groups:
                    q.appendleft(gid)
                    st.units += 1
        else:
            for rid in reversed(task.rows):
                back_row = rows.get(rid)
                if back_row is not None and back_row.queued & bit:
                    q.appendleft(rid)
                    st.units += 1
        return free

    def ready_units(self, stage: str) -> int:
        """Ready units in `stage`'s queue (rows, or groups for a group-level stage): 0 means
        `request` returns None, so a dispatch pass need not look for a worker first."""
        return self._stage(stage).units

    def queued_groups(self, stage: str, n: int) -> list[int]:
        """The groups of the first ``n`` ready units of ``stage``'s queue, in the order
        `request` would hand them out (for a row-level stage, each row's group); nothing is
        taken. O(n) but for dropped entries, which are skipped."""
        st = self._stage(stage)
        out: list[int] = []
        if n < 1:
            return out
        groups, rows, bit = self._groups, self._rows, st.bit
        for uid in st.queue:
            if st.group_level:
                if uid not in groups:
                    continue
                out.append(uid)
            else:
                row = rows.get(uid)
                if row is None or not row.queued & bit:
                    continue
                out.append(row.gid)
            if len(out) == n:
                break
        return out

    def in_flight_of(self, worker: str) -> list[int]:
        """Ids of the tasks handed to `worker` that are still in flight (to fail if it dies)."""
        return list(self._by_worker.get(worker, ()))

    def task(self, task_id: int) -> Task:
        """The in-flight task `task_id`."""
        rec = self._tasks.get(task_id)
        if rec is None:
            raise UnknownTask(f"task {task_id} is not in flight")
        return rec[0]

    # --- removal -------------------------------------------------------------------------------

    def take_stale(self) -> list[int]:
        """Group ids with rows evicted as stale since the last call, in eviction order.

        Stale rows never run again for the stage that evicted them, so they cannot retire: drop
        each group (`drop_group`) and readmit its prompt if wanted (`group_meta`).
        """
        out = list(self._stale)
        self._stale.clear()
        return out

    def drop_group(self, gid: int) -> list[Any]:
        """Remove group `gid` and all its rows from every queue; return handles to free now.

        Rows held by in-flight tasks are kept out of every queue and freed when their last task
        completes or fails (the handles come back from that call).
        """
        g = self._groups.pop(gid, None)
        if g is None:
            raise UnknownGroup(f"group {gid} is not live")
        self._stale.pop(gid, None)
        free: list[Any] = []
        rows = self._rows
        stages = self._stages
        group_queued = 0  # stage bits in which the group itself has a queue entry
        n = 0
        for rid in g.rows:
            row = rows.get(rid)
            if row is None:
                continue  # retired already
            n += 1
            for st in stages:
                b = st.bit
                if row.queued & b:
                    st.ready_rows -= 1
                    if st.group_level:
                        group_queued |= b
                    else:
                        st.units -= 1
                        st.garbage += 1
                elif row.flight & b:
                    st.flight_rows -= 1
                elif row.done & b:
                    st.done_rows -= 1
                elif row.stale & b:
                    st.stale_rows -= 1
            if row.version is not None:
                self._forget_version(row.version)
            row.queued = row.done = row.stale = 0
            if row.flight:
                row.dropped = True
                self._draining += 1
            else:
                unset = _UNSET
                free.extend([h for h in row.handles if h is not unset])
                del rows[rid]
        for st in stages:
            if group_queued & st.bit:
                st.units -= 1
                st.garbage += 1
            if st.garbage:
                self._maybe_compact(st)
        self._live -= n
        self._dropped += n
        self._shrink()
        return free

    def _maybe_compact(self, st: _Stage) -> None:
        # Dead entries are skipped when popped; rebuilding once they outnumber live ones keeps
        # memory bounded by the live queue and the cost amortized O(1) per drop.
        if st.units == 0:
            st.queue.clear()
            st.garbage = 0
        elif st.garbage > _COMPACT_MIN and st.garbage > st.units:
            if st.group_level:
                groups = self._groups
                st.queue = deque(g for g in st.queue if g in groups)
            else:
                rows = self._rows
                bit = st.bit
                st.queue = deque(
                    r for r in st.queue if (o := rows.get(r)) is not None and o.queued & bit
                )
            st.garbage = 0

    # --- introspection -------------------------------------------------------------------------

    def statistics(self) -> IndexStats:
        """A frozen snapshot; O(stages + distinct versions)."""
        stages: dict[str, StageStats] = {}
        totals = dict.fromkeys(STATES, 0)
        for st in self._stages:
            waiting = self._live - st.ready_rows - st.flight_rows - st.done_rows - st.stale_rows
            s = StageStats(st.name, waiting, st.ready_rows, st.flight_rows, st.done_rows,
                           st.stale_rows, st.units, st.tasks - st.formed, st.formed)
            stages[st.name] = s
            totals["waiting"] += waiting
            totals["ready"] += s.ready
            totals["in_flight"] += s.in_flight
            totals["done"] += s.done
            totals["stale"] += s.stale
        return IndexStats(
            rows=self._live,
            draining_rows=self._draining,
            groups=len(self._groups),
            rows_by_state=totals,
            stages=stages,
            min_version=min(self._versions) if self._versions else None,
            max_version=max(self._versions) if self._versions else None,
            tasks_in_flight=len(self._tasks) - len(self._formed),
            tasks_formed=len(self._formed),
            added_total=self._added,
            retired_total=self._retired,
            dropped_total=self._dropped,
            stale_total=self._stale_total,
        )

    def audit(self) -> dict[str, int]:
        """Recount everything from the rows and compare with the maintained counters.

        O(rows + queued entries): for tests and debugging. Raises `RuntimeError` on any
        mismatch; returns the sizes of the internal containers (all zero when the index is empty).
        """
        def expect(what: str, got: int, want: int) -> None:
            if got != want:
                raise RuntimeError(f"index audit: {what} is {got}, recount gives {want}")

        live = [(rid, r) for rid, r in self._rows.items() if not r.dropped]
        expect("live rows", self._live, len(live))
        expect("draining rows", self._draining, len(self._rows) - len(live))
        versions: dict[int, int] = {}
        for _, r in live:
            if r.version is not None:
                versions[r.version] = versions.get(r.version, 0) + 1
        expect("distinct versions", len(self._versions), len(versions))
        for v, c in versions.items():
            expect(f"rows at version {v}", self._versions.get(v, 0), c)
        for st in self._stages:
            b = st.bit
            counts = dict.fromkeys(STATES, 0)
            for _, r in live:
                states = [bool(r.queued & b), bool(r.flight & b), bool(r.done & b),
                          bool(r.stale & b)]
                if sum(states) > 1:
                    raise RuntimeError(f"index audit: a row is in two states for {st.name!r}")
                for name, on in zip(STATES[1:], states, strict=True):
                    counts[name] += on
            expect(f"{st.name} ready", st.ready_rows, counts["ready"])
            expect(f"{st.name} in_flight", st.flight_rows, counts["in_flight"])
            expect(f"{st.name} done", st.done_rows, counts["done"])
            expect(f"{st.name} stale", st.stale_rows, counts["stale"])
            if st.group_level:
                valid = sum(1 for g in st.queue if g in self._groups)
            else:
                valid = sum(
                    1 for rid in st.queue
                    if (o := self._rows.get(rid)) is not None and o.queued & b
                )
            expect(f"{st.name} queue entries", st.units, valid)
            expect(f"{st.name} dead queue entries", st.garbage, len(st.queue) - valid)
            expect(f"{st.name} tasks", st.tasks,
                   sum(1 for _, s in self._tasks.values() if s is st))
            expect(f"{st.name} tasks formed", st.formed,
                   sum(1 for t in self._formed if self._tasks[t][1] is st))
        for r in self._rows.values():
            if r.dropped and not r.flight:
                raise RuntimeError("index audit: a dropped row no task holds was not freed")
        for gid, g in self._groups.items():
            alive = sum(1 for rid in g.rows if self.has_row(rid))
            expect(f"group {gid} live rows", g.live, alive)
        sizes = {
            "rows": len(self._rows),
            "groups": len(self._groups),
            "tasks": len(self._tasks),
            "workers": len(self._by_worker),
            "stale": len(self._stale),
            "versions": len(self._versions),
        }
        for st in self._stages:
            sizes[f"queue:{st.name}"] = len(st.queue)
        return sizes

    # --- helpers -------------------------------------------------------------------------------

    def _stage(self, name: str) -> _Stage:
        try:
            return self._by_name[name]
        except KeyError:
            raise UnknownStage(f"no stage named {name!r}") from None

    def _field_id(self, name: str) -> int:
        try:
            return self._field_ids[name]
        except KeyError:
            raise UnknownField(f"no stage produces field {name!r} and the data source "
                               "does not provide it") from None

    def _check_fields(self, fields: Mapping[str, Sequence[Any]], n: int) -> list[int]:
        fids = []
        for f, handles in fields.items():
            fids.append(self._field_id(f))
            if len(handles) != n:
                raise ValueError(f"field {f!r} has {len(handles)} handles for {n} rows")
        return fids

    def _row(self, rid: int) -> _Row:
        row = self._rows.get(rid)
        if row is None or row.dropped:
            raise UnknownRow(f"row {rid} is not live")
        return row

    def _group(self, gid: int) -> _Group:
        g = self._groups.get(gid)
        if g is None:
            raise UnknownGroup(f"group {gid} is not live")
        return g
