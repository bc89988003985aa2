"""A worker reports each task with its next poll (one round trip per task), sends a report
again after a poll that failed, and sends a report it still holds on its own when it stops.

A real `Worker` over real sockets against a scripted controller (an `RpcServer` and a
`Publisher` whose handlers the test writes), so every call the worker makes is seen.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import torch

from flowrl import messages as m
from transport.endpoints import ipc_endpoint, new_run_id, remove_run_dir, run_dir
from transport.pubsub import Publisher
from transport.rpc import RpcServer
from transport.store_client import StoreClient
from workers.runtime import RoleOutput, Worker, WorkerConfig

pytestmark = pytest.mark.timeout(30)


class Echo:
    """Scores each row with its row id: no store traffic, nothing to load."""

    loads_weights = False

    async def run(self, task: m.TaskMsg, inputs: dict[str, list[Any]]) -> RoleOutput:
        return RoleOutput(fields={"reward": [float(r) for r in task["rows"]]})

    async def load_version(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        return None


def task(task_id: int) -> m.TaskMsg:
    return {"task_id": task_id, "stage": "reward", "rows": [task_id], "groups": [0],
            "row_groups": [0], "inputs": {}, "params": {}}


class Script:
    """The controller's side: hands out queued tasks and records every call."""

    def __init__(self) -> None:
        self.tasks: asyncio.Queue[m.TaskMsg] = asyncio.Queue()
        self.calls: list[tuple[str, Any]] = []  # (op, the report it carried)
        self.fail_first_report = True
        self.changed = asyncio.Event()
        self.served: list[Any] = []  # the ``served`` reports
        self.publisher: Publisher | None = None  # the broadcast the worker listens to

    def seen(self, op: str, report: Any) -> None:
        self.calls.append((op, report["task_id"] if isinstance(report, dict) else None))
        self.changed.set()

    async def until(self, predicate: Any) -> None:
        async with asyncio.timeout(10):
            while not predicate():
                self.changed.clear()
                await self.changed.wait()

    def handlers(self) -> dict[str, Any]:
        async def register(p: Any, peer: bytes) -> Any:
            return {"worker_id": "w1", "version": 0, "weights": None}

        async def get_task(p: Any, peer: bytes) -> Any:
            self.seen("get_task", p.get("done"))
            if p.get("done") is not None and self.fail_first_report:
                self.fail_first_report = False
                raise RuntimeError("the poll carrying this report is lost")
            try:
                async with asyncio.timeout(p["wait_s"]):
                    return await self.tasks.get()
            except TimeoutError:
                return None

        async def task_done(p: Any, peer: bytes) -> Any:
            self.seen("task_done", p)
            return {"ok": True}

        async def ok(p: Any, peer: bytes) -> Any:
            return {"ok": True}

        async def served(p: Any, peer: bytes) -> Any:
            self.served.append({k: v for k, v in p.items() if k not in ("worker_id", "token")})
            self.changed.set()
            return {"ok": True}

        return {m.OP_REGISTER: register, m.OP_GET_TASK: get_task, m.OP_TASK_DONE: task_done,
                m.OP_HEARTBEAT: ok, m.OP_BYE: ok, m.OP_TASK_FAILED: ok, m.OP_SERVED: served}


@asynccontextmanager
async def worker_against(
    script: Script, role: Any = None, capacity: int = 1
) -> AsyncIterator[tuple[Worker, asyncio.Task[None]]]:
    run_id = new_run_id()
    run_dir(run_id)
    server = RpcServer(ipc_endpoint(run_id, "ctl"), script.handlers())
    pub = Publisher(ipc_endpoint(run_id, "pub"))
    try:
        await server.start()
        await pub.start()
        script.publisher = pub
        config = WorkerConfig(name="reward.0", role="reward", node="node0",
                              controller=server.endpoint, broadcast=pub.endpoint,
                              heartbeat_s=5.0, poll_s=5.0, rpc_timeout_s=5.0,
                              capacity=capacity)
        store = StoreClient(run_id, "node0", ipc_endpoint(run_id, "store"))  # never used
        worker = Worker(config, role or Echo(), store)
        running = asyncio.create_task(worker.run())
        try:
            yield worker, running
        finally:
            worker.stop()
            async with asyncio.timeout(10):
                await running
            await store.aclose()
    finally:
        await pub.aclose()
        await server.aclose()
        remove_run_dir(run_id)


async def test_reports_ride_on_the_next_poll_and_survive_a_lost_poll() -> None:
    script = Script()
    async with worker_against(script) as (_, running):
        for task_id in (1, 2, 3):
            script.tasks.put_nowait(task(task_id))
        # Task 3's report goes out with the fourth task request, which waits for a task.
        await script.until(lambda: ("get_task", 3) in script.calls)
        assert not running.done()
    polls = [report for op, report in script.calls if op == "get_task"]
    # The first report's poll failed, so it went again; each later one went once.
    assert polls[:5] == [None, 1, 1, 2, 3]
    # Nothing went on its own while the worker was polling. Stopping mid-poll, the worker
    # could not know whether task 3's report arrived, so it sent it once more on its own
    # (the controller ignores a report it already took).
    assert [r for op, r in script.calls if op == "task_done"] == [3]


