"""Asynchronous request/reply over ZeroMQ: a ROUTER server and a DEALER client.

Wire (codec frames after the routing identity):
- request `[request_id: int, op: str, payload]`;
- with a `RequestAuth` on both sides, a request is preceded by its authenticator frame
  (`transport.request_auth`);
- reply `[request_id, status, body]`: status OK (body = the handler's result), ERROR (the
  handler raised; body = [type name, message]), UNKNOWN_OP (body = message), REJECTED (the
  request was malformed or too large; body = [error name, message]; request_id is None when it
  could not be read) or OVERLOADED (a long-poll budget is full; body = message).

Guarantees:
- Server: every request is handled in its own task, concurrently, up to `max_in_flight`; past
  that it stops reading and zmq's queues push back on clients. Operations declared `long_polls`
  (handlers that wait for work to appear) have budgets of their own and never stop the reading:
  at most `max_long_polls` in all and `max_long_polls_per_peer` from one peer; a long poll past
  either is answered at once with OVERLOADED (`Overloaded` at the client). So however many long
  polls clients hold open, other operations (heartbeats) are still read and answered. A
  long-poll handler with nothing to answer yet may return a `Parked`: the server holds that poll
  with no task, timer or future of its own, until `Parked.answer` (from any code on the server's
  loop) or its deadline (then it answers ``expired``); replies answered while a request is
  handled (by any server of the loop) leave as that request ends, others after the turn of the
  loop that answered them. A handler exception becomes an ERROR reply; a malformed request gets
  a REJECTED reply (it always has a routing identity); nothing a peer sends stops the server.
  With an authenticator, a request that fails its check is dropped before it is decoded, without
  a reply, and counted (`refused`). A reply to a peer that is gone or not reading is dropped and
  counted, never waited on: one stuck client cannot stall the others.
- Client: any number of calls in flight on one socket, matched by request id. Each call has a
  deadline (DeadlineExceeded); a reply that arrives after it is discarded and counted. Closing
  fails pending calls with ClosedError. No background task: replies are dispatched from the
  socket's reader callback. A curve client whose server refuses its keys (its handshakes fail:
  `transport.handshake`) fails its pending and new calls at once with KeysRefused, until a
  handshake succeeds. A reply that does not decode fails its call at once
  (MalformedMessage) when its request id can be read, else is dropped and counted.
"""

from __future__ import annotations

import asyncio
import heapq
import inspect
import logging
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Final

import msgpack
import zmq

from transport._lifecycle import Closeable, Service, cancel_and_wait
from transport._zsocket import AsyncSocket, bind, new_socket
from transport.codec import MAX_MESSAGE_BYTES, decode, encode, frames_nbytes
from transport.curve import Authorizer, CurveKeys, authorize
from transport.endpoints import check_bind
from transport.errors import (
    ClosedError,
    DeadlineExceeded,
    KeysRefused,
    MalformedMessage,
    MessageTooLarge,
    Overloaded,
    RemoteError,
    TransportError,
    UnknownOperation,
)
from transport.handshake import FAILED, HandshakeWatch, client_refusal, server_refusal
from transport.request_auth import RequestAuth

__all__ = ["Handler", "Parked", "RpcClient", "RpcClientStats", "RpcServer", "RpcServerStats"]

log = logging.getLogger(__name__)

Handler = Callable[[Any, bytes], Any]
"""(payload, peer identity) -> reply payload, or an awaitable of it (an ``async def`` handler),
or, for a long poll, a `Parked`. A reply returned at once is sent from the request's own read,
with no task (most calls a controller takes need nothing to wait for); an awaitable is awaited
in a task of its own."""

OK: Final = 0
ERROR: Final = 1
UNKNOWN_OP: Final = 2
REJECTED: Final = 3
OVERLOADED: Final = 4

# Queued messages per peer and direction. A client's in-flight calls are bounded by its
# callers (the scheduler's dispatch gate keeps them in the hundreds); 10k leaves room for
# bursts while bounding memory if a peer stops reading. At the mark, client sends wait and
# server replies are dropped and counted.
_HWM: Final = 10_000
_MAX_ERROR_TEXT: Final = 2_000
# Failed handshakes in a row after which a close without detail counts as a refusal of the
# client's keys (a server with other keys says nothing more); more than one, so a server that
# closes during one handshake (stopping) is not taken for one that refuses.
_CLOSES_TO_REFUSE: Final = 2


