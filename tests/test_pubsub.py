"""PubSub: the join handshake, lossless ordered delivery after join, exact topics."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio

from transport.endpoints import ipc_endpoint
from transport.errors import ClosedError, DeadlineExceeded
from transport.pubsub import DroppedSubscriber, Publisher, Subscriber

pytestmark = pytest.mark.timeout(60)

STEP = 20.0


@pytest.fixture
async def publisher(run_id: str, zmq_ctx: zmq.asyncio.Context) -> AsyncIterator[Publisher]:
    async with Publisher(ipc_endpoint(run_id, "pub"), ctx=zmq_ctx) as pub:
        yield pub


async def test_joined_subscribers_miss_nothing_and_keep_order(
    publisher: Publisher, zmq_ctx: zmq.asyncio.Context
) -> None:
    n_messages = 10_000  # more than two high-water marks: the publisher must wait, not drop
    endpoint = publisher.endpoint
    async with AsyncExitStack() as stack:
        subs = [
            await stack.enter_async_context(Subscriber(endpoint, ["step"], ctx=zmq_ctx))
            for _ in range(3)
        ]
        async with asyncio.timeout(STEP):
            await asyncio.gather(*(s.join(timeout=STEP) for s in subs))
        assert publisher.joined == 3

        async def consume(sub: Subscriber) -> list[int]:
            got = []
            for _ in range(n_messages):
                topic, payload = await sub.recv()
                assert topic == "step"
                got.append(payload)
            return got

        async def produce() -> None:
            for i in range(n_messages):
                await publisher.publish("step", i)

        async with asyncio.timeout(STEP * 2):
            # The producer runs first and fills every queue before anyone reads.
            producer = asyncio.ensure_future(produce())
            results = await asyncio.gather(*(consume(s) for s in subs))
            await producer
    for got in results:
        assert got == list(range(n_messages))


async def test_topics_match_exactly(publisher: Publisher, zmq_ctx: zmq.asyncio.Context) -> None:
    endpoint = publisher.endpoint
    async with (
        Subscriber(endpoint, ["ver"], ctx=zmq_ctx) as short,
        Subscriber(endpoint, ["version", "stop"], ctx=zmq_ctx) as both,
    ):
        async with asyncio.timeout(STEP):
            await short.join(timeout=STEP)
            await both.join(timeout=STEP)
            await publisher.publish("version", {"v": 3, "w": torch.ones(4)})
            await publisher.publish("other", "nobody listens")
            await publisher.publish("ver", 1)
            await publisher.publish("stop")
            assert await short.recv() == ("ver", 1)
            topic, payload = await both.recv()
            assert topic == "version"
            assert payload["v"] == 3
            assert torch.equal(payload["w"], torch.ones(4))
            assert await both.recv() == ("stop", None)
    with pytest.raises(ValueError, match="zero byte"):
        await publisher.publish("a\0b", 1)


async def test_subscriber_may_start_before_the_publisher(
    run_id: str, zmq_ctx: zmq.asyncio.Context
) -> None:
    endpoint = ipc_endpoint(run_id, "late")
    async with Subscriber(endpoint, ["t"], ctx=zmq_ctx) as sub:
        joining = asyncio.ensure_future(sub.join(timeout=STEP))
        async with Publisher(endpoint, ctx=zmq_ctx) as pub:
            async with asyncio.timeout(STEP):
                await joining
                await pub.publish("t", "hello")
                assert await sub.recv() == ("t", "hello")


async def test_a_subscriber_that_reconnects_is_still_sent_to(
    publisher: Publisher, zmq_ctx: zmq.asyncio.Context
) -> None:
    async with Subscriber(publisher.endpoint, ["t"], ctx=zmq_ctx) as sub:
        async with asyncio.timeout(STEP):
            await sub.join(timeout=STEP)
            # Break the connection and make a new one, as a network hiccup would (the socket is
            # private: nothing public breaks a connection).
            assert sub._sock is not None
            sub._sock.sock.disconnect(publisher.endpoint)
            sub._sock.sock.connect(publisher.endpoint)
            # Messages in flight as the connection broke may be lost; once one arrives, the
            # publisher knows the new connection, and nothing after it is lost.
            first = last = -1
            for last in range(1_000):
                await publisher.publish("t", last)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.05):
                        first = (await sub.recv())[1]
                        break
            assert first >= 0
            for i in range(last + 1, last + 100):
                await publisher.publish("t", i)
            got = [first]
            while got[-1] != last + 99:
                got.append((await sub.recv())[1])
            assert got == list(range(first, last + 100))
    assert publisher.joined == 1  # no second handshake was needed
    assert publisher.dropped == ()


async def test_join_times_out_without_a_publisher(
    run_id: str, zmq_ctx: zmq.asyncio.Context
) -> None:
    async with Subscriber(ipc_endpoint(run_id, "none"), ["t"], ctx=zmq_ctx) as sub:
        with pytest.raises(DeadlineExceeded):
            await sub.join(timeout=0.2)
    with pytest.raises(ClosedError):
        await sub.recv()


async def test_a_join_that_is_not_welcomed_is_made_again_on_a_fresh_connection(
    run_id: str, zmq_ctx: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A publisher that lost the first join (it never welcomes it): the subscriber joins again
    # under a new identity and is welcomed then.
    monkeypatch.setattr("transport.pubsub._REJOIN_S", 0.3)
    raw = zmq_ctx.socket(zmq.ROUTER)
    raw.setsockopt(zmq.LINGER, 0)
    endpoint = ipc_endpoint(run_id, "raw")
    raw.bind(endpoint)
    try:
        async with Subscriber(endpoint, ["t"], ctx=zmq_ctx, name="w-1") as sub:
            joining = asyncio.ensure_future(sub.join(timeout=STEP))
            async with asyncio.timeout(STEP):
                first, *_ = await raw.recv_multipart()  # not answered
                second, kind, name, *_ = await raw.recv_multipart()
                assert second != first
                assert (kind, name) == (b"\xffjoin", b"w-1")
                assert sub.token.encode() == second
                await raw.send_multipart([second, b"\xffwelcome"])
                await joining
                await raw.send_multipart([second, b"t\0", msgpack.packb("after")])
                assert await sub.recv() == ("t", "after")
    finally:
        raw.close()


async def test_malformed_broadcasts_are_dropped(run_id: str, zmq_ctx: zmq.asyncio.Context) -> None:
    # A raw ROUTER speaks the protocol by hand, so it can also send what Publisher never would.
    raw = zmq_ctx.socket(zmq.ROUTER)
    raw.setsockopt(zmq.LINGER, 0)
    endpoint = ipc_endpoint(run_id, "raw")
    raw.bind(endpoint)
    try:
        async with Subscriber(endpoint, ["t", "ü", ""], ctx=zmq_ctx, name="w-1") as sub:
            joining = asyncio.ensure_future(sub.join(timeout=STEP))
            async with asyncio.timeout(STEP):
                identity, kind, name, *topics = await raw.recv_multipart()
                assert (identity, kind, name) == (sub.token.encode(), b"\xffjoin", b"w-1")
                assert sorted(topics) == [b"\x00", b"t\x00", "ü\x00".encode()]
                await raw.send_multipart([identity, b"\xffwelcome"])
                await joining
                await raw.send_multipart([identity, b"t\0", b"\xc1"])  # undecodable payload
                await raw.send_multipart([identity, b"t\0x", msgpack.packb(1)])  # no zero end
                await raw.send_multipart([identity, b"t\0\xfe\0", msgpack.packb(1)])  # not UTF-8
                await raw.send_multipart([identity, b"t\0", msgpack.packb("good")])
                assert await sub.recv() == ("t", "good")
            assert sub.dropped == 3
    finally:
        raw.close()


async def test_malformed_joins_are_ignored(
    publisher: Publisher, zmq_ctx: zmq.asyncio.Context
) -> None:
    raw = zmq_ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(publisher.endpoint)
    try:
        await raw.send_multipart([b"hello"])
        await raw.send_multipart([b"\xffjoin", b"\xff", b"t\0"])  # name not UTF-8
        await raw.send_multipart([b"\xffjoin", b"n", b"t"])  # topic not terminated
        async with Subscriber(publisher.endpoint, ["t"], ctx=zmq_ctx) as sub:
            async with asyncio.timeout(STEP):
                await sub.join(timeout=STEP)
                await publisher.publish("t", 1)
                assert await sub.recv() == ("t", 1)
        assert publisher.joined == 1
        assert not await raw.poll(0)  # nothing was sent to the malformed peer
    finally:
        raw.close()


# -- one subscriber that does not read cannot hold up the others --------------------------------

PAYLOAD = bytes(1024)  # with 1 KiB messages, a few thousand fill a subscriber's queues


async def flood(publisher: Publisher, healthy: Subscriber, n: int) -> float:
    """Publish `n` messages while `healthy` reads them; checks it got all, in order, and
    returns the longest a `publish` took.

    The producer stays at most `LEAD` messages ahead of `healthy`, far less than zmq queues:
    however the cores are shared, `healthy` never has a backlog, so only the subscriber that
    does not read can be dropped."""
    longest = 0.0
    received = 0
    progress = asyncio.Event()
    loop = asyncio.get_running_loop()

    async def produce() -> None:
        nonlocal longest
        for i in range(n):
            while i - received > LEAD:
                progress.clear()
                await progress.wait()
            t0 = loop.time()
            await publisher.publish("step", [i, PAYLOAD])
            longest = max(longest, loop.time() - t0)

    async def consume() -> None:
        nonlocal received
        for i in range(n):
            topic, (got, _) = await healthy.recv()
            assert (topic, got) == ("step", i)
            received += 1
            progress.set()

    async with asyncio.timeout(STEP * 3):
        await asyncio.gather(produce(), consume())
    return longest


LEAD = 256
# Publish never waits; the old publisher waited for the stuck subscriber until the test's
# timeout. The bound leaves room for a process descheduled on busy cores.
PUBLISH_BOUND_S = 5.0


@pytest.mark.timeout(120)
async def test_a_subscriber_that_never_reads_is_dropped_and_reported(
    run_id: str, zmq_ctx: zmq.asyncio.Context
) -> None:
    # With XPUB_NODROP, the stuck subscriber's full queue blocked every publish forever.
    reported: asyncio.Queue[DroppedSubscriber] = asyncio.Queue()
    async with (
        Publisher(ipc_endpoint(run_id, "pub"), ctx=zmq_ctx, stall_timeout=1.0,
                  on_drop=reported.put_nowait) as pub,
        Subscriber(pub.endpoint, ["step"], ctx=zmq_ctx, name="healthy") as healthy,
        Subscriber(pub.endpoint, ["step"], ctx=zmq_ctx, name="stuck") as stuck,
    ):
        async with asyncio.timeout(STEP):
            await healthy.join(timeout=STEP)
            await stuck.join(timeout=STEP)  # joins, then never reads again
        longest = await flood(pub, healthy, 12_000)
        assert longest < PUBLISH_BOUND_S
        async with asyncio.timeout(STEP):
            report = await reported.get()
        assert (report.name, report.token) == ("stuck", stuck.token)
        assert "took no message for 1.0 s" in report.reason
        assert report.connected
        assert pub.dropped == (report,)
        # The stuck subscriber is no longer sent to; the healthy one still is.
        await pub.publish("step", [-1, b""])
        async with asyncio.timeout(STEP):
            assert await healthy.recv() == ("step", [-1, b""])
        # Closing with the subscriber still connected and its queue full does not wait.
        async with asyncio.timeout(STEP):
            await pub.aclose()


async def test_a_subscriber_that_left_is_reported_as_not_connected(
    run_id: str, zmq_ctx: zmq.asyncio.Context
) -> None:
    reported: asyncio.Queue[DroppedSubscriber] = asyncio.Queue()
    async with Publisher(ipc_endpoint(run_id, "pub"), ctx=zmq_ctx, stall_timeout=0.5,
                         on_drop=reported.put_nowait) as pub:
        async with Subscriber(pub.endpoint, ["t"], ctx=zmq_ctx, name="gone") as sub:
            await sub.join(timeout=STEP)
        # The publisher learns of the departure by sending: until then it may take messages.
        report = None
        async with asyncio.timeout(STEP):
            while report is None:
                await pub.publish("t")
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.1):
                        report = await reported.get()
        assert (report.name, report.connected) == ("gone", False)
        assert "not connected for 0.5 s" in report.reason


async def test_close_does_not_wait_for_a_backlog(run_id: str, zmq_ctx: zmq.asyncio.Context) -> None:
    async with (
        Publisher(ipc_endpoint(run_id, "pub"), ctx=zmq_ctx, stall_timeout=STEP * 10) as pub,
        Subscriber(pub.endpoint, ["step"], ctx=zmq_ctx) as stuck,
    ):
        await stuck.join(timeout=STEP)
        async with asyncio.timeout(STEP):
            for i in range(12_000):  # fills its queues; the rest waits in its backlog
                await pub.publish("step", [i, PAYLOAD])
            await pub.aclose()
        assert pub.dropped == ()
        with pytest.raises(ClosedError):
            await pub.publish("step")


STOPPED_SUBSCRIBER = r"""
import asyncio, sys
from transport.pubsub import Subscriber

