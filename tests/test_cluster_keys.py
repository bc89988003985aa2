"""What a user meets with a cluster's keys: the key file is the run's (a rerun, or a run after
one that died, just works), an agent holding other keys is told so within seconds and the
controller says so once, and a key file an agent cannot read is one line and exit code 2.

Real processes (agents, a process holding a key file), real tcp+curve sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import stat
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import zmq

from flowrl.node import agent_keys
from flowrl.node_hub import NODE_PROTOCOL, ClusterConfig, NodeHub
from transport.curve import ENV, CurveKeys
from transport.key_file import KeyFileInUse, hold

ROOT = Path(__file__).resolve().parents[1]
TOLD_S = 5.0  # an agent with other keys exits this soon after the controller refused it
START_S = 60.0  # bound on an agent process's start (imports) on busy cores


def hub(keys_file: Path, keys: CurveKeys | None = None) -> NodeHub:
    return NodeHub("keystest", {"a"}, ClusterConfig(keys_file=str(keys_file), keys=keys),
                   capacity=1 << 20, on_lost=lambda node: None, on_exit=lambda *a: None)


@contextlib.asynccontextmanager
async def running(h: NodeHub) -> AsyncIterator[str]:
    """`h` listening; closed (its key file released) on the way out."""
    h.publisher(f"inproc://keystest-{id(h)}")  # the join answer names its endpoint
    endpoint = await h.start({})
    task = asyncio.ensure_future(h.run())
    await asyncio.sleep(0)  # let it start, as a controller's does: its cleanup is in `run`
    try:
        yield endpoint
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def agent(endpoint: str, *args: str, env: dict[str, str] | None = None
                ) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "flowrl.node", "--controller", endpoint, "--node", "a", *args,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, cwd=ROOT,
        env={**{k: v for k, v in os.environ.items() if k != ENV}, **(env or {})})


async def output(proc: asyncio.subprocess.Process, within: float) -> str:
    """What `proc` printed, once it exited within `within` seconds (killed otherwise)."""
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(within):
            out = await proc.stdout.read()
            await proc.wait()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        pytest.fail(f"the agent did not exit within {within} s")
    return out.decode()


def one_error_line(out: str) -> str:
    lines = out.strip().splitlines()
    assert len(lines) == 1, out
    assert "Traceback" not in out, out
    record = json.loads(lines[0])
    assert record["level"] == "error", out
    return str(record["event"])


HOLDER = """
import sys, time
from transport.curve import CurveKeys
from transport.key_file import hold
held = hold(CurveKeys.generate(), sys.argv[1])
print("held", flush=True)
time.sleep(120)
"""


@pytest.mark.timeout(60)
async def test_a_live_runs_key_file_is_refused_and_a_dead_runs_is_taken_over(
    tmp_path: Path,
) -> None:
    path = tmp_path / "run.keys"
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HOLDER, str(path), stdout=asyncio.subprocess.PIPE, cwd=ROOT)
    try:
        assert holder.stdout is not None
        async with asyncio.timeout(30):
            assert await holder.stdout.readline() == b"held\n"
        theirs = path.read_text()
        with pytest.raises(KeyFileInUse, match=r"still running.*another key file"):
            hold(CurveKeys.generate(), path)
        assert path.read_text() == theirs  # a live run's keys are left alone
        holder.send_signal(signal.SIGKILL)  # the run dies: its file stays behind
        await holder.wait()
    finally:
        if holder.returncode is None:
            holder.kill()
            await holder.wait()
    assert path.read_text() == theirs
    keys = CurveKeys.generate()
    mine = hold(keys, path)
    try:
        assert CurveKeys.load(path) == keys
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    finally:
        mine.release()
    assert not path.exists()
    mine.release()  # twice is harmless


@pytest.mark.timeout(60)
async def test_a_rerun_with_the_same_key_file_starts_and_the_file_goes_with_the_run(
    tmp_path: Path,
) -> None:
    path = tmp_path / "run.keys"
    first = hub(path)
    async with running(first):
        assert CurveKeys.load(path) == first.keys
    assert not path.exists()
    # A run that died leaves its file behind, here readable by others: the next run takes it.
    CurveKeys.generate().save(path)
    path.chmod(0o644)
    second = hub(path)
    async with running(second):
        assert CurveKeys.load(path) == second.keys  # load refuses a file others may read
        with pytest.raises(KeyFileInUse):  # a run started beside it, with the same settings
            async with running(hub(path)):
                pass
        assert CurveKeys.load(path) == second.keys
    assert not path.exists()


@pytest.mark.timeout(120)
async def test_an_agent_with_another_runs_keys_is_told_at_once_and_the_controller_logs_it_once(
    tmp_path: Path,
) -> None:
    path = tmp_path / "run.keys"
    other = CurveKeys.generate().save(tmp_path / "old.keys")
    h = hub(path)
    refused = asyncio.Event()
    retried = asyncio.Event()
    first_refusal = 0.0
    told = h._refused  # wrapped, not replaced: the hub logs as it always does

    def refusal(reason: str) -> None:
        nonlocal first_refusal
        if not refused.is_set():
            first_refusal = time.monotonic()
            refused.set()
        if h._server is not None and h._server.statistics().handshakes_refused >= 5:
            retried.set()
        told(reason)

    h._refused = refusal  # type: ignore[method-assign]
    with structlog.testing.capture_logs() as logs:
        async with running(h) as endpoint:
            proc = await agent(endpoint, "--keys", str(other))
            try:
                async with asyncio.timeout(START_S):
                    await refused.wait()
                out = await output(proc, TOLD_S)
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            told_after = time.monotonic() - first_refusal
            # A client with other keys that keeps reconnecting (every 100 ms) is not logged
            # again.
            sock = zmq.Context.instance().socket(zmq.DEALER)
            try:
                for option, value in CurveKeys.load(other).client_options():
                    sock.setsockopt(option, value)
                sock.connect(endpoint)
                async with asyncio.timeout(30):
                    await retried.wait()
            finally:
                sock.close(linger=0)
    assert proc.returncode == 2, out
    line = one_error_line(out)
    assert f"refused the keys in {other}" in line, line
    assert "not this run's keys" in line, line
    assert "placement.cluster.keys_file" in line, line
    assert "--keys" in line, line
    assert told_after < TOLD_S
    warnings: list[dict[str, Any]] = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) == 1, warnings
    assert warnings[0]["event"] == "refused a connection: its curve keys are not this run's"
    assert warnings[0]["reason"] == "it encrypts for another server key"
    assert warnings[0]["use"] == f"the key file {path}"


@pytest.mark.timeout(60)
async def test_an_agent_without_its_key_file_says_so_in_one_line_with_exit_code_2(
    tmp_path: Path,
) -> None:
    missing = tmp_path / "run.keys"
    proc = await agent("tcp://127.0.0.1:9", "--keys", str(missing))
    line = one_error_line(await output(proc, START_S))
    assert proc.returncode == 2
    assert line.startswith(f"cannot read the run's keys from {missing}: No such file"), line
    assert "copy the key file the controller wrote for this run" in line, line


def test_every_unusable_key_source_is_one_line_naming_it(tmp_path: Path) -> None:
    ctl = "tcp://10.0.0.1:5555"
    keys = CurveKeys.generate()
    wide = keys.save(tmp_path / "wide.keys")
    wide.chmod(0o644)
    garbled = tmp_path / "garbled.keys"
    garbled.write_text("{not json")
    garbled.chmod(0o600)
    cases = {
        wide: "readable by others; chmod 600",
        garbled: "not valid JSON",
        tmp_path: "Is a directory",
    }
    for path, why in cases.items():
        with pytest.raises(ValueError, match=f"from {path}: .*{why}") as info:
            agent_keys(path, ctl, {})
        assert "\n" not in str(info.value)
        assert "--keys" in str(info.value)
    with pytest.raises(ValueError, match=rf"\${ENV} holds no usable keys"):
        agent_keys(None, ctl, {ENV: "{}"})
    with pytest.raises(ValueError, match=f"no keys: the controller at {ctl} admits only"):
        agent_keys(None, ctl, {})
    assert agent_keys(None, ctl, keys.to_env()) == keys
    assert agent_keys(None, "ipc:///tmp/flowrl-x/ctl.sock", {}) is None


async def test_an_agent_of_another_flowrl_version_is_refused_naming_both(tmp_path: Path) -> None:
    h = hub(tmp_path / "run.keys")
    async with running(h):
        # Agents say their node protocol when they join (every multi-node test joins one that
        # speaks this one); one of an older flowrl says none, which is protocol 1.
        for payload, said in (({"node": "a", "pid": 5}, "1"),
                              ({"node": "a", "pid": 5, "protocol": NODE_PROTOCOL + 1},
                               str(NODE_PROTOCOL + 1))):
            refusal = (f"speaks node protocol {said} and this controller {NODE_PROTOCOL}: "
                       "run the same version")
            with structlog.testing.capture_logs() as logs, pytest.raises(ValueError,
                                                                         match=refusal):
                await h._join(payload, b"")
            assert [e["event"] for e in logs] == ["node refused"]
        joined = await h._join({"node": "a", "pid": 5, "protocol": NODE_PROTOCOL}, b"")
        assert joined["run_id"] == "keystest"


async def test_a_real_agent_refused_at_its_join_says_why_in_one_line_with_exit_code_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # This controller speaks a newer node protocol than the agent's flowrl (a real agent
    # process): refused at its join, it exits at once, saying both versions in one line.
    monkeypatch.setattr("flowrl.node_hub.NODE_PROTOCOL", NODE_PROTOCOL + 1)
    path = tmp_path / "run.keys"
    async with running(hub(path)) as endpoint:
        proc = await agent(endpoint, "--keys", str(path))
        line = one_error_line(await output(proc, START_S))
    assert proc.returncode == 2
    assert line.startswith(f"the controller at {endpoint} refused this agent: node 'a'"), line
    assert (f"speaks node protocol {NODE_PROTOCOL} and this controller {NODE_PROTOCOL + 1}: "
            "run the same version of flowrl on every node") in line, line
