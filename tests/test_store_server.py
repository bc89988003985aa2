"""StoreServer / StoreClient: worker processes on the node, readers on another node."""

from __future__ import annotations

import asyncio
import importlib
import json
import signal
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import zmq
import zmq.asyncio

from transport import lazy_torch, shm
from transport.endpoints import ipc_endpoint, remove_run_dir, tcp_endpoint
from transport.errors import NodeLost, RemoteError, UnknownSegment
from transport.handles import free_entries, rows_from_wire, run_to_wire
from transport.rpc import RpcClient
from transport.store import Handle, SampleStore
from transport.store_client import StoreClient
from transport.store_server import StoreServer

pytestmark = pytest.mark.timeout(60)

STEP = 30.0  # bound on any single wait for a child process


@pytest.fixture
def run_id() -> Iterator[str]:
    rid = f"s{uuid.uuid4().hex[:10]}"
    yield rid
    leftovers = shm.segments_of(rid)
    for name in leftovers:
        shm.unlink(name)
    remove_run_dir(rid)
    assert leftovers == [], "segments left behind"


class Child:
    """A Python child process speaking JSON lines on stdin/stdout."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def recv(self) -> Any:
        assert self.proc.stdout is not None
        async with asyncio.timeout(STEP):
            line = await self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"child exited early with {await self.proc.wait()}")
        return json.loads(line)

    async def send(self, obj: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj).encode() + b"\n")
        await self.proc.stdin.drain()

    async def finish(self) -> int:
        async with asyncio.timeout(STEP):
            return await self.proc.wait()


@asynccontextmanager
async def child(code: str, *args: str) -> AsyncIterator[Child]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        yield Child(proc)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        assert proc.stdin is not None
        proc.stdin.close()


@asynccontextmanager
async def served(
    run_id: str, endpoint: str, capacity: int = 64 << 20, pool_bytes: int | None = None
) -> AsyncIterator[tuple[SampleStore, StoreServer]]:
    store = SampleStore(run_id, "node0", capacity_bytes=capacity, pool_bytes=pool_bytes)
    try:
        async with StoreServer(store, endpoint) as server:
            yield store, server
    finally:
        store.close()


def _all(handles: dict[str, list[Handle]]) -> list[Handle]:
    return [h for hs in handles.values() for h in hs]


def _wire(handles: dict[str, list[Handle]]) -> Any:
    return json.loads(json.dumps(handles))


def _handles(wire: Any) -> dict[str, list[Handle]]:
    return {k: [Handle.from_wire(h) for h in hs] for k, hs in wire.items()}


_WORKER = """
import asyncio, json, sys
import torch
from transport.store import Handle
from transport.store_client import StoreClient

async def main():
    run_id, endpoint = sys.argv[1], sys.argv[2]
    async with StoreClient(run_id, "node0", endpoint) as client:
        rows = [torch.arange(n, dtype=torch.int32) for n in (5, 0, 3)]
        handles = await client.put({"ids": rows, "score": torch.tensor([0.5, 1.5, 2.5])})
        views = await client.get(handles["ids"])
        batch, lengths = await client.get_padded(handles["ids"], pad=-1)
        maps = open("/proc/self/maps").read()
        print(json.dumps({
            "handles": handles,
            "views": [v.tolist() for v in views],
            "batch": batch.tolist(),
            "lengths": lengths.tolist(),
            "mapped": handles["ids"][0][1] in maps,
            "stats": await client.stats(),
        }), flush=True)
        json.loads(sys.stdin.readline())  # wait until the parent has looked

