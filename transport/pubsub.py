"""Broadcasts: a Publisher (ROUTER) fans messages out to Subscribers (DEALER) that joined.

Wire, publisher to subscriber: a message is `[topic + b"\\0", *codec frames]`; the welcome is
`[0xff "welcome"]` (UTF-8 topics never contain byte 0xff). Subscriber to publisher, once, as it
connects: its join `[0xff "join", name, *topic frames]`. The topic's terminating zero byte makes
every topic distinct from its prefixes ("ver" does not receive "version").

Why a ROUTER and not XPUB: an XPUB socket cannot tell its subscribers apart. When one
subscriber's queue is full it either drops that subscriber's copy silently (the default) or,
with XPUB_NODROP, refuses the message for everyone, so that one subscriber that stops reading
(a stopped process, any local process that connects) stalls every broadcast, and a shutdown
that broadcasts stop with it. A ROUTER holds one queue per peer and, with ROUTER_MANDATORY,
says which peer's queue is full (EAGAIN) or which peer is gone (EHOSTUNREACH); the Publisher
sends each message to each subscriber of its topic itself and keeps account per subscriber.

Handshake: a Subscriber's routing identity is its random token; its join, queued before the
connection exists, is the first thing the Publisher reads from it. The Publisher records the
topics under that identity and answers the welcome; `join()` returns when it arrives. The
identity outlives a reconnect, so a subscriber that reconnects is still known and needs no
second join (a publisher that restarts is not survived: it lives as long as its run).

Delivery: a joined subscriber receives every message published after its welcome, in publish
order, unless it is dropped. `publish` never waits: a message that a subscriber's queue cannot
take now (it is full, or the subscriber is reconnecting) joins that subscriber's backlog, in
order, and is sent as the queue frees; the encoded frames are shared, not copied. A subscriber
that takes nothing from its backlog for `stall_timeout` seconds, or falls more than
`max_backlog` messages behind, is dropped: never sent to again, and reported (`on_drop`,
`dropped`) with the name it joined with and its token, so that its owner can act (e.g. restart
a hung worker). The others are not delayed by it. Messages zmq had already queued for a
subscriber whose connection broke may be lost with the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import zmq

from transport._lifecycle import Closeable, Service, cancel_and_wait
from transport._zsocket import AsyncSocket, OutFrame, bind, new_socket
from transport.codec import MAX_MESSAGE_BYTES, decode, encode
from transport.curve import Authorizer, CurveKeys, authorize
from transport.endpoints import check_bind
from transport.errors import ClosedError, DeadlineExceeded, MalformedMessage, TransportError

__all__ = ["DroppedSubscriber", "Publisher", "Subscriber"]

log = logging.getLogger(__name__)

_JOIN: Final = b"\xffjoin"
_WELCOME: Final = b"\xffwelcome"
# Broadcasts are small, rare control messages (versions, pause, stop): zmq queues 4096 per
# subscriber and direction; past that, messages wait in the subscriber's backlog.
_HWM: Final = 4096
_MAX_NAME_BYTES: Final = 256
# A join carries a name and topics: anything larger is not one (zmq drops the peer unread).
_MAX_JOIN_BYTES: Final = 64 * 1024
# While a backlog waits, how often sends are retried without a sign from zmq: a send to one
# subscriber may consume the sign that another's queue freed (see `AsyncSocket.wait_writable`).
_RETRY_S: Final = 0.1
# A join not welcomed this long is made again on a fresh connection, under a fresh identity:
# a welcome is sent within milliseconds of a join, and a publisher that could not deliver it
# (it saw the connection gone) drops the identity after its stall timeout.
_REJOIN_S: Final = 8.0


def _topic_frame(topic: str) -> bytes:
    if "\0" in topic:
        raise ValueError(f"topic {topic!r} contains a zero byte")
    return topic.encode() + b"\0"


@dataclass(frozen=True, slots=True)
class DroppedSubscriber:
    """A subscriber the Publisher stopped sending to, and why."""

    name: str  # as the subscriber gave it (`Subscriber(name=...)`); "" when none
    token: str  # the subscriber's `Subscriber.token`
    reason: str
    # False: it was not connected when last tried (it left, or its connection broke) rather
    # than connected and not reading.
    connected: bool


@dataclass(eq=False, slots=True)
class _Peer:
    identity: bytes
    name: str
    topics: frozenset[bytes]
    # Messages its queue could not take yet, oldest first; `since`: when it last took one
    # from here (or the backlog began).
    backlog: deque[Sequence[OutFrame]] = field(default_factory=deque)
    since: float = 0.0
    connected: bool = True


class Publisher(Service):
    """Publishes `(topic, payload)` messages to the Subscribers of `endpoint` (module docstring)."""

    def __init__(
        self,
        endpoint: str,
        *,
        ctx: zmq.Context[Any] | None = None,
        allow_remote: bool = False,
        curve: CurveKeys | None = None,
        on_drop: Callable[[DroppedSubscriber], None] | None = None,
        stall_timeout: float = 10.0,
        max_backlog: int = 1 << 16,
    ) -> None:
        """`curve`: publish encrypted, to the run's subscribers only (needed to bind a
        non-loopback address, with `allow_remote`). `on_drop` is called (from the event loop)
        with each subscriber dropped for `stall_timeout` seconds without progress or a backlog
        over `max_backlog` messages; it may also be set later, as the attribute `on_drop`."""
        check_bind(endpoint, allow_remote=allow_remote, curve=curve is not None)
        if not (stall_timeout > 0 and max_backlog > 0):
            raise ValueError("stall_timeout and max_backlog must be positive")
        self._endpoint = endpoint
        self._ctx = ctx
        self._curve = curve
        self.on_drop = on_drop
        self._stall_timeout = stall_timeout
        self._max_backlog = max_backlog
        self._auth: Authorizer | None = None
        self._sock: AsyncSocket | None = None
        self._peers: dict[bytes, _Peer] = {}
        self._dropped: list[DroppedSubscriber] = []
        self._dropped_ids: set[bytes] = set()
        self._backlogged = asyncio.Event()
        self._flusher: asyncio.Task[None] | None = None
        self._joined = 0

    @property
    def endpoint(self) -> str:
        """The bound endpoint once started (with the real port for tcp port 0)."""
        return self._endpoint

    @property
    def joined(self) -> int:
        """Number of welcomes sent (subscribers that completed the handshake)."""
        return self._joined

    @property
    def dropped(self) -> tuple[DroppedSubscriber, ...]:
        """Every subscriber dropped so far, in order."""
        return tuple(self._dropped)

    async def start(self) -> str:
        """Bind; returns the bound endpoint."""
        if self._sock is not None:
            raise TransportError("publisher already started")
        options: list[tuple[int, int | bytes]] = [
            (zmq.SNDHWM, _HWM),
            (zmq.ROUTER_MANDATORY, 1),  # a full or absent peer is an error, not a silent drop
            (zmq.ROUTER_HANDOVER, 1),  # a reconnect takes over a connection not yet seen dead
            (zmq.MAXMSGSIZE, _MAX_JOIN_BYTES),
        ]
        if self._curve is not None:
            options += self._curve.server_options()
            self._auth = authorize(self._ctx, self._curve)  # before the bind: none unchecked
        try:
            sock = new_socket(self._ctx, zmq.ROUTER, options)
            self._endpoint = bind(sock, self._endpoint)
        except BaseException:
            self._release_auth()
            raise
        self._sock = AsyncSocket(sock, self._on_join)
        self._flusher = asyncio.get_running_loop().create_task(self._flush_backlogs())
        return self._endpoint

    def _on_join(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        try:
            if len(frames) < 3 or frames[1].bytes != _JOIN:
                raise MalformedMessage("not a join")
            name = frames[2].bytes.decode()
            topics = frozenset(f.bytes for f in frames[3:])
            if len(name.encode()) > _MAX_NAME_BYTES or not all(t.endswith(b"\0") for t in topics):
                raise MalformedMessage("bad name or topic")
        except (MalformedMessage, UnicodeDecodeError) as exc:
            log.warning("ignored a malformed join from %r: %s", identity[:64], exc)
            return
        if identity in self._peers or identity in self._dropped_ids:
            return  # joined already (the same join, resent), or dropped: nothing changes
        peer = self._peers[identity] = _Peer(identity, name, topics)
        self._joined += 1
        self._deliver(peer, [_WELCOME])

    async def publish(self, topic: str, payload: Any = None) -> None:
        """Send to every joined subscriber of `topic`; never waits (module docstring)."""
        sock = self._sock
        if sock is None:
            raise TransportError("publisher not started")
        if sock.closed:
            raise ClosedError("publisher is closed")
        frames = [_topic_frame(topic), *encode(payload)]
        for peer in list(self._peers.values()):
            if frames[0] in peer.topics:
                self._deliver(peer, frames)

    def _deliver(self, peer: _Peer, frames: Sequence[OutFrame]) -> None:
        if peer.backlog:
            if len(peer.backlog) >= self._max_backlog:
                self._drop(peer, f"more than {self._max_backlog} messages behind")
            else:
                peer.backlog.append(frames)
            return
        if not self._send(peer, frames):
            peer.backlog.append(frames)
            peer.since = asyncio.get_running_loop().time()
            self._backlogged.set()

    def _send(self, peer: _Peer, frames: Sequence[OutFrame]) -> bool:
        """Whether zmq took the message: its queue to `peer` may be full, or `peer` may be
        between connections."""
        assert self._sock is not None
        try:
            self._sock.send_nowait([peer.identity, *frames])
        except zmq.ZMQError as exc:  # Again: queue full; EHOSTUNREACH: not connected now
            if exc.errno not in (zmq.EAGAIN, zmq.EHOSTUNREACH):
                raise
            peer.connected = exc.errno == zmq.EAGAIN
            return False
        peer.connected = True
        return True

    def _flush(self, peer: _Peer) -> bool:
        """Send what `peer`'s queue takes of its backlog; whether it took any."""
        took = False
        while peer.backlog and self._send(peer, peer.backlog[0]):
            peer.backlog.popleft()
            took = True
        if took:
            peer.since = asyncio.get_running_loop().time()
        return took

    async def _flush_backlogs(self) -> None:
        try:
            await self._flush_backlogs_until_closed()
        except ClosedError:
            pass  # closing; or the socket failed, which AsyncSocket has logged
        except zmq.ZMQError:
            log.exception("sending failed; backlogs are no longer sent")

    async def _flush_backlogs_until_closed(self) -> None:
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        while True:
            await self._backlogged.wait()
            waiting = [p for p in self._peers.values() if p.backlog]
            for peer in waiting:
                self._flush(peer)
            now = loop.time()
            next_check = _RETRY_S
            for peer in waiting:
                if not peer.backlog or peer.identity not in self._peers:
                    continue
                left = peer.since + self._stall_timeout - now
                # A last try decides: a send sees all that zmq knows, even what an earlier
                # send consumed the sign of (only the wake-up can be missed, not the room).
                if left <= 0 and not self._flush(peer):
                    self._drop(peer, f"took no message for {self._stall_timeout} s" if
                               peer.connected else f"not connected for {self._stall_timeout} s")
                elif left > 0:
                    next_check = min(next_check, left)
            if not any(p.backlog for p in self._peers.values()):
                self._backlogged.clear()
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(next_check):
                    await self._sock.wait_writable()

    def _drop(self, peer: _Peer, reason: str) -> None:
        del self._peers[peer.identity]
        self._dropped_ids.add(peer.identity)
        peer.backlog.clear()
        report = DroppedSubscriber(peer.name, peer.identity.decode(errors="replace"), reason,
                                   peer.connected)
        self._dropped.append(report)
        log.warning("dropped subscriber %r (%s): %s", report.name, report.token, reason)
        if self.on_drop is not None:
            try:
                self.on_drop(report)
            except Exception:  # the owner's bug must not stop the broadcasts
                log.exception("on_drop failed")

    async def aclose(self) -> None:
        if self._flusher is not None:
            await cancel_and_wait([self._flusher])
        if self._sock is not None:
            self._sock.close()
        self._release_auth()

    def _release_auth(self) -> None:
        if self._auth is not None:
            self._auth.release()
            self._auth = None


