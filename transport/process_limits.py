"""Room in one process for many sockets: ZeroMQ's context and the open-files limit.

ZeroMQ's process-wide context allows 1,023 sockets unless told otherwise, and each socket holds
file descriptors (its mailbox, and each connection once made), against a soft limit of open
files that is often 1,024. A process hosting many workers (simulated workers are cheap: a
simulated recipe hosts all of a role's workers in one process) needs a few sockets each, and
without room its workers fail at start with ZeroMQ's "Too many open files". `make_room` says
how many sockets the process will hold, before its first, and raises both limits as far as
that needs (the soft limit of open files up to the hard one, which only the operator raises).
"""

from __future__ import annotations

import resource
from typing import Final

import zmq

__all__ = ["FDS_PER_SOCKET", "SocketRoomError", "make_room"]

#: file descriptors a client socket holds: its mailbox and its connection
FDS_PER_SOCKET: Final = 2
#: descriptors kept for the rest of the process (shared memory, logs, pipes, torch)
_SPARE_FDS: Final = 256


class SocketRoomError(RuntimeError):
    """The process cannot hold the sockets it needs; the message says what to change."""


def make_room(sockets: int, *, what: str) -> None:
    """Let this process hold ``sockets`` ZeroMQ sockets at once; call it before it makes its
    first (ZeroMQ takes the count when its context starts). ``what``: what needs them, for the
    error. SocketRoomError when the hard limit of open files is too low for them."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    if sockets > ctx.get(zmq.MAX_SOCKETS):
        ceiling = ctx.get(zmq.SOCKET_LIMIT)
        if sockets > ceiling:
            raise SocketRoomError(f"{what} needs {sockets} sockets; ZeroMQ allows at most "
                                  f"{ceiling} in one process")
        ctx.set(zmq.MAX_SOCKETS, sockets)
    need = sockets * FDS_PER_SOCKET + _SPARE_FDS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise SocketRoomError(
            f"{what} needs about {need} open files ({sockets} sockets) and the hard limit is "
            f"{hard}: host fewer workers in one process, or raise the limit (ulimit -Hn)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
