"""CurveZMQ for links that leave the machine: a run's keys and a ZAP handler that checks them.

A run has one `CurveKeys`: a server key pair (every socket of the run that binds tcp serves
with it: the controller's, each node's store server) and a client key pair (every socket that
connects). The keys are made per run (`CurveKeys.generate`) and reach node agents and workers by
file (`save`/`load`, mode 0600) or environment (`to_env`/`from_env`); their `repr` shows the
public keys only.

Guarantees:
- A server socket configured here (`server_options`) is encrypted and authenticated: the
  handshake fails unless the peer knows the server's public key, and the ZAP handler admits only
  the run's client public key. A peer without keys, or with other keys, never gets a message to
  the application: its requests time out; denials are counted (`Authorizer.statistics`), and
  each refused client key is logged once (not at every reconnection).
- The ZAP handler of a zmq context runs on the event loop (no thread, no polling) while at least
  one curve server of that context is open, and is bound before any of them binds: there is no
  window in which libzmq accepts a connection unchecked. Several runs may share a context; each
  run's sockets name their own ZAP domain, so one run's keys never admit a peer of another.
- ipc and inproc links never use curve (`for_endpoint`): on one node, file permissions already
  keep other users out.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import zmq
from zmq.utils import z85

from transport._zsocket import AsyncSocket, new_socket
from transport.errors import TransportError

__all__ = [
    "ENV",
    "Authorizer",
    "CurveKeys",
    "ZapStats",
    "authorize",
    "for_endpoint",
]

log = logging.getLogger(__name__)

#: environment variable that carries a run's keys (JSON, as `CurveKeys.to_json` writes it).
ENV: Final = "FLOWRL_CURVE_KEYS"
_ZAP_ENDPOINT: Final = "inproc://zeromq.zap.01"
_ZAP_VERSION: Final = b"1.0"
_FIELDS: Final = ("server_public", "server_secret", "client_public", "client_secret")
# Refused client keys remembered per domain, to log each once; bounded against a peer that
# makes up keys.
_REFUSED_KEYS_LOGGED: Final = 64


def _z85_key(value: Any, name: str) -> bytes:
    raw = value.encode() if isinstance(value, str) else value
    if not isinstance(raw, bytes) or len(raw) != 40:
        raise ValueError(f"{name} must be a 40-character Z85 curve key")
    try:
        z85.decode(raw)
    except (ValueError, KeyError, IndexError) as exc:
        raise ValueError(f"{name} is not valid Z85") from exc
    return raw


@dataclass(frozen=True, repr=False)
class CurveKeys:
    """The curve keys of one run (Z85-encoded, 40 bytes each)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    def __post_init__(self) -> None:
        for name in _FIELDS:
            _z85_key(getattr(self, name), name)

    def __repr__(self) -> str:
        return (
            f"CurveKeys(server_public={self.server_public.decode()!r}, "
            f"client_public={self.client_public.decode()!r})"
        )

    @classmethod
    def generate(cls) -> CurveKeys:
        """Fresh key pairs (libzmq's `zmq_curve_keypair`)."""
        if not zmq.has("curve"):
            raise TransportError("this libzmq was built without CURVE support")
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public, server_secret, client_public, client_secret)

    @property
    def domain(self) -> str:
        """The ZAP domain of this run's server sockets (derived from the server public key)."""
        return "flowrl-" + hashlib.sha256(self.server_public).hexdigest()[:16]

    # -- serialization ----------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps({name: getattr(self, name).decode() for name in _FIELDS})

    @classmethod
    def from_json(cls, text: str | bytes) -> CurveKeys:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError("curve keys are not valid JSON") from exc
        if not isinstance(data, dict) or set(data) != set(_FIELDS):
            raise ValueError(f"curve keys need exactly the fields {list(_FIELDS)}")
        return cls(*(_z85_key(data[name], name) for name in _FIELDS))

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the keys to a new file readable by this user only (0600); refuses to
        overwrite an existing file."""
        target = Path(path)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.to_json())
        return target

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CurveKeys:
        """Read keys written by `save`; refuses a file that others may read or that belongs to
        another user."""
        info = os.stat(path)
        if info.st_uid != os.getuid():
            raise PermissionError(f"{path} belongs to another user")
        if stat.S_IMODE(info.st_mode) & 0o077:
            raise PermissionError(f"{path} is readable by others; chmod 600 it")
        return cls.from_json(Path(path).read_text())

    def to_env(self) -> dict[str, str]:
        """The environment entry that hands these keys to a child process."""
        return {ENV: self.to_json()}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> CurveKeys | None:
        """The keys in ``FLOWRL_CURVE_KEYS``, or None when it is unset."""
        text = (os.environ if environ is None else environ).get(ENV)
        return None if not text else cls.from_json(text)

    # -- socket options ---------------------------------------------------------------------

    def server_options(self) -> list[tuple[int, int | bytes]]:
        """Options of a socket that binds: curve server with this run's key, ZAP domain set."""
        return [
            (zmq.CURVE_SERVER, 1),
            (zmq.CURVE_SECRETKEY, self.server_secret),
            (zmq.ZAP_DOMAIN, self.domain.encode()),
        ]

    def client_options(self) -> list[tuple[int, int | bytes]]:
        """Options of a socket that connects to one of this run's curve servers."""
        return [
            (zmq.CURVE_SERVERKEY, self.server_public),
            (zmq.CURVE_PUBLICKEY, self.client_public),
            (zmq.CURVE_SECRETKEY, self.client_secret),
        ]


