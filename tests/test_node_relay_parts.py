"""A node agent's relay (`flowrl.node_relay.NodeRelay`) on its own: the workers it drops for not
reading its broadcasts, and what happens to a ``node_served`` the controller does not answer,
refuses, or answers None.

Real parts: the controller's publisher, the relay (its subscriber, publisher and ipc server),
the workers' subscribers and an RPC client speaking for the workers, over ZeroMQ. The one
stand-in is the relay's ``send``: it is how the agent reaches the controller (an
`RpcClient.call`, or the agent's retrying wrapper of it), so it is where the controller's
answers, its silence (DeadlineExceeded), its refusals (TransportError) and its absence (None)
come from; a `Script` in its place lets each test answer each ``node_served`` as it chooses,
at the moment it chooses.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import structlog
import zmq.asyncio

from flowrl import messages as m
from flowrl.node_dispatch import DispatchApi, LocalDispatch
from flowrl.node_relay import Beat, NodeRelay, Renewals
from transport.endpoints import ipc_endpoint
from transport.errors import DeadlineExceeded, RemoteError
from transport.pubsub import DroppedSubscriber, Publisher, Subscriber
from transport.rpc import RpcClient

NODE = "n0"
NODE_TOKEN = b"node-token-0123"
# Any one wait of a test that involves no stall (a join, a call, a relayed message).
STEP = 20.0
# The relay drops a worker after its publisher's default stall timeout (10 s without taking
# a message); a drop is waited for this long: the flood that fills the worker's queues, the
# stall itself, and room for busy cores.
DROP_WAIT = 60.0
# With 1 KiB messages, this many fill a worker's zmq queues (4096 messages each way, plus the
# socket buffers) and start its backlog at the relay.
FLOOD = 12_000
PAYLOAD = bytes(1024)


@dataclass
class Call:
    """One ``node_served`` the relay sent, waiting for the test's answer."""

    payload: dict[str, Any]
    answer: asyncio.Future[Any] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())

    def reply(self, value: Any) -> None:
        self.answer.set_result(value)

    def fail(self, exc: BaseException) -> None:
        self.answer.set_exception(exc)


class Script:
    """The controller as the relay's ``send`` sees it: each ``node_served`` is queued (a copy of
    its payload, as sent) and answered when the test says how; ``node_heartbeat`` is answered at
    once (the relays here pass none on: their heartbeat period is an hour)."""

    def __init__(self) -> None:
        self.calls: asyncio.Queue[Call] = asyncio.Queue()

    async def send(self, op: str, payload: dict[str, Any]) -> Any:
        if op != m.OP_NODE_SERVED:
            return {"ok": True, "unknown": []}
        call = Call(copy.deepcopy(payload))
        self.calls.put_nowait(call)  # before any await: the relay's step that sends records it
        return await call.answer

    async def next(self, timeout: float = STEP) -> Call:  # noqa: ASYNC109 (a bounded wait)
        async with asyncio.timeout(timeout):
            return await self.calls.get()


@contextlib.asynccontextmanager
async def relaying(run_id: str, zmq_ctx: zmq.asyncio.Context,
                   script: Script) -> AsyncIterator[tuple[Publisher, NodeRelay]]:
    """The controller's publisher and a started, running relay of node `NODE` under it."""
    async with Publisher(ipc_endpoint(run_id, "controller-broadcast"), ctx=zmq_ctx) as upstream:
        relay = NodeRelay(run_id, NODE, upstream.endpoint, NODE_TOKEN, script.send,
                          heartbeat_s=3600.0)
        try:
            await relay.start(timeout=STEP)
            running = asyncio.create_task(relay.run(lambda: None))
            try:
                yield upstream, relay
            finally:
                running.cancel()
                # A relay that failed before the cancel raises its error here.
                with contextlib.suppress(asyncio.CancelledError):
                    await running
        finally:
            await relay.aclose()


async def worker_subscriber(stack: contextlib.AsyncExitStack, relay: NodeRelay, name: str,
                            zmq_ctx: zmq.asyncio.Context) -> Subscriber:
    """A worker's subscription to the relay's broadcasts, as a worker makes it, joined."""
    sub = await stack.enter_async_context(
        Subscriber(relay.broadcast, [m.TOPIC_VERSION, m.TOPIC_STOP], ctx=zmq_ctx, name=name))
    await sub.join(timeout=STEP)
    return sub


