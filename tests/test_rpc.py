"""RPC: concurrency, deadlines, remote errors, hostile peers, a real server process, close."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio

from transport._zsocket import AsyncSocket, new_socket
from transport.codec import decode, encode
from transport.endpoints import ipc_endpoint
from transport.errors import (
    ClosedError,
    DeadlineExceeded,
    MessageTooLarge,
    Overloaded,
    RemoteError,
    UnknownOperation,
)
from transport.rpc import REJECTED, Parked, RpcClient, RpcServer

pytestmark = pytest.mark.timeout(60)

STEP = 20.0  # bound on any single wait in these tests


class Service:
    """Handlers with observable behaviour."""

    def __init__(self) -> None:
        self.never = asyncio.Event()
        self.entered = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.peers: list[bytes] = []

    async def echo(self, payload: Any, peer: bytes) -> Any:
        self.peers.append(peer)
        return payload

    async def double(self, payload: Any, peer: bytes) -> Any:
        await asyncio.sleep(0)  # suspends once, so calls interleave
        return {"id": payload["id"], "t": payload["t"] * 2}

    async def fail(self, payload: Any, peer: bytes) -> Any:
        raise ValueError(f"bad input {payload!r}")

    async def hang(self, payload: Any, peer: bytes) -> Any:
        self.entered.set()
        try:
            await self.never.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return "late"

    async def unencodable(self, payload: Any, peer: bytes) -> Any:
        return {1, 2}

    async def zeros(self, payload: Any, peer: bytes) -> Any:
        return torch.zeros(payload, dtype=torch.uint8)

    async def inner_cancel(self, payload: Any, peer: bytes) -> Any:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        fut.cancel()  # something the handler awaits is cancelled; the server is not closing
        await fut

    def handlers(self) -> dict[str, Any]:
        return {
            name: getattr(self, name)
            for name in ("echo", "double", "fail", "hang", "unencodable", "zeros", "inner_cancel")
        }


@pytest.fixture
def service() -> Service:
    return Service()


@pytest.fixture
async def server(
    service: Service, run_id: str, zmq_ctx: zmq.asyncio.Context
) -> AsyncIterator[RpcServer]:
    async with RpcServer(ipc_endpoint(run_id, "rpc"), service.handlers(), ctx=zmq_ctx) as srv:
        yield srv
    assert srv.statistics().in_flight == 0


@pytest.fixture
async def client(server: RpcServer, zmq_ctx: zmq.asyncio.Context) -> AsyncIterator[RpcClient]:
    async with RpcClient(server.endpoint, ctx=zmq_ctx, timeout=STEP, identity=b"c1") as c:
        yield c


async def test_call_returns_the_handler_result_with_tensors(
    client: RpcClient, service: Service
) -> None:
    payload = {"t": torch.arange(5000, dtype=torch.bfloat16), "nested": [1, "two", None]}
    out = await client.call("echo", payload)
    assert torch.equal(out["t"], torch.arange(5000, dtype=torch.bfloat16))
    assert out["nested"] == [1, "two", None]
    assert service.peers == [b"c1"]


async def test_a_thousand_concurrent_calls_on_one_socket(client: RpcClient) -> None:
    async def one(i: int) -> None:
        out = await client.call("double", {"id": i, "t": torch.full((3,), float(i))})
        assert out["id"] == i
        assert torch.equal(out["t"], torch.full((3,), 2.0 * i))

    async with asyncio.timeout(STEP):
        await asyncio.gather(*(one(i) for i in range(1000)))
    stats = client.statistics()
    assert (stats.calls, stats.in_flight, stats.late_replies) == (1000, 0, 0)


async def test_handler_exception_becomes_remote_error(client: RpcClient) -> None:
    with pytest.raises(RemoteError) as info:
        await client.call("fail", 7)
    assert info.value.kind == "ValueError"
    assert info.value.message == "bad input 7"
    with pytest.raises(RemoteError) as info:
        await client.call("unencodable")
    assert info.value.kind == "TypeError"
    with pytest.raises(RemoteError) as info:
        await client.call("inner_cancel")
    assert info.value.kind == "CancelledError"
    assert await client.call("echo", "still serving") == "still serving"


async def test_unknown_operation(client: RpcClient, server: RpcServer) -> None:
    with pytest.raises(UnknownOperation, match="nope"):
        await client.call("nope")
    assert await client.call("echo", 1) == 1


async def test_deadline_fires_late_reply_is_discarded_and_counted(
    client: RpcClient, server: RpcServer, service: Service
) -> None:
    with pytest.raises(DeadlineExceeded):
        await client.call("hang", timeout=0.2)
    assert client.statistics().in_flight == 0
    assert await client.call("echo", "after") == "after"  # the server still serves
    service.never.set()  # the hung handler now replies, to a call that gave up
    async with asyncio.timeout(STEP):
        # Replies to this client arrive in order: each round trip flushes earlier replies.
        while client.statistics().late_replies == 0:
            assert await client.call("echo", 0) == 0
    assert client.statistics().late_replies == 1


async def test_malformed_requests_get_error_replies_and_the_server_survives(
    service: Service, run_id: str, zmq_ctx: zmq.asyncio.Context
) -> None:
    server_limit = 1 << 20
    server = RpcServer(
        ipc_endpoint(run_id, "m"), service.handlers(), ctx=zmq_ctx, max_bytes=server_limit
    )
    await server.start()
    client = RpcClient(server.endpoint, ctx=zmq_ctx, timeout=STEP)
    raw = zmq_ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(server.endpoint)
    tensor_header = bytes(encode(torch.zeros(4))[0])
    bad: list[tuple[list[bytes], int | None]] = [  # (frames, request id the reply carries)
        ([b"\xc1random"], None),
        ([b""], None),
        ([msgpack.packb("not a list")], None),
        ([msgpack.packb([1, 2])], None),
        ([msgpack.packb(["id", "echo", None])], None),
        ([msgpack.packb([True, "echo", None])], None),
        ([msgpack.packb([5, 42, None])], 5),
        ([tensor_header], None),  # declares a frame that is missing
        ([tensor_header, b"\x00" * 3], None),  # a frame shorter than declared
        ([msgpack.packb([6, "echo", None]), b"unreferenced"], 6),
    ]
    try:
        for frames, expected_id in bad:
            await raw.send_multipart(frames)
            async with asyncio.timeout(STEP):
                reply = decode(await raw.recv_multipart(copy=False))
            assert reply[:2] == [expected_id, REJECTED], frames
            kind, message = reply[2]
            assert kind == "MalformedMessage"
            assert message
        # A frame past the limit makes zmq drop the sender's connection; others are unaffected.
        await raw.send_multipart([b"\x00" * (server_limit + 1)])
    finally:
        raw.close()
    try:
        assert await client.call("echo", "alive") == "alive"
        assert server.statistics().rejected == len(bad)
    finally:
        await client.aclose()
        await server.aclose()


async def test_size_limits_on_both_sides(
    service: Service, run_id: str, zmq_ctx: zmq.asyncio.Context
) -> None:
    limit = 64 << 10
    endpoint = ipc_endpoint(run_id, "small")
    async with (
        RpcServer(endpoint, service.handlers(), ctx=zmq_ctx, max_bytes=limit) as server,
        RpcClient(server.endpoint, ctx=zmq_ctx, timeout=STEP) as big,
        RpcClient(server.endpoint, ctx=zmq_ctx, timeout=STEP, max_bytes=limit) as small,
    ):
        half = torch.zeros(limit // 2, dtype=torch.uint8)
        with pytest.raises(MessageTooLarge):  # refused before sending
            await small.call("echo", [half, half])
        with pytest.raises(MessageTooLarge, match="server rejected"):  # each frame fits
            await big.call("echo", [half, half])
        with pytest.raises(RemoteError) as info:  # the reply would not fit
            await small.call("zeros", limit)
        assert info.value.kind == "MessageTooLarge"
        assert torch.equal(await small.call("echo", half[:10]), half[:10])


async def test_in_flight_handlers_are_bounded(run_id: str, zmq_ctx: zmq.asyncio.Context) -> None:
    gate = asyncio.Event()
    full = asyncio.Event()
    active = 0
    peak = 0

    async def slow(payload: Any, peer: bytes) -> Any:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        if active == 4:
            full.set()
        await gate.wait()
        active -= 1
        return payload

    async with (
        RpcServer(ipc_endpoint(run_id, "b"), {"slow": slow}, ctx=zmq_ctx, max_in_flight=4) as srv,
        RpcClient(srv.endpoint, ctx=zmq_ctx, timeout=STEP) as client,
    ):
        calls = [asyncio.ensure_future(client.call("slow", i)) for i in range(50)]
        async with asyncio.timeout(STEP):
            await full.wait()
            assert srv.statistics().in_flight == 4
            gate.set()
            assert await asyncio.gather(*calls) == list(range(50))
    assert peak == 4


@pytest.mark.timeout(120)
async def test_long_polls_cannot_starve_other_ops(
    run_id: str, zmq_ctx: zmq.asyncio.Context
) -> None:
    # One client holds more long polls open than the whole ordinary budget (1024): before long
    # polls had budgets of their own, the server stopped reading and heartbeats went unanswered.
    release = asyncio.Event()
    entered = asyncio.Condition()
    waiting = 0
    cancelled = 0

    async def poll(payload: Any, peer: bytes) -> Any:
        nonlocal waiting, cancelled
        async with entered:
            waiting += 1
            entered.notify_all()
        try:
            await release.wait()
        except asyncio.CancelledError:
            cancelled += 1
            raise
        return payload

    async def heartbeat(payload: Any, peer: bytes) -> Any:
        return payload

    async def polls_waiting(n: int) -> None:
        async with entered:
            await entered.wait_for(lambda: waiting == n)

    server = RpcServer(ipc_endpoint(run_id, "lp"), {"poll": poll, "heartbeat": heartbeat},
                       ctx=zmq_ctx, long_polls={"poll"})
    await server.start()
    greedy = RpcClient(server.endpoint, ctx=zmq_ctx, timeout=STEP * 3, identity=b"greedy")
    other = RpcClient(server.endpoint, ctx=zmq_ctx, timeout=STEP, identity=b"other")
    try:
        polls = [asyncio.ensure_future(greedy.call("poll", i)) for i in range(1100)]
        async with asyncio.timeout(STEP * 2):
            await polls_waiting(1024)
            # The excess is answered at once, with the reason, rather than left hanging.
            for excess in polls[1024:]:
                with pytest.raises(Overloaded, match="already has 1024 long polls open"):
                    await excess
            # Other ops are still read and answered, from the same peer and from another one.
            assert await greedy.call("heartbeat", "same", timeout=STEP) == "same"
            assert await other.call("heartbeat", "other", timeout=STEP) == "other"
            # Another peer's long polls have their own allowance.
            theirs = asyncio.ensure_future(other.call("poll", "theirs"))
            await polls_waiting(1025)
            stats = server.statistics()
            assert (stats.long_polls, stats.overloaded, stats.in_flight) == (1025, 76, 0)
            release.set()
            assert await asyncio.gather(*polls[:1024], theirs) == [*range(1024), "theirs"]
            # Closing with long polls open cancels them all: no task outlives the server.
            release.clear()
            held = [asyncio.ensure_future(greedy.call("poll", i)) for i in range(100)]
            await polls_waiting(1125)
            await server.aclose()
            assert cancelled == 100
            assert server.statistics().long_polls == 0
            await greedy.aclose()
            for call in held:
                with pytest.raises(ClosedError):
                    await call
        assert asyncio.all_tasks() == {asyncio.current_task()}
    finally:
        await server.aclose()
        await greedy.aclose()
        await other.aclose()


async def test_a_handler_may_answer_at_once_with_no_task(
    run_id: str, zmq_ctx: zmq.asyncio.Context
) -> None:
    # A plain function's reply (or error) is sent from the request's read; a long poll that
    # finds its answer waiting holds no poll open; one that must wait returns an awaitable.
    waiting: list[str] = ["ready"]
    entered, arrived = asyncio.Event(), asyncio.Event()
    tasks_seen: list[asyncio.Task[Any] | None] = []

    def now(payload: Any, peer: bytes) -> Any:
        tasks_seen.append(asyncio.current_task())
        if payload == "bad":
            raise ValueError("bad input, said at once")
        return {"got": payload}

    def poll(payload: Any, peer: bytes) -> Any:
        if waiting:
            return waiting.pop()

        async def later() -> str:
            entered.set()
            await arrived.wait()
            return waiting.pop()
        return later()

    async with (
        RpcServer(ipc_endpoint(run_id, "now"), {"now": now, "poll": poll}, ctx=zmq_ctx,
                  long_polls={"poll"}, max_long_polls_per_peer=1) as srv,
        RpcClient(srv.endpoint, ctx=zmq_ctx, timeout=STEP) as client,
    ):
        assert await client.call("now", 7) == {"got": 7}
        with pytest.raises(RemoteError, match="bad input, said at once"):
            await client.call("now", "bad")
        assert tasks_seen == [None, None]  # run from the read, not in a task of its own
        # Answered at once: no poll stays open, so the client's one allowed poll is free.
        assert await client.call("poll", None) == "ready"
        assert srv.statistics().long_polls == 0
        held = asyncio.ensure_future(client.call("poll", None))
        async with asyncio.timeout(STEP):
            await entered.wait()
        assert srv.statistics().long_polls == 1
        with pytest.raises(Overloaded, match="already has 1 long polls open"):
            await client.call("poll", None)  # its one poll is open, waiting
        waiting.append("later")
        arrived.set()
        assert await held == "later"
        stats = srv.statistics()
        assert (stats.long_polls, stats.in_flight, stats.handler_errors) == (0, 0, 1)


async def test_a_parked_poll_is_answered_later_or_expires_with_no_task(
    run_id: str, zmq_ctx: zmq.asyncio.Context
) -> None:
    # A long poll parked by its handler is held with no task: answered once by whoever holds
    # it, or with its `expired` value at its own deadline, whatever the order of deadlines.
    parked: dict[str, Parked] = {}
    three = asyncio.Event()

    def poll(payload: Any, peer: bytes) -> Any:
        parked[payload["name"]] = p = Parked(payload["s"], expired=f"{payload['name']}: none")
        if len(parked) == 3:
            three.set()
        return p

    async with (
        RpcServer(ipc_endpoint(run_id, "park"), {"poll": poll}, ctx=zmq_ctx,
                  long_polls={"poll"}) as srv,
        RpcClient(srv.endpoint, ctx=zmq_ctx, timeout=STEP) as client,
    ):
        calls = {name: asyncio.ensure_future(client.call("poll", {"name": name, "s": s}))
                 for name, s in (("long", STEP), ("short", 0.05), ("answered", STEP))}
        async with asyncio.timeout(STEP):
            await three.wait()
        assert srv.statistics().long_polls == 3
        assert asyncio.all_tasks() == {asyncio.current_task(), *calls.values()}
        # The short one expires first, though parked after one with a later deadline.
        assert await calls["short"] == "short: none"
        assert not parked["short"].open
        assert not parked["short"].answer("too late")
        assert parked["answered"].answer({"task": 7})
        assert not parked["answered"].answer("twice")  # answered once
        assert await calls["answered"] == {"task": 7}
        assert srv.statistics().long_polls == 1
        assert parked["long"].answer("late but open")
        assert await calls["long"] == "late but open"
        assert srv.statistics().long_polls == 0


async def test_a_parked_polls_sent_callback_comes_after_its_reply_leaves(
    run_id: str, zmq_ctx: zmq.asyncio.Context
) -> None:
    # `sent` is how long a caller really waited: not when the answer was decided (answered
    # outside a request, the reply leaves after that turn of the loop), and a callback that
    # fails loses no other reply.
    parked: list[Parked] = []
    two = asyncio.Event()

    def poll(payload: Any, peer: bytes) -> Any:
        parked.append(Parked(STEP))
        if len(parked) == 2:
            two.set()
        return parked[-1]

    async with (
        RpcServer(ipc_endpoint(run_id, "sent"), {"poll": poll}, ctx=zmq_ctx,
                  long_polls={"poll"}) as srv,
        RpcClient(srv.endpoint, ctx=zmq_ctx, timeout=STEP) as client,
    ):
        calls = [asyncio.ensure_future(client.call("poll", i)) for i in range(2)]
        async with asyncio.timeout(STEP):
            await two.wait()
        order: list[str] = []

        def fails() -> None:
            order.append("first sent")
            raise RuntimeError("a caller's bookkeeping failed")

        parked[0].sent = fails
        parked[1].sent = lambda: order.append("second sent")
        parked[0].answer("a")
        parked[1].answer("b")
        order.append("answered")  # this turn goes on: nothing has left yet
        assert await asyncio.gather(*calls) == ["a", "b"]
        assert order == ["answered", "first sent", "second sent"]


@pytest.mark.parametrize("servers", ["one server", "the poll on another server"])
async def test_a_poll_answered_while_a_request_is_handled_leaves_as_that_request_ends(
    run_id: str, zmq_ctx: zmq.asyncio.Context, servers: str
) -> None:
    # A report that makes a task for a parked poll: the task's reply leaves with the report's
    # own, not after the rest of the turn of the loop (a socket's drain takes up to 64 requests
    # a turn, each handler maybe a dispatch pass). What the turn had queued runs after it. The
    # poll may be held by another server of the loop (a node's agent and the controller's).
    parked: list[Parked] = []
    polled = asyncio.Event()
    order: list[str] = []

    def poll(payload: Any, peer: bytes) -> Any:
        parked.append(p := Parked(STEP))
        p.sent = lambda: order.append("the poll's reply sent")
        polled.set()
        return p

    def report(payload: Any, peer: bytes) -> Any:
        asyncio.get_running_loop().call_soon(order.append, "the turn's next callback")
        parked[0].answer("a task")
        return "taken"

    across = servers != "one server"
    async with (
        RpcServer(ipc_endpoint(run_id, "ends"), {"poll": poll, "report": report}, ctx=zmq_ctx,
                  long_polls={"poll"}) as srv,
        RpcServer(ipc_endpoint(run_id, "other"), {"report": report}, ctx=zmq_ctx) as other,
        RpcClient(srv.endpoint, ctx=zmq_ctx, timeout=STEP) as client,
        RpcClient(other.endpoint, ctx=zmq_ctx, timeout=STEP) as reporter,
    ):
        waiting = asyncio.ensure_future(client.call("poll", None))
        async with asyncio.timeout(STEP):
            await polled.wait()
        assert await (reporter if across else client).call("report", None) == "taken"
        assert await waiting == "a task"
    assert order == ["the poll's reply sent", "the turn's next callback"]


async def test_parked_polls_keep_the_budgets_and_end_with_the_server(
    run_id: str, zmq_ctx: zmq.asyncio.Context
) -> None:
    parked: list[Parked] = []
    arrived = asyncio.Event()

    def poll(payload: Any, peer: bytes) -> Any:
        if payload == "again" and parked:
            return parked[0]  # a Parked answers the one poll it was returned for
        parked.append(Parked(STEP))
        arrived.set()
        return parked[-1]

    async def parked_count(n: int) -> None:
        async with asyncio.timeout(STEP):
            while len(parked) < n:
                arrived.clear()
                await arrived.wait()

    def not_a_poll(payload: Any, peer: bytes) -> Any:
        return Parked(STEP)

    server = RpcServer(ipc_endpoint(run_id, "pb"), {"poll": poll, "now": not_a_poll},
                       ctx=zmq_ctx, long_polls={"poll"}, max_long_polls_per_peer=2)
    await server.start()
    try:
        async with RpcClient(server.endpoint, ctx=zmq_ctx, timeout=STEP) as client:
            with pytest.raises(RemoteError, match="'now' is not a long poll"):
                await client.call("now", None)
            held = [asyncio.ensure_future(client.call("poll", i)) for i in range(2)]
            await parked_count(2)
            with pytest.raises(Overloaded, match="already has 2 long polls open"):
                await client.call("poll", None)
            parked[1].answer("one")
            assert await held[1] == "one"
            with pytest.raises(RemoteError, match="returned once"):
                await client.call("poll", "again")
            # Answers given in one turn of the loop leave together, each to its own call.
            more = [asyncio.ensure_future(client.call("poll", i)) for i in range(1)]
            await parked_count(3)
            assert parked[0].answer("a")
            assert parked[2].answer("b")
            assert [await held[0], await more[0]] == ["a", "b"]
            # Closing drops what is parked with no reply, as it cancels waiting handlers.
            last = asyncio.ensure_future(client.call("poll", None, timeout=0.5))
            await parked_count(4)
            await server.aclose()
            assert not parked[3].open
            assert not parked[3].answer("after close")
            assert server.statistics().long_polls == 0
            with pytest.raises(DeadlineExceeded):
                await last
    finally:
        await server.aclose()


async def test_answered_parked_polls_do_not_pile_up_until_their_deadlines(
    run_id: str, zmq_ctx: zmq.asyncio.Context
) -> None:
    # Polls of long waits answered at once (a worker busy all the time) leave their deadlines
    # behind; the server drops those rather than hold every poll of the last ten minutes.
    def poll(payload: Any, peer: bytes) -> Any:
        p = Parked(600.0)
        asyncio.get_running_loop().call_soon(p.answer, payload)
        return p

    async with (
        RpcServer(ipc_endpoint(run_id, "pile"), {"poll": poll}, ctx=zmq_ctx,
                  long_polls={"poll"}) as srv,
        RpcClient(srv.endpoint, ctx=zmq_ctx, timeout=STEP) as client,
    ):
        for start in range(0, 3000, 100):
            assert await asyncio.gather(*(client.call("poll", i)
                                          for i in range(start, start + 100))) == list(
                range(start, start + 100))
        assert srv.statistics().long_polls == 0
        assert len(srv._deadlines) <= 1024 + 100  # what this test is about


def test_long_polls_are_checked() -> None:
    with pytest.raises(ValueError, match="without a handler"):
        RpcServer("ipc:///nowhere", {"a": Service().echo}, long_polls={"b"})
    with pytest.raises(ValueError, match="at least 1"):
        RpcServer("ipc:///nowhere", {"a": Service().echo}, max_long_polls_per_peer=0)


async def test_client_close_fails_pending_calls(client: RpcClient, service: Service) -> None:
    pending = asyncio.ensure_future(client.call("hang"))
    async with asyncio.timeout(STEP):
        await service.entered.wait()
        await client.aclose()
        with pytest.raises(ClosedError):
            await pending
    with pytest.raises(ClosedError):
        await client.call("echo")
    assert client.statistics().in_flight == 0


async def test_server_close_cancels_running_handlers(
    service: Service, run_id: str, zmq_ctx: zmq.asyncio.Context
) -> None:
    server = RpcServer(ipc_endpoint(run_id, "c"), service.handlers(), ctx=zmq_ctx)
    await server.start()
    async with RpcClient(server.endpoint, ctx=zmq_ctx, timeout=STEP) as client:
        pending = asyncio.ensure_future(client.call("hang", timeout=0.5))
        async with asyncio.timeout(STEP):
            await service.entered.wait()
            await server.aclose()
            assert service.cancelled.is_set()
            assert server.statistics().in_flight == 0
            with pytest.raises(DeadlineExceeded):
                await pending
    await server.aclose()  # idempotent


SERVER_PROCESS = r"""
import asyncio, sys
import torch
from transport.rpc import RpcServer

