"""Plaintext cross-node reads: authenticated requests, unencrypted sample bytes, opt-in only."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import psutil
import pytest
import torch
import zmq
import zmq.asyncio

from flowrl.node import parse
from flowrl.recipe import ClusterSettings, PlacementConfig, Recipe
from flowrl.recipe_file import RecipeError, load_recipe
from flowrl.run import cluster_config
from transport.codec import decode, encode
from transport.curve import CurveKeys
from transport.endpoints import tcp_endpoint
from transport.errors import DeadlineExceeded, UnknownOperation
from transport.handles import Handle
from transport.request_auth import AuthStats, RequestAuth
from transport.rpc import OK, RpcClient
from transport.store import SampleStore
from transport.store_client import StoreClient
from transport.store_server import StoreServer

pytestmark = pytest.mark.timeout(30)

REFUSED_S = 0.5  # how long a refused call waits for the reply that never comes


@pytest.fixture(scope="module")
def keys() -> CurveKeys:
    return CurveKeys.generate()


@pytest.fixture
def store(run_id: str) -> Iterator[SampleStore]:
    s = SampleStore(run_id, "n0", capacity_bytes=16 << 20)
    yield s
    s.close()


@asynccontextmanager
async def plain_server(
    store: SampleStore, keys: CurveKeys, ctx: zmq.asyncio.Context
) -> AsyncIterator[StoreServer]:
    async with StoreServer(store, tcp_endpoint(), ctx=ctx, curve=keys, plaintext=True) as server:
        yield server


def auth_stats(server: StoreServer) -> AuthStats:
    stats = server.plaintext_statistics()
    assert stats is not None
    return stats[1]


def read_payload(handles: list[Handle]) -> dict[str, list[list[str | int]]]:
    h = handles[0]
    return {"ranges": [[h.segment, h.offset, h.nbytes * len(handles)]]}


def listening_tcp_ports() -> set[int]:
    conns = psutil.Process().net_connections(kind="tcp")
    return {c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN}


# -- the authenticator on its own -------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_signed_request_verifies_once_and_only_unchanged_and_in_time() -> None:
    clock = Clock()
    key = bytes(range(32))
    client, server = RequestAuth(key, clock=clock), RequestAuth(key, clock=clock)
    frames = encode([1, "read", {"ranges": [["seg", 0, 8]]}])
    auth = client.sign(frames)
    assert server.verify([auth, *frames])
    assert not server.verify([auth, *frames])  # replayed
    other = encode([1, "read", {"ranges": [["seg", 8, 8]]}])
    assert not server.verify([auth, *other])  # the payload changed on the way
    assert not RequestAuth(bytes(32), clock=clock).verify([client.sign(frames), *frames])
    assert not server.verify(frames)  # no authenticator frame
    assert not server.verify([b"\xc1" * 10, *frames])  # not msgpack
    clock.now -= 31.0
    late = client.sign(frames)
    clock.now += 31.0
    assert not server.verify([late, *frames])  # 31 s old
    assert server.statistics() == AuthStats(
        accepted=1, malformed=2, bad_tag=1, stale=1, replayed=1, full=0
    )


def test_nonces_are_remembered_for_two_windows_and_bounded() -> None:
    clock, elapsed = Clock(), Clock()
    key = bytes(range(32))
    client = RequestAuth(key, clock=clock)
    server = RequestAuth(key, clock=clock, monotonic=elapsed, max_nonces=3)
    frames = encode([1, "read", None])
    signed = [client.sign(frames) for _ in range(4)]
    assert [server.verify([a, *frames]) for a in signed] == [True, True, True, False]
    assert server.statistics().full == 1
    clock.now += 31.0
    elapsed.now += 59.0  # out of the window, but remembered for two...
    assert not server.verify([client.sign(frames), *frames])
    assert server.statistics().full == 2
    elapsed.now += 2.0  # ...then forgotten, which makes room
    assert server.verify([client.sign(frames), *frames])
    assert not server.verify([signed[0], *frames])  # an old one is refused by its timestamp
    assert server.statistics().stale == 1


def test_a_wall_clock_stepped_back_never_reopens_a_replay() -> None:
    """The server's wall clock jumps ahead (its nonces would leave a wall-clock window) and is
    then set back: the captured request's timestamp is fresh again, its nonce still known."""
    clock = Clock()
    key = bytes(range(32))
    client = RequestAuth(key, clock=clock)
    server = RequestAuth(key, clock=clock)  # the real monotonic clock: microseconds pass
    frames = encode([1, "read", None])
    captured = client.sign(frames)
    assert server.verify([captured, *frames])
    clock.now += 3600.0  # stepped ahead an hour...
    assert server.verify([client.sign(frames), *frames])  # (requests go on meanwhile)
    clock.now -= 3600.0  # ...and back
    assert not server.verify([captured, *frames])
    assert server.statistics().replayed == 1


