"""The store feed: frees what the index retired and keeps the store's accounting fresh.

One owned task batches frees into one ``free`` call, refreshes the store's ``stats`` after each
batch and whenever admission asks (`want_stats`), and, when nothing arrived for
`STORE_CHECK_S`, looks for a run stuck on a store too small for one step
(`flowrl.backpressure.StoreBackpressure.stalled`) and stops it with an error naming the
capacity instead of waiting forever.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable
from typing import Any

import structlog

from flowrl.control.admission import Admission
from flowrl.index import Index
from transport.handles import free_entries
from transport.rpc import RpcClient

__all__ = ["STORE_CHECK_S", "StoreFeed"]

log = structlog.get_logger("flowrl.controller")

#: the store is looked at after this long without a free or a refresh: often enough to stop a
#: run stuck on a too-small store within seconds (`StoreBackpressure.stall_s` after the first
#: look), and one ``stats`` call a second costs nothing.
STORE_CHECK_S = 1.0


class StoreFeed:
    def __init__(self, admission: Admission, index: Index, source_stage: str, group_size: int,
                 *, version: Callable[[], int], wake: Callable[[], None],
                 progress_mark: Callable[[], Hashable],
                 started_tasks: Callable[[], int],
                 may_stall: Callable[[], bool],
                 weights_bytes: Callable[[], int | None],
                 stalled: Callable[[str], None]) -> None:
        """``version()``: the policy version; ``wake()``: admission may go on (a refresh found
        room); ``progress_mark()``: changes whenever the run moves; ``started_tasks()``: tasks
        a worker has taken; ``may_stall()``: whether a stall is worth looking for now
        (running, not paused); ``weights_bytes()``: one weight version's size;
        ``stalled(error)``: the run is stuck on its store."""
        self.admission = admission
        self.backpressure = admission.store
        self._index = index
        self._source_stage = source_stage
        self._group_size = group_size
        self._version = version
        self._wake = wake
        self._progress_mark = progress_mark
        self._started_tasks = started_tasks
        self._may_stall = may_stall
        self._weights_bytes = weights_bytes
        self._stalled = stalled
        #: the node store's accounting, refreshed after every batch of frees, while admission
        #: waits for the store, and when the run has been quiet for `STORE_CHECK_S`.
        self.stats: dict[str, Any] = {}
        self.store: RpcClient | None = None
        # Unbounded, but bounded in practice: frees follow retirements (at most the rows the
        # staleness gate admitted).
        self._pending: list[Any] = []
        # Frees or a refresh request wait; every wake-up ends with a refresh.
        self._arrived = asyncio.Event()

    def free(self, handles: list[Any]) -> None:
        """Free ``handles`` (inline field values such as rewards are skipped) soon."""
        if handles:
            self._pending.extend(handles)
            self._arrived.set()

    def want_stats(self) -> None:
        """Refresh `stats` soon (at most one refresh waits)."""
        self._arrived.set()

    async def run(self) -> None:
        while True:
            try:
                async with asyncio.timeout(STORE_CHECK_S):
                    await self._arrived.wait()
            except TimeoutError:
                try:
                    await self._check_stall()
                except Exception as exc:
                    log.warning("store check failed", error=repr(exc))
                continue
            self._arrived.clear()
            # One batch of what piled up, a run's rows as one entry; inline field values
            # (prompt positions, rewards) hold no memory.
            entries = free_entries(self._pending)
            self._pending = []
            if self.store is None:
                continue
            try:
                if entries:
                    await self.store.call("free", {"handles": entries}, timeout=10.0)
                    self.backpressure.free_batches += 1
                await self.refresh()
            except Exception as exc:
                handles = sum(len(e[1]) if type(e) is list else 1 for e in entries)
                log.warning("store free failed", error=repr(exc), handles=handles)

    async def refresh(self) -> None:
        assert self.store is not None
        landed = self._landed_groups()  # before the call: bytes per group err high
        self.stats = await self.store.call("stats", {}, timeout=10.0)
        self.backpressure.observe(self.stats, landed)
        version = self._version()
        if (self.backpressure.room(self.admission.untrained(version))
                and self.admission.open(version)):
            self._wake()  # admission waited for this

    def _landed_groups(self) -> int:
        """Live groups whose data the first stage has written into the store."""
        stage = self._index.statistics().stages.get(self._source_stage)
        return 0 if stage is None else stage.done // max(1, self._group_size)

    async def _check_stall(self) -> None:
        """The run has been quiet: stop it if it is stuck on a store too small for a step."""
        if self.store is None or not self._may_stall():
            return
        mark = self._progress_mark()
        await self.refresh()
        now = time.perf_counter()
        if (self.backpressure.stalled(mark, self._started_tasks(), now)
                and mark == self._progress_mark()):
            self._stalled(self.backpressure.too_small(weights_bytes=self._weights_bytes(),
                                                      now=now))