async def main(endpoint):
    async with Subscriber(endpoint, ["step"], name="stopped") as sub:
        await sub.join(timeout=20)
        print(sub.token, flush=True)
        while True:
            await sub.recv()

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.timeout(120)
async def test_a_stopped_subscriber_process_is_dropped_and_reported(
    run_id: str, zmq_ctx: zmq.asyncio.Context
) -> None:
    reported: asyncio.Queue[DroppedSubscriber] = asyncio.Queue()
    # A small backlog bound: the stopped process is dropped as soon as it falls that far behind.
    async with (
        Publisher(ipc_endpoint(run_id, "pub"), ctx=zmq_ctx, max_backlog=500,
                  on_drop=reported.put_nowait) as pub,
        Subscriber(pub.endpoint, ["step"], ctx=zmq_ctx, name="healthy") as healthy,
    ):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", STOPPED_SUBSCRIBER, pub.endpoint, stdout=asyncio.subprocess.PIPE
        )
        try:
            assert proc.stdout is not None
            async with asyncio.timeout(STEP * 2):
                await healthy.join(timeout=STEP)
                token = (await proc.stdout.readline()).decode().strip()
            os.kill(proc.pid, signal.SIGSTOP)
            longest = await flood(pub, healthy, 8_000)
            assert longest < PUBLISH_BOUND_S
            async with asyncio.timeout(STEP):
                report = await reported.get()
            assert (report.name, report.token) == ("stopped", token)
            assert "more than 500 messages behind" in report.reason
            async with asyncio.timeout(STEP):
                await pub.publish("stop")
                await pub.aclose()
        finally:
            proc.kill()  # a stopped process is killed all the same
            await proc.wait()


async def test_publisher_checks_its_limits(run_id: str) -> None:
    with pytest.raises(ValueError, match="positive"):
        Publisher(ipc_endpoint(run_id, "x"), stall_timeout=0)
    with pytest.raises(ValueError, match="256 bytes"):
        Subscriber(ipc_endpoint(run_id, "x"), ["t"], name="n" * 257)
