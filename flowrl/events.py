"""What the controller tells its watchers: a bounded event log and a bounded activity trace.

Events (``step``, ``worker_up``, ``worker_down``, ``version``, ``interrupted``, ``error``,
``run_failed``) carry a sequence number so a stream consumer can tell it missed some. Each
subscriber has its own bounded queue; a subscriber too slow to keep up loses its oldest events
(counted), never slows the controller down.

Spans record what every worker did and when (stage, task, start, end), for the pipeline
timeline and the Chrome-trace export; the newest ``max_spans`` are kept. Marks are moments on a
worker's timeline (an ``interrupted`` weight load), kept alike.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, NamedTuple

#: a watcher that falls this far behind starts losing its oldest events.
SUBSCRIBER_QUEUE = 1024


class Span(NamedTuple):
    """A task on its worker's timeline (one a task: a tuple is made in half the time of a
    frozen dataclass)."""

    worker: str
    role: str
    stage: str
    task: int
    rows: int
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class Mark:
    worker: str
    role: str
    name: str
    time: float
    args: dict[str, Any]


class EventBus:
    def __init__(self, *, keep: int = 1000, max_spans: int = 20_000) -> None:
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=keep)
        self.spans: collections.deque[Span] = collections.deque(maxlen=max_spans)
        self.marks: collections.deque[Mark] = collections.deque(maxlen=max_spans)
        self.t0 = time.time()
        self.dropped = 0
        self._seq = 0
        self._subscribers: set[asyncio.Queue[dict[str, Any]]] = set()

    def emit(self, kind: str, **data: Any) -> None:
        self._seq += 1
        event = {"seq": self._seq, "kind": kind, "time": time.time(), **data}
        self.recent.append(event)
        for q in self._subscribers:
            if q.full():
                q.get_nowait()
                self.dropped += 1
            q.put_nowait(event)

    def span(self, span: Span) -> None:
        self.spans.append(span)

    def mark(self, worker: str, role: str, name: str, **args: Any) -> None:
        """A moment on ``worker``'s timeline, now."""
        self.marks.append(Mark(worker, role, name, time.time(), args))

    async def subscribe(self) -> AsyncIterator[dict[str, Any]]:
        """Every event emitted from now on, in order (the oldest go first when it lags)."""
        q: asyncio.Queue[dict[str, Any]] = asyncio.Queue(SUBSCRIBER_QUEUE)
        self._subscribers.add(q)
        try:
            while True:
                yield await q.get()
        finally:
            self._subscribers.discard(q)
