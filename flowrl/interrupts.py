"""A forced stop: what a second Ctrl-C ends at once.

The first Ctrl-C stops a launched run in order (the controller asks its workers to stop, waits
for them, then stops the node agent, which removes the run's shared memory). A second one must
not wait for any of that: `Interrupts.force` kills every process of the run that it was told of
(`track`) with SIGKILL, waits until they are gone, then removes the run's shared-memory segments
and run directory itself, since the node agent that owns them did not get to.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from collections.abc import Callable, Iterable

from transport import shm
from transport.endpoints import remove_run_dir

__all__ = ["Interrupts", "wait_gone"]

#: how long `Interrupts.force` waits for a killed process to be gone
FORCE_WAIT_S = 5.0


def wait_gone(pids: Iterable[int], timeout_s: float) -> list[int]:
    """Wait until the processes ``pids`` have terminated (exited, zombie or reaped); those
    still running after ``timeout_s``."""
    fds: dict[int, int] = {}
    for pid in pids:
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            continue
    try:
        deadline = time.monotonic() + timeout_s
        while fds and (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select(list(fds), [], [], left)
            for fd in ready:
                os.close(fd)
                fds.pop(fd)
        return list(fds.values())
    finally:
        for fd in fds:
            os.close(fd)


class Interrupts:
    """The processes and runs of this process that a forced stop ends (see the module
    docstring)."""

    def __init__(self) -> None:
        self._sources: dict[int, Callable[[], Iterable[int]]] = {}
        self._next = 0
        #: runs whose shared memory and run directory a forced stop removes
        self.run_ids: set[str] = set()
        #: a stop in order is under way (the first Ctrl-C)
        self.stopping = False
        #: a forced stop happened
        self.forced = False

    def track(self, pids: Callable[[], Iterable[int]]) -> Callable[[], None]:
        """Have a forced stop kill the processes ``pids()`` names then (only live children: a
        pid reaped and reused must not be killed); returns the function that stops tracking
        them."""
        key = self._next
        self._next += 1
        self._sources[key] = pids

        def untrack() -> None:
            self._sources.pop(key, None)

        return untrack

    def force(self) -> None:
        """Kill every tracked process (SIGKILL), wait for them, then remove the shared memory
        and run directory of every run in `run_ids`."""
        self.forced = True
        pids = [pid for source in list(self._sources.values()) for pid in source()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_gone(pids, FORCE_WAIT_S)
        for run_id in self.run_ids:
            for name in shm.segments_of(run_id):
                shm.unlink(name)
            remove_run_dir(run_id)
