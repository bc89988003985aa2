"""Broadcasts: a Publisher (XPUB) and Subscribers (SUB) with a ready handshake.

Wire: `[topic + b"\\0", *codec frames]`. The terminating zero byte turns zmq's prefix matching
into exact topic matching ("ver" does not receive "version").

Handshake: a Subscriber subscribes to its topics, then to a unique join topic starting with
byte 0xff (which UTF-8 topics never contain). zmq delivers subscriptions in order, and on
(re)connect resends them in byte order, which puts the join topic last as well. When the
Publisher reads the join subscription, every earlier subscription of that subscriber is
already in effect, so it publishes a welcome on the join topic; `join()` returns when the
welcome arrives. Guarantee: a joined subscriber receives every message published after its
welcome, in publish order — the publisher waits rather than drop (XPUB_NODROP) when a
subscriber's queue is full, so a stuck subscriber delays `publish` (bound it with a timeout
at the call site) and a disconnected one does not.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import deque
from collections.abc import Sequence
from typing import Any, Final

import zmq

from transport._lifecycle import Closeable, Service, cancel_and_wait
from transport._zsocket import AsyncSocket, bind, new_socket
from transport.codec import MAX_MESSAGE_BYTES, decode, encode
from transport.curve import Authorizer, CurveKeys, authorize
from transport.endpoints import check_bind
from transport.errors import ClosedError, DeadlineExceeded, MalformedMessage, TransportError

__all__ = ["Publisher", "Subscriber"]

log = logging.getLogger(__name__)

_JOIN: Final = b"\xffjoin-"
_SUBSCRIBE: Final = b"\x01"
# Broadcasts are small, rare control messages (versions, pause, stop). 4096 per subscriber
# absorbs any burst the controller makes; past it, NODROP turns a full queue into
# backpressure on `publish` instead of a silently lost message.
_HWM: Final = 4096


def _topic_frame(topic: str) -> bytes:
    if "\0" in topic:
        raise ValueError(f"topic {topic!r} contains a zero byte")
    return topic.encode() + b"\0"


class Publisher(Service):
    """Publishes `(topic, payload)` messages on an XPUB socket bound at `endpoint`."""

    def __init__(
        self,
        endpoint: str,
        *,
        ctx: zmq.Context[Any] | None = None,
        allow_remote: bool = False,
        curve: CurveKeys | None = None,
    ) -> None:
        """`curve`: publish encrypted, to the run's subscribers only (needed to bind a
        non-loopback address, with `allow_remote`)."""
        check_bind(endpoint, allow_remote=allow_remote, curve=curve is not None)
        self._endpoint = endpoint
        self._ctx = ctx
        self._curve = curve
        self._auth: Authorizer | None = None
        self._sock: AsyncSocket | None = None
        self._welcomes: set[asyncio.Task[None]] = set()
        self._joined = 0

    @property
    def endpoint(self) -> str:
        """The bound endpoint once started (with the real port for tcp port 0)."""
        return self._endpoint

    @property
    def joined(self) -> int:
        """Number of welcomes sent (subscribers that completed the handshake)."""
        return self._joined

    async def start(self) -> str:
        """Bind; returns the bound endpoint."""
        if self._sock is not None:
            raise TransportError("publisher already started")
        options: list[tuple[int, int | bytes]] = [(zmq.SNDHWM, _HWM), (zmq.XPUB_NODROP, 1)]
        if self._curve is not None:
            options += self._curve.server_options()
            self._auth = authorize(self._ctx, self._curve)  # before the bind: none unchecked
        try:
            sock = new_socket(self._ctx, zmq.XPUB, options)
            self._endpoint = bind(sock, self._endpoint)
        except BaseException:
            self._release_auth()
            raise
        self._sock = AsyncSocket(sock, self._on_subscription)
        return self._endpoint

    def _on_subscription(self, frames: list[zmq.Frame]) -> None:
        msg = frames[0].bytes
        if msg.startswith(_SUBSCRIBE + _JOIN):
            # A task, because the welcome may have to wait for room like any message.
            task = asyncio.get_running_loop().create_task(self._welcome(msg[1:]))
            self._welcomes.add(task)
            task.add_done_callback(self._welcomes.discard)

    async def _welcome(self, topic: bytes) -> None:
        assert self._sock is not None
        try:
            await self._sock.send([topic])
        except ClosedError:
            return  # closing: the subscriber's join times out, as it would with no publisher
        self._joined += 1

    async def publish(self, topic: str, payload: Any = None) -> None:
        """Send to every subscriber of `topic`; waits while a subscriber's queue is full."""
        if self._sock is None:
            raise TransportError("publisher not started")
        await self._sock.send([_topic_frame(topic), *encode(payload)])

    async def aclose(self) -> None:
        await cancel_and_wait(self._welcomes)
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
    ) -> None:
        """`curve`: subscribe as one of the run's clients to its curve publisher."""
        self._endpoint = endpoint
        self._curve = curve
        self._topics = [_topic_frame(t) for t in topics]
        self._ctx = ctx
        self._max_bytes = max_bytes
        self._token = _JOIN + secrets.token_hex(8).encode()
        self._sock: AsyncSocket | None = None
        self._joined = False
        # Messages read by `join` before the welcome, kept for `recv`. They can only be those
        # published in the instant between this subscriber's subscriptions and its welcome;
        # the bound is a backstop, and what it drops carried no delivery guarantee.
        self._early: deque[tuple[str, Any]] = deque(maxlen=_HWM)
        self.dropped = 0
        """Messages dropped because they could not be decoded."""

    def _socket(self) -> AsyncSocket:
        if self._sock is None:
            subscriptions = [(zmq.SUBSCRIBE, t) for t in (*self._topics, self._token)]
            # The join topic goes last, see the module docstring.
            keys = self._curve.client_options() if self._curve is not None else []
            # Curve options first: they must be set before the connect, like everything else.
            sock = new_socket(self._ctx, zmq.SUB, [(zmq.RCVHWM, _HWM), *keys, *subscriptions])
            sock.connect(self._endpoint)
            self._sock = AsyncSocket(sock)
        return self._sock

    async def join(self, timeout: float) -> None:  # noqa: ASYNC109 (part of the contract)
        """Return once the publisher delivers to this subscriber; DeadlineExceeded otherwise."""
        sock = self._socket()
        try:
            async with asyncio.timeout(timeout):
                while not self._joined:
                    item = self._take(await sock.recv())
                    if item is not None:
                        self._early.append(item)
        except TimeoutError:
            raise DeadlineExceeded(f"no welcome from {self._endpoint} within {timeout} s") from None

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
        if topic.startswith(_JOIN):
            if topic == self._token:
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
