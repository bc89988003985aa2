"""Bad input against every process that reads the network: does anything die, hang or leak?

Four endpoints, each fuzzed with malformed messages while valid requests are interleaved (and
must all succeed):

- ``controller``: the controller's RPC server during a real simulated run; afterwards the run
  must stop cleanly with exact accounting (every step trained in full, no row trained twice,
  no worker lost);
- ``store``: the node agent's StoreServer (a real SampleStore in its own process) during that
  same run, so the workers' real store traffic is the valid traffic next to ours;
- ``worker``: a real worker process (``python -m workers.main``, engine sim) served by a hostile
  controller that answers its calls with malformed replies and task messages and publishes
  malformed broadcasts; the worker must keep serving the valid tasks mixed in, exit on ``stop``,
  and exit with a clear error (never hang) when its registration is answered with garbage;
- ``monitor``: the controller's HTTP monitor: garbage, bad methods, huge headers, bad JSON
  bodies, missing or wrong tokens, path traversal, bad event ids;
- ``flood``: the monitor under a crowd, from another process: slow-header (slowloris)
  connections that never finish their request and many event-stream clients, switched on and
  off in alternate windows of the same run. Reports the run's steps/s with and without the
  crowd (``flood.ratio``, attacked over quiet), the monitor's `/status` answers during it and
  this process's peak file-descriptor count.

Message kinds (RPC): random bytes, truncated frames, msgpack of the right shape with a field of
the wrong type or range, tensor headers declaring terabytes, unknown operations, replays with
invalid request ids, extra and missing frames. Mutations are always invalid for their field:
a well-formed request is not bad input, and the fuzzer does not impersonate the run's own
processes (loopback peers are the run's processes; cross-node transport is authenticated).

Prints one JSON line: ``messages``, ``crashes``, ``valid_requests_failed``, ``peak_rss_mb`` and
a breakdown per endpoint.

    python -m bench.fuzz [--quick] [--endpoint controller,store,worker,monitor,flood]
                         [--messages N] [--flood SLOW,STREAMS] [--flood-rounds R]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgpack
import psutil
import zmq
import zmq.asyncio

from flowrl.controller import Controller
from flowrl.logs import configure
from flowrl.pipeline import PipelineSpec, PoolSpec, grpo_stages
from flowrl.recipe import MonitorConfig
from transport.codec import decode, encode
from transport.endpoints import ipc_endpoint, remove_run_dir, run_dir
from transport.errors import RemoteError, TransportError, UnknownOperation
from transport.rpc import RpcClient

ENDPOINTS: Final = ("controller", "store", "worker", "monitor", "flood")
FULL_MESSAGES: Final = 100_000
QUICK_MESSAGES: Final = 1_500

# Modelled costs small enough that steps keep coming while the fuzzer runs.
FAST: Final = {
    "prompt_len": 8, "max_new_tokens": 64, "log_mean": 2.5, "log_sigma": 0.8,
    "rollout_base_s": 0.002, "rollout_token_s": 0.0002, "reward_token_s": 0.0,
    "reference_token_s": 0.0, "train_token_s": 0.00002, "train_step_s": 0.005,
    "weight_numel": 1024,
}
GROUP: Final = 4
GROUPS_PER_STEP: Final = 4
# Requests in flight per fuzzing socket: enough to keep the server busy, few enough that its
# replies never reach the high-water mark (a dropped reply would look like a hang here).
WINDOW: Final = 64
VALID_EVERY: Final = 50  # one valid request per this many malformed ones
REPLY_WAIT_S: Final = 10.0


def sim_spec() -> PipelineSpec:
    return PipelineSpec(
        stages=grpo_stages(group_size=GROUP, train_micro_groups=2),
        pools=(PoolSpec("rollout", count=2, per_process=2), PoolSpec("reward", count=1),
               PoolSpec("train", count=1)),
        group_size=GROUP, groups_per_step=GROUPS_PER_STEP, max_staleness=1,
        engine="sim", engine_config=FAST, store_capacity_bytes=64 << 20,
        heartbeat_s=0.5, heartbeat_timeout_s=10.0,
    )


# ---- memory ---------------------------------------------------------------------------------


def rss_mb(pid: int) -> float:
    rss: int = psutil.Process(pid).memory_info().rss
    return rss / 2**20


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident set (VmHWM), or its current one where that is unknown."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return rss_mb(pid)


@dataclass
class Figures:
    """What one endpoint went through."""

    messages: int = 0
    valid_requests: int = 0
    valid_requests_failed: int = 0
    crashes: int = 0
    peak_rss_mb: float = 0.0
    rss_start_mb: float = 0.0
    rss_end_mb: float = 0.0
    wall_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("peak_rss_mb", "rss_start_mb", "rss_end_mb", "wall_s"):
            out[key] = round(out[key], 2)
        out["rss_growth_mb"] = round(self.rss_end_mb - self.rss_start_mb, 2)
        return out


# ---- the message generator -------------------------------------------------------------------


_EXT_TENSOR: Final = 1
_INT_EDGES: Final = (-1, 0, 1, -(2**63), 2**63 - 1, 2**64 - 1, 2**31, -(2**31) - 1)
_FLOAT_EDGES: Final = (math.nan, math.inf, -math.inf, -0.0, 1e308, -1e308, 5e-324)


class Gen:
    """Random malformed messages (seeded: a run is reproducible).

    `templates` maps each operation to a request payload that is harmless when it does reach
    its handler (ids that name nothing); `harmless` lists the operations whose template may be
    sent unmutated (under a bad request id the server must refuse it before any handler).
    """

    def __init__(self, seed: int, templates: dict[str, Any], harmless: set[str]) -> None:
        self.rng = random.Random(seed)
        self.templates = templates
        self.harmless = harmless
        self.ops = sorted(templates)

    # -- values

    def text(self, n: int | None = None) -> str:
        r = self.rng
        n = r.choice((0, 1, 8, 64, 4096)) if n is None else n
        alphabet = "abc/\\.\0\n\"'%{}é\u202e\U0001f600"
        return "".join(r.choice(alphabet) for _ in range(n))

    def blob(self, n: int | None = None) -> bytes:
        r = self.rng
        n = r.choice((0, 1, 7, 64, 300, 4096)) if n is None else n
        return r.randbytes(n)

    def tensor_ext(self) -> msgpack.ExtType:
        """A tensor header: a bad one, or one declaring terabytes."""
        r = self.rng
        kind = r.choice((0, 1, 2, -1, "torch"))
        dtype = r.choice(("float32", "bfloat16", "complex64", "", 7, None))
        shape = r.choice(([1 << 40, 1 << 20], [2**62], [-1], [3, "4"], [1] * 40, "big", [],
                          [0, 1 << 62]))
        frame = r.choice((1, 0, -1, 2, 99, "1", None))
        desc: Any = [kind, dtype, shape, frame]
        if r.random() < 0.2:
            desc = desc[: r.randrange(4)]
        data = msgpack.packb(desc) if r.random() < 0.9 else self.blob(9)
        return msgpack.ExtType(r.choice((_EXT_TENSOR, _EXT_TENSOR, 0, 2, 127)), data)

    def value(self, depth: int = 0) -> Any:
        r = self.rng
        pick = r.randrange(11 if depth < 3 else 8)
        if pick == 0:
            return None
        if pick == 1:
            return r.choice((True, False))
        if pick == 2:
            return r.choice(_INT_EDGES) if r.random() < 0.5 else r.randrange(-1000, 1000)
        if pick == 3:
            return r.choice(_FLOAT_EDGES) if r.random() < 0.5 else r.uniform(-1e6, 1e6)
        if pick == 4:
            return self.text()
        if pick == 5:
            return self.blob()
        if pick == 6:
            return self.tensor_ext()
        if pick == 7:
            return msgpack.ExtType(r.randrange(128), self.blob(r.randrange(20)))
        if pick == 8:
            return [self.value(depth + 1) for _ in range(r.randrange(6))]
        if pick == 9:
            return {self.key(): self.value(depth + 1) for _ in range(r.randrange(6))}
        return {self.value(3): self.value(depth + 1) for _ in range(r.randrange(3))}

    def key(self) -> Any:
        r = self.rng
        if r.random() < 0.8:
            return r.choice(("worker_id", "task_id", "pid", "size", "x", "", "handles"))
        return self.value(3)

    def bad(self, good: Any) -> Any:
        """A value that is invalid where `good` is expected: another type, or out of range."""
        r = self.rng
        if type(good) is int and r.random() < 0.5:
            return r.choice((-1, -(2**63), 2**64 - 1, -7, 0, True))
        if type(good) is float and r.random() < 0.5:
            return r.choice((math.nan, math.inf, -math.inf, -1.0, 1e308))
        if isinstance(good, list) and good and r.random() < 0.5:
            return [self.bad(good[0]), *good[1:]]
        if isinstance(good, dict) and good and r.random() < 0.5:
            return self.mutate(good)
        while True:
            v = self.value(1)
            if type(v) is not type(good) and not (type(good) is float and type(v) is int):
                return v

    def mutate(self, template: Any) -> Any:
        """`template` with one field made invalid, one removed, or a junk one added."""
        r = self.rng
        if not isinstance(template, dict) or not template:
            return self.bad(template)
        out = dict(template)
        key = r.choice(sorted(out))
        action = r.random()
        if action < 0.8:
            out[key] = self.bad(out[key])
        elif action < 0.9:
            del out[key]
        else:
            out[key] = self.bad(out[key])
            out[self.text(8)] = self.value(1)
        return out

    # -- requests

    def rid(self) -> int:
        return self.rng.randrange(1 << 20)

    def bad_rid(self) -> Any:
        r = self.rng
        return r.choice(("1", 1.0, None, True, [1], {"id": 1}, b"\x01", self.tensor_ext()))

    def request(self) -> tuple[str, list[bytes]]:
        """One malformed request (the frames after the routing identity) and its kind."""
        r = self.rng
        kind = r.choice(("random", "truncated", "wrong_types", "wrong_types", "huge",
                         "unknown_op", "bad_id", "frames", "envelope"))
        op = r.choice(self.ops)
        tpl = self.templates[op]
        if kind == "random":
            frames = [self.blob() for _ in range(r.choice((1, 1, 1, 2, 5)))]
        elif kind == "truncated":
            whole = _packed(encode([self.rid(), op, {"t": _small_tensor(), "p": tpl}]))
            frames = [whole[0][: r.randrange(max(1, len(whole[0])))], *whole[1:]]
            if r.random() < 0.5 and len(frames) > 1:
                frames[1] = frames[1][: r.randrange(len(frames[1]))]
        elif kind == "wrong_types":
            payload = self.mutate(tpl) if r.random() < 0.8 else self.value()
            frames = [msgpack.packb([self.rid(), op, payload], use_bin_type=True)]
        elif kind == "huge":
            payload = self.mutate(tpl) if isinstance(tpl, dict) else {}
            payload = dict(payload) if isinstance(payload, dict) else {}
            payload[r.choice(sorted(payload) or ["x"])] = self.tensor_ext()
            frames = [msgpack.packb([self.rid(), op, payload], use_bin_type=True), b"\0" * 64]
            if r.random() < 0.3:  # a msgpack container that declares billions of items
                frames = [b"\x93" + msgpack.packb(self.rid()) + b"\xdd\xff\xff\xff\xff"]
        elif kind == "unknown_op":
            name = r.choice((self.text(), "", "__init__", "_handlers", op.upper(), op + "\0",
                             self.value(1)))
            frames = [msgpack.packb([self.rid(), name, tpl], use_bin_type=True)]
        elif kind == "bad_id":
            payload = tpl if op in self.harmless else self.mutate(tpl)
            frames = [msgpack.packb([self.bad_rid(), op, payload], use_bin_type=True)]
        elif kind == "frames":
            good = _packed(encode([self.rid(), op, {"t": _small_tensor(), "p": self.mutate(tpl)}]))
            if r.random() < 0.5:
                frames = [good[0]]  # the tensor's frame is missing
            else:
                frames = [*good, *(self.blob(16) for _ in range(r.randrange(1, 4)))]
        else:  # envelope: not [id, op, payload]
            frames = [msgpack.packb(r.choice((
                [self.rid(), op], [self.rid(), op, tpl, 1], {"op": op}, op, self.rid(), [],
                [[self.rid()], op, tpl])), use_bin_type=True)]
        return kind, frames


def _small_tensor() -> Any:
    import torch

    return torch.arange(8, dtype=torch.float32)


def _packed(frames: list[bytes | memoryview]) -> list[bytes]:
    return [bytes(f) for f in frames]


# ---- fuzzing an RPC server -------------------------------------------------------------------


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
    }
    harmless = {"heartbeat", "get_task", "task_done", "task_failed", "served", "bye"}
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


# ---- fuzzing the monitor over HTTP -----------------------------------------------------------


_STATIC_OK: Final = {"index.html", "dashboard.js", "dashboard.css"}


@dataclass
class HttpFindings:
    server_errors: int = 0  # 5xx answers
    auth_bypass: int = 0  # a control request without the token that was not refused
    traversal_leaks: int = 0  # a static path outside the shipped files that answered 200
    host_bypass: int = 0  # a read answered for a Host that is not a loopback name
    bad_event_ids: int = 0  # an /events request with a malformed id not answered 400


class HttpGen:
    """Malformed and hostile HTTP requests against the monitor."""

    def __init__(self, seed: int, host: str, port: int, token: str) -> None:
        self.rng = random.Random(seed)
        self.host = f"{host}:{port}"
        self.token = token

    def request(self) -> tuple[str, bytes]:
        r = self.rng
        kind = r.choice(("random", "method", "headers", "json", "auth", "traversal", "length",
                         "version", "host", "event_id"))
        # Every well-formed part asks the server to close after answering: the answer then
        # ends where the stream does.
        h = f"{self.host}\r\nConnection: close"
        if kind == "random":
            return kind, r.randbytes(r.choice((1, 16, 200, 4000)))
        if kind == "method":
            method = r.choice(("FOO", "get", "DELETE", "PUT", "CONNECT", "TRACE", "G\0ET",
                               "X" * 5000, ""))
            return kind, f"{method} /status HTTP/1.1\r\nHost: {h}\r\n\r\n".encode()
        if kind == "headers":
            if r.random() < 0.5:
                head = f"X-Big: {'a' * r.choice((9000, 70000))}\r\n"
            else:
                head = "".join(f"X-{i}: v\r\n" for i in range(r.choice((200, 2000))))
            return kind, f"GET /status HTTP/1.1\r\nHost: {h}\r\n{head}\r\n".encode()
        if kind == "json":
            body = r.choice((
                b"{", b"[" * 100_000 + b"]" * 100_000, b"[" * 30_000 + b"]" * 30_000,
                b'{"max_staleness": "1"}',
                b'{"max_staleness": 1e999}', b'{"max_staleness": -1}', b"null", b"\xff\xfe",
                b'{"max_staleness": ' + b"9" * 5000 + b"}", b'{"max_staleness": true}',
                b'{"max_staleness": 65}', b'{"max_staleness": NaN}', b"[]", b'"x"',
                json.dumps({"max_staleness": [1]}).encode()))
            path = r.choice(("/staleness", "/staleness", "/pause?x=1"))
            # /pause: control without the token, with a body
            auth = "" if path.startswith("/pause") else f"Authorization: Bearer {self.token}\r\n"
            return kind, (f"POST {path} HTTP/1.1\r\nHost: {h}\r\n{auth}"
                          f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                          "\r\n").encode() + body
        if kind == "auth":
            path = r.choice(("/pause", "/resume", "/stop", "/staleness"))
            auth = r.choice(("", "Authorization: Bearer\r\n", "Authorization: Bearer x\r\n",
                             f"Authorization: Basic {self.token}\r\n",
                             f"Authorization: Bearer {self.token[:-1]}\r\n",
                             f"Authorization: Bearer {self.token}x\r\n",
                             f"Authorization: bearer  {self.token[1:]}\r\n",
                             "Authorization: Bearer \u00e9\u00e9\r\n"))
            return kind, (f"POST {path} HTTP/1.1\r\nHost: {h}\r\n{auth}Content-Length: 2\r\n"
                          "\r\n{}").encode("utf-8", "surrogateescape")
        if kind == "traversal":
            path = r.choice((
                "/static/../../pyproject.toml", "/static/%2e%2e/%2e%2e/server.py",
                "/static/..%2f..%2fserver.py", "/static/..%2F__init__.py",
                "/static/%2e%2e%2f%2e%2e%2fetc%2fpasswd", "/static//etc/passwd",
                "/static/index.html%00.py", "/static/....//....//server.py",
                "/static/%252e%252e%252fserver.py", "/static/./index.html/..",
                "/static/..\\..\\server.py", "/../../../etc/passwd", "/static/",
                "/static/dashboard.js/../../server.py"))
            return kind, f"GET {path} HTTP/1.1\r\nHost: {h}\r\n\r\n".encode()
        if kind == "length":
            length = r.choice(("10000000000000", "-1", "abc", "1, 2", "99"))
            return kind, (f"POST /staleness HTTP/1.1\r\nHost: {h}\r\n"
                          f"Authorization: Bearer {self.token}\r\nContent-Length: {length}\r\n"
                          "\r\n{}").encode()
        if kind == "version":
            line = r.choice(("GET /status HTTP/9.9", "GET /status", "GET status HTTP/1.1",
                             "GET /status HTTP/1.1 extra", "GET /st atus HTTP/1.1"))
            return kind, f"{line}\r\nHost: {h}\r\n\r\n".encode()
        if kind == "event_id":
            bad = r.choice(("\u00b2", "\u0663", "\u00e9", "9" * 5000, "1" * 21, "-1", "1e3"))
            if r.random() < 0.5:
                return kind, (f"GET /events HTTP/1.1\r\nHost: {h}\r\nLast-Event-ID: {bad}\r\n"
                              "\r\n").encode()
            return kind, f"GET /events?last_id={bad} HTTP/1.1\r\nHost: {h}\r\n\r\n".encode()
        host = r.choice(("evil.example", "127.0.0.1.evil", "", "[::1", "a" * 300))
        return kind, f"GET /status HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()


async def http_exchange(host: str, port: int, raw: bytes, *, eof: bool = False,
                        ) -> tuple[int | None, bytes]:
    """Send `raw` on a fresh connection (then end it if `eof`: for requests that are
    incomplete on purpose); the answer's status (None when the server closed without one) and
    body."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(raw)
        try:
            await writer.drain()
            if eof and writer.can_write_eof():
                writer.write_eof()
        except ConnectionError:
            pass
        async with asyncio.timeout(REPLY_WAIT_S):
            try:
                data = await reader.read()
            except ConnectionError:
                data = b""
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    head, _, body = data.partition(b"\r\n\r\n")
    parts = head.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        return None, b""
    return int(parts[1]), body


