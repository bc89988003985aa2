"""The node store over RPC: `StoreServer` in the node's store process, `StoreClient`
(`transport.store_client`) elsewhere.

Worker processes on the node write micro-batches straight into shared memory; only capacity
and bookkeeping go through the server:

    reserve(size) -> grant        (waits while the store is full: backpressure)
    <write the segment under its temporary or pooled name, rename it when complete>
    commit(grant, name, refs)     (the store now holds the segment; its handles are valid)

To keep one round trip per put, a commit also returns a *spare* grant of the same size when
one is free at once and no put is waiting: each client holds at most one spare, so at most one
segment of capacity per client sits reserved but unused.

Reads on the node map segments directly (`transport.store.local_get`), without the server.
Readers on other nodes send byte ranges to that node's server, which answers with views over
its mappings; the bytes go out as ZeroMQ frames without a copy in user space, and the reader
builds its tensors over the received frames. `get_padded_many` reads several fields (those of
a micro-batch) in one call: on the node, the fields of one put look their segment up once;
from another node, they travel in one request. Frees go to the node that holds the handles.

Plaintext reads (opt-in, for trusted fabrics where encryption is the bottleneck): a curve
server made with ``plaintext=True`` also serves ``read``, and nothing else, on a second tcp
endpoint of its host without curve. The sample bytes of those reads travel unencrypted; every
request there must carry an HMAC under the run's keys with a fresh timestamp and nonce
(`transport.request_auth`), so a peer without the keys gets nothing and a captured request
cannot be replayed. The server advertises that endpoint in its ``hello`` reply (over curve);
a `StoreClient` with the run's keys asks each other node's server once, and reads through the
plaintext endpoint when there is one, through curve otherwise. Everything else (puts, frees,
stats) stays on curve.

Guarantees: everything `SampleStore` guarantees, plus: a client that exits or dies never leaks
capacity — `aclose` gives its grants back, and the server reclaims the grants and unpublished
segments of dead writers before it makes a put wait.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import zmq

from transport import lazy_torch, shm
from transport.curve import CurveKeys
from transport.endpoints import tcp_endpoint
from transport.errors import MalformedMessage
from transport.handles import freed_handles
from transport.packing import Grant
from transport.request_auth import AuthStats, RequestAuth
from transport.rpc import RpcServer, RpcServerStats
from transport.store import SampleStore

if TYPE_CHECKING:
    import torch
else:
    from transport.lazy_torch import torch

__all__ = ["StoreServer"]

# A reserve waits at most this long on the server before answering "not yet"; the client
# (`transport.store_client`) asks again. Keeps every call well inside the RPC timeout however
# long the store stays full.
RESERVE_POLL_S = 5.0


def _as_int(value: Any, name: str) -> int:
    if type(value) is not int:
        raise MalformedMessage(f"{name} must be an int")
    return value


def _as_str(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise MalformedMessage(f"{name} must be a string")
    return value


def _field(payload: Any, name: str) -> Any:
    if not isinstance(payload, dict) or name not in payload:
        raise MalformedMessage(f"request needs {name!r}")
    return payload[name]


# A grant on the wire; `transport.store_client` reads it back.
def _grant_wire(grant: Grant | None) -> list[Any] | None:
    return None if grant is None else [grant.id, grant.size, grant.pool]


class StoreServer:
    """Serves one node's `SampleStore` on a ROUTER socket (through `RpcServer`)."""

    def __init__(
        self,
        store: SampleStore,
        endpoint: str,
        *,
        ctx: zmq.Context[Any] | None = None,
        allow_remote: bool = False,
        curve: CurveKeys | None = None,
        plaintext: bool = False,
    ) -> None:
        """`curve`: serve encrypted, to the run's clients only (what readers on other nodes
        connect to; needed to bind a non-loopback address, with `allow_remote`).
        `plaintext`: also serve ``read`` unencrypted on a second tcp endpoint of the same host
        (port chosen by the system), its requests authenticated with `curve`'s keys; needs a
        tcp `endpoint` and `curve`."""
        self.store = store
        self.endpoint = endpoint
        self._writers: dict[int, shm.Owner] = {}
        self._plain: RpcServer | None = None
        self._plain_auth: RequestAuth | None = None
        if plaintext:
            if curve is None:
                raise ValueError("plaintext reads need the run's curve keys")
            self._plain_auth = RequestAuth.from_keys(curve)
            self._plain = RpcServer(
                _any_port(endpoint),
                {"read": self._read},
                ctx=ctx,
                allow_remote=allow_remote,
                authenticator=self._plain_auth,
                tensors=False,
            )
        self._rpc = RpcServer(
            endpoint,
            {
                "hello": self._hello,
                "reserve": self._reserve,
                "commit": self._commit,
                "abandon": self._abandon,
                "release": self._release,
                "free": self._free,
                "read": self._read,
                "stats": self._stats,
            },
            ctx=ctx,
            allow_remote=allow_remote,
            curve=curve,
            tensors=False,
        )

    async def start(self) -> str:
        self.endpoint = await self._rpc.start()
        if self._plain is not None:
            try:
                await self._plain.start()
            except BaseException:
                await self._rpc.aclose()
                raise
        return self.endpoint

    @property
    def plaintext_endpoint(self) -> str | None:
        """Where plaintext reads are served once started; None without them."""
        return None if self._plain is None else self._plain.endpoint

    def statistics(self) -> RpcServerStats:
        """The RPC server's counters (the store's own are `store.statistics()`)."""
        return self._rpc.statistics()

    def plaintext_statistics(self) -> tuple[RpcServerStats, AuthStats] | None:
        """The plaintext endpoint's counters and its authenticator's; None without it."""
        if self._plain is None or self._plain_auth is None:
            return None
        return self._plain.statistics(), self._plain_auth.statistics()

    async def aclose(self) -> None:
        try:
            if self._plain is not None:
                await self._plain.aclose()
        finally:
            await self._rpc.aclose()

    async def __aenter__(self) -> StoreServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _writer(self, payload: Any) -> shm.Owner:
        pid = _as_int(_field(payload, "pid"), "pid")
        owner = self._writers.get(pid)
        if owner is None or not owner.alive():
            start = shm.process_start(pid)
            if start is None:
                raise ValueError(f"writer process {pid} is not running")
            owner = self._writers[pid] = shm.Owner(pid, start)
        return owner

    async def _hello(self, payload: Any, peer: bytes) -> dict[str, Any]:
        store = self.store
        return {
            "node": store.node,
            "run_id": store.run_id,
            "owner": [store.owner.pid, store.owner.start],
            "capacity": store.capacity_bytes,
            "plaintext": self.plaintext_endpoint,
        }

    async def _reserve(self, payload: Any, peer: bytes) -> list[Any] | None:
        writer = self._writer(payload)
        size = _as_int(_field(payload, "size"), "size")
        if size <= 0:  # a negative size would add capacity to the store
            raise MalformedMessage("size must be positive")
        wait: Any = payload.get("wait", RESERVE_POLL_S)
        if not (type(wait) in (int, float) and wait >= 0):  # NaN would break the loop's timers
            raise MalformedMessage("wait must be a non-negative number of seconds")
        wait = min(float(wait), RESERVE_POLL_S)
        try:
            async with asyncio.timeout(wait):
                return _grant_wire(await self.store.reserve(size, writer=writer))
        except TimeoutError:
            return None

    async def _commit(self, payload: Any, peer: bytes) -> list[Any] | None:
        writer = self._writer(payload)
        gid = _as_int(_field(payload, "grant"), "grant")
        name = _as_str(_field(payload, "name"), "name")
        # Checked before the commit: an error reply must mean that nothing was committed.
        refs = _as_int(_field(payload, "refs"), "refs")
        following = _as_int(payload.get("next", 0), "next")
        try:
            self.store.commit(gid, name, refs)
        except BaseException:
            parsed = shm.SegmentName.parse(name)
            if parsed is None or parsed.writer != writer.pid:
                raise  # not this writer's segment: the grant may be another writer's
            mine = shm.segments_of(self.store.run_id, self.store.owner, writer.pid)
            if name in mine and not self.store.holds(name):
                shm.unlink(name)  # written under a grant that no longer holds
            self.store.abandon(gid)
            raise
        if following <= 0:
            return None
        return _grant_wire(self.store.reserve_nowait(following, writer=writer))

    async def _abandon(self, payload: Any, peer: bytes) -> None:
        self.store.abandon(_as_int(_field(payload, "grant"), "grant"))

    async def _release(self, payload: Any, peer: bytes) -> None:
        self.store.release_writer(_as_int(_field(payload, "pid"), "pid"))

    async def _free(self, payload: Any, peer: bytes) -> None:
        self.store.free(freed_handles(_field(payload, "handles")))

    async def _read(self, payload: Any, peer: bytes) -> list[torch.Tensor]:
        ranges = _field(payload, "ranges")
        if not isinstance(ranges, list):
            raise MalformedMessage("ranges must be a list")
        checked: list[tuple[str, int, int]] = []
        for r in ranges:
            if not isinstance(r, list) or len(r) != 3:
                raise MalformedMessage("a range is [segment, offset, nbytes]")
            checked.append(
                (_as_str(r[0], "segment"), _as_int(r[1], "offset"), _as_int(r[2], "nbytes"))
            )
        if not lazy_torch.loaded():
            # A node agent runs without torch until another node first reads through it. The
            # import (~1-2 s of CPU, far more on busy cores) goes to a thread: on the event
            # loop it would stall the agent's relay and heartbeats, and a node silent for
            # `node_timeout_s` is declared lost. Only for a read that can be served: a bad
            # request does not cost the agent torch's ~200 MB.
            self.store.check_ranges(checked)
            await asyncio.to_thread(lazy_torch.load)
        return self.store.read_ranges(checked)

    async def _stats(self, payload: Any, peer: bytes) -> dict[str, Any]:
        stats = asdict(self.store.statistics())
        if self._plain_auth is not None:
            stats["plaintext"] = asdict(self._plain_auth.statistics())
        return stats


def _any_port(endpoint: str) -> str:
    """A tcp endpoint on `endpoint`'s host, any free port."""
    scheme, _, rest = endpoint.partition("://")
    host, colon, _ = rest.rpartition(":")
    if scheme != "tcp" or not colon:
        raise ValueError(f"plaintext reads need a tcp endpoint, not {endpoint!r}")
    return tcp_endpoint(host)
