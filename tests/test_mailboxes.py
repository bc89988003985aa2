"""A worker's mailbox in the controller (`WorkerApi`): ``get_task`` polls that find nothing are
parked there (`transport.rpc.Parked`), over a real RPC server and client; a delivered task
answers the oldest poll still open, or waits for the next poll."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import zmq.asyncio

from flowrl import messages as m
from flowrl.control.assignments import Assignment, Assignments
from flowrl.control.worker_api import WorkerApi
from flowrl.index import Task
from flowrl.registry import Registry, WorkerInfo
from transport.endpoints import ipc_endpoint
from transport.rpc import RpcClient, RpcServer

pytestmark = pytest.mark.timeout(60)

STEP = 20.0  # bound on any single wait


class Registered:
    """The one `WorkerEvents` call these tests make: a worker registers."""

    def worker_registered(self, info: WorkerInfo) -> dict[str, Any]:
        return {"worker_id": info.worker_id, "token": info.token}


def assignment(assignments: Assignments, worker: str, task_id: int) -> Assignment:
    task = Task(id=task_id, stage="rollout", rows=(task_id,), groups=(task_id,),
                row_groups=(task_id,), worker=worker, handles={"prompt": [7]}, lengths=(1,),
                versions=(None,), tokens=1)
    a = Assignment(task, worker, {}, 0.0)
    assignments.add(a)
    return a


async def test_a_task_answers_the_oldest_open_poll_or_waits_for_the_next(
        run_id: str, zmq_ctx: zmq.asyncio.Context) -> None:
    assignments = Assignments()
    api = WorkerApi(Registry(60.0), assignments, Registered(),  # type: ignore[arg-type]
                    has_role=lambda role: True, now=lambda: 0.0)
    handlers = api.handlers()
    get_task, polled = handlers[m.OP_GET_TASK], asyncio.Event()

    def counted(p: Any, peer: bytes) -> Any:
        polled.set()  # the server parks what this returns before the loop's next turn
        return get_task(p, peer)

    async with (
        RpcServer(ipc_endpoint(run_id, "ctl"), {**handlers, m.OP_GET_TASK: counted}, ctx=zmq_ctx,
                  long_polls=m.LONG_POLLS) as server,
        RpcClient(server.endpoint, ctx=zmq_ctx, timeout=STEP) as client,
    ):
        me = await client.call(m.OP_REGISTER, {"role": "rollout", "name": "rollout.0.0",
                                               "node": "n0", "pid": 1, "capacity": 2})

        def poll(wait_s: float) -> asyncio.Future[Any]:
            return asyncio.ensure_future(client.call(m.OP_GET_TASK, {**me, "wait_s": wait_s}))

        async def open_polls(n: int) -> None:
            async with asyncio.timeout(STEP):
                while server.statistics().long_polls != n:
                    polled.clear()
                    await polled.wait()

        # A worker of two slots holds two polls: the first task answers the first poll.
        first, second = poll(STEP), poll(STEP)
        await open_polls(2)
        a, b = assignment(assignments, me["worker_id"], 1), assignment(assignments,
                                                                       me["worker_id"], 2)
        sent: list[int] = []
        api.deliver(me["worker_id"], a, lambda: sent.append(1))
        api.deliver(me["worker_id"], b)
        assert sent == []  # told once the reply has left, not when it was decided
        assert (await first)["task_id"] == 1
        assert sent == [1]
        assert (await second)["task_id"] == 2
        assert a.started_at  # taken as they were answered
        assert b.started_at
        # A poll that expired answers "nothing"; a task delivered after it waits for the next
        # poll, which takes it at once, and expired polls do not pile up in the mailbox.
        for _ in range(20):
            assert await poll(0.0) is None
        assert len(api._mailboxes[me["worker_id"]].polls) <= 1  # what this test is about
        c = assignment(assignments, me["worker_id"], 3)
        api.deliver(me["worker_id"], c, lambda: sent.append(3))
        assert sent == [1, 3]  # queued: its worker's next poll takes it as it comes
        assert not c.started_at
        assert (await poll(STEP))["task_id"] == 3
        assert c.started_at
        # A task given back before its worker took it is dropped from the mailbox.
        api.deliver(me["worker_id"], assignment(assignments, me["worker_id"], 4))
        api.empty_mailbox(me["worker_id"])
        assert await poll(0.0) is None
        assert server.statistics().long_polls == 0
