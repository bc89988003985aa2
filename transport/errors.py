"""Typed errors of the transport layer.

Every failure that crosses a socket becomes one of these, so callers can tell a
malformed peer from a slow one from a remote bug without parsing strings.
"""

from __future__ import annotations


class TransportError(Exception):
    """Base class of every error raised by `transport`."""


class MalformedMessage(TransportError):
    """Bytes that do not decode into a valid message (bad msgpack, missing or short frames)."""


class MessageTooLarge(MalformedMessage):
    """A message, or a size it declares, exceeds the configured per-message limit."""


class UnknownOperation(TransportError):
    """A request named an operation the server does not serve."""


class DeadlineExceeded(TransportError, TimeoutError):
    """A call did not complete within its deadline."""


class RemoteError(TransportError):
    """The remote handler raised; carries the remote exception type and message."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


class Overloaded(TransportError):
    """The server refused a call at once: a concurrency limit for its kind of call was reached.
    Nothing was done; retry later."""


class ClosedError(TransportError):
    """The socket or store was closed while an operation was pending."""


class NodeLost(TransportError):
    """A node is out of the run and its store with it: its data cannot be read any more."""


class BindRefused(TransportError):
    """A bind to a non-loopback address was attempted without explicit permission."""


class UnknownSegment(TransportError):
    """A handle names a shared-memory segment the store does not hold (never written, or freed)."""


class SharedMemoryTooSmall(TransportError):
    """The shared-memory filesystem has less room than a store's capacity: segments written
    past its free space would kill their writers and readers with SIGBUS."""


class KeysRefused(TransportError):
    """A curve server refused this client's keys (they are not the server's run's): calls fail
    with this at once instead of waiting for their deadline."""

    def __init__(self, endpoint: str, reason: str) -> None:
        super().__init__(f"{endpoint} refused this client's curve keys ({reason})")
        self.endpoint = endpoint
        self.reason = reason