asyncio.run(main())
"""


async def test_worker_process_writes_shared_memory_and_reads_it_back(run_id: str) -> None:
    async with (
        served(run_id, ipc_endpoint(run_id, "store")) as (store, server),
        child(_WORKER, run_id, server.endpoint) as worker,
    ):
        got = await worker.recv()
        handles = _handles(got["handles"])
        assert got["views"] == [[0, 1, 2, 3, 4], [], [0, 1, 2]]
        assert got["batch"] == [[0, 1, 2, 3, 4], [-1] * 5, [0, 1, 2, -1, -1]]
        assert got["lengths"] == [5, 0, 3]
        assert got["mapped"] is True  # the worker read its own node's memory directly
        assert got["stats"]["segments"] == 1
        # The store process sees what the worker wrote, and it holds the segment.
        (segment,) = {h.segment for h in _all(handles)} - {""}
        assert shm.SegmentName.parse(segment) == shm.SegmentName(
            run_id, store.owner, worker.proc.pid, 0
        )
        assert [t.tolist() for t in store.get(handles["ids"])] == got["views"]
        assert store.get(handles["score"])[1].item() == 1.5
        spare_held = store.used_bytes
        await worker.send("done")
        assert await worker.finish() == 0
        # Closing the client gave its spare grant back; the segment stays until freed.
        assert store.used_bytes < spare_held
        store.free(_all(handles))
        assert store.used_bytes == store.statistics().pooled_bytes


_OTHER_NODE = """
import asyncio, json, os, sys
import torch
from transport.store import Handle
from transport.store_client import StoreClient

def opened(names):
    maps = open("/proc/self/maps").read()
    fds = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
           if os.path.exists(f"/proc/self/fd/{fd}")]
    return [n for n in names if n in maps or any(n in f for f in fds)]

async def main():
    run_id, endpoint = sys.argv[1], sys.argv[2]
    wire = json.loads(sys.stdin.readline())
    handles = {k: [Handle.from_wire(h) for h in hs] for k, hs in wire.items()}
    names = sorted({h.segment for hs in handles.values() for h in hs if h.segment})
    client = StoreClient(run_id, "node1", "ipc:///nonexistent", peers={"node0": endpoint})
    async with client:
        views = await client.get(handles["ids"])
        batch, lengths = await client.get_padded(handles["ids"], pad=-1)
        logp, _ = await client.get_padded(handles["logp"])
        mixed = await client.get(handles["ids"][::-1] + handles["logp"][:1])
        # Concurrent reads travel together in one request; each gets its own rows.
        together = await asyncio.gather(
            client.get_padded(handles["logp"]),
            client.get(handles["ids"]),
            client.get_padded(handles["ids"], pad=-2),
        )
        result = {
            "views": [v.tolist() for v in views],
            "batch": batch.tolist(),
            "lengths": lengths.tolist(),
            "logp": logp.tolist(),
            "mixed": [v.tolist() for v in mixed],
            "opened": opened(names),
            "together": [
                together[0][0].tolist(),
                [v.tolist() for v in together[1]],
                together[2][0].tolist(),
            ],
        }
        await client.free([h for hs in handles.values() for h in hs])
        try:
            await client.get(handles["ids"])
            result["after_free"] = "read"
        except Exception as exc:
            result["after_free"] = type(exc).__name__ + ": " + str(exc)
    print(json.dumps(result), flush=True)

asyncio.run(main())
"""


async def test_reader_on_another_node_reads_through_the_server(run_id: str) -> None:
    async with (
        served(run_id, tcp_endpoint()) as (store, server),
        child(_OTHER_NODE, run_id, server.endpoint) as reader,
    ):
        ids = [torch.arange(n, dtype=torch.int64) * 7 for n in (4, 1, 0, 6)]
        logp = torch.randn(4, 5)
        handles = await store.put({"ids": ids, "logp": logp})
        await reader.send(_wire(handles))
        got = await reader.recv()
        assert await reader.finish() == 0
    assert got["opened"] == []  # never mapped nor opened node0's shared memory
    assert got["views"] == [t.tolist() for t in ids]
    assert got["batch"] == [[0, 7, 14, 21, -1, -1], [0] + [-1] * 5, [-1] * 6, list(range(0, 42, 7))]
    assert got["lengths"] == [4, 1, 0, 6]
    assert got["logp"] == logp.tolist()
    assert got["mixed"] == [t.tolist() for t in ids[::-1]] + [logp[0].tolist()]
    padded_ids = [[0, 7, 14, 21, -2, -2], [0] + [-2] * 5, [-2] * 6, list(range(0, 42, 7))]
    assert got["together"] == [logp.tolist(), [t.tolist() for t in ids], padded_ids]
    # The reader freed the handles at node0's server; reading them again fails remotely.
    assert got["after_free"].startswith("RemoteError")
    assert "UnknownSegment" in got["after_free"]


_READ_ONCE = """
import asyncio, json, sys
from transport.store import Handle
from transport.store_client import StoreClient