def for_endpoint(keys: CurveKeys | None, endpoint: str) -> CurveKeys | None:
    """`keys` for a tcp (or other network) endpoint, None for ipc and inproc ones."""
    if keys is None or endpoint.startswith(("ipc://", "inproc://")):
        return None
    return keys


# -----------------------------------------------------------------------------------------------
# ZAP


@dataclass(frozen=True, slots=True)
class ZapStats:
    allowed: int
    denied: int


class _Domain:
    def __init__(self, clients: frozenset[bytes]) -> None:
        self.clients = clients
        self.users = 0
        self.allowed = 0
        self.denied = 0
        self.refused_keys: set[bytes] = set()


class _ZapHandler:
    """The ZAP handler of one zmq context: a REP socket on inproc://zeromq.zap.01."""

    def __init__(self, ctx: zmq.Context[Any]) -> None:
        self.domains: dict[str, _Domain] = {}
        sock = new_socket(ctx, zmq.REP)
        try:
            sock.bind(_ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise TransportError(
                f"cannot bind the ZAP handler ({exc}): another authenticator owns this context"
            ) from exc
        self._sock = AsyncSocket(sock, self._on_request)

    def _on_request(self, frames: list[zmq.Frame]) -> None:
        parts = [f.bytes for f in frames]
        request_id = parts[1] if len(parts) > 1 else b""
        status, text, user = b"400", b"denied", b""
        if len(parts) >= 7 and parts[0] == _ZAP_VERSION and parts[5] == b"CURVE":
            domain = self.domains.get(parts[2].decode(errors="replace"))
            key = z85.encode(parts[6]) if len(parts[6]) == 32 else b""
            if domain is not None and key in domain.clients:
                domain.allowed += 1
                status, text, user = b"200", b"OK", key
            elif domain is not None:
                domain.denied += 1
                seen = domain.refused_keys
                if key not in seen and len(seen) < _REFUSED_KEYS_LOGGED:
                    seen.add(key)
                    log.warning("curve: refused client key %s from %s (logged once per key)",
                                key.decode(), parts[3].decode(errors="replace"))
        try:
            self._sock.send_nowait([_ZAP_VERSION, request_id, status, text, user, b""])
        except zmq.ZMQError:  # libzmq's own inproc peer: cannot be full or gone while it waits
            log.exception("cannot answer a ZAP request")

    def close(self) -> None:
        # Unbind first: an inproc name is released at once, so a new handler can bind it.
        with contextlib.suppress(zmq.ZMQError):
            self._sock.sock.unbind(_ZAP_ENDPOINT)
        self._sock.close()


# One handler per zmq context (keyed by its address), shared by every curve server in it.
_handlers: dict[int, _ZapHandler] = {}


class Authorizer:
    """A curve server's hold on its context's ZAP handler; `release` once the socket is closed."""

    def __init__(self, ctx: zmq.Context[Any], keys: CurveKeys) -> None:
        self._key = ctx.underlying
        self._domain_name = keys.domain
        self._released = False
        handler = _handlers.get(self._key)
        if handler is None:
            handler = _handlers[self._key] = _ZapHandler(ctx)
        domain = handler.domains.get(self._domain_name)
        if domain is None:
            domain = handler.domains[self._domain_name] = _Domain(frozenset([keys.client_public]))
        domain.users += 1
        self._domain = domain

    def statistics(self) -> ZapStats:
        """Handshakes of this run's domain in this context that ZAP allowed and denied."""
        return ZapStats(self._domain.allowed, self._domain.denied)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        handler = _handlers.get(self._key)
        if handler is None:
            return
        self._domain.users -= 1
        if self._domain.users <= 0:
            handler.domains.pop(self._domain_name, None)
        if not handler.domains:
            del _handlers[self._key]
            handler.close()


def authorize(ctx: zmq.Context[Any] | None, keys: CurveKeys) -> Authorizer:
    """Start (or join) the ZAP handler of `ctx` (the process-wide context if None) for `keys`;
    call before binding a socket configured with `keys.server_options()`. Needs a running
    event loop."""
    return Authorizer(ctx if ctx is not None else zmq.Context.instance(), keys)
