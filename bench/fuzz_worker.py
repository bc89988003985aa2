"""A real worker process against a hostile controller (`bench/fuzz.py` endpoint ``worker``):
malformed replies, tasks and broadcasts; a garbage registration reply must be fatal."""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time
from collections.abc import Callable
from typing import Any, Final

import msgpack
import zmq
import zmq.asyncio

from bench.fuzz_common import (
    FAST,
    FULL_MESSAGES,
    GROUP,
    REPLY_WAIT_S,
    Figures,
    peak_rss_mb,
    rss_mb,
)
from bench.fuzz_messages import Gen, packed
from transport.codec import decode, encode
from transport.endpoints import ipc_endpoint, remove_run_dir, run_dir
from transport.errors import MalformedMessage
from transport.handles import Handle, is_handle, is_run, run_rows

OK: Final = 0
ERROR: Final = 1
UNKNOWN_OP: Final = 2
REJECTED: Final = 3


class HostileController:
    """A controller that lies: raw ROUTERs for the worker's calls and for its broadcasts, so
    any bytes can be sent. Answers every call (after a malformed answer, with a
    proper one, so no call has to wait for its deadline) and mixes valid rollout tasks into its
    task messages."""

    def __init__(self, run_id: str, seed: int, ctx: zmq.asyncio.Context, count: int,
                 register_reply: Any = None) -> None:
        self.rng = random.Random(seed)
        self.gen = Gen(seed, {}, set())
        self.ctx = ctx
        self.count = count
        self.register_reply = register_reply
        self.rpc_ep = ipc_endpoint(run_id, "hostile-ctl")
        self.pub_ep = ipc_endpoint(run_id, "hostile-pub")
        self.router = ctx.socket(zmq.ROUTER)
        self.pub = ctx.socket(zmq.ROUTER)
        self.subscriber = b""  # the worker's identity at `pub`, once it joined
        for s in (self.router, self.pub):
            s.setsockopt(zmq.LINGER, 0)
        self.router.bind(self.rpc_ep)
        self.pub.bind(self.pub_ep)
        self.messages = 0  # malformed messages sent, replies and broadcasts
        self.broadcast = 0
        self._sent_more = asyncio.Event()  # a malformed reply went out
        self.valid_sent: dict[int, float] = {}
        self.valid_done: set[int] = set()
        self.valid_failed: set[int] = set()
        self.reported: set[Any] = set()  # task ids whose report came (a report may repeat)
        #: called with the handles of each valid task's outputs (to free them)
        self.on_done: Callable[[list[Any]], None] = lambda handles: None
        self.heartbeats = 0
        self.calls: dict[str, int] = {}  # the worker's calls, by operation
        self.registered = asyncio.Event()
        self.finished = asyncio.Event()  # every malformed message is out
        self.settled = asyncio.Event()  # ... and every valid task is reported
        self.next_task = 1

    def close(self) -> None:
        self.router.close(linger=0)
        self.pub.close(linger=0)

    async def reply(self, ident: bytes, rid: int, status: int, body: Any) -> None:
        await self.router.send_multipart([ident, *packed(encode([rid, status, body]))])

    async def malformed_reply(self, ident: bytes, rid: int) -> None:
        """One malformed answer to call `rid`; the caller then sends a proper one."""
        r = self.rng
        kind = r.randrange(6)
        if kind == 0:
            frames = [self.gen.blob() for _ in range(r.choice((1, 2)))]
        elif kind == 1:
            frames = [msgpack.packb([rid, r.choice((7, -1, "ok", None)), self.gen.value()])]
        elif kind == 2:
            # An id no call of the worker holds (one that does would be a lie nobody can
            # detect: that call would take this body for its own).
            frames = [msgpack.packb([rid + r.choice((10**9, -(10**9))), OK, self.gen.value()])]
        elif kind == 3:
            frames = [msgpack.packb([self.gen.bad_rid(), OK, {"ok": True}])]
        elif kind == 4:
            frames = [msgpack.packb([rid, OK, {"x": self.gen.tensor_ext()}]), b"\0" * 16]
        else:
            frames = [msgpack.packb(r.choice(([rid, OK], [rid, OK, None, 1], {"rid": rid})))]
        await self.router.send_multipart([ident, *frames])
        self.messages += 1

    def bad_task(self) -> Any:
        r = self.rng
        good = self.valid_task(10**9 + r.randrange(10**6))
        if r.random() < 0.2:
            return self.gen.value()
        task = self.gen.mutate(good)
        if r.random() < 0.3 and isinstance(task, dict):
            task["inputs"] = {"response_ids": [[
                "node0", r.choice(("flowrl-x", "../../etc/passwd", "")), r.choice((0, -8, 3)),
                r.choice(("float32", "int64", "complex")),
                r.choice(([2**40], [-1], [4], "x"))]]}
        return task

    def valid_task(self, task_id: int) -> dict[str, Any]:
        return {"task_id": task_id, "stage": "rollout", "rows": [0, 1, 2, 3], "groups": [0],
                "row_groups": [0, 0, 0, 0], "inputs": {"prompt": [0, 0, 0, 0]},
                "params": {"data_pos": [0]}}

    def take_report(self, report: dict[str, Any]) -> None:
        tid = report.get("task_id")
        fields = {k: _rows(v) for k, v in report.get("fields", {}).items()}
        # Free every output, also of the malformed tasks the worker ran: a controller that
        # never frees would fill the store (its puts would then wait).
        self.on_done([h for f in fields.values() for h in f])
        if tid in self.valid_sent and tid not in self.valid_done:
            self.valid_done.add(tid)
            ok = all(len(fields.get(f, ())) == GROUP
                     for f in ("prompt_ids", "response_ids", "rollout_logprobs"))
            if not ok:
                self.valid_failed.add(tid)

    async def serve(self) -> None:
        while True:
            ident, *frames = await self.router.recv_multipart(copy=False)
            rid, op, payload = decode(frames)
            ident_b = ident.bytes
            self.calls[op] = self.calls.get(op, 0) + 1
            # A task's report comes with the next poll, and again after a poll that failed.
            report = payload.get("done") if op == "get_task" and isinstance(payload, dict) \
                else payload if op == "task_done" else None
            if isinstance(report, dict) and report.get("task_id") not in self.reported:
                self.reported.add(report.get("task_id"))
                self.calls["report"] = self.calls.get("report", 0) + 1
                self.take_report(report)
            if op == "register":
                body = self.register_reply or {"worker_id": "w0", "version": 0, "weights": None}
                await self.reply(ident_b, rid, OK, body)
                self.registered.set()
                continue
            if op == "task_failed":
                tid = payload.get("task_id")
                if tid in self.valid_sent and tid not in self.valid_done:
                    self.valid_failed.add(tid)
                    print(f"valid task {tid} failed: {payload.get('error')}", file=sys.stderr)
            elif op == "heartbeat":
                self.heartbeats += 1
            self._sent_more.set()
            if self.messages >= self.count:
                self.finished.set()
                if len(self.valid_done | self.valid_failed) == len(self.valid_sent):
                    self.settled.set()
            lied = self.rng.random() < 0.3 or (op == "get_task" and self.rng.random() < 0.5)
            if lied:  # the call may be over already: what follows can only be a late reply
                await self.malformed_reply(ident_b, rid)
            if op == "get_task":
                if self.messages >= self.count or self.rng.random() < 0.1:
                    await self.reply(ident_b, rid, OK, None)
                elif not lied and self.rng.random() < 0.5:
                    tid = self.next_task
                    self.next_task += 1
                    self.valid_sent[tid] = time.perf_counter()
                    await self.reply(ident_b, rid, OK, self.valid_task(tid))
                elif self.rng.random() < 0.05:
                    await self.reply(ident_b, rid, self.rng.choice((ERROR, REJECTED)),
                                     ["FuzzError", "the controller lies"])
                    self.messages += 1
                else:
                    await self.reply(ident_b, rid, OK, self.bad_task())
                    self.messages += 1
            elif op == "heartbeat" and self.rng.random() < 0.3:
                body = self.rng.choice(({"ok": "yes"}, {}, None, [True], {"ok": 1},
                                        self.gen.value()))
                await self.reply(ident_b, rid, OK, body)
                self.messages += 1
            else:
                await self.reply(ident_b, rid, OK, {"ok": True})

    async def broadcasts(self) -> None:
        """Welcomes subscribers (the join handshake), then publishes malformed broadcasts."""
        while True:
            ident, *msg = await self.pub.recv_multipart()
            if msg[:1] == [b"\xffjoin"]:
                self.subscriber = ident
                await self.pub.send_multipart([ident, b"\xffwelcome"])
                break
        await self.registered.wait()
        while not self.finished.is_set():
            # One broadcast in five messages: the rest are replies.
            await self._sent_more.wait()
            self._sent_more.clear()
            if self.broadcast * 5 >= self.messages:
                continue
            r = self.rng
            kind = r.randrange(5)
            if kind == 0:
                frames = [b"version\0", *(self.gen.blob() for _ in range(r.choice((1, 2))))]
            elif kind == 1:
                frames = [b"version", msgpack.packb({"version": 1})]  # not zero-terminated
            elif kind == 2:
                frames = [b"version\0", msgpack.packb(self.gen.value(), use_bin_type=True)]
            elif kind == 3:
                payload = self.gen.mutate({"version": 10**6, "weights": {
                    "w": [["node0", "flowrl-nothing", 0, "float32", [4]], [4]]}})
                frames = [b"version\0", msgpack.packb(payload, use_bin_type=True)]
            else:
                frames = [b"version\0", msgpack.packb({"version": 10**6, "weights": {
                    "w": [self.gen.value(), self.gen.value()]}}, use_bin_type=True)]
            await self.pub.send_multipart([self.subscriber, *frames])
            self.messages += 1
            self.broadcast += 1

    async def stop(self) -> None:
        await self.pub.send_multipart([self.subscriber, b"stop\0",
                                       msgpack.packb({"reason": "fuzz over"})])