async def fuzz_monitor(ctl: Controller, count: int, seed: int, figures: Figures,
                       findings: HttpFindings) -> None:
    import aiohttp

    assert ctl.monitor is not None
    assert ctl.monitor_token is not None
    url = ctl.monitor_url or ""
    host, port = "127.0.0.1", int(url.rstrip("/").rsplit(":", 1)[1])
    token = ctl.monitor_token.get_secret_value()
    gen = HttpGen(seed, host, port, token)
    statics = {name: ctl.monitor._static[name][0] for name in _STATIC_OK}
    auth = {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession() as http:
        for i in range(count):
            kind, raw = gen.request()
            status, body = await http_exchange(host, port, raw,
                                               eof=kind in ("random", "length"))
            figures.messages += 1
            if status is not None and status >= 500:
                findings.server_errors += 1
                print(f"monitor answered {status} to {raw[:120]!r}", file=sys.stderr)
            if kind == "auth" and status != 401:
                findings.auth_bypass += 1
                print(f"control without the token got {status}: {raw[:120]!r}", file=sys.stderr)
            loopback_host = b"Host: [::1\r" in raw or b"Host: \r" in raw
            if kind == "host" and status == 200 and not loopback_host:
                findings.host_bypass += 1
                print(f"non-loopback Host answered: {raw[:120]!r}", file=sys.stderr)
            if kind == "event_id" and status != 400:
                findings.bad_event_ids += 1
                print(f"bad event id answered {status}: {raw[:120]!r}", file=sys.stderr)
            if kind == "traversal" and status == 200 and body not in statics.values():
                findings.traversal_leaks += 1
                print(f"traversal answered 200: {raw[:120]!r}", file=sys.stderr)
            if i % VALID_EVERY == VALID_EVERY - 1:
                figures.valid_requests += 2
                async with http.get(url + "status") as resp:
                    ok = resp.status == 200 and (await resp.json())["run_id"] == ctl.run_id
                figures.valid_requests_failed += not ok
                keep = {"max_staleness": ctl.gate.max_staleness}
                async with http.post(url + "staleness", json=keep, headers=auth) as resp:
                    figures.valid_requests_failed += resp.status != 200


# ---- a crowd against the monitor (endpoint flood) --------------------------------------------


#: the crowd's process: stdlib only, so that it starts fast and costs little. It reads "on" and
#: "off" lines on stdin (clients connect / all hang up) and prints its counts on "quit".
CROWD = r"""
import asyncio, json, sys
host, port, n_slow, n_streams = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
stats = {"connections": 0, "closed_by_monitor": 0, "busy_503": 0, "streams_served": 0,
         "stream_bytes": 0}

async def slowloris(i):
    # A request head that never ends: one more header line a second, until the monitor hangs up.
    while True:
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            await asyncio.sleep(0.5)
            continue
        stats["connections"] += 1
        try:
            writer.write(b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            while True:
                try:
                    async with asyncio.timeout(1.0):
                        got = await reader.read(256)
                except TimeoutError:
                    writer.write(b"X-%d: a\r\n" % i)
                    continue
                if got.startswith(b"HTTP/1.1 503"):
                    stats["busy_503"] += 1
                elif not got:
                    stats["closed_by_monitor"] += 1
                break
        except OSError:
            stats["closed_by_monitor"] += 1
        finally:
            writer.close()
        await asyncio.sleep(0.2)

async def stream(i):
    # An event-stream client that reads everything, and comes back at once when refused.
    while True:
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            await asyncio.sleep(0.5)
            continue
        stats["connections"] += 1
        try:
            writer.write(b"GET /events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            head = await reader.readuntil(b"\r\n\r\n")
            if head.startswith(b"HTTP/1.1 200"):
                stats["streams_served"] += 1
                while chunk := await reader.read(65536):
                    stats["stream_bytes"] += len(chunk)
            else:
                stats["busy_503"] += 1
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()
        stats["closed_by_monitor"] += 1
        await asyncio.sleep(0.5)

async def main():
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    tasks = []
    while line := (await stdin.readline()).strip():
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks)
        tasks = []
        if line == b"on":
            tasks = [asyncio.ensure_future(slowloris(i)) for i in range(n_slow)]
            tasks += [asyncio.ensure_future(stream(i)) for i in range(n_streams)]
        elif line == b"quit":
            break
        print("ok", flush=True)
    print(json.dumps(stats), flush=True)

asyncio.run(main())
"""
FLOOD_SLOW: Final = 1000
FLOOD_STREAMS: Final = 300
FLOOD_ROUNDS: Final = 3
FLOOD_WINDOW_S: Final = 6.0


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def flood_monitor(ctl: Controller, figures: Figures, slow: int, streams: int,
                        rounds: int) -> dict[str, Any]:
    """Alternate quiet and attacked windows (quiet first); in each, the run's steps/s and, in
    the attacked ones, `/status` polled twice a second (each answer must be 200)."""
    import aiohttp

    url = ctl.monitor_url or ""
    port = url.rstrip("/").rsplit(":", 1)[1]
    crowd = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CROWD, "127.0.0.1", port, str(slow), str(streams),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    stdin, stdout = crowd.stdin, crowd.stdout
    assert stdin is not None
    assert stdout is not None
    rates: dict[str, list[float]] = {"quiet": [], "attacked": []}
    # CPU seconds a second of this process (the controller and its monitor) and of the crowd.
    cpu: dict[str, list[float]] = {"controller_attacked": [], "controller_quiet": [],
                                   "crowd_attacked": []}
    me, them = psutil.Process(), psutil.Process(crowd.pid)
    latencies: list[float] = []
    peak_fds = open_fds()

    async def say(line: bytes) -> None:
        stdin.write(line + b"\n")
        await stdin.drain()
        async with asyncio.timeout(60):
            await stdout.readline()

    try:
        async with aiohttp.ClientSession() as http:
            for window in range(2 * rounds):
                attacked = window % 2 == 1
                await say(b"on" if attacked else b"off")
                v0, t0 = ctl.version, time.perf_counter()
                c0, k0 = sum(me.cpu_times()[:2]), sum(them.cpu_times()[:2])
                while (left := FLOOD_WINDOW_S - (time.perf_counter() - t0)) > 0:
                    await asyncio.sleep(min(0.5, left))
                    peak_fds = max(peak_fds, open_fds())
                    if not attacked:
                        continue
                    figures.valid_requests += 1
                    t = time.perf_counter()
                    try:
                        async with asyncio.timeout(REPLY_WAIT_S), http.get(url + "status") as r:
                            ok = r.status == 200 and (await r.json())["run_id"] == ctl.run_id
                    except (aiohttp.ClientError, TimeoutError) as exc:
                        ok = False
                        print(f"/status under the crowd failed: {exc!r}", file=sys.stderr)
                    latencies.append((time.perf_counter() - t) * 1e3)
                    figures.valid_requests_failed += not ok
                wall = time.perf_counter() - t0
                rates["attacked" if attacked else "quiet"].append((ctl.version - v0) / wall)
                side = "attacked" if attacked else "quiet"
                cpu[f"controller_{side}"].append((sum(me.cpu_times()[:2]) - c0) / wall)
                if attacked:
                    cpu["crowd_attacked"].append((sum(them.cpu_times()[:2]) - k0) / wall)
            await say(b"off")
            stdin.write(b"quit\n")
            await stdin.drain()
            async with asyncio.timeout(30):
                counts = json.loads((await stdout.readline()).decode())
                await crowd.wait()
    finally:
        if crowd.returncode is None:
            crowd.kill()
            await crowd.wait()
    figures.messages = counts["connections"]
    quiet = statistics.median(rates["quiet"])
    attacked = statistics.median(rates["attacked"])
    assert ctl.monitor is not None
    return {"slowloris": slow, "streams": streams, "rounds": rounds,
            "window_s": FLOOD_WINDOW_S,
            "steps_per_s_quiet": [round(x, 2) for x in rates["quiet"]],
            "steps_per_s_attacked": [round(x, 2) for x in rates["attacked"]],
            "ratio": round(attacked / quiet, 3) if quiet else None,
            "status_p50_ms": round(statistics.median(latencies), 1) if latencies else None,
            "status_max_ms": round(max(latencies), 1) if latencies else None,
            "peak_fds": peak_fds, "crowd": counts,
            "cpu_per_s": {k: round(statistics.median(v), 2) for k, v in cpu.items() if v},
            "load_avg_1m": round(os.getloadavg()[0], 1),
            "monitor_limits": {"max_connections": ctl.monitor.config.max_connections,
                               "max_event_streams": ctl.monitor.config.max_event_streams}}


# ---- the controller run (endpoints controller, store, monitor) -------------------------------


def _node_agent_pid() -> int:
    for child in psutil.Process().children(recursive=True):
        try:
            if "flowrl.node" in child.cmdline():
                return int(child.pid)
        except psutil.NoSuchProcess:
            continue
    raise RuntimeError("no node agent process found")


async def fuzz_run(endpoints: list[str], count: int, seed: int,
                   flood: tuple[int, int, int] = (FLOOD_SLOW, FLOOD_STREAMS, FLOOD_ROUNDS),
                   ) -> dict[str, Any]:
    """One real simulated run, fuzzed endpoint by endpoint while it goes on; then stopped and
    its accounting checked. `flood`: slowloris connections, event streams, rounds."""
    out: dict[str, Any] = {}
    me = os.getpid()
    monitor = MonitorConfig() if {"monitor", "flood"} & set(endpoints) else None
    ctx = zmq.asyncio.Context()
    try:
        async with Controller(sim_spec(), monitor=monitor) as ctl:
            run = asyncio.ensure_future(ctl.run(steps=10**6))
            await ctl.wait_for(lambda: ctl.version >= 1)
            version0 = ctl.version
            node_pid = _node_agent_pid()
            for name in endpoints:
                fig = Figures()
                pid = node_pid if name == "store" else me
                fig.rss_start_mb = rss_mb(pid)
                t0 = time.perf_counter()
                if name == "controller":
                    templates, harmless = controller_templates()
                    await fuzz_rpc(ctl.workforce.endpoints.controller,
                                   Gen(seed, templates, harmless), count, controller_valid(),
                                   fig, ctx)
                    # No malformed registration was taken for a worker.
                    fig.valid_requests += 1
                    if len(ctl.registry) != sum(p.count for p in ctl.spec.pools):
                        fig.valid_requests_failed += 1
                        print(f"registry holds {len(ctl.registry)} workers", file=sys.stderr)
                elif name == "store":
                    templates, harmless = store_templates(ctl.run_id, me)
                    await fuzz_rpc(ctl.workforce.endpoints.store,
                                   Gen(seed + 1, templates, harmless), count,
                                   store_valid(ctl.run_id, node_pid), fig, ctx)
                    fig.crashes += not psutil.Process(node_pid).is_running()
                elif name == "flood":
                    out["flood_report"] = await flood_monitor(ctl, fig, *flood)
                else:
                    findings = HttpFindings()
                    await fuzz_monitor(ctl, count, seed + 2, fig, findings)
                    out.setdefault("monitor_findings", asdict(findings))
                fig.wall_s = time.perf_counter() - t0
                fig.rss_end_mb = rss_mb(pid)
                fig.peak_rss_mb = peak_rss_mb(pid)
                out[name] = fig
            progressed = ctl.version - version0
            ctl.stop()
            async with asyncio.timeout(60):
                await run
    finally:
        ctx.destroy(linger=0)
    # Counted once the controller has closed: the step being trained when `stop` came still
    # commits after `run` returned (its rows are trained, not dropped), so the run's summary
    # may be one step behind the controller's final state.
    status = ctl.status()
    steps = ctl.version
    accounting = {
        "steps": steps,
        "steps_during_fuzz": progressed,
        "samples": status["samples_trained"],
        "rows_trained": ctl.rows_trained,
        "rows_trained_twice": ctl.rows_trained_twice,
        "stale_dropped": ctl.stale_dropped,
        "worker_deaths": status["worker_deaths"],
        "restarts": status["restarts"],
        "errors": len(status["errors"]),
    }
    ok = (steps == len(ctl.step_log) and progressed > 0
          and all(e["samples"] == GROUP * GROUPS_PER_STEP for e in ctl.step_log)
          and status["samples_trained"] == steps * GROUP * GROUPS_PER_STEP == ctl.rows_trained
          and ctl.rows_trained_twice == 0 and status["worker_deaths"] == 0
          and status["restarts"] == 0 and not status["errors"])
    accounting["ok"] = ok
    out["run"] = accounting
    if not ok:  # the run is the valid traffic of the controller and store endpoints
        for name in ("controller", "store"):
            if name in out:
                out[name].valid_requests_failed += 1
        print(f"run accounting wrong: {accounting}", file=sys.stderr)
    return out


# ---- the worker against a hostile controller ---------------------------------------------------


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
        await self.router.send_multipart([ident, *_packed(encode([rid, status, body]))])

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
        fields = report.get("fields", {})
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


def worker_argv(run_id: str, hostile: HostileController, store_ep: str) -> list[str]:
    from flowrl.worker_launch import worker_command
    from flowrl.worker_spec import Endpoints, ProcessSpec, WorkerSpec

    return worker_command(WorkerSpec(
        process=ProcessSpec(name="rollout.0", role="rollout", count=1, capacity=4, threads=1,
                            seed=0, heartbeat_s=0.05, weight_sync_timeout_s=60.0,
                            engine="sim", sim=FAST),
        endpoints=Endpoints(run_id=run_id, node="node0", controller=hostile.rpc_ep,
                            broadcast=hostile.pub_ep, store=store_ep)))


async def fuzz_worker(count: int, seed: int) -> dict[str, Any]:
    from transport.endpoints import new_run_id
    from transport.handles import Handle
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
                [Handle.from_wire(h) for h in handles if isinstance(h, list)])
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


