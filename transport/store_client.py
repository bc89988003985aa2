"""`StoreClient`: a process's view of the node stores, over RPC to their `StoreServer`s
(`transport.store_server`, which describes the protocol and the guarantees).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import zmq

from transport import shm
from transport.curve import CurveKeys, for_endpoint
from transport.errors import ClosedError, MalformedMessage, NodeLost, RemoteError, TransportError
from transport.handles import DTYPES, ITEMSIZE, Handle, Run, contiguous_runs, single_run
from transport.packing import (
    FieldData,
    Grant,
    SegmentWriter,
    count_refs,
    make_handles,
    plan_fields,
    size_class,
)
from transport.reading import (
    DEFAULT_CACHE_BYTES,
    Mapped,
    MappingCache,
    cached_padded,
    map_runs,
    padded_from_runs,
    views_from_runs,
)
from transport.request_auth import RequestAuth
from transport.rpc import RpcClient
from transport.store_server import RESERVE_POLL_S

if TYPE_CHECKING:
    import torch
else:
    from transport.lazy_torch import torch

__all__ = ["StoreClient"]

#: how long a closing client waits for its store server to take back its grants.
RELEASE_TIMEOUT_S = 2.0
# Remote reads are split into requests of about this many bytes, sent concurrently, so the
# server's sends and the reader's receives overlap.
_READ_CHUNK = 4 << 20
# A reply carries at most this much: a range larger than a chunk goes alone in one request.
_MAX_REPLY = 1 << 34


# A grant as `transport.store_server` sends it.
def _grant_from_wire(value: Any) -> Grant | None:
    if value is None:
        return None
    gid, size, pool = value
    return Grant(int(gid), int(size), None if pool is None else str(pool))


class StoreClient:
    """A process's view of the sample store: its own node's, and other nodes' for reading.

    Writes go into shared memory directly, with capacity reserved from the node's server; reads
    of this node's handles map shared memory (no server involved); reads of other nodes' handles
    go to their servers, whose endpoints `peers` (or `set_peer`) give.
    """

    def __init__(
        self,
        run_id: str,
        node: str,
        endpoint: str,
        *,
        peers: Mapping[str, str] | None = None,
        ctx: zmq.Context[Any] | None = None,
        timeout: float = 30.0,
        spare: bool = True,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        curve: CurveKeys | None = None,
    ) -> None:
        """`spare`: ask for a spare grant with every commit (one round trip per put).
        `cache_bytes` bounds each of this process's two mapping caches (segments it wrote,
        segments it read), which make recycled segments free of page faults.
        `curve`: the run's keys, used for every tcp endpoint (other nodes' store servers),
        and to sign reads at the plaintext endpoint of a server that advertises one."""
        self.run_id = shm.check_run_id(run_id)
        self.node = node
        self.endpoint = endpoint
        self._peers = dict(peers or {})
        self._curve = curve
        self._ctx = ctx
        self._timeout = timeout
        self._spare_wanted = spare
        self._rpc: RpcClient | None = None
        self._remote: dict[str, RpcClient] = {}
        self._plain: dict[str, RpcClient] = {}  # other nodes' plaintext read endpoints
        self._discovering = asyncio.Lock()  # one hello per other node
        self._connecting = asyncio.Lock()  # one hello, one writer (its names must not repeat)
        self._writer: SegmentWriter | None = None
        self._capacity = 0
        self._spare: Grant | None = None
        self._pid = os.getpid()
        self._closed = False
        self._reads = MappingCache(cache_bytes)
        self._writes = MappingCache(cache_bytes, writable=True)
        self._batchers: dict[str, _ReadBatcher] = {}
        self._lost: set[str] = set()

    def set_peer(self, node: str, endpoint: str) -> None:
        """Where the store server of `node` listens (for reading and freeing its handles)."""
        self._peers[node] = endpoint

    async def lose_node(self, node: str) -> None:
        """`node` is out of the run, its store with it: calls to its server waiting now raise
        `NodeLost` at once (not after the timeout), and so does every later one."""
        if node == self.node or node in self._lost:
            return
        self._lost.add(node)
        self._peers.pop(node, None)
        self._batchers.pop(node, None)
        error = NodeLost(f"node {node!r} was lost with its store")
        for clients in (self._remote, self._plain):
            client = clients.pop(node, None)
            if client is not None:
                await client.aclose(error)

    # -- connections ----------------------------------------------------------------------------

    def _own(self) -> RpcClient:
        if self._closed:
            raise ClosedError("store client closed")
        if self._rpc is None:
            self._rpc = RpcClient(
                self.endpoint,
                ctx=self._ctx,
                timeout=self._timeout,
                curve=for_endpoint(self._curve, self.endpoint),
            )
        return self._rpc

    def _peer(self, node: str) -> RpcClient:
        if node == self.node:
            return self._own()
        if node in self._lost:
            raise NodeLost(f"node {node!r} was lost with its store")
        client = self._remote.get(node)
        if client is None:
            endpoint = self._peers.get(node)
            if endpoint is None:
                raise ValueError(f"no store endpoint known for node {node!r}")
            client = RpcClient(
                endpoint,
                ctx=self._ctx,
                timeout=self._timeout,
                max_bytes=_MAX_REPLY,
                curve=for_endpoint(self._curve, endpoint),
            )
            self._remote[node] = client
        return client

    async def _batcher(self, node: str) -> _ReadBatcher:
        batcher = self._batchers.get(node)
        if batcher is not None:
            return batcher
        self._peer(node)  # NodeLost for a lost node, before waiting for anything
        async with self._discovering:
            batcher = self._batchers.get(node)
            if batcher is None:
                reader = await self._reader(node)
                self._peer(node)  # lost meanwhile: NodeLost
                batcher = self._batchers[node] = _ReadBatcher(reader)
            return batcher

    async def _reader(self, node: str) -> RpcClient:
        """Where reads of `node`'s handles go: its server's plaintext endpoint when its
        ``hello`` (over curve, so it cannot be forged) advertises one, else its server."""
        peer = self._peer(node)
        keys = for_endpoint(self._curve, self._peers[node])
        if keys is None:
            return peer
        hello = await peer.call("hello")
        if not isinstance(hello, dict) or hello.get("node") != node:
            raise ValueError(f"the store server of node {node!r} answered as another node")
        plain = hello.get("plaintext")
        if plain is None:
            return peer
        if not isinstance(plain, str):
            raise MalformedMessage("a plaintext endpoint is a string")
        client = self._plain[node] = RpcClient(
            plain,
            ctx=self._ctx,
            timeout=self._timeout,
            max_bytes=_MAX_REPLY,
            authenticator=RequestAuth.from_keys(keys),
        )
        return client

    async def _connect(self) -> SegmentWriter:
        if self._writer is not None:
            return self._writer
        async with self._connecting:
            if self._writer is None:
                self._writer = await self._hello()
            return self._writer

    async def _hello(self) -> SegmentWriter:
        hello = await self._own().call("hello")
        if hello["node"] != self.node or hello["run_id"] != self.run_id:
            raise ValueError(
                f"store at {self.endpoint} serves node {hello['node']!r} of run "
                f"{hello['run_id']!r}, not node {self.node!r} of run {self.run_id!r}"
            )
        self._capacity = int(hello["capacity"])
        owner = shm.Owner(int(hello["owner"][0]), int(hello["owner"][1]))
        return SegmentWriter(self.run_id, owner, self._writes)

    # -- writing --------------------------------------------------------------------------------

    async def put(
        self, fields: Mapping[str, FieldData], *, spare: bool | None = None
    ) -> dict[str, list[Handle]]:
        """Write one micro-batch into this node's store; waits while the store is full.
        `spare`: ask for a spare grant of this put's size with the commit (default: as the
        client was made); a put that is not repeated soon (a model's weights) should not hold
        a second segment of its size reserved meanwhile."""
        plans, nbytes = plan_fields(fields)
        if nbytes == 0:
            self._own()
            return make_handles(self.node, "", plans)
        writer = await self._connect()
        size = size_class(nbytes)
        if size > self._capacity:
            raise ValueError(f"a put of {size} bytes exceeds the capacity {self._capacity}")
        grant = await self._grant(size)
        rpc = self._own()
        try:
            name, _ = writer.write(grant, plans)
        except BaseException:
            await rpc.call("abandon", {"grant": grant.id})
            raise
        refs = count_refs(plans)
        spare = await rpc.call(
            "commit",
            {
                "pid": self._pid,
                "grant": grant.id,
                "name": name,
                "refs": refs,
                "next": size if (self._spare_wanted if spare is None else spare) else 0,
            },
        )
        extra = _grant_from_wire(spare)
        if extra is not None and self._spare is None:
            self._spare = extra
        elif extra is not None:  # a concurrent put got one first: at most one is held
            await rpc.call("abandon", {"grant": extra.id})
        return make_handles(self.node, name, plans)

    async def _grant(self, size: int) -> Grant:
        rpc = self._own()
        spare, self._spare = self._spare, None
        if spare is not None:
            if size <= spare.size <= 2 * size:
                return spare
            await rpc.call("abandon", {"grant": spare.id})
        while True:
            reply = await rpc.call(
                "reserve",
                {"pid": self._pid, "size": size, "wait": RESERVE_POLL_S},
                timeout=RESERVE_POLL_S + self._timeout,
            )
            grant = _grant_from_wire(reply)
            if grant is not None:
                return grant

    # -- reading --------------------------------------------------------------------------------

    async def _buffers(self, runs: Sequence[Run], cache: MappingCache | None) -> list[torch.Tensor]:
        """One uint8 buffer per run: this node's through `cache` (fresh mappings if None),
        other nodes' fetched from their servers, concurrently."""
        if all(r.node == self.node for r in runs):
            return map_runs(runs, cache)
        out: list[torch.Tensor | None] = [None] * len(runs)
        local = [k for k, r in enumerate(runs) if r.node == self.node]
        for k, buf in zip(local, map_runs([runs[k] for k in local], cache), strict=True):
            out[k] = buf
        remote: dict[str, list[int]] = {}
        for k, r in enumerate(runs):
            if r.node != self.node:
                remote.setdefault(r.node, []).append(k)
        fetches = [
            self._fetch(node, chunk, runs, out)
            for node, indices in remote.items()
            for chunk in _chunks(indices, runs)
        ]
        if len(fetches) == 1:
            await fetches[0]  # one request: no task needed
        elif fetches:
            await _all_or_first_error(fetches)
        return [b for b in out if b is not None]

    async def _fetch(
        self, node: str, indices: list[int], runs: Sequence[Run], out: list[torch.Tensor | None]
    ) -> None:
        ranges = [(runs[k].segment, runs[k].offset, runs[k].nbytes) for k in indices]
        batcher = await self._batcher(node)
        for k, buf in zip(indices, await batcher.read(ranges), strict=True):
            out[k] = buf

    async def get(self, handles: Sequence[Handle]) -> list[torch.Tensor]:
        """Per-row tensors: views of shared memory on this node, of received frames otherwise."""
        runs = contiguous_runs(handles)
        return views_from_runs(handles, runs, await self._buffers(runs, None))

    async def get_readonly(self, handles: Sequence[Handle]) -> list[torch.Tensor]:
        """Per-row tensors like `get`, but this node's rows are views of this process's cached
        read-only mapping: no copy, and no mapping or page fault for a recycled segment seen
        before. For readers that never write (an engine serving weights): a write into such
        a view is a segfault. Other nodes' rows are received frames, as with `get`."""
        runs = contiguous_runs(handles)
        return views_from_runs(handles, runs, await self._buffers(runs, self._reads))

    async def get_padded(
        self, handles: Sequence[Handle], pad: float | int | bool = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One padded batch and the lengths: one copy on this node; from another node, the
        received bytes themselves when the rows need no padding (the kernel's copy is the one
        copy), else one copy out of them."""
        if handles and handles[0].node == self.node:  # this node's: the common case first
            fast = cached_padded(handles, self._reads)
            if fast is not None:
                return fast
        single = single_run(handles) if handles else None
        if single is not None:
            run, lens = single
            (buf,) = await self._buffers([run], self._reads)
            count, width, dtype = len(lens), lens[0], handles[0].dtype
            aligned = buf.data_ptr() % ITEMSIZE[dtype] == 0
            if run.node != self.node and aligned and lens.count(width) == count:
                # The received frame is this call's own writable memory: it is the batch.
                batch = buf.view(DTYPES[dtype]).view(count, width)
                return batch, torch.full((count,), width, dtype=torch.int64)
            return padded_from_runs(handles, [run], [buf], pad, lens)
        runs = contiguous_runs(handles)
        return padded_from_runs(handles, runs, await self._buffers(runs, self._reads), pad)

    async def get_padded_many(
        self, fields: Mapping[str, Sequence[Handle]], pad: float | int | bool = 0
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """`get_padded` of several fields at once (typically every field of one micro-batch),
        by field name. Fields of one put on this node look their segment up once (a freed
        handle still fails); the other fields are read concurrently, and those on another node
        travel in one request."""
        seen: dict[str, Mapped] = {}
        out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        rest: list[str] = []
        for name, handles in fields.items():
            fast = None
            if handles and handles[0].node == self.node:
                fast = cached_padded(handles, self._reads, seen)
            if fast is None:
                rest.append(name)
            else:
                out[name] = fast
        if not rest:
            return out
        if len(rest) == 1:
            out[rest[0]] = await self.get_padded(fields[rest[0]], pad)
        else:
            read = await _gather([self.get_padded(fields[name], pad) for name in rest])
            out.update(zip(rest, read, strict=True))
        return {name: out[name] for name in fields}

    async def free(self, handles: Sequence[Handle]) -> None:
        """Free handles at the nodes that hold them."""
        by_node: dict[str, list[Handle]] = {}
        for h in handles:
            if h.segment:
                by_node.setdefault(h.node, []).append(h)
        targets = [(self._peer(node), hs) for node, hs in by_node.items()]  # may raise: first
        calls = [client.call("free", {"handles": hs}) for client, hs in targets]
        if len(calls) == 1:
            await calls[0]
        elif calls:
            await _all_or_first_error(calls)

    async def stats(self, node: str | None = None) -> dict[str, Any]:
        reply: dict[str, Any] = await self._peer(node or self.node).call("stats")
        return reply

    # -- lifetime -------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Give back this process's grants and close every connection (idempotent)."""
        if self._closed:
            return
        try:
            if self._rpc is not None and self._writer is not None:
                # Best effort and brief: a store server that is gone (its node agent exited
                # with the run) must not hold up this process's exit; a live one also
                # reclaims a dead writer's grants by itself.
                with contextlib.suppress(TransportError):
                    await self._rpc.call("release", {"pid": self._pid}, timeout=RELEASE_TIMEOUT_S)
        finally:
            self._closed = True
            self._spare = None
            clients = [
                c
                for c in (self._rpc, *self._remote.values(), *self._plain.values())
                if c is not None
            ]
            self._rpc = None
            self._remote.clear()
            self._plain.clear()
            self._batchers.clear()
            self._reads.clear()
            self._writes.clear()
            for client in clients:
                await client.aclose()

    async def __aenter__(self) -> StoreClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


_T = TypeVar("_T")


async def _all_or_first_error(calls: Iterable[Awaitable[Any]]) -> None:
    """Run `calls` concurrently; if one fails, cancel the rest and raise its error as is."""
    await _gather(calls)


async def _gather(calls: Iterable[Awaitable[_T]]) -> list[_T]:
    """The results of `calls`, run concurrently; if one fails, the rest are cancelled and its
    error is raised as is."""
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(_wrap(call)) for call in calls]
    except BaseExceptionGroup as group:
        first: BaseException = group
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None
    return [t.result() for t in tasks]


async def _wrap(call: Awaitable[_T]) -> _T:
    return await call


class _ReadBatcher:
    """Joins the reads that start in the same loop iteration into one request to a peer.

    A reader of a micro-batch asks for its fields concurrently; one request per field would pay
    the per-message costs of both sides several times for the same round trip. The first caller
    leads: it yields once, so that concurrent callers can join its request (up to
    `_READ_CHUNK` bytes), sends it, and hands each joined caller its buffers.
    """

    def __init__(self, rpc: RpcClient) -> None:
        self._rpc = rpc
        self._open: _Batch | None = None

    async def read(self, ranges: list[tuple[str, int, int]]) -> list[torch.Tensor]:
        nbytes = sum(r[2] for r in ranges)
        batch = self._open
        if batch is not None and batch.nbytes + nbytes <= _READ_CHUNK:
            try:
                return await batch.join(ranges, nbytes)
            except _ReadAlone:
                return await self._read(ranges)
        batch = self._open = _Batch()
        part = batch.add(ranges, nbytes)
        try:
            try:
                await asyncio.sleep(0)  # one yield: let the concurrent readers join
            finally:
                if self._open is batch:
                    self._open = None
            buffers = await self._read(batch.ranges)
        except RemoteError:
            if batch.parts == 1:
                raise
            # One reader's bad range (a freed handle, say) must not fail the others: each
            # asks again on its own and gets its own answer.
            batch.fail(_ReadAlone())
            return await self._read(ranges)
        except BaseException as exc:
            batch.fail(exc)  # whoever joined learns of it too
            raise
        return batch.deliver(buffers)[part]

    async def _read(self, ranges: list[tuple[str, int, int]]) -> list[torch.Tensor]:
        reply = await self._rpc.call("read", {"ranges": [list(r) for r in ranges]})
        return _checked_buffers(reply, ranges)


class _ReadAlone(Exception):
    """Tells the readers that joined a failed request to ask again on their own."""


class _Batch:
    def __init__(self) -> None:
        self.ranges: list[tuple[str, int, int]] = []
        self.nbytes = 0
        self._parts: list[tuple[int, int]] = []  # (start, stop) into `ranges`
        self._waiters: dict[int, asyncio.Future[list[torch.Tensor]]] = {}

    @property
    def parts(self) -> int:
        return len(self._parts)

    def add(self, ranges: list[tuple[str, int, int]], nbytes: int) -> int:
        self._parts.append((len(self.ranges), len(self.ranges) + len(ranges)))
        self.ranges.extend(ranges)
        self.nbytes += nbytes
        return len(self._parts) - 1

    async def join(self, ranges: list[tuple[str, int, int]], nbytes: int) -> list[torch.Tensor]:
        part = self.add(ranges, nbytes)
        fut: asyncio.Future[list[torch.Tensor]] = asyncio.get_running_loop().create_future()
        self._waiters[part] = fut
        return await fut

    def deliver(self, buffers: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        parts = [buffers[start:stop] for start, stop in self._parts]
        for part, fut in self._waiters.items():
            if not fut.done():
                fut.set_result(parts[part])
        return parts

    def fail(self, exc: BaseException) -> None:
        if isinstance(exc, asyncio.CancelledError):  # the leader left; its followers did not
            exc = ClosedError("the read this one joined was cancelled")
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(exc)


def _checked_buffers(reply: Any, ranges: list[tuple[str, int, int]]) -> list[torch.Tensor]:
    if not isinstance(reply, list) or len(reply) != len(ranges):
        raise MalformedMessage("a read reply has one buffer per range")
    buffers: list[torch.Tensor] = []
    for buf, (_, _, nbytes) in zip(reply, ranges, strict=True):
        if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8:
            raise MalformedMessage("a read reply holds uint8 tensors")
        if buf.numel() != nbytes:
            raise MalformedMessage("a read reply buffer has the wrong size")
        buffers.append(buf)
    return buffers


def _chunks(indices: list[int], runs: Sequence[Run]) -> list[list[int]]:
    """Split runs into requests of about `_READ_CHUNK` bytes."""
    chunks: list[list[int]] = []
    current: list[int] = []
    size = 0
    for k in indices:
        if current and size + runs[k].nbytes > _READ_CHUNK:
            chunks.append(current)
            current, size = [], 0
        current.append(k)
        size += runs[k].nbytes
    if current:
        chunks.append(current)
    return chunks
