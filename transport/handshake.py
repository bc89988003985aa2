"""Failed CurveZMQ handshakes, seen from a socket's monitor (`zmq_socket_monitor`).

A failed curve handshake is silent at the socket level: libzmq closes the connection and
reconnects every reconnect interval, a client's requests wait for their deadline, and the
server's application hears nothing. Only the socket's monitor says so. What each side sees
(libzmq 4.3):

- the client holds another server key (another run's keys): the server cannot decrypt its
  HELLO (``HANDSHAKE_FAILED_PROTOCOL``, cryptographic error) and closes the connection; the
  client sees only the close (``HANDSHAKE_FAILED_NO_DETAIL``);
- the server's ZAP handler does not admit the client's key: both see ``HANDSHAKE_FAILED_AUTH``;
- one side speaks curve and the other does not: both see ``HANDSHAKE_FAILED_PROTOCOL``
  (mechanism mismatch).

`HandshakeWatch` serves a socket's monitor on the running event loop (no thread, no polling)
and hands each handshake outcome to a callback; `client_refusal` and `server_refusal` say in
words what an outcome means.
"""

from __future__ import annotations

import contextlib
import itertools
import struct
from collections.abc import Callable
from typing import Any, Final

import zmq

from transport._zsocket import AsyncSocket, new_socket

__all__ = ["FAILED", "HandshakeWatch", "client_refusal", "server_refusal"]

#: the monitor events of a failed handshake.
FAILED: Final = frozenset({int(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL),
                           int(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL),
                           int(zmq.EVENT_HANDSHAKE_FAILED_AUTH)})
_SUCCEEDED: Final = int(zmq.EVENT_HANDSHAKE_SUCCEEDED)
_EVENTS: Final = _SUCCEEDED | int(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL) | int(
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL) | int(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_CRYPTOGRAPHIC: Final = int(zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC)
_MECHANISM_MISMATCH: Final = int(zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)
_names = itertools.count()
_EVENT: Final = struct.Struct("=Hi")

Outcome = Callable[[int, int], None]
"""(event, value): ``zmq.EVENT_HANDSHAKE_SUCCEEDED`` or one of `FAILED`, and the event's value
(a ZAP status code, a protocol error code, an errno)."""


class HandshakeWatch:
    """The handshake outcomes of `sock`, handed to `on_outcome` from the event loop.

    `close` before the socket closes (it stops the monitor, then closes its socket)."""

    def __init__(self, sock: zmq.Socket[Any], on_outcome: Outcome) -> None:
        self._sock = sock
        self._on_outcome = on_outcome
        # Not `get_monitor_socket`: from an asyncio context it makes an asyncio socket.
        address = f"inproc://flowrl-handshakes-{id(self)}-{next(_names)}"
        sock.monitor(address, _EVENTS)
        monitor = new_socket(sock.context, zmq.PAIR)
        try:
            monitor.connect(address)
        except BaseException:
            monitor.close(linger=0)
            sock.disable_monitor()
            raise
        self._monitor = AsyncSocket(monitor, self._on_event)

    def _on_event(self, frames: list[zmq.Frame]) -> None:
        # libzmq's monitor message: a 16-bit event and a 32-bit value, then the endpoint
        # (as `zmq.utils.monitor` reads it, which would import zmq.asyncio into every process).
        kind, value = _EVENT.unpack_from(frames[0].bytes)
        if kind == _SUCCEEDED or kind in FAILED:
            self._on_outcome(kind, value)

    def close(self) -> None:
        if self._monitor.closed:
            return
        with contextlib.suppress(zmq.ZMQError):  # the socket may be closed already
            self._sock.disable_monitor()
        self._monitor.close()


def client_refusal(event: int, value: int) -> str:
    """Why a curve client's handshake failed, in words."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"it does not admit this client's key: ZAP status {value}"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == _MECHANISM_MISMATCH:
            return "it does not speak curve"
        return f"protocol error {value:#x}"
    return "it closes the connection during every handshake: it holds other keys"


def server_refusal(event: int, value: int) -> str:
    """Why a client's handshake with a curve server failed, in words."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "its client key is not admitted"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == _CRYPTOGRAPHIC:
            return "it encrypts for another server key"
        if value == _MECHANISM_MISMATCH:
            return "it connected without curve keys"
        return f"protocol error {value:#x}"
    return "it closed the connection during the handshake"
