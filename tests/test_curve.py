"""CurveZMQ: keyed peers work; peers without keys or with other keys never reach a handler."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
import zmq.asyncio

from transport.curve import ENV, CurveKeys, for_endpoint
from transport.endpoints import check_bind
from transport.errors import BindRefused, DeadlineExceeded, KeysRefused
from transport.pubsub import Publisher, Subscriber
from transport.rpc import RpcClient, RpcServer
from transport.store import SampleStore
from transport.store_client import StoreClient
from transport.store_server import StoreServer

pytestmark = pytest.mark.timeout(60)

REFUSED_WAIT = 1.0  # a refused peer's call must still be unanswered after this long
TOLD_S = 10.0  # a curve client whose keys are refused is told long before this


class Counter:
    def __init__(self) -> None:
        self.calls = 0

    async def echo(self, payload: Any, peer: bytes) -> Any:
        self.calls += 1
        return payload


def test_keys_round_trip_through_file_and_env(tmp_path: Path) -> None:
    keys = CurveKeys.generate()
    path = keys.save(tmp_path / "keys.json")
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert CurveKeys.load(path) == keys
    assert CurveKeys.from_env(keys.to_env()) == keys
    assert CurveKeys.from_env({}) is None
    assert keys.server_secret.decode() not in repr(keys)
    assert keys.client_secret.decode() not in repr(keys)
    with pytest.raises(FileExistsError):
        keys.save(path)  # never overwritten
    os.chmod(path, 0o644)
    with pytest.raises(PermissionError):
        CurveKeys.load(path)
    with pytest.raises(ValueError, match="Z85"):
        CurveKeys.from_env({ENV: keys.to_json().replace(keys.client_public.decode(), "~" * 40)})


def test_remote_binds_need_curve_keys() -> None:
    with pytest.raises(BindRefused, match="curve"):
        check_bind("tcp://0.0.0.0:0", allow_remote=True)
    check_bind("tcp://0.0.0.0:0", allow_remote=True, curve=True)
    check_bind("tcp://127.0.0.1:0", allow_remote=False)  # loopback stays as it was
    with pytest.raises(BindRefused):
        RpcServer("tcp://0.0.0.0:0", {}, allow_remote=True)
    with pytest.raises(BindRefused):
        Publisher("tcp://0.0.0.0:0", allow_remote=True)
    keys = CurveKeys.generate()
    assert for_endpoint(keys, "ipc:///tmp/x.sock") is None
    assert for_endpoint(keys, "tcp://10.0.0.1:5") is keys


async def test_rpc_admits_only_the_runs_clients(zmq_ctx: zmq.asyncio.Context) -> None:
    keys = CurveKeys.generate()
    other = CurveKeys.generate()
    # Knows the server's public key, but its own key pair is not the run's.
    wrong_client = CurveKeys(keys.server_public, keys.server_secret,
                             other.client_public, other.client_secret)
    service = Counter()
    refusals: list[str] = []
    async with RpcServer("tcp://127.0.0.1:0", {"echo": service.echo}, ctx=zmq_ctx,
                         curve=keys, on_refused=refusals.append) as server:
        assert server._auth is not None
        async with RpcClient(server.endpoint, ctx=zmq_ctx, curve=keys) as good:
            tensor = torch.arange(1000, dtype=torch.float32)
            reply = await good.call("echo", {"t": tensor}, timeout=20)
            assert torch.equal(reply["t"], tensor)
        async with RpcClient(server.endpoint, ctx=zmq_ctx) as plain:
            with pytest.raises(DeadlineExceeded):
                await plain.call("echo", "let me in", timeout=REFUSED_WAIT)
        # A curve client learns from its failed handshakes that its keys are refused, at once
        # rather than at its deadline, and so does every later call until one succeeds.
        told = {wrong_client: "does not admit this client's key", other: "holds other keys"}
        for bad_keys, why in told.items():
            async with RpcClient(server.endpoint, ctx=zmq_ctx, curve=bad_keys) as bad:
                for _ in range(2):
                    with pytest.raises(KeysRefused, match=why) as info:
                        await bad.call("echo", "let me in", timeout=TOLD_S)
                    assert info.value.endpoint == server.endpoint
        assert service.calls == 1
        assert server.statistics().requests == 1
        # The server heard of each kind of refusal, in words.
        assert {"it connected without curve keys", "its client key is not admitted",
                "it encrypts for another server key"} <= set(refusals)
        assert server.statistics().handshakes_refused == len(refusals)
        # The wrong client key reached ZAP and was denied there (the wrong server key and the
        # plaintext peer fail the handshake before ZAP is asked).
        assert server._auth.statistics().denied >= 1
        async with RpcClient(server.endpoint, ctx=zmq_ctx, curve=keys) as good:
            assert await good.call("echo", 2, timeout=20) == 2  # still serving keyed peers


async def test_two_runs_in_one_context_do_not_admit_each_other(
    zmq_ctx: zmq.asyncio.Context,
) -> None:
    a, b = CurveKeys.generate(), CurveKeys.generate()
    service = Counter()
    async with (
        RpcServer("tcp://127.0.0.1:0", {"echo": service.echo}, ctx=zmq_ctx, curve=a) as sa,
        RpcServer("tcp://127.0.0.1:0", {"echo": service.echo}, ctx=zmq_ctx, curve=b) as sb,
    ):
        # b's client, told a's server key: ZAP checks it against a's domain and refuses.
        crossed = CurveKeys(a.server_public, a.server_secret, b.client_public, b.client_secret)
        async with RpcClient(sa.endpoint, ctx=zmq_ctx, curve=crossed) as bad:
            with pytest.raises(KeysRefused, match="does not admit this client's key"):
                await bad.call("echo", 1, timeout=TOLD_S)
        async with (
            RpcClient(sa.endpoint, ctx=zmq_ctx, curve=a) as ca,
            RpcClient(sb.endpoint, ctx=zmq_ctx, curve=b) as cb,
        ):
            assert await ca.call("echo", "a", timeout=20) == "a"
            assert await cb.call("echo", "b", timeout=20) == "b"
    assert service.calls == 2


async def test_broadcasts_reach_only_keyed_subscribers(zmq_ctx: zmq.asyncio.Context) -> None:
    keys = CurveKeys.generate()
    async with Publisher("tcp://127.0.0.1:0", ctx=zmq_ctx, curve=keys) as pub:
        async with Subscriber(pub.endpoint, ["v"], ctx=zmq_ctx, curve=keys) as good:
            await good.join(timeout=20)
            await pub.publish("v", {"version": 3})
            assert await good.recv() == ("v", {"version": 3})
        async with Subscriber(pub.endpoint, ["v"], ctx=zmq_ctx) as plain:
            with pytest.raises(DeadlineExceeded):
                await plain.join(timeout=REFUSED_WAIT)
        assert pub.joined == 1


async def test_store_reads_from_another_node_over_curve(
    zmq_ctx: zmq.asyncio.Context, run_id: str
) -> None:
    keys = CurveKeys.generate()
    store = SampleStore(run_id, "a", capacity_bytes=16 << 20)
    try:
        async with (
            StoreServer(store, "tcp://127.0.0.1:0", ctx=zmq_ctx, curve=keys) as server,
            StoreClient(run_id, "b", "ipc:///nonexistent", peers={"a": server.endpoint},
                        ctx=zmq_ctx, curve=keys) as reader,
            StoreClient(run_id, "b", "ipc:///nonexistent", peers={"a": server.endpoint},
                        ctx=zmq_ctx, timeout=REFUSED_WAIT) as plain,
        ):
            rows = [torch.randn(300) for _ in range(4)]
            handles = (await store.put({"x": rows}))["x"]
            got = await reader.get(handles)
            assert all(torch.equal(g, r) for g, r in zip(got, rows, strict=True))
            with pytest.raises(DeadlineExceeded):
                await plain.get(handles)
            await reader.free(handles)
            assert store.used_bytes == 0 or store.statistics().segments == 0
    finally:
        store.close()
