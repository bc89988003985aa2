"""Bad input never takes a process down: `bench/fuzz.py` with fewer messages.

Each test runs the fuzzer as a process (``python -m bench.fuzz``, one harness for the benchmark
and the tests) against real endpoints: the controller's RPC server, the node agent's store
server and the HTTP monitor during a real simulated run, and a real worker process served by a
hostile controller. It asserts no crash, no failed valid request, exact run accounting and
bounded memory growth.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
MESSAGES = 600
# Growth of a fuzzed process's resident set over the fuzzing, in MiB: a leak of even a few
# hundred bytes a message would show here; allocator noise stays well under it.
MAX_GROWTH_MB = 40.0


def fuzz(endpoints: str, messages: int = MESSAGES) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.fuzz", "--endpoint", endpoints, "--messages",
         str(messages), "--seed", "7"],
        cwd=ROOT, capture_output=True, text=True, timeout=100, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    out["stderr"] = proc.stderr[-3000:]  # says which request or figure went wrong
    return out


def check_endpoint(out: dict[str, Any], name: str) -> None:
    fig = out["endpoints"][name]
    assert fig["messages"] >= MESSAGES
    assert fig["crashes"] == 0
    assert fig["valid_requests"] > 0
    assert fig["valid_requests_failed"] == 0, out["stderr"]
    assert fig["peak_rss_mb"] > 0
    assert fig["rss_growth_mb"] < MAX_GROWTH_MB


@pytest.mark.timeout(100)
def test_controller_store_and_monitor_survive_fuzzing_during_a_run() -> None:
    out = fuzz("controller,store,monitor")
    for name in ("controller", "store", "monitor"):
        check_endpoint(out, name)
    run = out["run"]
    assert run["ok"], run
    assert run["steps_during_fuzz"] > 0
    assert run["rows_trained"] == run["samples"] == run["steps"] * 16
    assert run["rows_trained_twice"] == 0
    assert run["worker_deaths"] == 0
    assert out["monitor_findings"] == {
        "server_errors": 0, "auth_bypass": 0, "traversal_leaks": 0, "host_bypass": 0,
        "bad_event_ids": 0}


@pytest.mark.timeout(100)
def test_a_worker_survives_a_hostile_controller_and_garbage_registration_is_fatal() -> None:
    out = fuzz("worker")
    check_endpoint(out, "worker")
    assert out["worker_exit_code"] == 0  # it left on the final stop broadcast
    # Every valid task was reported (with the next poll, or alone when the worker stopped).
    assert out["worker_calls"]["report"] >= out["endpoints"]["worker"]["valid_requests"]
    garbage = out["register_garbage"]
    assert garbage["exited_nonzero"] == garbage["cases"] > 0
    assert garbage["clear_error"] == garbage["cases"]
    assert garbage["max_exit_s"] < 20