def _is_int(value: Any) -> bool:
    return type(value) is int


class Parked:
    """A long poll the server holds open for its handler, answered later: what a long-poll
    handler returns when it has nothing yet, and keeps to answer it with.

    The server holds it with no task, timer or future of its own (a task awaiting a queue with a
    timeout costs ~25 µs a poll; this, ~1), and answers it once: with what `answer` is given, or
    with ``expired`` when ``seconds`` have passed.
    """

    __slots__ = ("_handler", "_open", "_peer", "_result", "_rid", "_server", "expired",
                 "seconds", "sent")

    def __init__(self, seconds: float, expired: Any = None) -> None:
        self.seconds = seconds
        self.expired = expired
        self._server: RpcServer | None = None
        self._handler: Handler | None = None
        self._peer = b""
        self._rid = 0
        self._open = False
        self._result: Any = None
        #: called once its reply has been handed to the socket (see `answer`): how long a caller
        #: really waited, where `answer` is only when it was decided
        self.sent: Callable[[], None] | None = None

    @property
    def open(self) -> bool:
        """Held by a server and not answered yet (not expired, its server not closed)."""
        return self._open

    def answer(self, result: Any) -> bool:
        """Reply ``result``: sent as the request being handled ends (on any server of this
        loop), or after the current turn of the loop when no request is. False, and nothing
        sent, if the poll is not open."""
        if not self._open:
            return False
        assert self._server is not None  # open means held
        self._server._answer(self, result)
        return True


class _Answered(threading.local):
    """The servers of this thread (its event loop) with polls answered and not yet sent."""

    def __init__(self) -> None:
        self.servers: dict[RpcServer, None] = {}


_answered = _Answered()


def _send_answered() -> None:
    """The replies of the polls answered while a request was handled, sent as it ends: a
    report that made a task for a parked poll has it leave with the report's own reply, not
    after every other request the socket's drain takes in that turn of the loop (up to 64)."""
    servers, _answered.servers = _answered.servers, {}
    for server in servers:
        server._send_answered()


@dataclass(frozen=True, slots=True)
class RpcServerStats:
    requests: int
    handler_errors: int
    rejected: int
    dropped_replies: int
    in_flight: int  # handlers running, long polls excluded
    refused: int  # failed the authenticator's check (by reason: `RequestAuth.statistics`)
    long_polls: int  # long polls open (handlers running, and polls parked)
    overloaded: int  # long polls answered OVERLOADED
    handshakes_refused: int = 0  # failed curve handshakes (counted with `on_refused` only)


@dataclass(frozen=True, slots=True)
class RpcClientStats:
    calls: int
    in_flight: int
    late_replies: int
    malformed_replies: int


