"""Starting a child process so that a cancel cannot leave it behind.

`asyncio.create_subprocess_exec` awaits the new child's pipes before it returns the process. A
cancel that lands in that wait (a Ctrl-C just as a stage starts a child) loses the process: on
uvloop the child is sent SIGKILL and nobody waits for it, so it cannot remove what it began and,
when the cancel goes on to end the parent, it is still there for a moment after the parent is
gone. `start_child` finishes such a start out of the cancel's reach, stops the child as any stop
does (SIGTERM, then SIGKILL) and waits until it is gone; then the cancel goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from typing import Any

__all__ = ["STOP_GRACE_S", "start_child", "stop_child"]

#: how long a child has to exit after SIGTERM before it is sent SIGKILL
STOP_GRACE_S = 5.0


async def start_child(*argv: str, grace_s: float = STOP_GRACE_S,
                      **options: Any) -> asyncio.subprocess.Process:
    """`asyncio.create_subprocess_exec(*argv, **options)`; cancelled while the child starts,
    the child is stopped (`stop_child` with ``grace_s``) before the cancel goes on."""
    starting = asyncio.ensure_future(asyncio.create_subprocess_exec(*argv, **options))
    try:
        return await asyncio.shield(starting)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):  # a child that failed to start has nothing to stop
            await stop_child(await starting, grace_s)
        raise


async def stop_child(proc: asyncio.subprocess.Process, grace_s: float = STOP_GRACE_S) -> int:
    """Stop ``proc``: SIGTERM, SIGKILL if it has not exited ``grace_s`` later; its exit code
    once it is gone (at once if it had exited)."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(grace_s):
                return await proc.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
    return await proc.wait()
