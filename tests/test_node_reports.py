"""The controller's reading of a node agent's gathered reports (`WorkerApi`'s ``node_served``
and ``node_heartbeat``, entries as arrays: `flowrl.node_relay`): each entry is checked by
itself, and one that is wrong is skipped, not the request."""

from __future__ import annotations

import inspect
from typing import Any

import msgpack
import pytest
import structlog

from flowrl import messages as m
from flowrl.control.assignments import Assignments
from flowrl.control.worker_api import WorkerApi
from flowrl.registry import Registry, WorkerInfo

NODE_TOKEN = b"n" * 16


class Served:
    """The controller's side of `WorkerEvents` that these two requests reach: what each
    ``node_served`` passed on (the rest of the protocol is never called here)."""

    def __init__(self) -> None:
        self.batches: list[list[tuple[WorkerInfo, int]]] = []
        self.interrupted: list[list[tuple[WorkerInfo, int, int]]] = []

    def workers_serve(self, served: list[tuple[WorkerInfo, int]],
                      interrupted: list[tuple[WorkerInfo, int, int]]) -> None:
        self.batches.append(served)
        self.interrupted.append(interrupted)


@pytest.fixture
def setup() -> tuple[WorkerApi, Registry, Served]:
    registry = Registry(60.0)
    for i, node in enumerate(("n1", "n1", "n1", "n2")):
        registry.register(name=f"rollout.{i}.0", role="rollout", node=node, pid=100 + i,
                          capacity=1, version=0, now=0.0)
    events = Served()
    api = WorkerApi(registry, Assignments(), events, has_role=lambda role: True,  # type: ignore[arg-type]
                    now=lambda: 30.0,
                    node_token=lambda node: NODE_TOKEN if node in ("n1", "n2") else None)
    return api, registry, events


async def call(api: WorkerApi, op: str, payload: dict[str, Any]) -> Any:
    # Through msgpack, as the request arrives: what a worker id or a token decodes to. A
    # handler answers at once or with an awaitable (`transport.rpc.Handler`).
    reply = api.handlers()[op](msgpack.unpackb(msgpack.packb(payload)), b"")
    return await reply if inspect.isawaitable(reply) else reply


async def test_each_served_entry_is_checked_by_itself(
        setup: tuple[WorkerApi, Registry, Served]) -> None:
    api, registry, events = setup
    w0, w1, w2, other = registry.of_role("rollout")  # in registration order
    entries: list[Any] = [
        [w0.worker_id, w0.token, 3],  # taken
        [w1.worker_id, w1.token, 3, 2, 5],  # taken: interrupted 2 tasks, 5 sequences go on
        [w2.worker_id, b"x" * 16, 3],  # a wrong token
        [w2.worker_id, w2.token, -1],  # a version out of range
        [w2.worker_id, w2.token, 3, 1],  # neither three nor five values
        [w2.worker_id, w2.token, "3"],  # a version of the wrong type
        [other.worker_id, other.token, 3],  # another node's worker
        ["rollout-99", b"t" * 16, 3],  # not registered (gone before its agent reported)
        {"worker_id": w2.worker_id, "token": w2.token, "version": 3},  # a map, not an array
        None,
    ]
    with structlog.testing.capture_logs() as logs:
        reply = await call(api, m.OP_NODE_SERVED, {"node": "n1", "token": NODE_TOKEN,
                                                   "served": entries, "dropped": []})
    assert reply == {"ok": True, "served": 2}
    assert [(i.worker_id, v) for i, v in events.batches[0]] == [
        (w0.worker_id, 3), (w1.worker_id, 3)]
    assert [(i.worker_id, a, b) for i, a, b in events.interrupted[0]] == [(w1.worker_id, 2, 5)]
    said = [e["event"] for e in logs]
    assert said.count("ignored a served report without its worker's token") == 1
    assert said.count("ignored a malformed served report") == 2  # out of range, wrong type
    # The request itself must be the node's agent's.
    with pytest.raises(PermissionError):
        await call(api, m.OP_NODE_SERVED, {"node": "n1", "token": b"x" * 16,
                                           "served": entries[:1], "dropped": []})
    with pytest.raises(ValueError, match="at most"):
        await call(api, m.OP_NODE_SERVED, {"node": "n1", "token": NODE_TOKEN,
                                           "served": [entries[0]] * (m.MAX_NODE_SERVED + 1),
                                           "dropped": []})


async def test_each_heartbeat_entry_is_checked_by_itself(
        setup: tuple[WorkerApi, Registry, Served]) -> None:
    api, registry, _ = setup
    w0, w1, w2, other = registry.of_role("rollout")  # in registration order
    before = {w.worker_id: w.deadline for w in (w0, w1, w2, other)}
    beats: list[Any] = [
        [w0.worker_id, w0.token],  # renewed
        [w1.worker_id, b"x" * 16],  # a wrong token: not renewed
        [w2.worker_id, w2.token, 1],  # not [id, token]
        [other.worker_id, other.token],  # another node's worker
        ["rollout-99", b"t" * 16],  # gone: named in the reply, so its agent tells it to exit
        {"worker_id": w2.worker_id, "token": w2.token},
    ]
    reply = await call(api, m.OP_NODE_HEARTBEAT,
                       {"node": "n1", "token": NODE_TOKEN, "workers": beats})
    assert reply == {"ok": True, "unknown": ["rollout-99"]}
    renewed = {w.worker_id for w in (w0, w1, w2, other) if w.deadline != before[w.worker_id]}
    assert renewed == {w0.worker_id}
