"""The worker registry: who is alive, what each worker serves, how loaded it is.

A pure state machine driven by the controller (no sockets, no clock of its own: every method
that needs the time takes ``now``). Liveness: a worker is dead when its process exits or when no
heartbeat arrived for ``heartbeat_timeout_s``; the controller then fails its tasks so their rows
are redone elsewhere.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field


@dataclass(slots=True)
class WorkerInfo:
    worker_id: str
    name: str
    role: str
    node: str
    pid: int
    capacity: int
    #: the policy version it serves (`version`): a field the registry indexes, so it is set
    #: through the property
    _version: int = 0
    #: assigned and not finished: task id -> load (tokens, or rows when lengths are unknown).
    tasks: dict[int, int] = field(default_factory=dict)
    load: int = 0
    deadline: float = 0.0
    done: int = 0
    failed: int = 0
    #: the secret its register reply carried; every later call of the worker carries it
    token: bytes = field(default=b"", repr=False)
    #: a worker of another role in the same process (colocated placement): the two take
    #: turns, so neither is given a task while the other holds one
    partner: WorkerInfo | None = field(default=None, repr=False)
    #: its node's agent dispatches its tasks (`flowrl.control.node_leases`): never picked here
    leased: bool = False
    #: the registry's hook for a version change (None once removed)
    _moved: Callable[[WorkerInfo, int], None] | None = field(default=None, repr=False,
                                                             compare=False)

    @property
    def version(self) -> int:
        return self._version

    @version.setter
    def version(self, version: int) -> None:
        if self._moved is not None and version != self._version:
            self._moved(self, version)
        self._version = version

    @property
    def in_flight(self) -> int:
        return len(self.tasks)

    @property
    def process(self) -> str:
        """The name of the process hosting it: worker ``role.proc_no.i`` of ``role.proc_no``."""
        return self.name.rsplit(".", 1)[0]


class Registry:
    def __init__(self, heartbeat_timeout_s: float, *, tasks_per_slot: int = 2) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        #: a worker holds at most ``capacity * tasks_per_slot`` assigned tasks (the surplus
        #: waits in its queue so it never idles between tasks).
        self.tasks_per_slot = tasks_per_slot
        self._workers: dict[str, WorkerInfo] = {}
        self._by_role: dict[str, dict[str, WorkerInfo]] = {}
        # Workers that can take another task, by role and version: dispatch scans only these,
        # and only those of the versions a bound allows.
        self._open: _Buckets = {}
        # Workers with no task, by role and version, longest idle first: dispatch takes one
        # without a scan, and a search for a version nobody idle serves costs one look a version.
        self._idle: _Buckets = {}
        # How many workers of each role serve each version: whether anyone may run a task of a
        # version bound, and the oldest version still served, without a look at the workers.
        self._versions: dict[str, dict[int, int]] = {}
        self._ids = itertools.count()
        # Workers by the process hosting them (name, pid, node): pairing a registration with
        # its process's other worker looks at that process only, not at every worker.
        self._processes: dict[tuple[str, int, str], dict[str, WorkerInfo]] = {}

    def register(
        self, *, name: str, role: str, node: str, pid: int, capacity: int, version: int,
        now: float,
    ) -> WorkerInfo:
        worker_id = f"{role}-{next(self._ids)}"
        info = WorkerInfo(worker_id, name, role, node, pid, max(1, capacity), version,
                          deadline=now + self.heartbeat_timeout_s,
                          token=secrets.token_bytes(16))
        mates = self._processes.setdefault((info.process, pid, node), {})
        for other in mates.values():  # one process, named for it (`process`)
            if other.role != role:
                info.partner, other.partner = other, info
        mates[worker_id] = info
        self._workers[worker_id] = info
        self._by_role.setdefault(role, {})[worker_id] = info
        self._count(info, info.version, 1)
        _put(self._open, info, info.version)
        _put(self._idle, info, info.version)
        info._moved = self._moved
        return info

    def lease_out(self, info: WorkerInfo) -> None:
        """``info``'s tasks come from its node's agent from now on: dispatch never picks it."""
        info.leased = True
        _take(self._open, info)
        _take(self._idle, info)

    def open_count(self, role: str) -> int:
        """How many of ``role``'s workers dispatched here have a free slot (O(versions))."""
        return sum(len(bucket) for bucket in self._open.get(role, {}).values())

    def get(self, worker_id: str) -> WorkerInfo | None:
        return self._workers.get(worker_id)

    def heartbeat(self, worker_id: str, now: float) -> WorkerInfo | None:
        info = self._workers.get(worker_id)
        if info is not None:
            info.deadline = now + self.heartbeat_timeout_s
        return info

    def remove(self, worker_id: str) -> WorkerInfo | None:
        info = self._workers.pop(worker_id, None)
        if info is not None:
            if info.partner is not None:
                info.partner.partner = None
            key = (info.process, info.pid, info.node)
            mates = self._processes[key]
            del mates[worker_id]
            if not mates:
                del self._processes[key]
            self._by_role[info.role].pop(worker_id, None)
            _take(self._open, info)
            _take(self._idle, info)
            self._count(info, info.version, -1)
            info._moved = None
        return info

    def of_role(self, role: str) -> list[WorkerInfo]:
        return list(self._by_role.get(role, {}).values())

    def versions(self, role: str) -> set[int]:
        """The versions that workers of ``role`` serve."""
        return set(self._versions.get(role, ()))

    def iter_role(self, role: str) -> Iterator[WorkerInfo]:
        """The workers of ``role`` without a copy: for a scan that may stop early (the
        registry must not change while it runs)."""
        return iter(self._by_role.get(role, {}).values())

    def by_pid(self, pid: int) -> list[WorkerInfo]:
        return [w for w in self._workers.values() if w.pid == pid]

    def expired(self, now: float) -> list[WorkerInfo]:
        return [w for w in self._workers.values() if w.deadline < now]

    def next_deadline(self) -> float | None:
        return min((w.deadline for w in self._workers.values()), default=None)

    def assign(self, info: WorkerInfo, task_id: int, load: int) -> None:
        info.tasks[task_id] = load
        info.load += load
        _take(self._idle, info)
        if len(info.tasks) >= info.capacity * self.tasks_per_slot:
            _take(self._open, info)

    def finish(self, info: WorkerInfo, task_id: int, *, ok: bool) -> None:
        info.load -= info.tasks.pop(task_id, 0)
        if ok:
            info.done += 1
        else:
            info.failed += 1
        if info.worker_id in self._workers and not info.leased:
            _put(self._open, info, info.version)
            if not info.tasks:
                _put(self._idle, info, info.version)

    def least_loaded(self, role: str, min_version: int | None = None) -> WorkerInfo | None:
        """The worker of ``role`` with the least outstanding load that can take one more task
        (and whose colocated partner, if any, holds none).

        An idle worker (nothing beats it) is taken without a scan, of the newest version idle
        workers serve, the one idle longest; otherwise only workers with a free slot are
        scanned, and none when no worker serves a version the bound allows, so dispatch stays
        cheap with a thousand workers.
        """
        idle: WorkerInfo | None = None
        for version, bucket in self._idle.get(role, {}).items():
            if ((min_version is not None and version < min_version)
                    or (idle is not None and version <= idle.version)):
                continue
            for w in bucket.values():
                if w.partner is None or not w.partner.tasks:
                    idle = w
                    break
        if idle is not None:
            return idle
        best: WorkerInfo | None = None
        best_key = (0, 0)
        for version, bucket in self._open.get(role, {}).items():
            if min_version is not None and version < min_version:
                continue
            for w in bucket.values():
                if w.partner is not None and w.partner.tasks:
                    continue  # its process is in the other phase
                if not w.tasks:
                    return w
                key = (w.load, len(w.tasks))
                if best is None or key < best_key:
                    best, best_key = w, key
        return best

    # ---- the indexes ------------------------------------------------------------------------

    def _moved(self, info: WorkerInfo, version: int) -> None:
        """``info`` serves ``version`` from now on (its ``version`` is about to be set)."""
        self.serve(((info, version),))

    def serve(self, served: Iterable[tuple[WorkerInfo, int]]) -> None:
        """Each ``(worker, version)``: the worker serves the version from now on; the counts
        and the open and idle tables follow. A node's gathered ``served`` moves most of its
        workers from one version to the next, so each role's tables are looked up once."""
        tables: dict[str, tuple[dict[int, int], list[dict[int, dict[str, WorkerInfo]]]]] = {}
        for info, version in served:
            old = info._version
            if old == version:
                continue
            if info._moved is None:  # removed: in none of the tables
                info._version = version
                continue
            role, wid = info.role, info.worker_id
            found = tables.get(role)
            if found is None:
                found = tables[role] = (
                    self._versions.setdefault(role, {}),
                    [b for b in (self._open.get(role), self._idle.get(role)) if b is not None])
            counts, indexes = found
            n = counts.get(old, 0) - 1
            if n:
                counts[old] = n
            else:
                del counts[old]
            counts[version] = counts.get(version, 0) + 1
            for buckets in indexes:
                bucket = buckets.get(old)
                if bucket is None or bucket.pop(wid, None) is None:
                    continue
                if not bucket:
                    del buckets[old]
                to = buckets.get(version)
                if to is None:
                    buckets[version] = {wid: info}
                else:
                    to[wid] = info
            info._version = version

    def _count(self, info: WorkerInfo, version: int, delta: int) -> None:
        counts = self._versions.setdefault(info.role, {})
        n = counts.get(version, 0) + delta
        if n:
            counts[version] = n
        else:
            del counts[version]

    def all(self) -> list[WorkerInfo]:
        return list(self._workers.values())

    def __len__(self) -> int:
        return len(self._workers)


_Buckets = dict[str, dict[int, dict[str, WorkerInfo]]]
"""Workers by role, then by the version they serve, then by id (in the order they came)."""


def _put(index: _Buckets, info: WorkerInfo, version: int) -> None:
    index.setdefault(info.role, {}).setdefault(version, {})[info.worker_id] = info


def _take(index: _Buckets, info: WorkerInfo) -> bool:
    """Take ``info`` out of ``index`` (an emptied version goes too); whether it was there."""
    buckets = index.get(info.role)
    bucket = buckets.get(info.version) if buckets is not None else None
    if bucket is None or bucket.pop(info.worker_id, None) is None:
        return False
    if not bucket:
        del buckets[info.version]  # type: ignore[union-attr]
    return True
