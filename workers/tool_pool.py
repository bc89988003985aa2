"""A pool of tool sandbox processes (`workers.tool_sandbox`) serving an episode's tool calls.

`ToolPool.call` never raises because of the tool: a call that raises, runs past ``timeout_s``,
exhausts ``memory_mb``, returns something that is not a JSON value, or whose sandbox dies gives
a failed `flowrl.episode.ToolResult` (its ``kind`` says which), and the rollout worker goes on.
A sandbox that timed out, ran out of memory or died is killed (its whole process group: what
the tool started too) and replaced by a fresh one on a later call; one that answered stays for
the next call.

At most ``workers`` calls run at once, each in its own process; processes start lazily, on the
first calls, and `ToolPool.aclose` kills them all. Each sandbox also dies with its worker
process (`flowrl.lifecycle.die_with_parent`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import struct
import sys
from collections.abc import Mapping
from typing import Any

from flowrl.episode import ToolResult
from flowrl.lifecycle import PARENT_ENV
from flowrl.spawn import start_child
from workers.tool_sandbox import MAX_FRAME_BYTES, pack, unpack

__all__ = ["ToolPool", "ToolPoolError"]

#: how long a fresh sandbox may take to import its tools and say it is ready
START_TIMEOUT_S = 60.0
_HEADER = struct.Struct(">I")


class ToolPoolError(RuntimeError):
    """The sandboxes cannot start (a tool that cannot be imported there): no call can run."""


class _Garbled(Exception):
    """A sandbox answered something that is not a reply frame."""


class _Sandbox:
    """One sandbox process and its pipes."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        assert proc.stdin is not None
        assert proc.stdout is not None
        self._in = proc.stdin
        self._out = proc.stdout
        self._killed = False

    async def ask(self, message: dict[str, Any]) -> Any:
        self._in.write(pack(message))
        await self._in.drain()
        header = await self._out.readexactly(_HEADER.size)
        (size,) = _HEADER.unpack(header)
        if size > MAX_FRAME_BYTES:
            raise _Garbled(f"a frame of {size} bytes")
        try:
            return unpack(await self._out.readexactly(size))
        except ValueError as e:  # msgpack's errors are ValueErrors
            raise _Garbled(str(e)) from None

    async def kill(self) -> None:
        """Kill the process and whatever it started (its own process group), and reap it."""
        if not self._killed:
            self._killed = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        await self.proc.wait()


class ToolPool:
    """Runs tools (``name -> "module:function"`` or ``"path/file.py:function"``) in sandbox
    processes; see the module docstring."""

    def __init__(self, tools: Mapping[str, str], *, workers: int = 2, timeout_s: float = 10.0,
                 memory_mb: int | None = 1024) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.tools = dict(tools)
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self._slots = asyncio.Semaphore(workers)
        self._idle: list[_Sandbox] = []
        self._busy: set[_Sandbox] = set()
        self._closed = False
        #: sandbox processes started so far (replacements included)
        self.started = 0

    async def call(self, name: str, args: Mapping[str, Any]) -> ToolResult:
        """Run tool ``name`` with keyword ``args``. `TypeError` for arguments msgpack cannot
        carry (the episode's bug); `ToolPoolError` when no sandbox can start."""
        if name not in self.tools:
            known = ", ".join(sorted(self.tools)) or "none"
            return ToolResult.failed("unknown", f"no tool named {name!r} (tools: {known})")
        request = {"tool": name, "args": dict(args)}
        try:
            pack(request)
        except (TypeError, ValueError) as e:
            raise TypeError(f"tool {name!r}: arguments must be strings, numbers, booleans, None "
                            f"or lists and dicts of them: {e}") from None
        async with self._slots:
            box = self._idle.pop() if self._idle else await self._start()
            self._busy.add(box)
            keep = False
            try:
                result, keep = await self._ask(box, name, request)
            finally:
                self._busy.discard(box)
                if keep and not self._closed:
                    self._idle.append(box)
                else:
                    await box.kill()
            return result

    async def _ask(self, box: _Sandbox, name: str, request: dict[str, Any]
                   ) -> tuple[ToolResult, bool]:
        """The call's result, and whether the sandbox may serve another call."""
        try:
            async with asyncio.timeout(self.timeout_s):
                reply = await box.ask(request)
        except TimeoutError:
            return ToolResult.failed("timeout", f"tool {name!r} ran past rollout.tool_timeout_s "
                                     f"= {self.timeout_s:g} s"), False
        except (asyncio.IncompleteReadError, ConnectionError):
            await box.kill()
            code = box.proc.returncode
            if code == -signal.SIGKILL:  # only the kernel's OOM killer sends it but us
                return ToolResult.failed("memory", f"tool {name!r} was killed: out of "
                                         "memory"), False
            return ToolResult.failed("crashed", f"tool {name!r}'s sandbox exited (code "
                                     f"{code})"), False
        except _Garbled as e:
            return ToolResult.failed("garbage", f"tool {name!r}'s sandbox answered garbage: "
                                     f"{e}"), False
        if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
            return ToolResult.failed("garbage", f"tool {name!r}'s sandbox answered "
                                     "garbage"), False
        if reply["ok"] and isinstance(reply.get("text"), str):
            return ToolResult(ok=True, text=reply["text"]), True
        kind, error = reply.get("kind"), reply.get("error")
        if kind not in ("raised", "memory", "garbage") or not isinstance(error, str):
            return ToolResult.failed("garbage", f"tool {name!r}'s sandbox answered "
                                     "garbage"), False
        # After a MemoryError the process may hold fragmented memory: start afresh.
        return ToolResult.failed(kind, f"tool {name!r}: {error}"), kind != "memory"

    async def _start(self) -> _Sandbox:
        if self._closed:
            raise ToolPoolError("the tool pool is closed")
        proc = await start_child(
            sys.executable, "-m", "workers.tool_sandbox",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            # its own process group, killed whole: what a tool starts dies with it
            start_new_session=True, env={**os.environ, PARENT_ENV: str(os.getpid())})
        box = _Sandbox(proc)
        self.started += 1
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                hello = await box.ask({"tools": self.tools, "memory_mb": self.memory_mb})
        except BaseException as e:
            await box.kill()
            if isinstance(e, Exception):
                raise ToolPoolError(f"a tool sandbox did not start: {type(e).__name__}: "
                                    f"{e}") from e
            raise
        if not isinstance(hello, dict) or hello.get("ready") is not True:
            await box.kill()
            error = hello.get("error") if isinstance(hello, dict) else None
            raise ToolPoolError(f"a tool sandbox did not start: {error or hello!r}")
        return box

    async def aclose(self) -> None:
        """Kill every sandbox; later calls raise `ToolPoolError`."""
        self._closed = True
        boxes, self._idle = [*self._idle, *self._busy], []
        for box in boxes:
            await box.kill()
