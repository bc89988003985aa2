"""The node agent: ``python -m flowrl.node --run-id R --node N --controller EP --store EP``.

One per node. It owns the node's shared-memory sample store (its capacity bound and segment
reference counts), serves reads from other nodes and frees from the controller, and removes
every segment of the run when it exits. It tells the controller it is up with ``node_up``, and
it exits on SIGTERM/SIGINT or when its parent dies (Linux parent-death signal).
"""

from __future__ import annotations

import argparse
import asyncio
import signal

import structlog

from flowrl.logs import bind, configure
from transport.rpc import RpcClient
from transport.store import SampleStore
from transport.store_server import StoreServer
from workers.lifecycle import die_with_parent, run_main

log = structlog.get_logger("flowrl.node")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flowrl.node", description=__doc__)
    p.add_argument("--run-id", required=True)
    p.add_argument("--node", required=True)
    p.add_argument("--controller", required=True)
    p.add_argument("--store", required=True, help="endpoint the store server binds")
    p.add_argument("--capacity", type=int, required=True, help="store capacity in bytes")
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    store = SampleStore(args.run_id, args.node, capacity_bytes=args.capacity)
    try:
        async with StoreServer(store, args.store) as server:
            async with RpcClient(args.controller) as ctl:
                await ctl.call("node_up", {"node": args.node, "store": server.endpoint})
            log.info("node agent up", node=args.node, store=server.endpoint)
            await stop.wait()
    finally:
        store.close()


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    die_with_parent()
    configure()
    bind(run_id=args.run_id, role="node", node=args.node)
    run_main(serve(args))


if __name__ == "__main__":
    main()
