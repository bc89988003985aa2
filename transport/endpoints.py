"""Endpoint naming and the bind policy.

Guarantees:
- On one node, sockets live under a private per-run directory (`/tmp/flowrl-<run_id>`, mode 0700,
  owned by the current user); `remove_run_dir` removes it with every ipc socket file inside.
- Nothing in `transport` binds a non-loopback address unless the caller passes
  `allow_remote=True` and the socket is a curve server (`transport.curve`): `check_bind` raises
  `BindRefused` otherwise. Host names are never resolved; only literal loopback addresses and
  `localhost` count as loopback.
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
import shutil
import stat
from pathlib import Path

from transport.errors import BindRefused, TransportError

__all__ = [
    "check_bind",
    "check_run_id",
    "default_endpoint",
    "ipc_endpoint",
    "new_run_id",
    "remove_run_dir",
    "run_dir",
    "tcp_endpoint",
]

# Short names keep ipc paths far below the ~107-byte limit of a unix socket path.
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,48}")
_RUN_ROOT = Path("/tmp")


def new_run_id() -> str:
    """A fresh run id: 8 hex characters."""
    return secrets.token_hex(4)


def _check_name(kind: str, value: str) -> None:
    if not _NAME.fullmatch(value) or value in {".", ".."}:
        raise ValueError(f"invalid {kind} {value!r}: use 1-48 of [A-Za-z0-9_.-]")


def check_run_id(run_id: str) -> str:
    """Return `run_id` if valid (1-48 of ``[A-Za-z0-9_.-]``, not "." or ".."); else ValueError."""
    _check_name("run id", run_id)
    return run_id


def _run_path(run_id: str) -> Path:
    return _RUN_ROOT / f"flowrl-{check_run_id(run_id)}"


def run_dir(run_id: str) -> Path:
    """The per-run socket directory, created 0700 if missing.

    /tmp is shared: a directory that another user created, or a symlink, is refused rather
    than trusted with our sockets.
    """
    path = _run_path(run_id)
    path.mkdir(mode=0o700, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise TransportError(f"{path} exists and is not a directory owned by this user")
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def remove_run_dir(run_id: str) -> None:
    """Remove the run directory and every socket file in it; a missing directory is fine."""
    shutil.rmtree(_run_path(run_id), ignore_errors=True)


def ipc_endpoint(run_id: str, name: str) -> str:
    """`ipc://` endpoint `name` inside the run directory (which is created if needed)."""
    _check_name("endpoint name", name)
    return f"ipc://{run_dir(run_id) / name}.sock"


def tcp_endpoint(host: str = "127.0.0.1", port: int = 0) -> str:
    """`tcp://host:port`; port 0 asks the OS for a free port when binding."""
    if not 0 <= port <= 65535:
        raise ValueError(f"invalid port {port}")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def default_endpoint(run_id: str, name: str, *, single_node: bool = True) -> str:
    """ipc under the run directory on one node, loopback tcp on an OS-chosen port otherwise."""
    return ipc_endpoint(run_id, name) if single_node else tcp_endpoint()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # an interface name, a wildcard or a host name: never assumed local


def check_bind(endpoint: str, *, allow_remote: bool, curve: bool = False) -> None:
    """Raise BindRefused unless `endpoint` is local (ipc, inproc, loopback tcp), or remote
    binds are allowed and the socket authenticates its peers with the run's keys (`curve`:
    CurveZMQ, or every request checked by a `transport.request_auth.RequestAuth`)."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        raise BindRefused(f"not a zmq endpoint: {endpoint!r}")
    if scheme in {"ipc", "inproc"}:
        return
    if scheme == "tcp":
        host, colon, _port = rest.rpartition(":")
        if colon and _is_loopback(host):
            return
    if allow_remote and curve:
        return
    if allow_remote:
        raise BindRefused(f"refusing to bind {endpoint!r} without curve keys")
    raise BindRefused(
        f"refusing to bind {endpoint!r}: only ipc and loopback tcp are allowed "
        "unless allow_remote=True (and curve keys)"
    )