def _rows(value: Any) -> Any:
    """A reported field's values, a value a row (a field's rows of one put come as one run, as
    the controller takes them: `transport.handles.run_rows`); none for a malformed run."""
    if not is_run(value):
        return value
    try:
        return run_rows(value)
    except MalformedMessage:
        return []


def worker_argv(run_id: str, hostile: HostileController, store_ep: str) -> list[str]:
    from flowrl.worker_launch import worker_command
    from flowrl.worker_spec import Endpoints, ProcessSpec, WorkerSpec

    return worker_command(WorkerSpec(
        process=ProcessSpec(name="rollout.0", role="rollout", count=1, capacity=4, threads=1,
                            seed=0, heartbeat_s=0.05, weight_sync_timeout_s=60.0,
                            engine="sim", sim=FAST, start_token="0123456789abcdef"),
        endpoints=Endpoints(run_id=run_id, node="node0", controller=hostile.rpc_ep,
                            broadcast=hostile.pub_ep, store=store_ep)))


async def fuzz_worker(count: int, seed: int) -> dict[str, Any]:
    from transport.endpoints import new_run_id
    from transport.store import SampleStore
    from transport.store_server import StoreServer

    run_id = new_run_id()
    run_dir(run_id)
    ctx = zmq.asyncio.Context()
    fig = Figures()
    out: dict[str, Any] = {}
    env = {**os.environ, "FLOWRL_LOG_FORMAT": "json", "FLOWRL_LOG_LEVEL": "error"}
    store = SampleStore(run_id, "node0", capacity_bytes=64 << 20)
    try:
        async with StoreServer(store, ipc_endpoint(run_id, "store-node0")) as server:
            hostile = HostileController(run_id, seed, ctx, count)
            hostile.on_done = lambda handles: store.free(
                [Handle.from_wire(h) for h in handles if is_handle(h)])
            log_path = os.environ.get("FLOWRL_FUZZ_WORKER_LOG")  # to see what the worker saw
            log_file = open(log_path, "wb") if log_path else None  # noqa: SIM115, ASYNC230
            proc = await asyncio.create_subprocess_exec(
                *worker_argv(run_id, hostile, server.endpoint),
                env={**env, "FLOWRL_LOG_LEVEL": "debug"} if log_file else env,
                stderr=log_file or asyncio.subprocess.DEVNULL)
            if log_file:
                log_file.close()
            t0 = time.perf_counter()
            try:
                async with asyncio.TaskGroup() as tg:
                    serving = tg.create_task(hostile.serve())
                    casting = tg.create_task(hostile.broadcasts())
                    async with asyncio.timeout(30):
                        await hostile.registered.wait()
                    fig.rss_start_mb = rss_mb(proc.pid)
                    exited = tg.create_task(proc.wait())
                    finished = tg.create_task(hostile.finished.wait())
                    await asyncio.wait([exited, finished], timeout=30 + count / 50,
                                       return_when=asyncio.FIRST_COMPLETED)
                    finished.cancel()
                    settled = tg.create_task(hostile.settled.wait())
                    await asyncio.wait([exited, settled], timeout=REPLY_WAIT_S,
                                       return_when=asyncio.FIRST_COMPLETED)
                    settled.cancel()
                    alive = proc.returncode is None
                    if alive:
                        fig.rss_end_mb = rss_mb(proc.pid)
                        fig.peak_rss_mb = peak_rss_mb(proc.pid)
                    await hostile.stop()
                    async with asyncio.timeout(10):
                        code = await exited
                    serving.cancel()
                    casting.cancel()
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
                hostile.close()
            fig.wall_s = time.perf_counter() - t0
            fig.messages = hostile.messages
            fig.valid_requests = len(hostile.valid_sent)
            fig.valid_requests_failed = len(hostile.valid_failed) + len(
                set(hostile.valid_sent) - hostile.valid_done - hostile.valid_failed)
            fig.crashes = int(not alive or code != 0)
            out["worker"] = fig
            out["worker_exit_code"] = code
            out["worker_calls"] = hostile.calls
            out["register_garbage"] = await register_garbage(
                run_id, seed, ctx, server.endpoint, env, 4 if count >= FULL_MESSAGES else 2)
    finally:
        store.close()
        ctx.destroy(linger=0)
        remove_run_dir(run_id)
    return out


