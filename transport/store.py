"""The per-node shared-memory sample store.

`SampleStore` lives in the node's store process (the node agent). A `put` writes one
micro-batch — one or more fields, each a list of per-row tensors, a (padded, lengths) pair or a
batch tensor — into one shared-memory segment, each field as one packed buffer, and returns one
`Handle` per row and field. Handles are plain msgpack-able tuples; any process on the node turns
them back into tensors without a copy (`get`) or into one padded batch with one copy
(`get_padded`; `get_padded_many` for several fields at once). `transport.store_server` serves
the same store to worker processes (which write into shared memory themselves) and to readers
on other nodes.

Files: `shm` (segment names, mapping, cleanup), `handles` (the handle, contiguous runs,
`Rows`), `packing` (writing a micro-batch), `reading` (views, padded batches, mapping caches),
this module (capacity, reference counts, the pool), `store_server` (the store over RPC).

Guarantees:
- A handle exists only after its buffer is complete (segments are written under a temporary
  name and renamed when done), so a reader never sees a half-written row.
- `used_bytes` never exceeds `capacity_bytes`: a `put` that does not fit waits, first in first
  served, until `free` makes room (backpressure instead of an out-of-memory death). A put larger
  than the whole capacity fails at once. A store whose capacity ``/dev/shm`` cannot hold at its
  start is refused (`SharedMemoryTooSmall`, naming the free space), not left to SIGBUS later.
- A segment lives while it holds at least one unfreed handle. When its last handle is freed it
  is renamed away (handles to it fail from then on) and either kept in a small pool of warm
  segments that later puts rewrite (fresh shared memory costs a page fault per 4 KiB) or unlinked.
  Tensors obtained from freed handles are therefore invalid: free only what every reader is done
  with, as with any allocator.
- Freeing a handle twice, or a handle of another node, raises — after the valid handles of the
  same call are freed. Rows of zero bytes reference no segment (``segment == ""``); freeing them
  is a no-op.
- `close` removes every segment of this store, including the ones workers were writing; segments
  of stores whose process died are removed by the next store's start or `python -m flowrl.cleanup`.

The store is not thread-safe: use it from one event loop.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from transport import shm
from transport.errors import ClosedError, UnknownSegment
from transport.handles import DTYPES, Handle, Run, contiguous_runs, single_run
from transport.packing import (
    FieldData,
    Grant,
    SegmentWriter,
    count_refs,
    make_handles,
    plan_fields,
    size_class,
)
from transport.reading import (
    DEFAULT_CACHE_BYTES,
    MappingCache,
    local_get,
    local_get_padded,
    map_runs,
    padded_from_runs,
    views_from_runs,
)

if TYPE_CHECKING:
    import torch
else:
    from transport.lazy_torch import torch

__all__ = [
    "DTYPES",
    "FieldData",
    "Handle",
    "SampleStore",
    "StoreStats",
    "local_get",
    "local_get_padded",
]


@dataclass(frozen=True, slots=True)
class StoreStats:
    """A snapshot of a store's accounting."""

    node: str
    capacity_bytes: int
    used_bytes: int  # segments + outstanding grants + pooled segments
    pooled_bytes: int
    segments: int
    waiting_puts: int


