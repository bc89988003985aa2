"""A tool sandbox process: runs the recipe's tools one call at a time for `workers.tool_pool`.

Started as ``python -m workers.tool_sandbox`` with pipes for stdin and stdout. Both ends speak
frames: a 4-byte big-endian length, then a msgpack map (never pickle: a tool's result crosses
to the rollout worker only as a checked string).

1. The pool sends ``{"tools": {name: reference}, "memory_mb": int | None}``; the process
   resolves the references (`flowrl.reward_fn`), limits its address space to ``memory_mb``
   (``RLIMIT_AS``: the whole process, interpreter and the tools' modules included) and
   answers ``{"ready": true}`` or ``{"ready": false, "error": text}``.
2. Then per call ``{"tool": name, "args": {...}}`` → ``{"ok": true, "text": text}`` or
   ``{"ok": false, "kind": kind, "error": text}`` with kind ``raised``, ``memory`` or
   ``garbage`` (a result that is not a JSON value, or longer than `MAX_RESULT_CHARS` as text).

The pool enforces the per-call timeout by killing the process. The protocol uses duplicates of
the original stdin and stdout; fds 0 and 1 then point at /dev/null and stderr, so a tool that
prints cannot corrupt a frame (a tool is trusted code that may misbehave, not an adversary).
Imports only the standard library, msgpack and flowrl's stdlib-only modules, so it starts fast.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import resource
import struct
import sys
from collections.abc import Callable
from typing import IO, Any

import msgpack

from flowrl.lifecycle import die_with_parent
from flowrl.reward_fn import describe_error, resolve_reward_fn

__all__ = ["MAX_FRAME_BYTES", "MAX_RESULT_CHARS", "as_text", "pack", "unpack"]

#: the longest result text a tool may return
MAX_RESULT_CHARS = 1 << 16
#: the largest frame either side accepts (a result of `MAX_RESULT_CHARS` fits)
MAX_FRAME_BYTES = 1 << 20
_HEADER = struct.Struct(">I")


def pack(message: dict[str, Any]) -> bytes:
    """One frame: the length, then the msgpack of ``message``."""
    body: bytes = msgpack.packb(message, use_bin_type=True)
    return _HEADER.pack(len(body)) + body


def unpack(body: bytes) -> Any:
    """A frame's message (its body, without the length); no extension types."""
    return msgpack.unpackb(body, raw=False, strict_map_key=True)


def as_text(value: object) -> str:
    """A tool's result as the text the policy sees: a string as it is, another JSON value as
    JSON; `ValueError` (or `TypeError`) for anything else."""
    text = value if isinstance(value, str) else json.dumps(value, allow_nan=False,
                                                           ensure_ascii=False)
    if len(text) > MAX_RESULT_CHARS:
        raise ValueError(f"a result of {len(text)} characters (at most {MAX_RESULT_CHARS})")
    return text


def _read(stream: IO[bytes]) -> Any:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None  # the pool closed the pipe: exit
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {size} bytes")
    return unpack(stream.read(size))


def _write(stream: IO[bytes], message: dict[str, Any]) -> None:
    stream.write(pack(message))
    stream.flush()


def _call(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], args: dict[str, Any]
          ) -> dict[str, Any]:
    try:
        value = fn(**args)
        if inspect.isawaitable(value):
            value = loop.run_until_complete(value)
    except MemoryError:
        return {"ok": False, "kind": "memory", "error": "the tool ran out of memory "
                "(rollout.tool_memory_mb)"}
    except BaseException as e:  # SystemExit too: a tool must not end its sandbox
        return {"ok": False, "kind": "raised", "error": describe_error(e)}
    try:
        return {"ok": True, "text": as_text(value)}
    except MemoryError:
        return {"ok": False, "kind": "memory", "error": "the tool's result ran out of memory"}
    except (TypeError, ValueError) as e:
        kind = type(value).__name__
        return {"ok": False, "kind": "garbage",
                "error": f"the tool returned a {kind}, not a JSON value: {describe_error(e)}"}


def main() -> None:
    die_with_parent()
    proto_in = os.fdopen(os.dup(0), "rb")
    proto_out = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    hello = _read(proto_in)
    if not isinstance(hello, dict):
        return
    try:
        tools = {str(name): resolve_reward_fn(str(ref), what=f"tool {name!r}")
                 for name, ref in dict(hello["tools"]).items()}
        memory_mb = hello.get("memory_mb")
        if memory_mb is not None:
            limit = int(memory_mb) << 20
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except Exception as e:
        _write(proto_out, {"ready": False, "error": describe_error(e)})
        return
    _write(proto_out, {"ready": True})
    loop = asyncio.new_event_loop()
    while True:
        request = _read(proto_in)
        if request is None:
            return
        reply = _call(loop, tools[request["tool"]], dict(request["args"]))
        sys.stdout.flush()  # what the tool printed, before the next call's
        _write(proto_out, reply)


if __name__ == "__main__":
    main()
