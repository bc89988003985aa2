"""The monitor's listener: a bounded number of connections, each on a deadline.

aiohttp serves each connection for as long as the client keeps it open and reads a request
head for as long as it trickles in, so a crowd of slow-header (slowloris) connections holds
one file descriptor each, without bound, in the controller's own process. Here every
connection goes through `ConnectionLimits`, which wraps aiohttp's protocol to

- hold at most ``max_connections``: when full, a new connection takes the place of the
  longest-idle one (no request under way: its head still coming, or an idle keep-alive); when
  every connection is serving a request, the new one gets a canned 503 and is closed, before
  aiohttp sees it;
- close a connection that does not complete a request within ``header_timeout_s`` of opening
  or of its previous answer;
- abort a connection whose answer has not drained for ``stall_timeout_s`` (the transport paused
  writing: the client stopped reading), so a stalled client is dropped, not buffered for. The
  kernel's send buffer of each connection is fixed at `SEND_BUFFER` (Linux otherwise grows it
  to megabytes): bounded memory, and a client that stops reading shows within that many bytes.

Deadlines are one loop timer per connection, re-armed on each change of state: no polling.
aiohttp meets a connection only once its first request head is complete (up to `MAX_HEAD`
bytes, buffered here): a connection that never completes one, the slowloris kind, costs a
buffer and a timer, never a request handler and its task.
"""

from __future__ import annotations

import asyncio
import collections
import socket
from typing import cast

from aiohttp import web

__all__ = ["BUSY_REPLY", "SEND_BUFFER", "BoundedSite", "ConnectionLimits"]

#: the longest first request head taken (request line and headers); a longer one is closed.
MAX_HEAD = 64 << 10
#: the kernel send buffer of a monitor connection (bytes; Linux doubles it for bookkeeping).
SEND_BUFFER = 64 << 10

#: what a connection beyond the limit gets: a complete answer, written once, no parsing.
BUSY_REPLY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
              b"Retry-After: 5\r\nConnection: close\r\nContent-Length: 33\r\n\r\n"
              b"the monitor has too many clients\n")


class _Refused(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        t = cast(asyncio.Transport, transport)
        t.write(BUSY_REPLY)
        t.close()


class _Connection(asyncio.Protocol):
    """aiohttp's protocol for one connection, wrapped to count it and keep it on a deadline."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self._limits = limits
        self._inner: asyncio.Protocol | None = None  # aiohttp's, once a request head is in
        self._head = b""
        self.transport: asyncio.Transport | None = None
        self.requests = 0  # handlers running on it (aiohttp runs one at a time)
        self._paused = False  # the transport's buffer is over its high-water mark
        self._timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol, passed on to aiohttp

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        self._limits.opened(self)
        self._rearm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        self._limits.closed(self)
        self.transport = None
        if self._inner is not None:
            self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._inner is not None:
            self._inner.data_received(data)
            return
        # The head ends at the first blank line; look for it only where it may now be.
        start = max(0, len(self._head) - 3)
        self._head += data
        if self._head.find(b"\r\n\r\n", start) < 0:
            if len(self._head) > MAX_HEAD:
                self.drop()
            return
        assert self.transport is not None
        self._inner = self._limits.handler()
        self._inner.connection_made(self.transport)
        head, self._head = self._head, b""
        self._inner.data_received(head)

    def eof_received(self) -> bool | None:
        return None if self._inner is None else self._inner.eof_received()

    def pause_writing(self) -> None:
        self._paused = True
        self._rearm()
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._paused = False
        self._rearm()
        if self._inner is not None:
            self._inner.resume_writing()

    # -- state

    def request_started(self) -> None:
        self.requests += 1
        self._limits.busy(self)
        self._rearm()

    def request_ended(self) -> None:
        self.requests -= 1
        if not self.requests:
            self._limits.idle(self)
        self._rearm()

    def drop(self) -> None:
        """Close now: at once if answer bytes are still queued (the client is not reading)."""
        self._cancel()
        t = self.transport
        if t is None or t.is_closing():
            return
        if t.get_write_buffer_size():
            t.abort()
        else:
            t.close()

    def _rearm(self) -> None:
        self._cancel()
        if self.transport is None:
            return
        if self._paused:  # an answer is waiting for the client to read (after the handler too)
            delay = self._limits.stall_timeout_s
        elif not self.requests:
            delay = self._limits.header_timeout_s
        else:
            return  # serving, and the client keeps up
        self._timer = asyncio.get_running_loop().call_later(delay, self._expire)

    def _expire(self) -> None:
        self._timer = None
        self._limits.timed_out += 1
        self.drop()

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class ConnectionLimits:
    """The protocol factory of the monitor's listener (see the module's docstring)."""

    def __init__(self, server: web.Server, *, max_connections: int, header_timeout_s: float,
                 stall_timeout_s: float) -> None:
        self._server = server
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self._open: set[_Connection] = set()
        #: connections with no request under way, longest idle first (eviction order).
        self._idle: collections.OrderedDict[_Connection, None] = collections.OrderedDict()
        self.refused = 0
        self.evicted = 0
        self.timed_out = 0

    def __len__(self) -> int:
        return len(self._open)

    def __call__(self) -> asyncio.Protocol:
        if len(self._open) >= self.max_connections:
            if not self._idle:
                self.refused += 1
                return _Refused()
            oldest, _ = self._idle.popitem(last=False)
            self.evicted += 1
            oldest.drop()
            # Its slot frees when its transport reports the loss; it is no longer counted.
            self._open.discard(oldest)
        return _Connection(self)

    def handler(self) -> asyncio.Protocol:
        """A new aiohttp protocol for a connection whose first request head is in."""
        return self._server()

    def opened(self, conn: _Connection) -> None:
        self._open.add(conn)
        self._idle[conn] = None

    def closed(self, conn: _Connection) -> None:
        self._open.discard(conn)
        self._idle.pop(conn, None)

    def busy(self, conn: _Connection) -> None:
        self._idle.pop(conn, None)

    def idle(self, conn: _Connection) -> None:
        if conn in self._open:
            self._idle[conn] = None

    @staticmethod
    def of(request: web.BaseRequest) -> _Connection | None:
        """The connection `request` came on (None once it is gone)."""
        transport = request.transport
        proto = transport.get_protocol() if transport is not None else None
        return proto if isinstance(proto, _Connection) else None


class BoundedSite(web.BaseSite):
    """A TCP site whose connections go through `ConnectionLimits`, with a bounded backlog."""

    def __init__(self, runner: web.BaseRunner, limits: ConnectionLimits, host: str, port: int,
                 *, backlog: int) -> None:
        super().__init__(runner, backlog=backlog)
        self._limits = limits
        self._host = host
        self._port = port

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._limits, self._host, self._port,
                                                backlog=self._backlog)
