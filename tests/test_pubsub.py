"""PubSub: the join handshake, lossless ordered delivery after join, exact topics."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio

from transport.endpoints import ipc_endpoint
from transport.errors import ClosedError, DeadlineExceeded
from transport.pubsub import Publisher, Subscriber

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


async def test_join_times_out_without_a_publisher(
    run_id: str, zmq_ctx: zmq.asyncio.Context
) -> None:
    async with Subscriber(ipc_endpoint(run_id, "none"), ["t"], ctx=zmq_ctx) as sub:
        with pytest.raises(DeadlineExceeded):
            await sub.join(timeout=0.2)
    with pytest.raises(ClosedError):
        await sub.recv()


async def test_malformed_broadcasts_are_dropped(run_id: str, zmq_ctx: zmq.asyncio.Context) -> None:
    # A raw XPUB speaks the protocol by hand, so it can also send what Publisher never would.
    raw = zmq_ctx.socket(zmq.XPUB)
    raw.setsockopt(zmq.LINGER, 0)
    endpoint = ipc_endpoint(run_id, "raw")
    raw.bind(endpoint)
    try:
        async with Subscriber(endpoint, ["t", "ü", ""], ctx=zmq_ctx) as sub:
            joining = asyncio.ensure_future(sub.join(timeout=STEP))
            seen = []
            async with asyncio.timeout(STEP):
                while not (sub_msg := await raw.recv()).startswith(b"\x01\xff"):
                    seen.append(sub_msg)
                # The join subscription comes after every topic subscription.
                assert sorted(seen) == [b"\x01\x00", b"\x01t\x00", "\x01ü\x00".encode()]
                await raw.send(sub_msg[1:])  # the welcome
                await joining
                await raw.send_multipart([b"t\0", b"\xc1"])  # undecodable payload
                await raw.send_multipart([b"t\0x", msgpack.packb(1)])  # not terminated
                await raw.send_multipart([b"t\0\xfe\0", msgpack.packb(1)])  # not UTF-8
                await raw.send_multipart([b"t\0", msgpack.packb("good")])
                assert await sub.recv() == ("t", "good")
            assert sub.dropped == 3
    finally:
        raw.close()