def test_nonces_expire_by_elapsed_time_when_the_wall_clock_goes_back() -> None:
    """A wall clock set back an hour does not keep nonces an hour longer (refusing every request
    as `full` meanwhile): they expire after two windows of elapsed time."""
    clock, elapsed = Clock(), Clock()
    key = bytes(range(32))
    client = RequestAuth(key, clock=clock)
    server = RequestAuth(key, clock=clock, monotonic=elapsed, max_nonces=2)
    frames = encode([1, "read", None])
    assert all(server.verify([client.sign(frames), *frames]) for _ in range(2))
    clock.now -= 3600.0
    elapsed.now += 61.0
    assert server.verify([client.sign(frames), *frames])
    assert server.statistics().full == 0


def test_the_key_comes_from_the_runs_client_secret(keys: CurveKeys) -> None:
    frames = encode([1, "read", None])
    same = RequestAuth.from_keys(CurveKeys.from_json(keys.to_json()))
    assert same.verify([RequestAuth.from_keys(keys).sign(frames), *frames])
    other = RequestAuth.from_keys(CurveKeys.generate())
    assert not other.verify([RequestAuth.from_keys(keys).sign(frames), *frames])


# -- the store server ---------------------------------------------------------------------------


async def test_plaintext_reads_return_the_bytes_of_curve_reads(
    run_id: str, store: SampleStore, keys: CurveKeys, zmq_ctx: zmq.asyncio.Context
) -> None:
    ids = [torch.arange(n, dtype=torch.int64) * 3 for n in (5, 0, 7)]
    logp = torch.randn(3, 9)
    handles = await store.put({"ids": ids, "logp": logp})
    fields = {"ids": handles["ids"], "logp": handles["logp"]}
    async with (
        plain_server(store, keys, zmq_ctx) as plain,
        StoreServer(store, tcp_endpoint(), ctx=zmq_ctx, curve=keys) as encrypted,
    ):
        assert plain.plaintext_endpoint is not None
        assert encrypted.plaintext_endpoint is None
        readers = [
            StoreClient(run_id, "n1", "ipc:///unused", peers={"n0": server.endpoint},
                        ctx=zmq_ctx, curve=keys)
            for server in (plain, encrypted)
        ]
        async with readers[0] as via_plain, readers[1] as via_curve:
            got = [await r.get_padded_many(fields, pad=-1) for r in (via_plain, via_curve)]
            views = [await r.get(handles["ids"]) for r in (via_plain, via_curve)]
        assert auth_stats(plain).accepted == 2  # both reads went through the plaintext endpoint
        assert plain.plaintext_statistics()[0].refused == 0  # type: ignore[index]
        # The curve servers saw only the hellos (and no read) of the plaintext reader.
        assert plain.statistics().requests == 1
        assert encrypted.statistics().requests == 3  # hello and two reads
    for name in fields:
        want = store.get_padded(fields[name], pad=-1)
        for g in got:
            assert torch.equal(g[name][0], want[0])
            assert torch.equal(g[name][1], want[1])
    assert [[v.tolist() for v in vs] for vs in views] == [[t.tolist() for t in ids]] * 2
    store.free([h for hs in handles.values() for h in hs])


