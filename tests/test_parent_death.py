"""A worker process or node agent whose parent is killed while it is still starting (a worker
imports torch for seconds) exits within seconds: the parent-death signal is armed before the heavy
imports, and a parent that died even earlier is noticed (`flowrl.lifecycle.die_with_parent`).
A controller killed during its start leaves nothing plain ``python -m flowrl.cleanup`` spares."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from transport.endpoints import ipc_endpoint, new_run_id, remove_run_dir

ROOT = Path(__file__).resolve().parents[1]
# Well under the seconds a worker takes to import torch and far under the ~50 s an orphaned
# worker took to give up on its controller; Python's own start is the rest.
GONE_S = 5.0
# A line of ``python -X importtime``: "import time: <self> | <cumulative> | <module>". Each
# entry is caught importing a package it imports after arming the signal: a worker torch, a
# node agent (which never loads torch) numpy.
IMPORTING = {entry: re.compile(rf"import time:\s+\d+ \|\s+\d+ \|\s+{package}\.")
             for entry, package in (("worker", "torch"), ("node agent", "numpy"))}

# A parent as the controller is one: it starts the child with `flowrl.procs.Supervisor`, says
# the child's pid, and waits (to be SIGKILLed).
PARENT = """
import asyncio, json, sys
from flowrl.procs import Supervisor

async def main():
    supervisor = Supervisor(lambda child, code: None)
    child = await supervisor.spawn("child", json.loads(sys.argv[1]))
    print(child.pid, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def _entry_points(run_id: str) -> dict[str, list[str]]:
    ctl, store = ipc_endpoint(run_id, "ctl"), ipc_endpoint(run_id, "store")
    return {
        "worker": [sys.executable, "-m", "workers.main", "--run-id", run_id, "--node", "node0",
                   "--controller", ctl, "--broadcast", ipc_endpoint(run_id, "pub"),
                   "--store", store, "--role", "rollout", "--name", "rollout-0"],
        "node agent": [sys.executable, "-m", "flowrl.node", "--run-id", run_id, "--node",
                       "node0", "--controller", ctl, "--store", store,
                       "--capacity", str(1 << 20)],
    }


def _wait_gone(pid: int, timeout: float) -> bool:
    """Whether process `pid` (not our child: it is orphaned) terminates within `timeout`."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
        return bool(ready)
    finally:
        os.close(fd)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("entry", ["worker", "node agent"])
@pytest.mark.parametrize("when", ["at once", "while it imports"])
def test_a_child_whose_parent_dies_during_its_start_exits_at_once(entry: str, when: str) -> None:
    """Killed "at once", the parent may die before the child has armed the signal (the child
    notices on arming); "while it imports", the signal itself stops the child."""
    run_id = new_run_id()
    argv = _entry_points(run_id)[entry]
    child = 0
    # Python reports each import as it completes (on stderr, which the parent relays to its
    # stdout): the child's progress, without a timer.
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"} if when != "at once" else None
    with subprocess.Popen([sys.executable, "-c", PARENT, json.dumps(argv)], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as parent:
        try:
            assert parent.stdout is not None
            child = int(parent.stdout.readline())
            if when != "at once":
                for line in parent.stdout:
                    if IMPORTING[entry].search(line):
                        break
                else:
                    pytest.fail(f"the child never imported {IMPORTING[entry].pattern}")
            parent.kill()  # the child has not finished its imports
            parent.wait()
            killed = time.monotonic()
            gone = _wait_gone(child, GONE_S)
            waited = time.monotonic() - killed
            assert gone, f"the {entry} outlived its parent by more than {GONE_S} s"
            assert waited < GONE_S
        finally:
            if parent.poll() is None:
                parent.kill()
            if child and not _wait_gone(child, 0.0):
                os.kill(child, signal.SIGKILL)
                _wait_gone(child, 10.0)
            remove_run_dir(run_id)