async def flood(upstream: Publisher) -> None:
    """`FLOOD` broadcasts from the controller, numbered; the relay passes each on."""
    for i in range(FLOOD):
        await upstream.publish(m.TOPIC_VERSION, [i, PAYLOAD])  # never waits
        if i % 500 == 499:
            # A turn of the event loop (no timed wait): the relay, in this process, forwards
            # as the flood goes, as it would in a process of its own; else the controller's
            # publisher might see it take nothing for its stall timeout on a slow machine, and
            # drop it.
            await asyncio.sleep(0)


def served(worker: str, version: int) -> dict[str, Any]:
    """A worker's ``served`` report, as its process sends it to the relay (`reports`)."""
    return {"worker_id": worker, "token": f"token-{worker}".encode(), "version": version}


def reports(*served: dict[str, Any]) -> dict[str, Any]:
    """``served`` reports as one process sends them to the relay (``served_many``)."""
    return {"reports": list(served)}


async def report(workers: RpcClient, worker: str, version: int) -> None:
    """``worker``'s ``served`` report of ``version``, sent to the relay and taken."""
    assert await workers.call(m.OP_SERVED_MANY, reports(served(worker, version))) == {"ok": True}


def entry(worker: str, version: int) -> list[Any]:
    """`served`'s report as the relay passes it on: an array (`flowrl.node_relay`)."""
    return [worker, f"token-{worker}".encode(), version]


def by_worker(entries: list[list[Any]]) -> dict[str, list[Any]]:
    return {e[0]: e for e in entries}


def observe_drops(relay: NodeRelay) -> asyncio.Queue[DroppedSubscriber]:
    """Each subscriber the relay's publisher drops, after the relay has taken it (its
    `Publisher.on_drop`, wrapped): how a test knows a drop happened while a ``node_served`` is
    still unanswered, when nothing the relay sends shows it yet."""
    publisher = relay._pub
    inner = publisher.on_drop
    assert inner is not None
    seen: asyncio.Queue[DroppedSubscriber] = asyncio.Queue()

    def taken_then_seen(dropped: DroppedSubscriber) -> None:
        inner(dropped)
        seen.put_nowait(dropped)

    publisher.on_drop = taken_then_seen
    return seen


@pytest.mark.timeout(150)
async def test_a_worker_that_stops_reading_is_dropped_and_reported_in_the_next_node_served(
        run_id: str, zmq_ctx: zmq.asyncio.Context) -> None:
    script = Script()
    async with (relaying(run_id, zmq_ctx, script) as (upstream, relay),
                contextlib.AsyncExitStack() as stack):
        healthy = await worker_subscriber(stack, relay, "rollout-0", zmq_ctx)
        await worker_subscriber(stack, relay, "rollout-1", zmq_ctx)  # joins, never reads
        gone = await worker_subscriber(stack, relay, "rollout-2", zmq_ctx)
        await gone.aclose()  # its process exited

        async def read(sub: Subscriber) -> list[int]:
            got = []
            while (message := await sub.recv()) != (m.TOPIC_STOP, None):
                got.append(message[1][0])
            return got

        reading = asyncio.create_task(read(healthy))
        try:
            await flood(upstream)
            drops: list[dict[str, Any]] = []
            while len(drops) < 2:  # in one node_served or two, as they come
                call = await script.next(timeout=DROP_WAIT)
                assert call.payload["node"] == NODE
                assert call.payload["token"] == NODE_TOKEN
                assert call.payload["served"] == []
                drops += call.payload["dropped"]
                call.reply({"ok": True, "served": 0})
            await upstream.publish(m.TOPIC_STOP)
            async with asyncio.timeout(STEP * 2):
                got = await reading
        finally:
            reading.cancel()
        assert sorted(drops, key=lambda d: d["name"]) == [
            {"name": "rollout-1", "reason": "took no message for 10.0 s", "connected": True},
            {"name": "rollout-2", "reason": "not connected for 10.0 s", "connected": False},
        ]
        # The worker that reads was relayed every broadcast, in order, and not dropped.
        assert got == list(range(FLOOD))
        # A drop is reported once: the next node_served carries only what came since.
        async with RpcClient(relay.served, ctx=zmq_ctx, timeout=STEP) as workers:
            await report(workers, "rollout-0", 1)
        call = await script.next()
        assert (call.payload["served"], call.payload["dropped"]) == ([entry("rollout-0", 1)], [])
        call.reply({"ok": True, "served": 1})