async def main():
    run_id, endpoint = sys.argv[1], sys.argv[2]
    handles = [Handle.from_wire(h) for h in json.loads(sys.stdin.readline())]
    async with StoreClient(run_id, "node1", "ipc:///nonexistent",
                           peers={"node0": endpoint}) as client:
        print(json.dumps([v.tolist() for v in await client.get(handles)]), flush=True)

asyncio.run(main())
"""


async def test_the_first_read_from_another_node_imports_torch_off_the_event_loop(
        run_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node agent runs without torch until another node first reads through it. That read
    imports torch in a thread, so the agent's loop goes on (its relay, its heartbeats: a node
    silent for ``node_timeout_s`` is declared lost). On the loop, the import stalled an agent
    for ~1 s, and for over 3 s on busy cores."""
    async with served(run_id, tcp_endpoint()) as (store, server):
        ids = [torch.arange(n, dtype=torch.int64) for n in (3, 5)]
        handles = (await store.put({"ids": ids}))["ids"]
        # This process imported torch long ago, so the proxy is emptied as in a fresh agent and
        # the import is played by a blocking sleep: what the real one is to the thread it runs
        # in. A ticker on the loop counts the turns the loop took meanwhile.
        ticks = 0
        imports: list[tuple[bool, int]] = []  # (on the loop's thread, ticks during it)

        def slow_import(name: str) -> Any:
            before = ticks
            time.sleep(0.5)
            imports.append((threading.current_thread() is threading.main_thread(),
                            ticks - before))
            return importlib.import_module(name)

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.005)
                ticks += 1

        monkeypatch.setattr(lazy_torch.torch, "_module", None)
        monkeypatch.setattr(lazy_torch, "importlib", SimpleNamespace(import_module=slow_import))
        ticker = asyncio.create_task(tick())
        try:
            async with child(_READ_ONCE, run_id, server.endpoint) as reader:
                await reader.send(json.loads(json.dumps(handles)))
                got = await reader.recv()
                assert await reader.finish() == 0
        finally:
            ticker.cancel()
    assert got == [t.tolist() for t in ids]
    assert len(imports) == 1, imports  # once, by the read
    on_loop, turns = imports[0]
    assert not on_loop, imports  # in a thread
    assert turns > 0, imports  # and the loop went on while it ran


_FILLER = """
import asyncio, json, sys
import torch
from transport.store_client import StoreClient

async def main():
    run_id, endpoint = sys.argv[1], sys.argv[2]
    async with StoreClient(run_id, "node0", endpoint) as client:
        for i in range(3):
            handles = await client.put({"x": [torch.full((1 << 16,), i, dtype=torch.uint8)]})
            print(json.dumps({"put": i, "handles": handles}), flush=True)
        json.loads(sys.stdin.readline())

asyncio.run(main())
"""


async def test_a_full_store_makes_worker_puts_wait_until_a_free(run_id: str) -> None:
    segment = 1 << 16
    async with (
        served(run_id, ipc_endpoint(run_id, "store"), 2 * segment, 0) as (store, server),
        child(_FILLER, run_id, server.endpoint) as filler,
    ):
        first = await filler.recv()
        second = await filler.recv()
        assert [first["put"], second["put"]] == [0, 1]
        await store.wait_waiting_puts(1)  # the third put waits at the server
        assert store.used_bytes == store.capacity_bytes
        store.free(_all(_handles(second["handles"])))
        third = await filler.recv()
        assert third["put"] == 2
        assert store.used_bytes <= store.capacity_bytes
        await filler.send("done")
        assert await filler.finish() == 0
        store.free(_all(_handles(first["handles"])) + _all(_handles(third["handles"])))
        assert store.used_bytes == 0