async def register_garbage(run_id: str, seed: int, ctx: zmq.asyncio.Context, store_ep: str,
                           env: dict[str, str], cases: int) -> dict[str, Any]:
    """A controller that answers registration with garbage: the worker must exit non-zero,
    with an error that says so, within seconds (the protocol has no way to go on)."""
    results = []
    replies: list[Any] = [42, {"worker_id": 7}, {"version": "x", "worker_id": "w"}, [None]]
    for reply in replies[:cases]:
        hostile = HostileController(run_id, seed, ctx, 0, register_reply=reply)
        proc = await asyncio.create_subprocess_exec(
            *worker_argv(run_id, hostile, store_ep), env=env,
            stderr=asyncio.subprocess.PIPE)
        t0 = time.perf_counter()
        try:
            async with asyncio.TaskGroup() as tg:
                serving = tg.create_task(hostile.serve())
                welcoming = tg.create_task(hostile.broadcasts())
                async with asyncio.timeout(30):
                    assert proc.stderr is not None
                    err = await proc.stderr.read()
                    code = await proc.wait()
                serving.cancel()
                welcoming.cancel()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            hostile.close()
        results.append({"exit_code": code, "exit_s": round(time.perf_counter() - t0, 2),
                        "clear_error": b"invalid register reply" in err})
    return {"cases": len(results),
            "exited_nonzero": sum(r["exit_code"] != 0 for r in results),
            "clear_error": sum(bool(r["clear_error"]) for r in results),
            "max_exit_s": max(float(r["exit_s"]) for r in results)}
