"""A child process started with `flowrl.spawn.start_child` is never left behind by a cancel.

A Ctrl-C that lands while a stage starts its child cancels ``create_subprocess_exec`` in its
wait for the child's pipes: uvloop then sends the child SIGKILL and nobody reaps it, so a
launcher that exits at once leaves it behind. These tests cancel at each point of a start, on
both loops flowrl runs on, and look for any child of this process afterwards, zombies included.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import psutil
import pytest
import uvloop

from flowrl.spawn import start_child, stop_child

LOOPS: dict[str, Callable[[Coroutine[Any, Any, Any]], Any]] = {
    "uvloop": uvloop.run, "asyncio": asyncio.run}
#: the loop passes a test lets go by before it cancels, each inside the start (`start_child`
#: returns on the sixth, on both loops): plain ``create_subprocess_exec`` returns on the third,
#: and a cancel after one or two passes, in its wait for the child's pipes, loses the child on
#: uvloop
CANCEL_AFTER = range(5)
SLEEPER = (sys.executable, "-c", "import time; time.sleep(60)")


def _children() -> list[tuple[int, str]]:
    """This process's children, zombies included."""
    found = []
    for child in psutil.Process().children():
        try:
            found.append((child.pid, child.status()))
        except psutil.NoSuchProcess:
            continue
    return found


@pytest.mark.timeout(60)
@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("passes", CANCEL_AFTER)
def test_a_cancel_at_any_point_of_a_start_leaves_no_child(loop: str, passes: int) -> None:
    async def cancelled_start() -> list[tuple[int, str]]:
        task = asyncio.create_task(start_child(*SLEEPER))
        for _ in range(passes):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return _children()  # before the loop's end can reap anything

    assert LOOPS[loop](cancelled_start()) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("loop", LOOPS)
def test_a_started_child_is_stopped_with_sigterm_then_sigkill(loop: str) -> None:
    async def stops() -> tuple[int, int, int]:
        polite = await start_child(*SLEEPER)
        # One that ignores SIGTERM, and says so once it does: the SIGTERM must come after.
        stubborn = await start_child(
            sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
            "signal.SIG_IGN); print('ready', flush=True); time.sleep(60)",
            stdout=asyncio.subprocess.PIPE)
        assert stubborn.stdout is not None
        assert await stubborn.stdout.readline() == b"ready\n"
        terminated = await stop_child(polite)
        killed = await stop_child(stubborn, grace_s=0.2)
        return terminated, killed, await stop_child(polite)  # exited already: its code

    assert LOOPS[loop](stops()) == (-signal.SIGTERM, -signal.SIGKILL, -signal.SIGTERM)
    assert _children() == []
