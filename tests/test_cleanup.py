"""``python -m flowrl.cleanup`` in a subprocess, against real segments of dead and live runs."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from transport import shm
from transport.store import SampleStore

pytestmark = pytest.mark.timeout(60)

_DYING_STORE = """
import asyncio, os, sys
import torch
from transport import shm
from transport.store import SampleStore

async def main():
    store = SampleStore(sys.argv[1], "node0", capacity_bytes=1 << 24)
    await store.put({"x": [torch.ones(100)]})
    shm.create(store.prefix + "1-0.tmp", shm.PAGE)
    print(store.prefix, flush=True)
    os._exit(0)  # dies without closing its store

asyncio.run(main())
"""


def _cleanup(*args: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-m", "flowrl.cleanup", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return done.stdout.splitlines()


async def _arun(*argv: str) -> list[str]:
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0
    return out.decode().splitlines()


@pytest.fixture
def run_ids() -> Iterator[list[str]]:
    ids = [f"c{uuid.uuid4().hex[:10]}" for _ in range(3)]
    yield ids
    for rid in ids:
        leftovers = shm.list_segments(f"flowrl-{rid}-")
        for name in leftovers:
            shm.unlink(name)
        assert leftovers == []
        assert not shm.run_dir_path(rid).exists()


async def test_removes_dead_runs_and_spares_live_ones(run_ids: list[str]) -> None:
    live_run, dead_run, _ = run_ids
    with SampleStore(live_run, "node0", capacity_bytes=1 << 20) as live:
        handles = await live.put({"x": [torch.ones(10)]})
        (dead_prefix,) = await _arun(sys.executable, "-c", _DYING_STORE, dead_run)
        dead_segments = shm.list_segments(dead_prefix)
        assert len(dead_segments) == 2
        assert shm.run_dir_path(dead_run).is_dir()

        lines = await _arun(sys.executable, "-m", "flowrl.cleanup")

        expected = {f"removed /dev/shm/{n}" for n in dead_segments}
        expected.add(f"removed {shm.run_dir_path(dead_run)}")
        assert expected <= set(lines)
        assert shm.list_segments(dead_prefix) == []
        assert not shm.run_dir_path(dead_run).exists()
        # The live run is untouched and still readable.
        assert not any(live.prefix in line or live_run in line for line in lines)
        assert shm.run_dir_path(live_run).is_dir()
        assert torch.equal(live.get(handles["x"])[0], torch.ones(10))
        live.free(handles["x"])
    cmd = (sys.executable, "-m", "flowrl.cleanup", "--run-id", dead_run)
    assert await _arun(*cmd) == ["nothing to remove"]


def test_all_removes_unowned_leftovers_but_not_live_sockets(run_ids: list[str]) -> None:
    stale_run, busy_run, young_run = run_ids
    stale_dir, busy_dir, young_dir = (shm.run_dir_path(r) for r in run_ids)
    for d in (stale_dir, busy_dir, young_dir):
        d.mkdir(mode=0o700)
    unowned = f"flowrl-{stale_run}-not-a-store-segment"
    Path(shm.path_of(unowned)).write_bytes(b"x")
    (stale_dir / "controller.sock").touch()  # a socket file nobody is bound to
    old = time.time() - 3600
    os.utime(stale_dir, (old, old))
    os.utime(busy_dir, (old, old))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as bound:
        bound.bind(str(busy_dir / "s"))
        bound.listen()
        try:
            # Without --all, nothing that names no owner is touched.
            for rid in run_ids:
                assert _cleanup("--run-id", rid) == ["nothing to remove"]
            assert _cleanup("--all", "--run-id", stale_run) == [
                f"removed /dev/shm/{unowned}",
                f"removed {stale_dir}",
            ]
            assert _cleanup("--all", "--run-id", busy_run) == ["nothing to remove"]
            assert _cleanup("--all", "--run-id", young_run) == ["nothing to remove"]
            assert _cleanup("--all", "--grace", "0", "--run-id", young_run) == [
                f"removed {young_dir}"
            ]
        finally:
            for path in (busy_dir / "s", busy_dir):
                if path.is_dir():
                    path.rmdir()
                elif path.exists():
                    path.unlink()
    assert not stale_dir.exists()
    assert shm.list_segments(f"flowrl-{stale_run}-") == []


def test_plain_cleanup_removes_an_empty_unmarked_run_directory(run_ids: list[str]) -> None:
    """What a run killed while starting can leave: its directory, made before anything was
    marked or bound in it (or made again by a process of the run that outlived it). Empty, it
    holds nothing anyone could be using; only the grace spares a run that is just starting."""
    old_run, young_run, socket_run = run_ids
    old_dir, young_dir, socket_dir = (shm.run_dir_path(r) for r in run_ids)
    for d in (old_dir, young_dir, socket_dir):
        d.mkdir(mode=0o700)
    (socket_dir / "ctl.sock").touch()  # not empty: plain cleanup leaves it to --all
    long_ago = time.time() - 3600
    os.utime(socket_dir, (long_ago, long_ago))
    # Older than a 5 s grace but well within the default 30 s: a store starting meanwhile in
    # another test sweeps with the default, and must not take this directory first.
    a_while_ago = time.time() - 6
    os.utime(old_dir, (a_while_ago, a_while_ago))
    try:
        assert _cleanup("--grace", "5", "--run-id", old_run) == [f"removed {old_dir}"]
        assert _cleanup("--run-id", young_run) == ["nothing to remove"]
        assert _cleanup("--grace", "0", "--run-id", young_run) == [f"removed {young_dir}"]
        assert _cleanup("--run-id", socket_run) == ["nothing to remove"]
        assert _cleanup("--all", "--run-id", socket_run) == [f"removed {socket_dir}"]
    finally:
        for d in (old_dir, young_dir, socket_dir):
            if d.exists():
                for entry in d.iterdir():
                    entry.unlink()
                d.rmdir()


def test_help_is_fast_and_imports_no_torch() -> None:
    code = "import sys, flowrl.cleanup; print('torch' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True
    )
    assert done.stdout.strip() == "False"