async def main(endpoint):
    stop = asyncio.Event()

    async def scale(payload, peer):
        return payload["t"] * payload["k"]

    async def fail(payload, peer):
        raise KeyError("missing")

    async def shutdown(payload, peer):
        stop.set()
        return "bye"

    handlers = {"scale": scale, "fail": fail, "shutdown": shutdown}
    async with RpcServer(endpoint, handlers) as server:
        print(server.endpoint, flush=True)
        await stop.wait()
    print("closed", flush=True)

asyncio.run(main(sys.argv[1]))
"""


async def test_server_in_another_process(run_id: str, zmq_ctx: zmq.asyncio.Context) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        SERVER_PROCESS,
        ipc_endpoint(run_id, "proc"),
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(STEP * 2):  # the child imports torch
            endpoint = (await proc.stdout.readline()).decode().strip()
        assert endpoint == ipc_endpoint(run_id, "proc")
        async with RpcClient(endpoint, ctx=zmq_ctx, timeout=STEP) as client:
            t = torch.arange(100_000, dtype=torch.float32)
            out = await asyncio.gather(*(client.call("scale", {"t": t, "k": k}) for k in range(8)))
            for k, o in enumerate(out):
                assert torch.equal(o, t * k)
            with pytest.raises(RemoteError) as info:
                await client.call("fail")
            assert info.value.kind == "KeyError"
            assert await client.call("shutdown") == "bye"
        async with asyncio.timeout(STEP):
            assert (await proc.stdout.readline()).strip() == b"closed"
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


# -- the socket layer under RPC and PubSub ---------------------------------------------------


async def test_senders_wait_at_the_high_water_mark_and_lose_nothing(
    run_id: str, zmq_ctx: zmq.asyncio.Context
) -> None:
    """With queues of one message, every send past the first few must wait for the reader."""
    endpoint = ipc_endpoint(run_id, "hwm")
    push, pull = new_socket(zmq_ctx, zmq.PUSH), new_socket(zmq_ctx, zmq.PULL)
    push.setsockopt(zmq.SNDHWM, 1)
    pull.setsockopt(zmq.RCVHWM, 1)
    pull.bind(endpoint)
    push.connect(endpoint)
    received: list[int] = []
    done = asyncio.Event()
    n = 300

    def on_message(frames: list[zmq.Frame]) -> None:
        received.append(int.from_bytes(frames[0].bytes[:4], "little"))
        if len(received) == n:
            done.set()

    sender, receiver = AsyncSocket(push), AsyncSocket(pull, on_message)
    try:
        blob = bytes(64 << 10)  # large enough that kernel buffers hold only a few
        async with asyncio.timeout(STEP):
            for i in range(n):
                await sender.send([i.to_bytes(4, "little") + blob])
            await done.wait()
    finally:
        sender.close()
        receiver.close()
    assert received == list(range(n))