class RpcServer(Service):
    """Serves `handlers` by operation name on a ROUTER socket bound at `endpoint`."""

    def __init__(
        self,
        endpoint: str,
        handlers: Mapping[str, Handler],
        *,
        ctx: zmq.Context[Any] | None = None,
        max_bytes: int = MAX_MESSAGE_BYTES,
        allow_remote: bool = False,
        max_in_flight: int = 1024,
        long_polls: Collection[str] = (),
        max_long_polls: int = 16_384,
        max_long_polls_per_peer: int = 1024,
        curve: CurveKeys | None = None,
        authenticator: RequestAuth | None = None,
        on_refused: Callable[[str], None] | None = None,
        tensors: bool = True,
    ) -> None:
        """`tensors=False`: a request holding a tensor or array is malformed (for servers
        whose requests carry none). `curve`: serve encrypted and admit only the run's clients
        (needed to bind a non-loopback address, with `allow_remote`). `on_refused`: with
        `curve`, called with the reason, in words, of every client handshake that fails (a
        client whose keys are not the run's). `authenticator`: serve only requests it admits;
        without `curve`, the requests and replies travel in clear (it also allows a
        non-loopback bind, with `allow_remote`). `long_polls`: the operations of `handlers`
        that wait for work to appear, served on their own budgets (module docstring); the
        per-peer default admits a worker of the largest legal capacity."""
        unknown = set(long_polls) - set(handlers)
        if unknown:
            raise ValueError(f"long polls without a handler: {sorted(unknown)}")
        if min(max_in_flight, max_long_polls, max_long_polls_per_peer) < 1:
            raise ValueError("concurrency limits must be at least 1")
        check_bind(
            endpoint,
            allow_remote=allow_remote,
            curve=curve is not None or authenticator is not None,
        )
        self._authenticator = authenticator
        self._endpoint = endpoint
        self._curve = curve
        self._auth: Authorizer | None = None
        self._handlers = dict(handlers)
        self._ctx = ctx
        self._max_bytes = max_bytes
        self._tensors = tensors
        self._max_in_flight = max_in_flight
        self._long_polls = frozenset(long_polls)
        self._max_long_polls = max_long_polls
        self._max_long_polls_per_peer = max_long_polls_per_peer
        self._sock: AsyncSocket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._polls: set[asyncio.Task[None]] = set()
        self._polls_by_peer: Counter[bytes] = Counter()
        # Parked polls: the open ones (insertion-ordered), their deadlines (a heap that keeps
        # answered ones until they come up or it is compacted), the one timer for the earliest,
        # and the answered ones whose replies leave at the next turn of the loop.
        self._parked: dict[Parked, None] = {}
        self._deadlines: list[tuple[float, int, Parked]] = []
        self._parked_seq = 0
        self._expiry: asyncio.TimerHandle | None = None
        self._expiry_at = 0.0
        self._answered: list[Parked] = []
        self._overloaded = 0
        self._closed = False
        self._requests = 0
        self._handler_errors = 0
        self._rejected = 0
        self._dropped = 0
        self._refused = 0
        self._on_refused = on_refused
        self._handshakes: HandshakeWatch | None = None
        self._handshakes_refused = 0

    @property
    def endpoint(self) -> str:
        """The bound endpoint once started (with the real port for tcp port 0)."""
        return self._endpoint

    async def start(self) -> str:
        """Bind and start serving; returns the bound endpoint."""
        if self._closed or self._sock is not None:
            raise TransportError("server already started or closed")
        options: list[tuple[int, int | bytes]] = [
            # Mandatory routing makes a full or vanished peer an error we can count,
            # instead of a silent drop inside zmq.
            (zmq.ROUTER_MANDATORY, 1),
            (zmq.SNDHWM, _HWM),
            (zmq.RCVHWM, _HWM),
            # zmq drops a peer that sends a frame past the limit before buffering it whole.
            (zmq.MAXMSGSIZE, self._max_bytes),
        ]
        if self._curve is not None:
            options += self._curve.server_options()
            self._auth = authorize(self._ctx, self._curve)  # before the bind: none unchecked
        try:
            sock = new_socket(self._ctx, zmq.ROUTER, options)
            if self._curve is not None and self._on_refused is not None:
                self._handshakes = HandshakeWatch(sock, self._on_handshake)  # before the bind
            self._endpoint = bind(sock, self._endpoint)
        except BaseException:
            if self._handshakes is not None:
                self._handshakes.close()
            self._release_auth()
            raise
        self._sock = AsyncSocket(sock, self._on_request)
        return self._endpoint

    def _on_handshake(self, event: int, value: int) -> None:
        if event in FAILED and self._on_refused is not None:
            self._handshakes_refused += 1
            self._on_refused(server_refusal(event, value))

    def _release_auth(self) -> None:
        if self._auth is not None:
            self._auth.release()
            self._auth = None

    async def aclose(self) -> None:
        """Stop reading, cancel running handlers, close the socket."""
        if self._closed:
            return
        self._closed = True
        if self._sock is not None:
            self._sock.pause()
        self._drop_parked()
        await cancel_and_wait([*self._tasks, *self._polls])
        if self._handshakes is not None:
            self._handshakes.close()
        if self._sock is not None:
            self._sock.close()
        self._release_auth()

    def statistics(self) -> RpcServerStats:
        return RpcServerStats(
            requests=self._requests,
            handler_errors=self._handler_errors,
            rejected=self._rejected,
            dropped_replies=self._dropped,
            in_flight=len(self._tasks),
            refused=self._refused,
            long_polls=len(self._polls) + len(self._parked),
            overloaded=self._overloaded,
            handshakes_refused=self._handshakes_refused,
        )

    def _on_request(self, frames: list[zmq.Frame]) -> None:
        self._take_request(frames)
        if _answered.servers:
            _send_answered()

    def _take_request(self, frames: list[zmq.Frame]) -> None:
        self._requests += 1
        peer = frames[0].bytes
        if self._authenticator is not None:
            # Checked before anything of the request is decoded; no reply: a peer without the
            # key learns nothing, not even why.
            if not self._authenticator.verify([f.buffer for f in frames[1:]]):
                self._refused += 1
                log.debug("refused an unauthenticated request from %r", peer)
                return
            frames = [frames[0], *frames[2:]]
        try:
            msg = decode(frames[1:], max_bytes=self._max_bytes, tensors=self._tensors)
        except MalformedMessage as exc:
            self._reject(peer, _peek_request_id(frames[1:]), exc)
            return
        if not (type(msg) is list and len(msg) == 3 and _is_int(msg[0])):
            self._reject(peer, None, MalformedMessage("request is not [id, op, payload]"))
            return
        rid, op, payload = msg
        if type(op) is not str:
            self._reject(peer, rid, MalformedMessage("operation name is not a string"))
            return
        handler = self._handlers.get(op)
        if handler is None:
            self._reply(peer, [rid, UNKNOWN_OP, f"unknown operation {op[:100]!r}"])
            return
        if op in self._long_polls:
            self._start_long_poll(handler, peer, rid, op, payload)
            return
        pending = self._call(handler, peer, rid, payload)
        if pending is None:
            return
        if isinstance(pending, Parked):
            self._send(peer, self._error(handler, rid, TypeError(
                f"{op!r} is not a long poll: its handler cannot park")))
            return
        task = asyncio.get_running_loop().create_task(self._serve(handler, peer, rid, pending))
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        if len(self._tasks) >= self._max_in_flight and self._sock is not None:
            self._sock.pause()

    def _call(self, handler: Handler, peer: bytes, rid: int,
              payload: Any) -> Awaitable[Any] | Parked | None:
        """Run ``handler``: a reply it returns at once (or its error) is sent now and None
        returned; an awaitable it returns is returned, for the caller to serve in a task, and a
        `Parked` for the caller to hold."""
        try:
            result = handler(payload, peer)
        except Exception as exc:
            self._send(peer, self._error(handler, rid, exc))
            return None
        if type(result) is Parked or inspect.isawaitable(result):
            return result
        try:
            frames = self._reply_frames(rid, result)
        except Exception as exc:
            frames = self._error(handler, rid, exc)
        self._send(peer, frames)
        return None

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not self._closed and self._sock is not None and len(self._tasks) < self._max_in_flight:
            self._sock.resume()

    def _start_long_poll(self, handler: Handler, peer: bytes, rid: int, op: str,
                         payload: Any) -> None:
        # Answered, never queued: stopping the reading here would hold back every other op.
        if self._polls_by_peer[peer] >= self._max_long_polls_per_peer:
            self._overload(peer, rid, f"{op!r}: this client already has "
                           f"{self._max_long_polls_per_peer} long polls open (the limit)")
            return
        if len(self._polls) + len(self._parked) >= self._max_long_polls:
            self._overload(peer, rid, f"{op!r}: the server already holds "
                           f"{self._max_long_polls} long polls open (the limit)")
            return
        pending = self._call(handler, peer, rid, payload)
        if pending is None:
            return  # answered at once (it had something waiting): no poll stays open
        if isinstance(pending, Parked):
            self._park(pending, peer, rid, handler)
            return
        task = asyncio.get_running_loop().create_task(self._serve(handler, peer, rid, pending))
        self._polls.add(task)
        self._polls_by_peer[peer] += 1

        def done(task: asyncio.Task[None]) -> None:
            self._polls.discard(task)
            self._unpoll(peer)

        task.add_done_callback(done)

    # ---- parked polls ----------------------------------------------------------------------

    def _park(self, p: Parked, peer: bytes, rid: int, handler: Handler) -> None:
        if p._server is not None:
            self._send(peer, self._error(handler, rid, ValueError(
                "a Parked is returned once, for the poll it answers")))
            return
        p._server, p._handler, p._peer, p._rid, p._open = self, handler, peer, rid, True
        self._parked[p] = None
        self._polls_by_peer[peer] += 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + p.seconds
        self._parked_seq += 1
        heapq.heappush(self._deadlines, (deadline, self._parked_seq, p))
        if self._expiry is None or deadline < self._expiry_at:
            self._expire_at(loop, deadline)
        elif len(self._deadlines) > 2 * len(self._parked) + 1024:
            # Most entries are polls answered long before their deadline: drop them, so a heap
            # of long waits does not hold every poll of the last minutes.
            self._deadlines = [e for e in self._deadlines if e[2]._open]
            heapq.heapify(self._deadlines)

    def _expire_at(self, loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry_at = deadline
        self._expiry = loop.call_at(deadline, self._expire)

    def _expire(self) -> None:
        """The timer of the earliest deadline: answer what is due, then wait for the next."""
        self._expiry = None
        heap = self._deadlines
        loop = asyncio.get_running_loop()
        now = loop.time()
        while heap and (not heap[0][2]._open or heap[0][0] <= now):
            _, _, p = heapq.heappop(heap)
            if p._open:
                self._answer(p, p.expired)
        if heap:
            self._expire_at(loop, heap[0][0])

    def _answer(self, p: Parked, result: Any) -> None:
        p._open = False
        p._result = result
        del self._parked[p]
        self._unpoll(p._peer)
        self._answered.append(p)
        if len(self._answered) == 1:
            # Sent at the end of the request being handled (any server's, on this thread), or,
            # answered outside one (a timer, a task), after this turn of the loop.
            _answered.servers[self] = None
            asyncio.get_running_loop().call_soon(self._send_answered)

    def _send_answered(self) -> None:
        """The replies of the polls answered in the last turn of the loop."""
        _answered.servers.pop(self, None)  # sent: nothing left for the request's end
        answered, self._answered = self._answered, []
        for p in answered:
            try:
                frames = self._reply_frames(p._rid, p._result)
            except Exception as exc:
                frames = self._error(p._handler, p._rid, exc)
            p._result = None
            self._send(p._peer, frames)
            if p.sent is not None:
                sent, p.sent = p.sent, None
                try:
                    sent()
                except Exception:  # a caller's bookkeeping: never the other replies
                    log.exception("a parked poll's sent callback failed")

    def _unpoll(self, peer: bytes) -> None:
        self._polls_by_peer[peer] -= 1
        if not self._polls_by_peer[peer]:
            del self._polls_by_peer[peer]

    def _drop_parked(self) -> None:
        """Closing: parked polls end with no reply, as the polls' tasks are cancelled."""
        for p in self._parked:
            p._open = False
            self._unpoll(p._peer)
        self._parked.clear()
        self._deadlines.clear()
        self._answered.clear()
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    def _overload(self, peer: bytes, rid: int, message: str) -> None:
        self._overloaded += 1
        log.debug("refused a long poll from %r: %s", peer, message)
        self._reply(peer, [rid, OVERLOADED, message])

    def _reply_frames(self, rid: int, result: Any) -> list[bytes | memoryview]:
        frames = encode([rid, OK, result])
        size = frames_nbytes(frames)
        if size > self._max_bytes:
            raise MessageTooLarge(f"reply of {size} bytes exceeds {self._max_bytes}")
        return frames

    async def _serve(self, handler: Handler, peer: bytes, rid: int,
                     pending: Awaitable[Any]) -> None:
        try:
            frames = self._reply_frames(rid, await pending)
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the server is closing
            frames = self._error(handler, rid, exc)  # the handler's own awaitable was cancelled
        except Exception as exc:
            frames = self._error(handler, rid, exc)
        self._send(peer, frames)

    def _error(self, handler: Handler | None, rid: int,
               exc: BaseException) -> list[bytes | memoryview]:
        self._handler_errors += 1
        log.debug("handler %r failed", handler, exc_info=exc)
        return encode([rid, ERROR, [type(exc).__name__, str(exc)[:_MAX_ERROR_TEXT]]])

    def _reject(self, peer: bytes, rid: int | None, exc: MalformedMessage) -> None:
        self._rejected += 1
        log.debug("rejected a request from %r: %s", peer, exc)
        self._reply(peer, [rid, REJECTED, [type(exc).__name__, str(exc)[:_MAX_ERROR_TEXT]]])

    def _reply(self, peer: bytes, body: list[Any]) -> None:
        self._send(peer, encode(body))

    def _send(self, peer: bytes, frames: list[bytes | memoryview]) -> None:
        sock = self._sock
        if sock is None or sock.closed:
            self._dropped += 1
            return
        try:
            sock.send_nowait([peer, *frames])
        except zmq.ZMQError as exc:  # Again: peer's queue full; EHOSTUNREACH: peer gone
            self._dropped += 1
            log.debug("dropped a reply to %r: %s", peer, exc)


class RpcClient(Closeable):
    """Calls operations on the RpcServer at `endpoint` over one DEALER socket."""

    def __init__(
        self,
        endpoint: str,
        *,
        ctx: zmq.Context[Any] | None = None,
        identity: bytes | None = None,
        timeout: float = 30.0,
        max_bytes: int = MAX_MESSAGE_BYTES,
        curve: CurveKeys | None = None,
        authenticator: RequestAuth | None = None,
    ) -> None:
        """`curve`: connect as one of the run's clients to its curve server.
        `authenticator`: sign every request for a server that checks them."""
        if identity is not None and not (0 < len(identity) <= 255 and identity[0] != 0):
            raise ValueError("identity must be 1-255 bytes and not start with a zero byte")
        self._endpoint = endpoint
        self._ctx = ctx
        self._identity = identity
        self._timeout = timeout
        self._max_bytes = max_bytes
        self._curve = curve
        self._authenticator = authenticator
        self._sock: AsyncSocket | None = None
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._next_id = 0
        self._closed = False
        self._closed_by: TransportError | None = None  # what calls raise once closed
        self._late = 0
        self._malformed = 0
        self._handshakes: HandshakeWatch | None = None
        self._failed_handshakes = 0  # in a row
        self._refused = ""  # why the server refuses this client's keys; "" when it does not

    def _open(self) -> AsyncSocket:
        if self._closed:
            raise self._closed_by or ClosedError("client is closed")
        options: list[tuple[int, int | bytes]] = [
            (zmq.SNDHWM, _HWM),
            (zmq.RCVHWM, _HWM),
            (zmq.MAXMSGSIZE, self._max_bytes),
        ]
        if self._identity is not None:
            options.append((zmq.ROUTING_ID, self._identity))
        if self._curve is not None:
            options += self._curve.client_options()
        sock = new_socket(self._ctx, zmq.DEALER, options)
        try:
            if self._curve is not None:  # before the connect: no handshake goes unseen
                self._handshakes = HandshakeWatch(sock, self._on_handshake)
            sock.connect(self._endpoint)
        except BaseException:
            if self._handshakes is not None:
                self._handshakes.close()
            sock.close(linger=0)
            raise
        self._sock = AsyncSocket(sock, self._on_reply)
        return self._sock

    def _on_handshake(self, event: int, value: int) -> None:
        if event not in FAILED:
            self._failed_handshakes = 0
            self._refused = ""
            return
        self._failed_handshakes += 1
        if (event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                and self._failed_handshakes < _CLOSES_TO_REFUSE):
            return
        self._refused = client_refusal(event, value)
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(KeysRefused(self._endpoint, self._refused))

    async def call(
        self,
        op: str,
        payload: Any = None,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (a per-call deadline is the contract)
    ) -> Any:
        """Call `op` with `payload`; returns the handler's result.

        Raises DeadlineExceeded, RemoteError, UnknownOperation, MessageTooLarge (request over
        the limit, here or at the server), Overloaded (a long poll over the server's
        budget), KeysRefused (a curve server refuses this client's keys), ClosedError.
        """
        if self._closed:
            raise self._closed_by or ClosedError("client is closed")
        sock = self._sock or self._open()
        if self._refused:
            raise KeysRefused(self._endpoint, self._refused)
        rid = self._next_id
        self._next_id = rid + 1
        frames = encode([rid, op, payload])
        if self._authenticator is not None:
            frames.insert(0, self._authenticator.sign(frames))
        size = frames_nbytes(frames)
        if size > self._max_bytes:
            raise MessageTooLarge(f"request of {size} bytes exceeds {self._max_bytes}")
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        deadline = self._timeout if timeout is None else timeout
        try:
            async with asyncio.timeout(deadline):
                try:
                    sock.send_nowait(frames)
                except zmq.Again:
                    await sock.send(frames)
                return await fut
        except TimeoutError:
            raise DeadlineExceeded(f"{op!r} got no reply within {deadline} s") from None
        finally:
            self._pending.pop(rid, None)

    def _on_reply(self, frames: list[zmq.Frame]) -> None:
        try:
            msg = decode(frames, max_bytes=self._max_bytes)
        except MalformedMessage as exc:
            self._malformed += 1
            log.debug("dropped a malformed reply", exc_info=True)
            # Its call fails now rather than at its deadline, when the id can be read.
            rid = _peek_request_id(frames)
            pending = None if rid is None else self._pending.pop(rid, None)
            if pending is not None and not pending.done():
                pending.set_exception(MalformedMessage(f"undecodable reply: {exc}"))
            return
        if not (type(msg) is list and len(msg) == 3 and _is_int(msg[0])):
            self._malformed += 1
            return
        rid, status, body = msg
        fut = self._pending.pop(rid, None)
        if fut is None or fut.done():
            self._late += 1
            return
        if status == OK:
            fut.set_result(body)
        else:
            fut.set_exception(_reply_error(status, body))

    async def aclose(self, error: TransportError | None = None) -> None:
        """Close the socket; pending and later calls raise ``error`` (default: ClosedError)."""
        if self._closed:
            return
        self._closed = True
        self._closed_by = error
        if self._handshakes is not None:
            self._handshakes.close()
        if self._sock is not None:
            self._sock.close()
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(error or ClosedError("client closed"))

    def statistics(self) -> RpcClientStats:
        return RpcClientStats(
            calls=self._next_id,
            in_flight=len(self._pending),
            late_replies=self._late,
            malformed_replies=self._malformed,
        )


def _peek_request_id(frames: list[zmq.Frame]) -> int | None:
    """The request id of a request that does not decode, if its first bytes hold one.

    A valid id is at most 9 bytes after the array header, so a 16-byte prefix suffices and
    nothing else of a hostile frame is read.
    """
    if not frames:
        return None
    unpacker = msgpack.Unpacker()
    unpacker.feed(frames[0].buffer[:16])
    try:
        if unpacker.read_array_header() != 3:
            return None
        rid = unpacker.unpack()
    except Exception:  # msgpack raises several types on a bad prefix; all mean "no id"
        return None
    return rid if _is_int(rid) else None


def _error_pair(body: Any) -> tuple[str, str] | None:
    if type(body) is list and len(body) == 2 and all(type(x) is str for x in body):
        return body[0], body[1]
    return None


def _reply_error(status: Any, body: Any) -> TransportError:
    if status == UNKNOWN_OP and type(body) is str:
        return UnknownOperation(body)
    if status == OVERLOADED and type(body) is str:
        return Overloaded(body)
    pair = _error_pair(body)
    if status == ERROR and pair is not None:
        return RemoteError(*pair)
    if status == REJECTED and pair is not None:
        kind, message = pair
        cls = MessageTooLarge if kind == MessageTooLarge.__name__ else MalformedMessage
        return cls(f"server rejected the request: {message}")
    return MalformedMessage(f"invalid reply status {status!r}")