class Recorder(Echo):
    """Keeps the inputs each task brought."""

    def __init__(self) -> None:
        self.inputs: list[dict[str, list[Any]]] = []

    async def run(self, task: m.TaskMsg, inputs: dict[str, list[Any]]) -> RoleOutput:
        self.inputs.append(inputs)
        return await super().run(task, inputs)


async def test_an_inline_value_shaped_like_a_handle_stays_inline() -> None:
    # Spans of five numbers have a handle's length; only a value sent as a handle
    # (`transport.handles.to_wire`) is read from the store (this one has none).
    script = Script()
    script.fail_first_report = False
    role = Recorder()
    spans = [[0, 4, 8, 12, 16], [1, 2, 3, 4, 5]]
    async with worker_against(script, role):
        script.tasks.put_nowait({**task(1), "rows": [1, 2], "inputs": {"span": spans}})
        await script.until(lambda: ("get_task", 1) in script.calls)
    assert role.inputs == [{"span": spans}]


class Interruptible(Echo):
    """A rollout whose task runs until a new version arrives, loaded while it runs (as
    episodes with ``rollout.partial`` load one between two decode steps)."""

    loads_weights = True
    interruptible = True

    def __init__(self) -> None:
        self.running = asyncio.Event()
        self.loaded = asyncio.Event()

    async def run(self, task: m.TaskMsg, inputs: dict[str, list[Any]]) -> RoleOutput:
        self.running.set()
        await self.loaded.wait()
        return await super().run(task, inputs)

    async def load_version(self, version: int, weights: dict[str, torch.Tensor]) -> int:
        self.loaded.set()
        return 3  # running sequences that continue under it


async def test_an_interruptible_role_loads_a_version_while_its_task_runs() -> None:
    script = Script()
    script.fail_first_report = False
    role = Interruptible()
    async with worker_against(script, role) as (worker, _):
        script.tasks.put_nowait(task(1))
        await role.running.wait()
        assert script.publisher is not None
        await script.publisher.publish(m.TOPIC_VERSION, {"version": 1, "weights": {}})
        # Without waiting for the task: it only ends once the version is loaded.
        await script.until(lambda: ("get_task", 1) in script.calls and script.served)
        assert worker.version == 1
    assert script.served == [{"version": 1, "interrupted": 1, "continued": 3}]


class Gate(asyncio.Event):
    """The worker's admission gate, seen from outside: ``closed`` is set once it closes (a
    version waits to load), ``blocking`` once a task waits at it closed."""

    def __init__(self) -> None:
        super().__init__()
        self.set()
        self.closed = asyncio.Event()
        self.blocking = asyncio.Event()

    def clear(self) -> None:
        super().clear()
        self.closed.set()

    async def wait(self) -> bool:
        if not self.is_set():
            self.blocking.set()
        return await super().wait()


class Exclusive(Echo):
    """A rollout that loads a version only with no task running (``rollout.partial`` off);
    task 1 runs until released. Keeps the order of what happened."""

    loads_weights = True

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def run(self, task: m.TaskMsg, inputs: dict[str, list[Any]]) -> RoleOutput:
        self.log.append(("start", task["task_id"]))
        self.started.set()
        if task["task_id"] == 1:
            await self.release.wait()
        self.log.append(("end", task["task_id"]))
        return await super().run(task, inputs)

    async def load_version(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        self.log.append(("load", version))


async def test_a_worker_of_several_tasks_admits_none_while_a_version_waits() -> None:
    # Two pull loops: the second one's task arrives while a version waits for the first task.
    # Started, it would keep the worker busy (and a stream of them, never idle to load).
    script = Script()
    script.fail_first_report = False
    role = Exclusive()
    async with worker_against(script, role, capacity=2) as (worker, _):
        gate = Gate()
        worker._gate = gate
        script.tasks.put_nowait(task(1))
        await role.started.wait()
        assert script.publisher is not None
        await script.publisher.publish(m.TOPIC_VERSION, {"version": 1, "weights": {}})
        async with asyncio.timeout(10):
            await gate.closed.wait()
            script.tasks.put_nowait(task(2))
            await gate.blocking.wait()  # task 2 is held, not started
        assert role.log == [("start", 1)]
        role.release.set()
        await script.until(lambda: ("get_task", 2) in script.calls)
        assert worker.version == 1
    # Task 1 ended, the version loaded with nothing running, then task 2 ran under it.
    assert role.log == [("start", 1), ("end", 1), ("load", 1), ("start", 2), ("end", 2)]
    assert script.served == [{"version": 1}]
