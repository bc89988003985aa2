"""Shared fixtures: a run id, a zmq context, and a leak check around every test."""

from __future__ import annotations

import contextlib
import os
import select
import time
from collections.abc import Iterator

import psutil
import pytest
import zmq
import zmq.asyncio

from transport.endpoints import new_run_id, remove_run_dir

_SHM = "/dev/shm"
# Helpers Python starts once per interpreter and keeps by design, and the pooled idle workers
# of the Ray cluster a module fixture starts (Ray adds one whenever it likes and ends them with
# the cluster); not a test's leak.
_PERSISTENT_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver",
                       "ray::IDLE")


@pytest.fixture
def run_id() -> Iterator[str]:
    """A fresh run id whose socket directory is removed after the test."""
    rid = new_run_id()
    yield rid
    remove_run_dir(rid)


@pytest.fixture
def zmq_ctx() -> Iterator[zmq.asyncio.Context]:
    """A private asyncio zmq context; the test fails if it leaves a socket open."""
    ctx = zmq.asyncio.Context()
    yield ctx
    # pyzmq keeps a weak set of a context's sockets; there is no public accessor.
    open_sockets = [s for s in list(getattr(ctx, "_sockets", ())) if not s.closed]
    ctx.destroy(linger=0)
    assert not open_sockets, f"test left {len(open_sockets)} zmq socket(s) open"


def _shm_entries() -> set[str]:
    try:
        return {n for n in os.listdir(_SHM) if n.startswith("flowrl-")}
    except FileNotFoundError:
        return set()


def _made_by(name: str, pids: set[int]) -> bool:
    """Whether a segment name carries one of `pids` as a dash-separated field.

    Store segment names carry their owner's and writer's pids; other test sessions may run on
    the same machine, and their segments are none of this session's business.
    """
    return any(field.isdigit() and int(field) in pids for field in name.split("-")[2:])


def _live_children() -> dict[int, psutil.Process]:
    found: dict[int, psutil.Process] = {}
    exiting: list[psutil.Process] = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            cmdline = child.cmdline()
            if not cmdline:  # its memory is released: it is exiting (a killed Ray worker)
                exiting.append(child)
                continue
            if any(h in " ".join(cmdline) for h in _PERSISTENT_HELPERS):
                continue
        except psutil.NoSuchProcess:
            continue
        found[child.pid] = child
    found.update((p.pid, p) for p in _still_running(exiting, timeout=10.0))
    return found


def _still_running(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Those of ``procs`` that have not terminated within ``timeout`` (they need not be our
    children: a pidfd becomes readable when its process terminates, zombie or not)."""
    fds: dict[int, psutil.Process] = {}
    for p in procs:
        try:
            fds[os.pidfd_open(p.pid)] = p
        except ProcessLookupError:
            continue
    try:
        pending = dict(fds)
        deadline = time.monotonic() + timeout
        while pending and (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select(list(pending), [], [], left)
            for fd in ready:
                pending.pop(fd)
        return list(pending.values())
    finally:
        for fd in fds:
            os.close(fd)


@pytest.fixture(autouse=True)
def _no_leaks() -> Iterator[None]:
    """Fail a test that leaves new /dev/shm/flowrl-* entries or child processes behind.

    What it finds is removed (segments unlinked, processes killed) so one leak does not
    fail the tests that follow.
    """
    shm_before = _shm_entries()
    children_before = set(_live_children())
    yield
    children_after = _live_children()
    pids = {os.getpid(), *children_before, *children_after}
    leaked_shm = sorted(n for n in _shm_entries() - shm_before if _made_by(n, pids))
    for name in leaked_shm:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(_SHM, name))
    described = []
    for pid, proc in children_after.items():
        if pid in children_before:
            continue
        try:
            described.append(f"{pid}: {' '.join(proc.cmdline())[:120]}")
            proc.kill()
            proc.wait(timeout=10)
        except psutil.NoSuchProcess:
            pass
    problems = []
    if leaked_shm:
        problems.append(f"shared-memory entries left behind: {leaked_shm}")
    if described:
        problems.append(f"child processes left running: {described}")
    if problems:
        pytest.fail("; ".join(problems))
