"""Process lifecycle helpers shared by every flowrl child process.

Light on purpose (the standard library only, asyncio not even): entry points import it and
call `die_with_parent` before their heavy imports (torch, transformers: seconds).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import signal
import sys
from collections.abc import Coroutine
from typing import Any, Final, TypeVar

_PR_SET_PDEATHSIG = 1

T = TypeVar("T")

#: set by whoever starts a flowrl child process (`flowrl.procs.Supervisor`, a Ray agent's
#: actor) to its own pid: the child can tell that its parent died before it asked to die with it
PARENT_ENV: Final = "FLOWRL_PARENT_PID"
#: whether a flowrl process started this one (`die_with_parent` found `PARENT_ENV`)
_managed = False


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies, so no child outlives a killed
    controller (elsewhere heartbeats to the controller time out instead).

    A parent that died before this call sends no signal: when ``$FLOWRL_PARENT_PID`` names a
    process that is no longer the parent, this process SIGTERMs itself at once. The variable is
    removed, so that this process's own children never mistake it for theirs.

    Such a process ignores SIGINT from then on (`stop_signals`). Call it from the main thread.
    """
    global _managed
    if PARENT_ENV in os.environ:
        _managed = True
        # Ctrl-C in a terminal reaches the whole foreground process group; the parent stops its
        # children itself, in order (workers before the node agent whose shared memory they
        # read), and says what it does.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is not None and parent != str(os.getppid()):
        os.kill(os.getpid(), signal.SIGTERM)


def stop_signals() -> tuple[signal.Signals, ...]:
    """The signals that stop this process in order: SIGTERM, and SIGINT unless a flowrl
    process started it (`die_with_parent`), which stops it itself."""
    return (signal.SIGTERM,) if _managed else (signal.SIGTERM, signal.SIGINT)


def take_niceness(niceness: int) -> int:
    """Lower this process's niceness to `niceness` (what it forks inherits it); the niceness it
    has afterwards. Lowering needs privilege (root, CAP_SYS_NICE or RLIMIT_NICE): without it
    the process keeps its niceness, and the caller says so. A higher niceness is kept."""
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if current > niceness:
        with contextlib.suppress(PermissionError):
            os.setpriority(os.PRIO_PROCESS, 0, niceness)
    return os.getpriority(os.PRIO_PROCESS, 0)


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to its end on uvloop when installed, else on asyncio's own loop, and
    return its result: the loop every flowrl process runs on, the launched controller's too (a
    controller embedded in a notebook runs on the notebook's loop)."""
    try:
        import uvloop
    except ImportError:
        import asyncio

        return asyncio.run(coro)
    return uvloop.run(coro)


def run_main(coro: Coroutine[Any, Any, None]) -> None:
    """Run a child process's main coroutine (`run_loop`)."""
    # Everything imported so far (torch included) lives for the whole process: keep it out of
    # the collector's generations, or each full collection stalls the loop for tens of ms.
    gc.freeze()
    run_loop(coro)
