"""What the workers of one process share: one fetch of a version's weights (`WeightFetches`),
against a real store server read from another node as a rollout process off the trainer's node
reads them, counting the server's requests; and one request to their node's relay for the
``served`` reports of one turn (`ServedReports`), against a real RPC server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

from flowrl import messages as m
from transport.endpoints import ipc_endpoint
from transport.errors import RemoteError
from transport.handles import Handle, handle_to_wire
from transport.rpc import RpcClient, RpcServer
from transport.store import SampleStore
from transport.store_client import StoreClient
from transport.store_server import StoreServer
from workers.runtime import ServedReports, WeightFetches, publish_weights

pytestmark = pytest.mark.timeout(60)

WEIGHTS = {"layer.weight": torch.randn(16, 8), "norm": torch.randn(8, dtype=torch.float64)}


@pytest.fixture
async def served(run_id: str) -> AsyncIterator[tuple[StoreServer, StoreClient, StoreClient]]:
    """The trainer's node's store server, a writer on that node, and a reader on another."""
    store = SampleStore(run_id, "n0", capacity_bytes=16 << 20)
    endpoint = ipc_endpoint(run_id, "store")
    try:
        async with (StoreServer(store, endpoint) as server,
                    StoreClient(run_id, "n0", endpoint) as writer,
                    StoreClient(run_id, "n1", "ipc:///unused", peers={"n0": endpoint}) as reader):
            yield server, writer, reader
    finally:
        store.close()


def reads(server: StoreServer) -> int:
    return server.statistics().requests


async def test_the_workers_of_a_process_fetch_a_version_once(
        served: tuple[StoreServer, StoreClient, StoreClient]) -> None:
    server, writer, reader = served
    wire = await publish_weights(writer, WEIGHTS)
    fetches = WeightFetches(reader, workers=8)
    before = reads(server)
    got = await asyncio.gather(*(fetches.fetch(1, wire) for _ in range(8)))
    assert reads(server) - before == 1
    assert (fetches.started, fetches.shared) == (1, 7)
    for state in got:
        assert all(torch.equal(state[n], w) for n, w in WEIGHTS.items())
    # Every worker took it: nothing is held, and an ask after that reads again.
    await fetches.fetch(1, wire)
    assert reads(server) - before == 2


async def test_a_newer_version_replaces_one_some_workers_skipped(
        served: tuple[StoreServer, StoreClient, StoreClient]) -> None:
    _, writer, reader = served
    v1 = await publish_weights(writer, WEIGHTS)
    v2 = await publish_weights(writer, {n: w * 2 for n, w in WEIGHTS.items()})
    fetches = WeightFetches(reader, workers=4)
    await asyncio.gather(*(fetches.fetch(1, v1) for _ in range(2)))  # two workers skip it
    got = await asyncio.gather(*(fetches.fetch(2, v2) for _ in range(4)))
    assert (fetches.started, fetches.shared) == (2, 4)
    assert all(torch.equal(s["norm"], WEIGHTS["norm"] * 2) for s in got)
    # A version's description that differs from the one held is fetched, not shared.
    await fetches.fetch(2, v1)
    assert fetches.started == 3


async def test_a_process_of_one_worker_keeps_nothing(
        served: tuple[StoreServer, StoreClient, StoreClient]) -> None:
    server, writer, reader = served
    wire = await publish_weights(writer, WEIGHTS)
    fetches = WeightFetches(reader, workers=1)
    before = reads(server)
    for _ in range(2):
        await fetches.fetch(1, wire)
    assert reads(server) - before == 2
    assert (fetches.started, fetches.shared) == (2, 0)


async def test_a_failed_fetch_fails_its_sharers_and_is_not_kept(
        served: tuple[StoreServer, StoreClient, StoreClient]) -> None:
    _, writer, reader = served
    wire = await publish_weights(writer, WEIGHTS)
    # The same segments named on a node the reader has no server for: the read fails.
    lost = {n: [handle_to_wire(Handle.from_wire(h)._replace(node="n9")), shape]
            for n, (h, shape) in wire.items()}
    fetches = WeightFetches(reader, workers=3)
    results = await asyncio.gather(*(fetches.fetch(1, lost) for _ in range(2)),
                                   return_exceptions=True)
    assert all(isinstance(r, ValueError) and "no store endpoint known for node 'n9'"
               in str(r) for r in results), results
    assert (fetches.started, fetches.shared) == (1, 1)
    with pytest.raises(ValueError, match="'n9'"):  # fetched again, not the failure handed on
        await fetches.fetch(1, lost)
    assert fetches.started == 2


async def test_one_worker_giving_up_does_not_cancel_the_others_fetch(
        served: tuple[StoreServer, StoreClient, StoreClient]) -> None:
    _, writer, reader = served
    wire = await publish_weights(writer, WEIGHTS)
    fetches = WeightFetches(reader, workers=2)
    first = asyncio.create_task(fetches.fetch(1, wire))
    second = asyncio.create_task(fetches.fetch(1, wire))
    await asyncio.sleep(0)  # one turn: each task runs up to its wait
    assert (fetches.started, fetches.shared) == (1, 1)  # both wait on the one read
    first.cancel()  # its weight-sync deadline, say
    state = await second
    assert torch.equal(state["layer.weight"], WEIGHTS["layer.weight"])
    with pytest.raises(asyncio.CancelledError):
        await first


class Relay:
    """A relay's ``served_many`` endpoint that records each request's reports, and refuses
    those of worker ``refuse``."""

    def __init__(self, refuse: str = "") -> None:
        self.requests: list[list[str]] = []
        self.refuse = refuse

    async def served_many(self, p: Any, peer: bytes) -> dict[str, Any]:
        workers = [r["worker_id"] for r in p["reports"]]
        self.requests.append(workers)
        if self.refuse in workers:
            raise ValueError(f"refused {self.refuse}")
        return {"ok": True}


@pytest.fixture
async def relay(run_id: str) -> AsyncIterator[tuple[Relay, RpcClient]]:
    recorder = Relay(refuse="bad")
    async with (RpcServer(ipc_endpoint(run_id, "served"),
                          {m.OP_SERVED_MANY: recorder.served_many}) as server,
                RpcClient(server.endpoint, timeout=10.0) as client):
        yield recorder, client


def report(worker: str) -> dict[str, Any]:
    return {"worker_id": worker, "token": b"t", "version": 1}


async def test_the_reports_of_one_turn_leave_in_one_request(
        relay: tuple[Relay, RpcClient]) -> None:
    recorder, client = relay
    served = ServedReports(client)
    await asyncio.gather(*(served.report(report(f"w{i}")) for i in range(5)))
    assert recorder.requests == [[f"w{i}" for i in range(5)]]
    await served.report(report("w5"))  # a later turn: a request of its own
    assert recorder.requests[1:] == [["w5"]]
    assert served.requests == 2


async def test_a_refused_request_fails_each_of_its_reports(
        relay: tuple[Relay, RpcClient]) -> None:
    recorder, client = relay
    served = ServedReports(client)
    results = await asyncio.gather(served.report(report("w1")), served.report(report("bad")),
                                   return_exceptions=True)
    assert recorder.requests == [["w1", "bad"]]
    assert [type(r) for r in results] == [RemoteError, RemoteError]
    await served.report(report("w2"))  # the next turn's request is not the failed one
    assert recorder.requests[1:] == [["w2"]]


async def test_one_worker_giving_up_does_not_cancel_the_others_report(
        relay: tuple[Relay, RpcClient]) -> None:
    recorder, client = relay
    served = ServedReports(client)
    first = asyncio.create_task(served.report(report("w1")))
    second = asyncio.create_task(served.report(report("w2")))
    await asyncio.sleep(0)  # one turn: both reports are in the request, which is on its way
    first.cancel()
    await second
    assert recorder.requests == [["w1", "w2"]]
    with pytest.raises(asyncio.CancelledError):
        await first
