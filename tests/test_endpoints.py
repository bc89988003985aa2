"""Endpoints: the per-run socket directory and the loopback-only bind policy."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest
import zmq.asyncio

from transport.endpoints import (
    check_bind,
    default_endpoint,
    ipc_endpoint,
    new_run_id,
    remove_run_dir,
    run_dir,
    tcp_endpoint,
)
from transport.errors import BindRefused, TransportError
from transport.pubsub import Publisher
from transport.rpc import RpcClient, RpcServer

pytestmark = pytest.mark.timeout(30)


def test_new_run_ids_are_short_hex_and_distinct() -> None:
    ids = {new_run_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(len(i) == 8 and int(i, 16) >= 0 for i in ids)


def test_run_dir_is_private_and_idempotent(run_id: str) -> None:
    path = run_dir(run_id)
    assert path == Path(f"/tmp/flowrl-{run_id}")
    info = os.lstat(path)
    assert stat.S_ISDIR(info.st_mode)
    assert stat.S_IMODE(info.st_mode) == 0o700
    os.chmod(path, 0o755)
    assert run_dir(run_id) == path  # reused, and tightened back
    assert stat.S_IMODE(os.lstat(path).st_mode) == 0o700


def test_run_dir_refuses_a_planted_symlink(run_id: str) -> None:
    with tempfile.TemporaryDirectory() as target:
        os.symlink(target, f"/tmp/flowrl-{run_id}")
        try:
            with pytest.raises(TransportError, match="not a directory owned"):
                run_dir(run_id)
        finally:
            os.unlink(f"/tmp/flowrl-{run_id}")


@pytest.mark.parametrize("bad", ["", "a/b", "..", ".", "x" * 49, "a b", "ü"])
def test_names_are_validated(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid"):
        run_dir(bad)
    with pytest.raises(ValueError, match="invalid"):
        ipc_endpoint("abc", bad)


def test_endpoint_forms(run_id: str) -> None:
    assert ipc_endpoint(run_id, "ctl") == f"ipc:///tmp/flowrl-{run_id}/ctl.sock"
    assert len(ipc_endpoint(run_id, "x" * 48)) < 107  # unix socket path limit
    assert tcp_endpoint() == "tcp://127.0.0.1:0"
    assert tcp_endpoint("::1", 5) == "tcp://[::1]:5"
    assert default_endpoint(run_id, "a") == ipc_endpoint(run_id, "a")
    assert default_endpoint(run_id, "a", single_node=False) == "tcp://127.0.0.1:0"
    with pytest.raises(ValueError, match="port"):
        tcp_endpoint(port=70000)


@pytest.mark.parametrize(
    "endpoint",
    [
        "ipc:///tmp/x.sock",
        "inproc://x",
        "tcp://127.0.0.1:0",
        "tcp://127.8.9.10:5555",
        "tcp://localhost:5555",
        "tcp://[::1]:5555",
    ],
)
def test_local_binds_are_allowed(endpoint: str) -> None:
    check_bind(endpoint, allow_remote=False)


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://0.0.0.0:5555",
        "tcp://*:5555",
        "tcp://10.1.2.3:5555",
        "tcp://[::]:5555",
        "tcp://eth0:5555",
        "tcp://example.com:5555",
        "tcp://127.0.0.1",
        "ws://127.0.0.1:5555",
        "127.0.0.1:5555",
    ],
)
def test_remote_binds_are_refused_unless_allowed(endpoint: str) -> None:
    with pytest.raises(BindRefused):
        check_bind(endpoint, allow_remote=False)
    if "://" in endpoint:
        with pytest.raises(BindRefused):
            check_bind(endpoint, allow_remote=True)  # a remote bind needs curve keys too
        check_bind(endpoint, allow_remote=True, curve=True)


async def test_servers_refuse_remote_binds_before_touching_a_socket(
    zmq_ctx: zmq.asyncio.Context,
) -> None:
    with pytest.raises(BindRefused):
        RpcServer("tcp://0.0.0.0:0", {}, ctx=zmq_ctx)
    with pytest.raises(BindRefused):
        Publisher("tcp://*:0", ctx=zmq_ctx)


async def test_tcp_port_zero_resolves_to_the_bound_port(zmq_ctx: zmq.asyncio.Context) -> None:
    async def echo(payload: object, peer: bytes) -> object:
        return payload

    async with RpcServer(tcp_endpoint(), {"echo": echo}, ctx=zmq_ctx) as server:
        host, port = server.endpoint.removeprefix("tcp://").rsplit(":", 1)
        assert host == "127.0.0.1"
        assert int(port) > 0
        async with RpcClient(server.endpoint, ctx=zmq_ctx, timeout=10) as client:
            assert await client.call("echo", "over tcp") == "over tcp"


async def test_remove_run_dir_leaves_no_socket_files(zmq_ctx: zmq.asyncio.Context) -> None:
    rid = new_run_id()
    try:
        async with (
            RpcServer(ipc_endpoint(rid, "rpc"), {}, ctx=zmq_ctx) as server,
            Publisher(ipc_endpoint(rid, "pub"), ctx=zmq_ctx),
        ):
            assert server.endpoint == ipc_endpoint(rid, "rpc")
            assert sorted(os.listdir(run_dir(rid))) == ["pub.sock", "rpc.sock"]
    finally:
        remove_run_dir(rid)
    assert not Path(f"/tmp/flowrl-{rid}").exists()  # noqa: ASYNC240 (a local stat)
    remove_run_dir(rid)  # a missing directory is fine