_KILLED_MID_PUT = """
import asyncio, json, sys, threading
import torch
from transport import packing
from transport.store_client import StoreClient

def stuck(plan, segment):
    print(json.dumps("writing"), flush=True)
    threading.Event().wait()  # never returns: killed here, its segment half-written

async def main():
    run_id, endpoint = sys.argv[1], sys.argv[2]
    client = StoreClient(run_id, "node0", endpoint)
    handles = await client.put({"x": [torch.ones(1000)]})
    print(json.dumps(handles), flush=True)
    packing.write_field = stuck
    await client.put({"x": [torch.ones(1000)]})

asyncio.run(main())
"""


async def test_a_worker_killed_mid_put_leaks_nothing(run_id: str) -> None:
    async with (
        served(run_id, ipc_endpoint(run_id, "store")) as (store, server),
        child(_KILLED_MID_PUT, run_id, server.endpoint) as victim,
    ):
        committed = _handles(await victim.recv())
        assert await victim.recv() == "writing"
        pid = victim.proc.pid
        half_written = shm.segments_of(run_id, store.owner, pid)
        assert len(half_written) == 2
        assert sum(n.endswith(".tmp") or n.endswith(".pool") for n in half_written) == 1
        held = store.used_bytes
        victim.proc.send_signal(signal.SIGKILL)
        assert await victim.finish() == -signal.SIGKILL
        assert store.reap_dead_writers() == [pid]
        # The unpublished segment is gone and its capacity is back; the committed one stays.
        assert shm.segments_of(run_id, store.owner, pid) == [committed["x"][0].segment]
        assert store.used_bytes < held
        assert torch.equal(store.get(committed["x"])[0], torch.ones(1000))
        store.free(committed["x"])
        assert store.used_bytes == store.statistics().pooled_bytes
    assert shm.segments_of(run_id) == []


async def test_server_answers_bad_requests_with_errors_and_keeps_serving(run_id: str) -> None:
    async with served(run_id, ipc_endpoint(run_id, "store")) as (store, server):
        handles = await store.put({"x": [torch.ones(4)]})
        (h,) = handles["x"]
        async with RpcClient(server.endpoint) as rpc:
            bad_calls: list[tuple[str, Any]] = [
                ("free", {"handles": [["node0", "../etc/passwd", 0, "uint8", [1]]]}),
                ("free", {"handles": "nope"}),
                ("free", {"handles": [list(h._replace(node="elsewhere"))]}),
                ("read", {"ranges": [[h.segment, 0, 1 << 30]]}),
                ("read", {"ranges": [["flowrl-x-1-2-3-4", 0, 1]]}),
                ("read", {"ranges": [[h.segment, -1, 4]]}),
                ("commit", {"pid": 1, "grant": 99, "name": h.segment, "refs": 1}),
                ("reserve", {"pid": 1 << 30, "size": 4096}),
                ("reserve", {"pid": 1, "size": 1 << 40}),
            ]
            for op, payload in bad_calls:
                with pytest.raises(RemoteError):
                    await rpc.call(op, payload)
            (buf,) = await rpc.call("read", {"ranges": [[h.segment, h.offset, h.nbytes]]})
            assert torch.equal(buf.view(torch.float32), torch.ones(4))
        assert store.holds(h.segment)  # a refused commit never removes a held segment
        store.free(handles["x"])


async def test_a_free_takes_a_runs_rows_as_one_entry(run_id: str) -> None:
    async with served(run_id, ipc_endpoint(run_id, "store")) as (store, server):
        handles = (await store.put({"x": [torch.ones(n) for n in (4, 3, 2)]}))["x"]
        run = run_to_wire(handles)
        assert run is not None
        (segment,) = {h.segment for h in handles}
        async with RpcClient(server.endpoint) as rpc:
            with pytest.raises(RemoteError, match="row 3 of a run of 3 rows"):
                await rpc.call("free", {"handles": [[run, [0, 3]]]})
            assert store.holds(segment)  # a refused free frees nothing
            # As the controller frees what it retired: the rows as an entry of their run.
            await rpc.call("free", {"handles": free_entries([(run, 2), 0.5, (run, 0)])})
            assert store.holds(segment)  # row 1 is still held
            with pytest.raises(RemoteError, match="freed twice"):
                await rpc.call("free", {"handles": [[run, [0]]]})
            await rpc.call("free", {"handles": [[run, [1]]]})
        assert not store.holds(segment)
        assert store.used_bytes == store.statistics().pooled_bytes


