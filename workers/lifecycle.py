"""Process lifecycle helpers shared by every flowrl child process."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import os
import signal
import sys
from collections.abc import Coroutine
from typing import Any

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies, so no child outlives a killed
    controller (elsewhere heartbeats to the controller time out instead)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def take_niceness(niceness: int) -> int:
    """Lower this process's niceness to `niceness` (what it forks inherits it); the niceness it
    has afterwards. Lowering needs privilege (root, CAP_SYS_NICE or RLIMIT_NICE): without it
    the process keeps its niceness, and the caller says so. A higher niceness is kept."""
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if current > niceness:
        with contextlib.suppress(PermissionError):
            os.setpriority(os.PRIO_PROCESS, 0, niceness)
    return os.getpriority(os.PRIO_PROCESS, 0)


def run_main(coro: Coroutine[Any, Any, None]) -> None:
    """Run a child process's main coroutine on uvloop when installed (never inside a notebook:
    children are our own processes)."""
    # Everything imported so far (torch included) lives for the whole process: keep it out of
    # the collector's generations, or each full collection stalls the loop for tens of ms.
    gc.freeze()
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
    else:
        uvloop.run(coro)
