"""One subscription to the controller's events, shared by every ``/events`` client.

The controller's `EventBus` gives each subscriber a queue of its own, so a subscription per
client made every event cost the controller one queue put, one JSON encoding and one wake-up per
client, all in its own loop. `EventFanout` subscribes once and encodes each event once, into
its Server-Sent Events form, appending it to a ring as long as the bus's own log of recent
events. Each client reads the ring from a position of its own, at its own pace; a client that
falls a whole ring behind is told so (it is dropped and resumes with ``Last-Event-ID``) instead
of having events buffered for it. Readers wait on one shared future, replaced on every change.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
from collections.abc import AsyncGenerator, Callable
from typing import Any, cast

from flowrl.events import EventBus

__all__ = ["KEEPALIVE", "EventFanout"]

#: the comment an idle stream sends now and then, so proxies keep it and a gone client shows.
KEEPALIVE = b": keepalive\n\n"


class EventFanout:
    """`encode` turns an event into its bytes on the wire (called once per event)."""

    def __init__(self, bus: EventBus, encode: Callable[[dict[str, Any]], bytes], *,
                 keepalive_s: float) -> None:
        self._bus = bus
        self._encode = encode
        self._keepalive_s = keepalive_s
        #: (seq, encoded event), oldest first.
        self._ring: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=bus.recent.maxlen or 1000)
        self._end = 0  # the position after the newest encoded event (events ever appended)
        self._changed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        #: keepalive periods passed (a reader that sees it change sends a keepalive comment).
        self.keepalives = 0
        self.closed = False

    async def run(self) -> None:
        """Encodes every event as it comes, until cancelled; wakes the readers after each
        event and after each keepalive period without one."""
        # subscribe() is an async generator; it must be closed to drop its queue at once.
        live = cast(AsyncGenerator[dict[str, Any], None], self._bus.subscribe())
        nxt: asyncio.Future[dict[str, Any]] = asyncio.ensure_future(anext(live))
        try:
            # One turn of the loop runs the subscription up to its queue wait: from then on it
            # receives every event, so taking `recent` now leaves no gap (and the queue's
            # copies of those events are skipped by `_append`).
            await asyncio.sleep(0)
            for event in list(self._bus.recent):
                self._append(event)
            self._wake()
            while True:
                done, _ = await asyncio.wait({nxt}, timeout=self._keepalive_s)
                if done:
                    self._append(nxt.result())
                    nxt = asyncio.ensure_future(anext(live))
                else:
                    self.keepalives += 1
                self._wake()
        finally:
            nxt.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await nxt
            await live.aclose()
            self.close()

    def close(self) -> None:
        """Readers end (their next `read` is None)."""
        self.closed = True
        self._wake()

    def start(self, last_id: int | None) -> int:
        """A reader's first position: after event `last_id` (the oldest kept when that is gone
        already), or after the newest event without one."""
        if last_id is None:
            return self._end
        first = bisect.bisect_right(self._ring, last_id, key=lambda item: item[0])
        return self._end - len(self._ring) + first

    def read(self, pos: int) -> tuple[bytes, int] | None:
        """The encoded events from `pos` on and the position after them; None when the stream
        is over: closed, or `pos` fell out of the ring (that reader is too slow)."""
        behind = self._end - pos
        if self.closed or behind > len(self._ring):
            return None
        # From the right end: indexing a deque near its ends is O(1).
        return b"".join(self._ring[-k][1] for k in range(behind, 0, -1)), self._end

    async def changed(self) -> None:
        """Returns after the next event, keepalive period or close."""
        # shield: a reader cancelled while waiting must not cancel the future all share.
        await asyncio.shield(self._changed)

    def _append(self, event: dict[str, Any]) -> None:
        seq = event["seq"]
        if self._ring and seq <= self._ring[-1][0]:
            return  # taken from `recent` already
        self._ring.append((seq, self._encode(event)))
        self._end += 1

    def _wake(self) -> None:
        done, self._changed = self._changed, asyncio.get_running_loop().create_future()
        done.set_result(None)
