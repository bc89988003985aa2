"""Child processes of the controller: start, watch, forward output, stop in order.

Every child is owned: one watcher task per child awaits its exit and reports it through
``on_exit`` (a dead worker's rows are requeued at once, without waiting for missed heartbeats).
Children's output lines reach the controller's log prefixed with the child's name; a traceback a
child prints reaches it as one ``error`` record (`flowrl.logs.ChildLines`), and the last error a
child logged is kept (`Child.last_error`) for the reason it exited. Stopping is polite first
(the caller broadcasts ``stop``), then SIGTERM, then SIGKILL, each with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog

from flowrl.lifecycle import PARENT_ENV
from flowrl.logs import FORMAT_ENV, ChildLines
from flowrl.spawn import start_child

log = structlog.get_logger("flowrl.procs")

#: a traceback a child printed is emitted once its output pauses this long (or a record follows)
TRACEBACK_PAUSE_S = 0.2


@dataclass
class Child:
    name: str
    proc: asyncio.subprocess.Process
    watcher: asyncio.Task[None]
    expected_exit: bool = False
    #: the last error line it logged (its event and error), for the reason it exited
    last_error: str = ""

    @property
    def pid(self) -> int:
        return self.proc.pid


class Supervisor:
    def __init__(self, on_exit: Callable[[Child, int], None]) -> None:
        self._on_exit = on_exit
        self._children: dict[int, Child] = {}

    @property
    def children(self) -> list[Child]:
        return list(self._children.values())

    async def spawn(
        self, name: str, argv: Sequence[str], env: dict[str, str] | None = None
    ) -> Child:
        # PARENT_ENV: a child that dies with its parent (`die_with_parent`) can tell when this
        # process died before it asked
        full_env = {**os.environ, **(env or {}), PARENT_ENV: str(os.getpid())}
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        full_env.setdefault(FORMAT_ENV, "json")  # the relay parses children's lines
        proc = await start_child(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=full_env,
        )
        child = Child(name, proc, asyncio.get_running_loop().create_task(self._watch(name, proc)))
        self._children[proc.pid] = child
        return child

    async def _watch(self, name: str, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        lines = ChildLines(name)

        def note(error: str | None) -> None:
            running = self._children.get(proc.pid)
            if error is not None and running is not None:
                running.last_error = error[:500]

        while True:
            if lines.pending:  # a traceback is being gathered: a pause ends it
                try:
                    async with asyncio.timeout(TRACEBACK_PAUSE_S):
                        line = await proc.stdout.readline()
                except TimeoutError:  # the unread part of a line stays in the stream's buffer
                    note(lines.flush())
                    continue
            else:
                line = await proc.stdout.readline()
            if not line:
                break
            note(lines.feed(line.decode(errors="replace")))
        note(lines.flush())
        code = await proc.wait()
        child = self._children.pop(proc.pid, None)
        if child is not None:
            if not child.expected_exit:
                log.warning("child exited", child=name, pid=proc.pid, code=code)
            self._on_exit(child, code)

    def exited(self, pid: int) -> bool:
        """Whether child ``pid`` has exited, even if its exit has not been handled yet (it is
        not reaped here: its watcher still reports it). A dead child stays a zombie until
        reaped, so the answer follows from what caused the question: a peer that saw this
        child's sockets close asks after the child died."""
        if pid not in self._children:
            return True
        try:
            state = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped already, its exit not yet handled
            return True
        return state is not None

    def kill(self, pid: int, sig: int = signal.SIGKILL) -> None:
        child = self._children.get(pid)
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                child.proc.send_signal(sig)

    async def stop_all(
        self, grace_s: float = 5.0, *, only: Callable[[Child], bool] | None = None,
        signals: Sequence[int] = (signal.SIGTERM, signal.SIGKILL),
    ) -> None:
        """Wait ``grace_s`` for children to exit on their own, then send each of ``signals``
        (TERM, then KILL) in turn, 5 s apart, until they have exited.

        With ``grace_s = 0`` children are sent SIGTERM at once (for those that do not listen
        to broadcasts, like the node agent); ``signals=(SIGKILL,)`` ends them at once."""
        children = [c for c in self._children.values() if only is None or only(c)]
        for c in children:
            c.expected_exit = True
        watchers = [c.watcher for c in children]
        if not watchers:
            return
        pending = set(watchers)
        if grace_s > 0:
            _, pending = await asyncio.wait(watchers, timeout=grace_s)
        for sig in signals:
            if not pending:
                break
            for c in children:
                if c.watcher in pending:
                    with contextlib.suppress(ProcessLookupError):
                        c.proc.send_signal(sig)
            _, pending = await asyncio.wait(pending, timeout=5.0)
        for task in pending:  # unreachable unless the kernel refuses SIGKILL
            task.cancel()