class Subscriber(Closeable):
    """Receives the messages of `topics` from the Publisher at `endpoint`."""

    def __init__(
        self,
        endpoint: str,
        topics: Sequence[str],
        *,
        ctx: zmq.Context[Any] | None = None,
        max_bytes: int = MAX_MESSAGE_BYTES,
        curve: CurveKeys | None = None,
        name: str = "",
    ) -> None:
        """`curve`: subscribe as one of the run's clients to its curve publisher. `name`: how
        the Publisher reports this subscriber if it drops it (e.g. the worker's name)."""
        if len(name.encode()) > _MAX_NAME_BYTES:
            raise ValueError(f"subscriber name over {_MAX_NAME_BYTES} bytes")
        self._endpoint = endpoint
        self._curve = curve
        self._join_msg = [_JOIN, name.encode(), *(_topic_frame(t) for t in topics)]
        self._ctx = ctx
        self._max_bytes = max_bytes
        # Starts with a letter: zmq reserves identities that start with a zero byte.
        self._token = "s" + secrets.token_hex(8)
        self._sock: AsyncSocket | None = None
        self._joined = False
        # Messages read by `join` before the welcome, kept for `recv`. The publisher sends
        # nothing before the welcome, so this stays empty; the bound is a backstop.
        self._early: deque[tuple[str, Any]] = deque(maxlen=_HWM)
        self.dropped = 0
        """Messages dropped because they could not be decoded."""

    @property
    def token(self) -> str:
        """This subscriber's identity at the Publisher (`DroppedSubscriber.token`)."""
        return self._token

    def _socket(self) -> AsyncSocket:
        if self._sock is None:
            keys = self._curve.client_options() if self._curve is not None else []
            # Everything is set before the connect, curve options included.
            options: list[tuple[int, int | bytes]] = [
                (zmq.RCVHWM, _HWM), (zmq.ROUTING_ID, self._token.encode()), *keys]
            sock = new_socket(self._ctx, zmq.DEALER, options)
            sock.connect(self._endpoint)
            self._sock = AsyncSocket(sock)
            # Queued until the connection is up (zmq keeps a pipe for a connecting socket).
            self._sock.send_nowait(self._join_msg)
        return self._sock

    async def join(self, timeout: float) -> None:  # noqa: ASYNC109 (part of the contract)
        """Return once the publisher delivers to this subscriber; DeadlineExceeded otherwise.
        A join not welcomed within `_REJOIN_S` is made again from a fresh connection and
        identity (the token changes), until `timeout`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            sock = self._socket()
            left = deadline - loop.time()
            try:
                async with asyncio.timeout(min(left, _REJOIN_S)):
                    while not self._joined:
                        item = self._take(await sock.recv())
                        if item is not None:
                            self._early.append(item)
                return
            except TimeoutError:
                if left <= _REJOIN_S:
                    raise DeadlineExceeded(
                        f"no welcome from {self._endpoint} within {timeout} s") from None
            log.warning("no welcome from %s within %s s; joining again on a new connection",
                        self._endpoint, _REJOIN_S)
            sock.close()
            self._sock = None
            self._token = "s" + secrets.token_hex(8)

    async def recv(self) -> tuple[str, Any]:
        """The next `(topic, payload)`."""
        if self._early:
            return self._early.popleft()
        sock = self._socket()
        while True:
            item = self._take(await sock.recv())
            if item is not None:
                return item

    def _take(self, frames: list[zmq.Frame]) -> tuple[str, Any] | None:
        topic = frames[0].bytes
        if topic == _WELCOME:
            self._joined = True
            return None
        try:
            if not topic.endswith(b"\0"):
                raise MalformedMessage("topic frame is not zero-terminated")
            return topic[:-1].decode(), decode(frames[1:], max_bytes=self._max_bytes)
        except (MalformedMessage, UnicodeDecodeError) as exc:
            self.dropped += 1
            log.warning("dropped a malformed broadcast on %r: %s", topic[:64], exc)
            return None

    async def aclose(self) -> None:
        if self._sock is not None:
            self._sock.close()