_LOOPER = """
import asyncio, json, os, sys
import torch
from transport.store_client import StoreClient

async def main():
    run_id, endpoint = sys.argv[1], sys.argv[2]
    async with StoreClient(run_id, "node0", endpoint) as client:
        for line in sys.stdin:
            value = json.loads(line)
            if value is None:
                break
            handles = await client.put({"x": torch.full((4, 1000), float(value))})
            segment = handles["x"][0].segment
            print(json.dumps({"handles": handles, "inode": os.stat("/dev/shm/" + segment).st_ino,
                              "read": (await client.get_padded(handles["x"]))[0][:, 0].tolist()}),
                  flush=True)

asyncio.run(main())
"""


async def test_a_worker_rewrites_recycled_segments_in_place(run_id: str) -> None:
    async with (
        served(run_id, ipc_endpoint(run_id, "store")) as (store, server),
        child(_LOOPER, run_id, server.endpoint) as worker,
    ):
        inodes = []
        for value in range(4):
            await worker.send(value)
            got = await worker.recv()
            assert got["read"] == [float(value)] * 4
            handles = _handles(got["handles"])
            assert torch.equal(store.get(handles["x"])[3], torch.full((1000,), float(value)))
            inodes.append(got["inode"])
            store.free(handles["x"])  # back to the pool, and from there to the worker again
        # Fresh segments for the first put and its spare grant; recycled files after that.
        assert len(set(inodes)) == 2
        assert store.statistics().pooled_bytes > 0
        await worker.send(None)
        assert await worker.finish() == 0


async def test_concurrent_remote_reads_share_a_request_but_not_its_failure(run_id: str) -> None:
    async with served(run_id, tcp_endpoint()) as (store, server):
        good = (await store.put({"x": torch.arange(8).view(2, 4)}))["x"]
        more = (await store.put({"x": torch.arange(3)}))["x"]
        gone = (await store.put({"x": torch.ones(2, 4)}))["x"]
        store.free(gone)
        peers = {"node0": server.endpoint}
        async with StoreClient(run_id, "node1", "ipc:///unused", peers=peers) as reader:
            before = server.statistics().requests
            (batch, _), views = await asyncio.gather(reader.get_padded(good), reader.get(more))
            assert server.statistics().requests == before + 1
            assert torch.equal(batch, torch.arange(8).view(2, 4))
            assert [v.item() for v in views] == [0, 1, 2]  # rows of shape ()
            ok, failed = await asyncio.gather(
                reader.get_padded(good), reader.get_padded(gone), return_exceptions=True
            )
        assert isinstance(ok, tuple)
        assert torch.equal(ok[0], torch.arange(8).view(2, 4))
        assert isinstance(failed, RemoteError)
        assert failed.kind == "UnknownSegment"
        store.free(good + more)


async def test_get_padded_many_reads_a_micro_batch_in_one_call(run_id: str) -> None:
    async with served(run_id, tcp_endpoint()) as (store, server):
        ids = [torch.arange(n) * 3 for n in (4, 0, 2)]
        handles = await store.put(
            {"ids": ids, "logp": torch.randn(3, 5), "mask": torch.ones(3, 5, dtype=torch.bool)}
        )
        other = (await store.put({"x": torch.arange(6).view(3, 2)}))["x"]
        fields: dict[str, Sequence[Handle]] = {
            k: rows_from_wire(v) for k, v in _wire({**handles, "x": other}).items()
        }
        fields["mixed"] = list(fields["x"][::-1])
        want = {k: store.get_padded(hs, pad=-1) for k, hs in fields.items()}
        local = StoreClient(run_id, "node0", server.endpoint)
        remote = StoreClient(run_id, "node1", "ipc:///unused", peers={"node0": server.endpoint})
        async with local, remote:
            got_local = await local.get_padded_many(fields, pad=-1)
            before = server.statistics().requests
            got_remote = await remote.get_padded_many(fields, pad=-1)
            assert server.statistics().requests == before + 1  # every field in one request
            for got in (got_local, got_remote):
                assert list(got) == list(fields)
                for name, (batch, lengths) in got.items():
                    assert torch.equal(batch, want[name][0]), name
                    assert torch.equal(lengths, want[name][1]), name
            assert await local.get_padded_many({}) == {}
            store.free(_all(handles))
            # A freed handle fails, here and there, however its field is read.
            for name in ("mask", "ids"):
                with pytest.raises(UnknownSegment):
                    await local.get_padded_many({"x": fields["x"], name: fields[name]})
                with pytest.raises(RemoteError) as failed:
                    await remote.get_padded_many({"x": fields["x"], name: fields[name]})
                assert failed.value.kind == "UnknownSegment"
            (batch, _) = (await local.get_padded_many({"x": fields["x"]}))["x"]
            assert torch.equal(batch, torch.arange(6).view(3, 2))
        store.free(other)