# ---- main ------------------------------------------------------------------------------------


async def main_async(endpoints: list[str], count: int, seed: int,
                     flood: tuple[int, int, int] = (FLOOD_SLOW, FLOOD_STREAMS, FLOOD_ROUNDS),
                     ) -> dict[str, Any]:
    t0 = time.perf_counter()
    results: dict[str, Any] = {}
    in_run = [e for e in endpoints if e != "worker"]
    if in_run:
        results.update(await fuzz_run(in_run, count, seed, flood))
    if "worker" in endpoints:
        results.update(await fuzz_worker(count, seed + 3))
    figures = {e: results.pop(e) for e in endpoints}
    return {
        "bench": "fuzz",
        "messages_per_endpoint": count,
        "messages": sum(f.messages for f in figures.values()),
        "crashes": sum(f.crashes for f in figures.values()),
        "valid_requests_failed": sum(f.valid_requests_failed for f in figures.values()),
        "peak_rss_mb": round(max(f.peak_rss_mb for f in figures.values()), 1),
        "endpoints": {e: f.as_dict() for e, f in figures.items()},
        **results,
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.fuzz", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK_MESSAGES} messages per endpoint instead of {FULL_MESSAGES}")
    p.add_argument("--messages", type=int, default=None, help="messages per endpoint")
    p.add_argument("--endpoint", default=",".join(ENDPOINTS),
                   help=f"comma-separated subset of {','.join(ENDPOINTS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--flood", default=f"{FLOOD_SLOW},{FLOOD_STREAMS}", metavar="SLOW,STREAMS",
                   help="the flood's slowloris connections and event-stream clients")
    p.add_argument("--flood-rounds", type=int, default=FLOOD_ROUNDS,
                   help=f"quiet and attacked windows of {FLOOD_WINDOW_S:g} s each")
    args = p.parse_args(argv)
    try:
        slow, streams = (int(n) for n in args.flood.split(","))
    except ValueError:
        p.error("--flood takes two integers: SLOW,STREAMS")
    endpoints = [e for e in args.endpoint.split(",") if e]
    unknown = set(endpoints) - set(ENDPOINTS)
    if unknown:
        p.error(f"unknown endpoint(s) {sorted(unknown)}")
    count = args.messages or (QUICK_MESSAGES if args.quick else FULL_MESSAGES)
    configure(level="error")
    flood = (slow, streams, args.flood_rounds)
    print(json.dumps(asyncio.run(main_async(endpoints, count, args.seed, flood))), flush=True)


if __name__ == "__main__":
    main()
