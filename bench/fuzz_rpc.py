"""Fuzzing an RPC server (`bench/fuzz.py` endpoints ``controller`` and ``store``): malformed
requests with valid ones interleaved, and what each server is sent and must answer."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from bench.fuzz_common import (
    REPLY_WAIT_S,
    VALID_EVERY,
    WINDOW,
    Figures,
    sim_spec,
)
from bench.fuzz_messages import Gen
from transport.errors import RemoteError, TransportError, UnknownOperation
from transport.rpc import RpcClient

ValidCheck = Callable[[], Any]


async def fuzz_rpc(
    endpoint: str, gen: Gen, count: int, valid: list[tuple[str, Any, Callable[[Any], bool]]],
    figures: Figures, ctx: zmq.asyncio.Context,
) -> None:
    """Send `count` malformed requests to `endpoint` over a few sockets, WINDOW in flight each,
    reading every reply; after every VALID_EVERY of them, one of `valid` (op, payload, check of
    the reply or of the exception) goes over a separate, well-behaved client."""
    socks = [ctx.socket(zmq.DEALER) for _ in range(4)]
    for s in socks:
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint)
    client = RpcClient(endpoint, ctx=ctx, timeout=REPLY_WAIT_S)
    sent = [0] * len(socks)
    answered = [0] * len(socks)

    async def drain(k: int, wait: bool) -> None:
        sock = socks[k]
        while True:
            if not await sock.poll(REPLY_WAIT_S * 1000 if wait else 0):
                if wait:
                    raise TimeoutError(f"no reply from {endpoint} within {REPLY_WAIT_S} s")
                return
            await sock.recv_multipart(copy=False)
            answered[k] += 1
            wait = False

    try:
        for i in range(count):
            k = i % len(socks)
            _, frames = gen.request()
            await socks[k].send_multipart(frames)
            sent[k] += 1
            figures.messages += 1
            await drain(k, wait=sent[k] - answered[k] >= WINDOW)
            if i % VALID_EVERY == VALID_EVERY - 1:
                op, payload, check = valid[(i // VALID_EVERY) % len(valid)]
                figures.valid_requests += 1
                try:
                    result: Any = await client.call(op, payload)
                except TransportError as exc:
                    result = exc
                if not check(result):
                    figures.valid_requests_failed += 1
                    print(f"valid {op} failed: {result!r:.300}", file=sys.stderr)
        for k in range(len(socks)):  # every malformed request gets an answer
            while answered[k] < sent[k]:
                await drain(k, wait=True)
    finally:
        await client.aclose()
        for s in socks:
            s.close(linger=0)


def _is(expected: Any) -> Callable[[Any], bool]:
    return lambda got: got == expected


def _raises(kind: type[Exception], remote: str | None = None) -> Callable[[Any], bool]:
    def check(got: Any) -> bool:
        return isinstance(got, kind) and (remote is None or getattr(got, "kind", "") == remote)

    return check


def controller_templates() -> tuple[dict[str, Any], set[str]]:
    ghost = "fuzz-ghost"  # names no worker: a request that reaches a handler changes nothing
    templates = {
        "register": {"name": "fuzz", "role": "rollout", "node": "node0", "pid": os.getpid(),
                     "capacity": 1},
        "heartbeat": {"worker_id": ghost, "version": 0, "busy": 0},
        "get_task": {"worker_id": ghost, "wait_s": 0.0,
                     "done": {"worker_id": ghost, "task_id": 10**12, "fields": {"reward": [0.5]},
                              "lengths": [1], "version": 0, "metrics": {}}},
        "task_done": {"worker_id": ghost, "task_id": 10**12, "fields": {"reward": [0.5]},
                      "lengths": [1], "version": 0, "metrics": {}},
        "task_failed": {"worker_id": ghost, "task_id": 10**12, "error": "fuzz"},
        "served": {"worker_id": ghost, "version": 1},
        "bye": {"worker_id": ghost},
        "node_up": {"node": "node0", "store": "ipc:///nonexistent/fuzz"},
        "start_failed": {"process": "rollout.0", "token": "0" * 32, "error": "fuzz"},
    }
    harmless = {"heartbeat", "get_task", "task_done", "task_failed", "served", "bye",
                "start_failed"}
    return templates, harmless


def controller_valid() -> list[tuple[str, Any, Callable[[Any], bool]]]:
    ghost = "fuzz-ghost"
    return [
        ("heartbeat", {"worker_id": ghost, "version": 0, "busy": 0}, _is({"ok": False})),
        ("get_task", {"worker_id": ghost, "wait_s": 0.0}, _is(None)),
        ("bye", {"worker_id": ghost}, _is({"ok": True})),
        ("task_failed", {"worker_id": ghost, "task_id": 10**12, "error": "x"}, _is({"ok": True})),
        ("no_such_op", None, _raises(UnknownOperation)),
    ]


def store_templates(run_id: str, pid: int) -> tuple[dict[str, Any], set[str]]:
    # A well-formed name of a segment that does not exist.
    ghost = f"flowrl-{run_id}-{pid}-1-{pid}-999999"
    handle = ["node0", ghost, 0, "float32", [4]]
    templates = {
        "hello": {},
        "stats": {},
        "reserve": {"pid": pid, "size": 4096, "wait": 0.0},
        "commit": {"pid": pid, "grant": 10**12, "name": ghost, "refs": 1, "next": 0},
        "abandon": {"grant": 10**12},
        "release": {"pid": 2**31},
        "free": {"handles": [handle]},
        "read": {"ranges": [[ghost, 0, 16]]},
    }
    return templates, {"hello", "stats", "abandon", "free", "read", "release"}


def store_valid(run_id: str, pid: int) -> list[tuple[str, Any, Callable[[Any], bool]]]:
    ghost = f"flowrl-{run_id}-{pid}-1-{pid}-999999"
    return [
        ("hello", None, lambda got: isinstance(got, dict) and got.get("run_id") == run_id),
        # The accounting holds: no request made the store count negative or extra capacity.
        ("stats", None, lambda got: isinstance(got, dict) and got.get("node") == "node0"
         and 0 <= got["used_bytes"] <= got["capacity_bytes"] == sim_spec().store_capacity_bytes),
        ("read", {"ranges": [[ghost, 0, 16]]}, _raises(RemoteError, "UnknownSegment")),
        ("free", {"handles": [["node0", ghost, 0, "float32", [4]]]},
         _raises(RemoteError, "UnknownSegment")),
    ]