_READONLY_WRITER = """
import asyncio, json, sys
from transport.store import Handle
from transport.store_client import StoreClient

async def main():
    run_id, endpoint, handle = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    async with StoreClient(run_id, "node0", endpoint) as client:
        (view,) = await client.get_readonly([Handle.from_wire(handle)])
        print(float(view.sum()), flush=True)
        view[0] = 1.0  # through a read-only mapping: the process dies here

asyncio.run(main())
"""


async def test_readonly_views_see_recycled_contents_and_refuse_writes(run_id: str) -> None:
    async with (
        served(run_id, ipc_endpoint(run_id, "store")) as (store, server),
        StoreClient(run_id, "node0", server.endpoint) as writer,
        StoreClient(run_id, "node0", server.endpoint) as reader,
    ):
        seen = []
        for value in range(4):
            handles = await writer.put({"w": [torch.full((1000,), float(value))]})
            (view,) = await reader.get_readonly(handles["w"])
            assert torch.equal(view, torch.full((1000,), float(value)))
            seen.append(view.data_ptr())
            await reader.free(handles["w"])
        # Recycled segments come back to the reader already mapped: its views are the memory
        # it mapped before, at most one address per segment the pool rotates through.
        assert len(set(seen)) <= 2
        handles = await writer.put({"w": [torch.ones(4)]})
        async with child(_READONLY_WRITER, run_id, server.endpoint,
                         json.dumps(_wire(handles)["w"][0])) as proc:
            assert proc.proc.stdout is not None
            async with asyncio.timeout(STEP):
                assert (await proc.proc.stdout.readline()).strip() == b"4.0"
            assert await proc.finish() == -signal.SIGSEGV
        assert torch.equal(store.get(handles["w"])[0], torch.ones(4))  # unchanged
        await writer.free(handles["w"])


@pytest.mark.timeout(60)
async def test_reads_of_a_lost_node_fail_at_once_with_node_lost(run_id: str) -> None:
    # A peer that takes requests and never answers: the store server of a node whose agent
    # is stopped. A read waits for it (its timeout is far off) until the node is lost.
    ctx = zmq.asyncio.Context()
    peer = ctx.socket(zmq.ROUTER)
    peer.setsockopt(zmq.LINGER, 0)
    endpoint = ipc_endpoint(run_id, "silent-store")
    peer.bind(endpoint)
    lost = Handle("node0", f"flowrl-{run_id}-x", 0, "int64", (4,))
    client = StoreClient(run_id, "node1", "ipc:///unused", peers={"node0": endpoint},
                         timeout=600.0)
    try:
        async with client:
            reading = asyncio.ensure_future(client.get([lost]))
            async with asyncio.timeout(STEP):
                await peer.recv_multipart()  # the read is at the peer, waiting
            assert not reading.done()
            await client.lose_node("node0")
            async with asyncio.timeout(STEP):
                with pytest.raises(NodeLost, match="node 'node0' was lost"):
                    await reading
            # Later reads and frees of its handles fail at once too.
            with pytest.raises(NodeLost):
                await client.get([lost])
            with pytest.raises(NodeLost):
                await client.free([lost])
            await client.lose_node("node1")  # its own node: never lost from here
    finally:
        peer.close()
        ctx.term()