async def test_refused_requests_get_nothing_and_the_server_keeps_serving(
    run_id: str, store: SampleStore, keys: CurveKeys, zmq_ctx: zmq.asyncio.Context
) -> None:
    secret = torch.arange(64, dtype=torch.int64)
    handles = (await store.put({"x": [secret]}))["x"]
    payload = read_payload(handles)
    async with plain_server(store, keys, zmq_ctx) as server:
        endpoint = server.plaintext_endpoint
        assert endpoint is not None
        assert endpoint != server.endpoint
        signers = [
            None,  # no authenticator frame at all
            RequestAuth.from_keys(CurveKeys.generate()),  # another run's keys
            RequestAuth.from_keys(keys, clock=lambda: time.time() - 60.0),  # stale
        ]
        for signer in signers:
            async with RpcClient(endpoint, ctx=zmq_ctx, authenticator=signer) as rpc:
                with pytest.raises(DeadlineExceeded):
                    await rpc.call("read", payload, timeout=REFUSED_S)
        assert auth_stats(server) == AuthStats(
            accepted=0, malformed=1, bad_tag=1, stale=1, replayed=0, full=0
        )

        # A captured request sent again is refused; the requests around it are served.
        sock = zmq_ctx.socket(zmq.DEALER)
        try:
            sock.connect(endpoint)
            signer = RequestAuth.from_keys(keys)
            first = encode([7, "read", payload])
            first.insert(0, signer.sign(first))
            fresh = encode([8, "read", payload])
            fresh.insert(0, signer.sign(fresh))
            for frames in (first, first, fresh):
                await sock.send_multipart(frames)
            replies = [decode(await sock.recv_multipart(copy=False)) for _ in range(2)]
        finally:
            sock.close(linger=0)
        assert sorted(r[0] for r in replies) == [7, 8]
        for _, status, body in replies:
            assert status == OK
            assert torch.equal(body[0].view(torch.int64), secret)
        stats = auth_stats(server)
        assert (stats.accepted, stats.replayed) == (2, 1)
        assert server.plaintext_statistics()[0].refused == 4  # type: ignore[index]

        # Only reads are served there, even to the run's own clients.
        async with RpcClient(
            endpoint, ctx=zmq_ctx, authenticator=RequestAuth.from_keys(keys)
        ) as rpc:
            with pytest.raises(UnknownOperation):
                await rpc.call("free", {"handles": [list(h) for h in handles]})
        async with StoreClient(run_id, "n1", "ipc:///unused", peers={"n0": server.endpoint},
                               ctx=zmq_ctx, curve=keys) as reader:
            (got,) = await reader.get(handles)
        assert torch.equal(got, secret)
    store.free(handles)


async def test_the_default_binds_no_plaintext_endpoint(
    store: SampleStore, keys: CurveKeys, zmq_ctx: zmq.asyncio.Context
) -> None:
    def port(endpoint: str | None) -> int:
        assert endpoint is not None
        return int(endpoint.rsplit(":", 1)[1])

    # Ports listening before each server starts are left out: a closed one's may linger.
    before = listening_tcp_ports()
    async with StoreServer(store, tcp_endpoint(), ctx=zmq_ctx, curve=keys) as server:
        assert listening_tcp_ports() - before == {port(server.endpoint)}
        assert server.plaintext_endpoint is None
        assert server.plaintext_statistics() is None
        async with RpcClient(server.endpoint, ctx=zmq_ctx, curve=keys) as rpc:
            assert (await rpc.call("hello"))["plaintext"] is None
            assert "plaintext" not in await rpc.call("stats")
    before = listening_tcp_ports()
    async with plain_server(store, keys, zmq_ctx) as server:
        assert listening_tcp_ports() - before == {
            port(server.endpoint),
            port(server.plaintext_endpoint),
        }


def test_the_agent_beside_the_controller_takes_the_data_plane_with_its_peer_store() -> None:
    base = ["--controller", "ipc:///x", "--node", "n", "--run-id", "r", "--store", "ipc:///y",
            "--capacity", "1"]
    args = parse([*base, "--peer-store", "tcp://127.0.0.1:0", "--data-plane", "plaintext"])
    assert args.data_plane == "plaintext"
    with pytest.raises(SystemExit):
        parse([*base, "--data-plane", "plaintext"])


def test_plaintext_needs_keys_and_tcp(store: SampleStore, keys: CurveKeys) -> None:
    with pytest.raises(ValueError, match="curve keys"):
        StoreServer(store, tcp_endpoint(), plaintext=True)
    with pytest.raises(ValueError, match="tcp endpoint"):
        StoreServer(store, "ipc:///tmp/flowrl-x/store", curve=keys, plaintext=True)


# -- the recipe ---------------------------------------------------------------------------------


def test_the_recipe_field_is_validated_and_reaches_the_cluster_config(tmp_path: Path) -> None:
    path = tmp_path / "recipe.py"
    path.write_text(
        "from flowrl.recipe import Recipe\n"
        "recipe = Recipe(steps=1, placement={'roles': {'rollout': ['a']}, 'cluster': "
        "{'keys_file': 'k', 'data_plane': 'clear'}})\n"
    )
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert "placement.cluster.data_plane" in dict(info.value.problems)
    assert ClusterSettings().data_plane == "encrypted"
    recipe = Recipe(steps=1, placement=PlacementConfig(
        roles={"rollout": ("a",)},
        cluster=ClusterSettings(keys_file=str(tmp_path / "k"), data_plane="plaintext")))
    config = cluster_config(recipe)
    assert config is not None
    assert config.data_plane == "plaintext"
    default = cluster_config(Recipe(steps=1, placement=PlacementConfig(
        roles={"rollout": ("a",)}, cluster=ClusterSettings(keys_file=str(tmp_path / "k")))))
    assert default is not None
    assert default.data_plane == "encrypted"