class _Capacity:
    """A FIFO byte semaphore: takers wait in arrival order, so a large put is never starved."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.used = 0
        # Bounded by the number of concurrent puts, each of which awaits its own entry.
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()
        self._queued: asyncio.Event | None = None  # set when a taker starts waiting

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def wait_waiting(self, count: int) -> None:
        while len(self._waiters) < count:
            if self._queued is None:
                self._queued = asyncio.Event()
            await self._queued.wait()

    def try_take(self, n: int) -> bool:
        if self._waiters or self.used + n > self.total:
            return False
        self.used += n
        return True

    async def take(self, n: int) -> None:
        if self.try_take(n):
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._waiters.append(entry)
        if self._queued is not None:
            self._queued.set()
            self._queued = None
        try:
            await fut
        except BaseException:
            if entry in self._waiters:
                self._waiters.remove(entry)
                self._wake()  # the next in line may fit now
            elif fut.done() and not fut.cancelled() and fut.exception() is None:
                self.give(n)  # granted, but the taker left before it could use it
            raise

    def give(self, n: int) -> None:
        self.used -= n
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self.used + self._waiters[0][0] <= self.total:
            n, fut = self._waiters.popleft()
            self.used += n
            fut.set_result(None)

    def close(self) -> None:
        while self._waiters:
            _, fut = self._waiters.popleft()
            fut.set_exception(ClosedError("store closed"))


# ---------------------------------------------------------------------------------------------
# The store


@dataclass(slots=True)
class _Segment:
    name: str
    size: int
    refs: int  # handles with bytes not yet freed
    writer: int
    data: torch.Tensor | None  # uint8 over this process's shared mapping, if it wrote it
    freed: set[int] = field(default_factory=set)  # offsets freed so far


@dataclass(slots=True)
class _PoolEntry:
    name: str
    size: int


@dataclass(slots=True)
class _GrantState:
    grant: Grant
    writer: shm.Owner


class SampleStore:
    """The shared-memory sample store of one node, in the node's store process."""

    def __init__(
        self,
        run_id: str,
        node: str,
        *,
        capacity_bytes: int,
        pool_bytes: int | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        """`pool_bytes` bounds the freed segments kept warm for reuse (default: a quarter of
        the capacity, so that a model's previous weight version is recycled for the next:
        fresh segments cost a page fault per page on both sides, 4-8x the copy itself);
        pooled bytes count as used and are given up first whenever a put would otherwise
        wait. `cache_bytes` bounds each of this process's two mapping caches (segments it
        wrote, segments it read; see `MappingCache`)."""
        if capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be positive")
        self.run_id = shm.check_run_id(run_id)
        self.node = node
        self.capacity_bytes = capacity_bytes
        self._pool_limit = capacity_bytes // 4 if pool_bytes is None else pool_bytes
        self.owner = shm.Owner.current()
        self.prefix = shm.owner_prefix(run_id, self.owner)
        self.swept = shm.sweep()  # first: dead runs' segments give their room back
        shm.check_room(capacity_bytes)
        shm.claim_run_dir(run_id, self.owner)
        # Its own segments come back from the pool: keep their mappings (no page faults).
        self._writes = MappingCache(cache_bytes, writable=True)
        self._writer = SegmentWriter(run_id, self.owner, self._writes)
        self._reads = MappingCache(cache_bytes)
        self._cap = _Capacity(capacity_bytes)
        self._segments: dict[str, _Segment] = {}
        # size -> pooled segments of that size; a few distinct sizes in practice
        self._pool: dict[int, list[_PoolEntry]] = {}
        self._pool_bytes = 0
        self._grants: dict[int, _GrantState] = {}
        self._grant_ids = itertools.count(1)
        self._pool_seq = itertools.count()
        self._closed = False

    # -- accounting ----------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return self._cap.used

    async def wait_waiting_puts(self, count: int) -> None:
        """Return once at least `count` puts are waiting for capacity (for tests and probes)."""
        await self._cap.wait_waiting(count)

    def statistics(self) -> StoreStats:
        return StoreStats(
            self.node,
            self.capacity_bytes,
            self._cap.used,
            self._pool_bytes,
            len(self._segments),
            self._cap.waiting,
        )

    # -- writing -------------------------------------------------------------------------------

    async def put(self, fields: Mapping[str, FieldData]) -> dict[str, list[Handle]]:
        """Write one micro-batch; one handle per row and field. Waits while the store is full."""
        plans, nbytes = plan_fields(fields)
        if nbytes == 0:
            self._check_open()
            return make_handles(self.node, "", plans)
        grant = await self.reserve(size_class(nbytes), writer=self.owner)
        try:
            name, data = self._writer.write(grant, plans)
        except BaseException:
            self.abandon(grant.id)
            raise
        refs = count_refs(plans)
        self.commit(grant.id, name, refs, data=data)
        return make_handles(self.node, name, plans)

    async def reserve(self, size: int, *, writer: shm.Owner) -> Grant:
        """Reserve a segment of at least `size` bytes for `writer`; waits while the store is full.

        Prefers a pooled segment of a close size; gives pooled segments up before waiting.
        """
        self._check_open()
        if size > self.capacity_bytes:
            raise ValueError(f"a put of {size} bytes exceeds the capacity {self.capacity_bytes}")
        entry = self._take_pooled(size)
        if entry is not None:
            return self._grant(entry.size, entry.name, writer)
        if not self._cap.try_take(size):
            self.reap_dead_writers()
            self._evict_pool(size)
            if not self._cap.try_take(size):
                await self._cap.take(size)
        return self._grant(size, None, writer)

    def reserve_nowait(self, size: int, *, writer: shm.Owner) -> Grant | None:
        """A grant if one is available without waiting and no put is waiting; else None."""
        self._check_open()
        if size > self.capacity_bytes or self._cap.waiting:
            return None
        entry = self._take_pooled(size)
        if entry is not None:
            return self._grant(entry.size, entry.name, writer)
        if self._cap.try_take(size):
            return self._grant(size, None, writer)
        return None

    def _grant(self, size: int, pool: str | None, writer: shm.Owner) -> Grant:
        grant = Grant(next(self._grant_ids), size, pool)
        self._grants[grant.id] = _GrantState(grant, writer)
        return grant

    def commit(
        self, grant_id: int, name: str, refs: int, *, data: torch.Tensor | None = None
    ) -> None:
        """Register segment `name`, written and published under `grant_id`, holding `refs`
        handles with bytes. `data` is the writer's shared mapping (this process only)."""
        self._check_open()
        state = self._grants.get(grant_id)
        if state is None:
            raise UnknownSegment(f"no outstanding grant {grant_id}")
        parsed = shm.SegmentName.parse(name)
        if (
            parsed is None
            or parsed.run_id != self.run_id
            or parsed.owner != self.owner
            or parsed.state
            or parsed.writer != state.writer.pid
        ):
            raise ValueError(f"segment {name!r} was not written under grant {grant_id}")
        if refs <= 0:
            raise ValueError("a committed segment holds at least one handle")
        try:
            actual = shm.size_of(name)
        except FileNotFoundError:
            raise UnknownSegment(f"segment {name!r} does not exist") from None
        if actual != state.grant.size:
            raise ValueError(f"segment {name!r} has {actual} bytes, granted {state.grant.size}")
        del self._grants[grant_id]
        own = data if state.writer.pid == self.owner.pid else None
        self._segments[name] = _Segment(name, state.grant.size, refs, state.writer.pid, own)

    def abandon(self, grant_id: int) -> None:
        """Give back a grant that will not be committed."""
        state = self._grants.pop(grant_id, None)
        if state is None:
            return
        grant = state.grant
        if grant.pool is not None:
            self._release(grant.pool, grant.size)
        else:  # a fresh segment: its writer removes its own temporary file
            self._cap.give(grant.size)

    def reap_dead_writers(self) -> list[int]:
        """Abandon the grants of writers that died, and remove what they left unpublished."""
        dead = {s.writer.pid for s in self._grants.values() if not s.writer.alive()}
        for gid in [g for g, s in self._grants.items() if s.writer.pid in dead]:
            self.abandon(gid)
        for pid in dead:
            for name in shm.segments_of(self.run_id, self.owner, pid):
                if name not in self._segments and not self._is_pooled(name):
                    shm.unlink(name)
        return sorted(dead)

    def release_writer(self, pid: int) -> None:
        """Abandon every outstanding grant of process `pid` (it closed its client)."""
        for gid in [g for g, s in self._grants.items() if s.writer.pid == pid]:
            self.abandon(gid)

    def holds(self, name: str) -> bool:
        """Whether `name` is a committed segment of this store."""
        return name in self._segments

    # -- the pool of freed segments --------------------------------------------------------------

    def _take_pooled(self, size: int) -> _PoolEntry | None:
        """The smallest pooled segment of `size` to `2 * size` bytes, taken out of the pool."""
        fits = [s for s in self._pool if size <= s <= 2 * size]
        if not fits:
            return None
        best = min(fits)
        entries = self._pool[best]
        entry = entries.pop()
        if not entries:
            del self._pool[best]
        self._pool_bytes -= best
        return entry

    def _add_pooled(self, entry: _PoolEntry) -> None:
        self._pool.setdefault(entry.size, []).append(entry)
        self._pool_bytes += entry.size

    def _evict_pool(self, size: int) -> None:
        """Unlink pooled segments, largest first, until `size` more bytes would fit."""
        while self._pool and self._cap.used + size > self.capacity_bytes:
            largest = max(self._pool)
            entries = self._pool[largest]
            entry = entries.pop()
            if not entries:
                del self._pool[largest]
            self._pool_bytes -= entry.size
            shm.unlink(entry.name)
            self._cap.give(entry.size)

    def _is_pooled(self, name: str) -> bool:
        return any(e.name == name for entries in self._pool.values() for e in entries)

    # -- freeing -------------------------------------------------------------------------------

    def free(self, handles: Iterable[Handle]) -> None:
        """Release handles; a segment goes when its last handle does.

        Every valid handle is freed, even when others in the same call are not (a controller
        batching frees must not leak a batch for one bad handle); then, if any was invalid —
        another node's, of a segment not held, freed twice — this raises (UnknownSegment when
        the only problem is segments not held, else ValueError).
        """
        self._check_open()
        by_segment: dict[str, list[int]] = {}
        node = self.node
        problems: list[str] = []
        for h in handles:
            if h[0] != node:
                problems.append(f"a handle of node {h[0]!r} freed on node {node!r}")
            elif h[1]:
                offsets = by_segment.get(h[1])
                if offsets is None:
                    by_segment[h[1]] = [h[2]]
                else:
                    offsets.append(h[2])
        unknown = []
        for name, offsets in by_segment.items():
            seg = self._segments.get(name)
            if seg is None:
                unknown.append(name)
                continue
            fresh = set(offsets)
            if (
                len(fresh) != len(offsets)
                or not seg.freed.isdisjoint(fresh)
                or len(fresh) > seg.refs
                or min(fresh) < 0
                or max(fresh) >= seg.size
            ):
                fresh -= seg.freed
                fresh = {o for o in fresh if 0 <= o < seg.size}
                if len(fresh) > seg.refs:  # offsets this segment never held
                    fresh = set(sorted(fresh)[: seg.refs])
                problems.append(
                    f"{len(offsets) - len(fresh)} handle(s) of segment {name!r} freed twice "
                    "or never held"
                )
            seg.freed |= fresh
            seg.refs -= len(fresh)
            if seg.refs == 0:
                self._retire(seg)
        if problems:
            if unknown:
                problems.append(f"segments not held (already freed?): {unknown[:3]}")
            raise ValueError("; ".join(problems))
        if unknown:
            raise UnknownSegment(f"segments not held (already freed?): {unknown[:3]}")

    def _retire(self, seg: _Segment) -> None:
        del self._segments[seg.name]
        self._release(seg.name, seg.size)

    def _release(self, name: str, size: int) -> None:
        """Segment `name` holds nothing any more: pool it (renamed) while no put waits and the
        pool has room, else unlink it and give its bytes back."""
        if not self._cap.waiting and self._pool_bytes + size <= self._pool_limit:
            pooled = f"{self.prefix}{self.owner.pid}-{next(self._pool_seq)}.pool"
            try:
                shm.rename(name, pooled)
            except FileNotFoundError:  # removed behind our back: nothing left to pool
                self._cap.give(size)
            else:
                self._add_pooled(_PoolEntry(pooled, size))
            return
        shm.unlink(name)
        self._cap.give(size)

    # -- reading -------------------------------------------------------------------------------

    def _held(self, name: str) -> _Segment:
        seg = self._segments.get(name)
        if seg is None:
            raise UnknownSegment(f"segment {name!r} is not held (never written, or freed)")
        return seg

    def check_ranges(self, ranges: Sequence[tuple[str, int, int]]) -> None:
        """Raise what `read_ranges` would for a range of a segment not held or past its end,
        without touching the data (nor torch)."""
        self._check_open()
        for name, offset, nbytes in ranges:
            _check_range(name, offset, nbytes, self._held(name).size)

    def read_ranges(self, ranges: Sequence[tuple[str, int, int]]) -> list[torch.Tensor]:
        """uint8 views of (segment, offset, nbytes) ranges of held segments, for remote reads
        and padded copies: through the store's own mapping, or its cache of read mappings."""
        self._check_open()
        out = []
        for name, offset, nbytes in ranges:
            seg = self._held(name)
            data = seg.data if seg.data is not None else self._reads.data(name)
            _check_range(name, offset, nbytes, data.numel())
            out.append(data[offset : offset + nbytes])
        return out

    def _runs(self, handles: Sequence[Handle]) -> list[Run]:
        for h in handles:
            if h.node != self.node:
                raise ValueError(f"handle of node {h.node!r} read on node {self.node!r}")
        return contiguous_runs(handles)

    def get(self, handles: Sequence[Handle]) -> list[torch.Tensor]:
        """Per-row tensors viewing shared memory (no copy); valid until the handles are freed.

        Views of segments this process wrote share its writable mapping: do not write into
        them. Other segments are mapped afresh, copy-on-write.
        """
        runs = self._runs(handles)
        foreign = [r for r in runs if self._held(r.segment).data is None]
        fresh = dict(zip(foreign, map_runs(foreign), strict=True))
        buffers = [
            fresh[r] if r in fresh else self.read_ranges([(r.segment, r.offset, r.nbytes)])[0]
            for r in runs
        ]
        return views_from_runs(handles, runs, buffers)

    def get_padded(
        self, handles: Sequence[Handle], pad: float | int | bool = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One padded batch ``[B, max_len, ...]`` (one copy) and the lengths ``[B]``."""
        single = single_run(handles) if handles else None
        runs = [single[0]] if single is not None else self._runs(handles)
        if single is not None and single[0].node != self.node:
            self._runs(handles)  # raises: another node's handles
        buffers = self.read_ranges([(r.segment, r.offset, r.nbytes) for r in runs])
        return padded_from_runs(handles, runs, buffers, pad, single[1] if single else None)

    def get_padded_many(
        self, fields: Mapping[str, Sequence[Handle]], pad: float | int | bool = 0
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """`get_padded` of several fields at once (typically every field of one micro-batch),
        by field name."""
        return {name: self.get_padded(handles, pad) for name, handles in fields.items()}

    # -- lifetime ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("store closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Remove every segment of this store (idempotent). Pending puts raise ClosedError."""
        if self._closed:
            return
        self._closed = True
        self._cap.close()
        for name in shm.segments_of(self.run_id, self.owner):
            shm.unlink(name)
        self._segments.clear()
        self._pool.clear()
        self._grants.clear()
        self._reads.clear()
        self._writes.clear()
        shm.release_run_dir(self.run_id, self.owner)

    def __enter__(self) -> SampleStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_range(name: str, offset: int, nbytes: int, size: int) -> None:
    if offset < 0 or nbytes < 0 or offset + nbytes > size:
        raise ValueError(f"range {offset}+{nbytes} outside segment {name!r}")