@pytest.mark.timeout(240)
async def test_an_unanswered_node_served_is_sent_again_with_what_came_meanwhile(
        run_id: str, zmq_ctx: zmq.asyncio.Context) -> None:
    script = Script()
    async with (relaying(run_id, zmq_ctx, script) as (upstream, relay),
                contextlib.AsyncExitStack() as stack,
                RpcClient(relay.served, ctx=zmq_ctx, timeout=STEP) as workers):
        drops = observe_drops(relay)

        # A worker stops reading: its drop is the first node_served, left unanswered for now.
        await worker_subscriber(stack, relay, "rollout-a", zmq_ctx)
        await flood(upstream)
        first = await script.next(timeout=DROP_WAIT)
        a = {"name": "rollout-a", "reason": "took no message for 10.0 s", "connected": True}
        assert (first.payload["served"], first.payload["dropped"]) == ([], [a])
        # Meanwhile two workers report, and another worker stops reading and is dropped.
        await report(workers, "w1", 1)
        await report(workers, "w2", 1)
        async with asyncio.timeout(STEP):
            assert (await drops.get()).name == "rollout-a"
        await worker_subscriber(stack, relay, "rollout-b", zmq_ctx)
        await flood(upstream)
        async with asyncio.timeout(DROP_WAIT):
            assert (await drops.get()).name == "rollout-b"
        b = {**a, "name": "rollout-b"}
        assert script.calls.empty()  # one node_served in flight at a time

        # Unanswered: sent again at once with what came meanwhile, its own drop in front.
        first.fail(DeadlineExceeded("node_served: no reply"))
        second = await script.next()
        assert second.payload["dropped"] == [a, b]
        assert by_worker(second.payload["served"]) == {
            "w1": entry("w1", 1), "w2": entry("w2", 1)}
        # Meanwhile w1 serves a later version and w3 reports for the first time.
        await report(workers, "w1", 2)
        await report(workers, "w3", 1)
        second.fail(DeadlineExceeded("node_served: no reply"))
        third = await script.next()
        assert third.payload["dropped"] == [a, b]
        # w2's entry is kept, w1's is the later one, w3's is added.
        assert by_worker(third.payload["served"]) == {
            "w1": entry("w1", 2), "w2": entry("w2", 1), "w3": entry("w3", 1)}
        third.reply({"ok": True, "served": 3})

        # Answered: nothing of it is sent again; the next carries only what came since.
        await report(workers, "w4", 1)
        fourth = await script.next()
        assert (fourth.payload["served"], fourth.payload["dropped"]) == ([entry("w4", 1)], [])
        fourth.reply({"ok": True, "served": 1})
        assert script.calls.empty()


@pytest.mark.timeout(120)
async def test_a_refused_node_served_is_logged_not_resent_and_none_ends_the_reports(
        run_id: str, zmq_ctx: zmq.asyncio.Context) -> None:
    script = Script()
    async with (relaying(run_id, zmq_ctx, script) as (_, relay),
                RpcClient(relay.served, ctx=zmq_ctx, timeout=STEP) as workers):
        await report(workers, "w1", 1)
        refused = await script.next()
        assert refused.payload["served"] == [entry("w1", 1)]
        with structlog.testing.capture_logs() as logs:
            refused.fail(RemoteError("ValueError", "node n0 reported without its token"))
            # The next node_served carries only the report made after the refusal.
            await report(workers, "w2", 1)
            after = await script.next()
        assert after.payload["served"] == [entry("w2", 1)]
        warnings = [e for e in logs if e["event"] == "node_served refused"]
        assert len(warnings) == 1, logs
        assert warnings[0]["log_level"] == "warning"
        assert warnings[0]["node"] == NODE
        assert "without its token" in warnings[0]["error"]

        # None: the controller is gone; the relay sends no more node_served.
        after.reply(None)
        await report(workers, "w3", 1)
        # Had the report loop still been waiting, the report's wake-up would have run it (and
        # queued a call) before the reply to `report` reached this task: the relay's handler
        # wakes it before it replies, and the reply comes back only through zmq's I/O thread
        # and a later turn of the event loop.
        assert script.calls.empty()
        assert relay.waiting == 1  # w3's report, kept and never sent


@pytest.mark.timeout(60)
async def test_a_process_reports_its_workers_in_one_request_and_a_malformed_one_takes_none(
        run_id: str, zmq_ctx: zmq.asyncio.Context) -> None:
    script = Script()
    async with (relaying(run_id, zmq_ctx, script) as (_, relay),
                RpcClient(relay.served, ctx=zmq_ctx, timeout=STEP) as workers):
        bad: list[tuple[Any, str]] = [
            ({}, "'reports', a list of 1 to 4096"),
            ({"reports": []}, "'reports', a list of 1 to 4096"),
            ({"reports": [served("w", 1)] * (m.MAX_NODE_SERVED + 1)}, "a list of 1 to 4096"),
            (reports(served("w1", 1), {"worker_id": "w2", "version": 1}), "report 1: "),
            (reports(served("w1", 1), "w2"), "report 1: served needs"),
        ]
        for payload, error in bad:
            with pytest.raises(RemoteError, match=error):
                await workers.call(m.OP_SERVED_MANY, payload)
            assert relay.waiting == 0  # w1's good report in it was not taken either
        interrupted = {**served("w3", 2), "interrupted": 1, "continued": 4}
        assert await workers.call(m.OP_SERVED_MANY, reports(
            served("w1", 2), served("w2", 2), interrupted)) == {"ok": True}
        call = await script.next()
        assert by_worker(call.payload["served"]) == {
            "w1": entry("w1", 2), "w2": entry("w2", 2), "w3": [*entry("w3", 2), 1, 4]}
        call.reply({"ok": True, "served": 3})


@pytest.mark.timeout(60)
async def test_a_served_report_reaches_the_nodes_local_dispatch_before_the_controller(
        run_id: str, zmq_ctx: zmq.asyncio.Context) -> None:
    """The agent's local dispatch learns a worker's version from the relay (`on_served`), so a
    task leased ahead that needs that version goes to the worker before any ``node_served``
    is answered; a report without a version never reaches it."""
    script = Script()
    dispatch = LocalDispatch(NODE)
    dispatch.joined(1)
    api = DispatchApi(dispatch)
    api.admit("w1", b"token-w1", "rollout")
    task: m.TaskMsg = {"task_id": 1, "stage": "rollout", "rows": [0], "groups": [0],
                       "row_groups": [0], "inputs": {}, "params": {}}
    dispatch.add_lease({"lease": 1, "epoch": 1, "stage": "rollout", "tasks": [task],
                        "needs": [2]})
    async with (relaying(run_id, zmq_ctx, script) as (_, relay),
                RpcClient(relay.served, ctx=zmq_ctx, timeout=STEP) as workers):
        relay.on_served = api.served
        poll = asyncio.create_task(dispatch.take("w1", "rollout", STEP))
        with pytest.raises(RemoteError, match="'version'"):
            await workers.call(m.OP_SERVED_MANY, reports({**served("w1", 2), "version": "2"}))
        await report(workers, "w1", 1)
        await asyncio.sleep(0)
        assert not poll.done()  # version 1 may not run it
        await report(workers, "w1", 2)
        async with asyncio.timeout(STEP):
            assert await poll == task
        first = await script.next()  # the controller hears of it all the same
        assert by_worker(first.payload["served"])["w1"][2] in (1, 2)
        first.reply({"ok": True, "served": 1})


def test_each_heartbeat_is_passed_on_once_a_renewal_period_and_a_wrong_token_holds_none_back(
) -> None:
    a, b = ("rollout-1", b"token-a"), ("rollout-2", b"token-b")
    spoof = ("rollout-1", b"wrong")

    def passed_on(renewals: Renewals, heard: set[Beat], now: float) -> list[Beat]:
        """What a relay's pass sends at ``now``, the controller taking it."""
        due = renewals.due(heard, now)
        renewals.sent(due, now)
        return sorted(due)

    every = Renewals(0.0)
    assert passed_on(every, {a, b}, 0.0) == [a, b]
    assert passed_on(every, {a, b}, 0.1) == [a, b]  # without a period: every one heard

    renewals = Renewals(2.0)
    assert passed_on(renewals, {spoof, a, b}, 10.0) == [a, spoof, b]  # first heard: at once
    assert passed_on(renewals, {a, b}, 11.0) == []  # renewed 1 s ago: not yet
    assert passed_on(renewals, {spoof}, 11.5) == []
    assert passed_on(renewals, {a}, 12.0) == [a]  # a period on, a wrong one heard meanwhile
    assert passed_on(renewals, {b}, 13.9) == [b]  # b was not heard at 12: due when next heard
    assert passed_on(renewals, set(), 20.0) == []  # a worker that stops is not passed on
    assert passed_on(renewals, {a}, 20.0) == [a]
    # A pass the controller did not take (refused, timed out) renews nothing: due again next.
    assert renewals.due({a}, 22.5) == [a]
    assert passed_on(renewals, {a}, 23.0) == [a]
    # Workers gone for good do not stay: what it keeps is bounded by the workers it hears.
    for i in range(500):
        passed_on(renewals, {(f"w{i}", b"t")}, 100.0 + 3.0 * i)
    assert len(renewals) <= 2 + 64
