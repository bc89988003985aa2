"""The HTTP monitor against a real controller with simulated workers and a run in progress.

One controller (real node agent and worker processes) serves the whole module; its run goes
on in the background while each test reads or drives it over real HTTP on a real port. Since
that run writes shared memory while every test runs, the leak check (processes and /dev/shm
segments) is done once for the module rather than around each test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import urllib.parse
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import psutil
import pytest
import pytest_asyncio
from conftest import _live_children, _made_by, _shm_entries
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr

from flowrl.controller import Controller
from flowrl.events import EventBus, Span
from flowrl.monitor import MonitorServer
from flowrl.monitor.fanout import EventFanout
from flowrl.monitor.trace import chrome_trace, recent_marks
from flowrl.pipeline import PipelineSpec, PoolSpec, grpo_stages
from flowrl.recipe import MonitorConfig
from transport.errors import BindRefused

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOKEN = "monitor-test-token-0123456789"
# Small modelled costs: a step takes a few tens of milliseconds, so steps keep coming.
FAST = {
    "prompt_len": 8, "max_new_tokens": 64, "log_mean": 2.5, "log_sigma": 0.8,
    "rollout_base_s": 0.002, "rollout_token_s": 0.0002, "reward_token_s": 0.0,
    "reference_token_s": 0.0, "train_token_s": 0.00002, "train_step_s": 0.005,
    "weight_numel": 1024,
}
WORKERS = {"rollout": 2, "reward": 1, "train": 1}


def spec(max_staleness: int = 1) -> PipelineSpec:
    return PipelineSpec(
        stages=grpo_stages(group_size=4, train_micro_groups=2),
        pools=(PoolSpec("rollout", count=2, per_process=2), PoolSpec("reward", count=1),
               PoolSpec("train", count=1)),
        group_size=4, groups_per_step=4, max_staleness=max_staleness,
        engine="sim", engine_config=FAST, store_capacity_bytes=64 << 20,
        heartbeat_s=0.5, heartbeat_timeout_s=10.0,
    )


@pytest.fixture(autouse=True)
def _no_leaks() -> None:
    """Replaces the per-test check of conftest: see `_no_leaks_in_module`."""


@pytest.fixture(scope="module", autouse=True)
def _no_leaks_in_module() -> Iterator[None]:
    """No process and no /dev/shm segment of this module's runs outlives the module."""
    shm_before = _shm_entries()
    children_before = set(_live_children())
    yield
    children = _live_children()
    pids = {os.getpid(), *children_before, *children}
    leaked = sorted(n for n in _shm_entries() - shm_before if _made_by(n, pids))
    alive = [pid for pid in children if pid not in children_before]
    for pid in alive:
        children[pid].kill()
    for name in leaked:
        os.unlink(os.path.join("/dev/shm", name))
    assert not leaked, f"shared-memory segments left behind: {leaked}"
    assert not alive, f"processes left running: {alive}"


@dataclass
class Live:
    ctl: Controller
    url: str
    http: aiohttp.ClientSession
    run: asyncio.Future[dict[str, Any]]

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {TOKEN}"}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def live() -> AsyncIterator[Live]:
    """One run for the module's tests. Its start and stop have bounds of their own (the
    controller's start timeout, and those below): the tests' timeouts count only their own
    bodies (``func_only``), or the first test would carry the workers' start, which takes
    ~30 s beside other work on a slow 2-core host."""
    config = MonitorConfig(token=SecretStr(TOKEN))
    async with Controller(spec(), monitor=config) as ctl, aiohttp.ClientSession() as http:
        assert ctl.monitor_url is not None
        run = asyncio.ensure_future(ctl.run(steps=10**6))
        async with asyncio.timeout(120):
            await ctl.wait_for(lambda: ctl.version >= 2)
        yield Live(ctl, ctl.monitor_url, http, run)
        ctl.resume()
        ctl.stop()
        out = await asyncio.wait_for(run, 30)
        assert out["rows_trained_twice"] == 0


async def get_json(live: Live, path: str, **kw: Any) -> Any:
    async with live.http.get(live.url + path, **kw) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def sse(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """Parse a Server-Sent Events stream; checks that ``id`` and ``event`` match the data."""
    while True:
        async with asyncio.timeout(20):
            block = (await resp.content.readuntil(b"\n\n")).decode()
        fields: dict[str, str] = {}
        for line in block.strip("\n").split("\n"):
            if line.startswith(":"):
                continue
            key, _, value = line.partition(": ")
            fields[key] = value
        if "data" not in fields:
            continue
        event: dict[str, Any] = json.loads(fields["data"])
        assert int(fields["id"]) == event["seq"]
        assert fields["event"] == event["kind"]
        yield event


async def next_kind(events: AsyncIterator[dict[str, Any]], kind: str,
                    seen: list[dict[str, Any]]) -> dict[str, Any]:
    async for e in events:
        seen.append(e)
        if e["kind"] == kind:
            return e
    raise AssertionError("the stream ended")


# ---- read endpoints ---------------------------------------------------------------------------


@pytest.mark.timeout(30, func_only=True)
async def test_status_serves_the_controller_status(live: Live) -> None:
    body = await get_json(live, "status")
    assert set(body) == set(live.ctl.status())
    assert body["run_id"] == live.ctl.run_id
    assert body["monitor_url"] == live.url
    assert list(body["stages"]) == ["rollout", "reward", "train"]
    for stage in body["stages"].values():
        assert {"role", "queue_depth", "in_flight", "in_flight_rows"} <= set(stage)
    roles = sorted(w["role"] for w in body["workers"])
    assert roles == sorted(r for r, n in WORKERS.items() for _ in range(n))
    for w in body["workers"]:
        assert w["state"] in ("busy", "queued", "idle")
        assert {"node", "version", "in_flight", "tasks"} <= set(w)
    assert body["trainer"]["version"] >= 2
    assert sum(body["staleness_histogram"].values()) > 0
    assert body["throughput"]["samples_per_s"] > 0
    assert body["store"]["capacity_bytes"] == 64 << 20
    assert body["loop_lag"]["max_ms"] >= 0
    assert TOKEN not in json.dumps(body)


@pytest.mark.timeout(30, func_only=True)
async def test_metrics_parse_and_are_labelled_by_stage_and_worker(live: Live) -> None:
    async with live.http.get(live.url + "metrics") as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["flowrl_version"].samples[0].value >= 2
    assert families["flowrl_samples_trained"].type == "counter"
    depth = {s.labels["stage"] for s in families["flowrl_stage_queue_depth"].samples}
    assert depth == {"rollout", "reward", "train"}
    workers = {s.labels["worker"] for s in families["flowrl_worker_tasks"].samples}
    assert len(workers) == sum(WORKERS.values())
    durations = families["flowrl_task_duration_seconds"]
    assert durations.type == "histogram"
    counts = {s.labels["stage"]: s.value for s in durations.samples
              if s.name.endswith("_count")}
    assert set(counts) == {"rollout", "reward", "train"}
    assert min(counts.values()) > 0
    staleness = [s for s in families["flowrl_sample_staleness"].samples
                 if s.name.endswith("_bucket")]
    values = [s.value for s in staleness]
    assert values == sorted(values)
    assert values[-1] > 0
    # The last step's figures, next to the bound (simulated workers report no trainer figures).
    def gauge(name: str) -> float:
        family = families[name]
        assert family.type == "gauge", name
        assert family.documentation, name
        (sample,) = family.samples
        return float(sample.value)

    assert gauge("flowrl_response_length_tokens") >= 1
    assert gauge("flowrl_reward_std") >= 0
    assert 0 <= gauge("flowrl_step_staleness_mean") <= gauge("flowrl_step_staleness_max")
    assert gauge("flowrl_step_staleness_max") <= gauge("flowrl_max_staleness")
    assert families["flowrl_failed_samples"].type == "counter"
    assert families["flowrl_failed_samples"].samples == []  # no sample failed
    assert "flowrl_train_loss" not in families
    # A second scrape only adds the spans finished since the first.
    async with live.http.get(live.url + "metrics") as r:
        again = {f.name: f for f in text_string_to_metric_families(await r.text())}
    for s in again["flowrl_task_duration_seconds"].samples:
        if s.name.endswith("_count"):
            assert s.value >= counts[s.labels["stage"]]
            assert s.value <= len(live.ctl.events.spans) + sum(counts.values())
    assert TOKEN not in text


async def test_an_interrupted_weight_load_is_an_instant_event_on_its_workers_track() -> None:
    bus = EventBus()
    bus.span(Span("rollout-1", "rollout", "rollout", 3, 8, bus.t0 + 1.0, bus.t0 + 2.0))
    bus.mark("rollout-1", "rollout", "interrupted", version=1, tasks=1, sequences=5)
    bus.mark("rollout-2", "rollout", "interrupted", version=1, tasks=2, sequences=0)
    first, second = bus.marks
    assert recent_marks(bus.marks, second.time) == [second]
    assert recent_marks(bus.marks, None) == [first, second]
    events = chrome_trace(bus.spans, t0=bus.t0, roles=["rollout"], marks=bus.marks)["traceEvents"]
    threads = {e["args"]["name"]: (e["pid"], e["tid"]) for e in events
               if e["name"] == "thread_name"}
    span = next(e for e in events if e["ph"] == "X")
    marks = [e for e in events if e["ph"] == "i"]
    assert [e["args"] for e in marks] == [
        {"version": 1, "tasks": 1, "sequences": 5, "worker": "rollout-1"},
        {"version": 1, "tasks": 2, "sequences": 0, "worker": "rollout-2"}]
    for e, mk in zip(marks, (first, second), strict=True):
        assert {"name", "ph", "ts", "dur", "pid", "tid"} <= set(e)
        assert (e["name"], e["s"], e["dur"]) == ("interrupted", "t", 0)
        assert e["ts"] == round((mk.time - bus.t0) * 1e6, 1)
        assert (e["pid"], e["tid"]) == threads[mk.worker]
    assert (span["pid"], span["tid"]) == threads["rollout-1"]


@pytest.mark.timeout(30, func_only=True)
async def test_trace_is_valid_chrome_trace_json(live: Live) -> None:
    trace_version = live.ctl.version
    trace = await get_json(live, "trace")
    events = trace["traceEvents"]
    assert events
    for e in events:
        assert {"name", "ph", "ts", "dur", "pid", "tid"} <= set(e), e
        assert e["ph"] in ("X", "M")
        assert e["dur"] >= 0
    complete = [e for e in events if e["ph"] == "X"]
    assert {e["name"] for e in complete} == {"rollout", "reward", "train"}
    roles = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert sorted(roles.values()) == sorted(WORKERS)
    for e in complete:
        assert roles[e["pid"]] == e["cat"]  # one process track per role
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e["name"] == "thread_name"}
    assert len(threads) == sum(WORKERS.values())  # one thread track per worker
    assert {(e["pid"], e["tid"]) for e in complete} <= set(threads)
    assert all(threads[(e["pid"], e["tid"])] == e["args"]["worker"] for e in complete)
    # ?window=S keeps exactly the spans that ended in the last S seconds.
    ends = sorted(e["ts"] + e["dur"] for e in complete)
    window = (trace["otherData"]["now_us"] - ends[len(ends) // 2]) / 1e6
    recent = await get_json(live, f"trace?window={window}")
    cutoff = recent["otherData"]["now_us"] - window * 1e6
    kept = {e["args"]["task"] for e in recent["traceEvents"] if e["ph"] == "X"}
    assert kept, "the newest spans are kept"
    for e in complete:
        # ts and dur are rounded to 0.1 us
        assert (e["args"]["task"] in kept) == (e["ts"] + e["dur"] >= cutoff - 0.2), e
    assert len(kept) < len(complete)
    # ?after=US (a previous answer's now) brings only what ended since: a poller's increment.
    after = recent["otherData"]["now_us"]
    await live.ctl.wait_for(lambda: live.ctl.version > trace_version + 1)
    newer = await get_json(live, f"trace?after={after}")
    fresh = [e for e in newer["traceEvents"] if e["ph"] == "X"]
    assert fresh, "steps went on, so tasks ended"
    assert all(e["ts"] + e["dur"] >= after - 0.2 for e in fresh)
    assert not {e["args"]["task"] for e in fresh} & kept
    async with live.http.get(live.url + "trace?window=soon") as r:
        assert r.status == 400


@pytest.mark.timeout(30, func_only=True)
async def test_events_stream_every_step_in_order_and_resume_after_an_id(live: Live) -> None:
    steps: list[int] = []
    seqs: list[int] = []
    async with live.http.get(live.url + "events") as resp:
        assert resp.headers["Content-Type"] == "text/event-stream"
        async for e in sse(resp):
            seqs.append(e["seq"])
            if e["kind"] == "step":
                steps.append(e["step"])
                assert {"reward_mean", "samples_per_s", "staleness_max"} <= set(e)
            if len(steps) == 5:
                break
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # increasing, nothing lost
    assert steps == list(range(steps[0], steps[0] + 5))  # one event for each step
    # Reconnecting with Last-Event-ID replays what came after that id first.
    resume_from = seqs[-1]
    async with live.http.get(live.url + "events",
                             headers={"Last-Event-ID": str(resume_from)}) as resp:
        first = [e async for e in _take(sse(resp), 3)]
    assert [e["seq"] for e in first] == [resume_from + 1, resume_from + 2, resume_from + 3]


async def _take(it: AsyncIterator[dict[str, Any]], n: int) -> AsyncIterator[dict[str, Any]]:
    async for e in it:
        yield e
        n -= 1
        if n == 0:
            return


# ---- control ----------------------------------------------------------------------------------


@pytest.mark.timeout(30, func_only=True)
@pytest.mark.parametrize("path", ["pause", "resume", "stop", "staleness"])
@pytest.mark.parametrize("auth", [None, "Bearer wrong-token-wrong-token", f"Basic {TOKEN}"])
async def test_control_without_the_token_is_refused(live: Live, path: str,
                                                    auth: str | None) -> None:
    headers = {} if auth is None else {"Authorization": auth}
    async with live.http.post(live.url + path, json={"max_staleness": 0},
                              headers=headers) as r:
        assert r.status == 401
        assert r.headers["WWW-Authenticate"].startswith("Bearer")
        # A wrong token is told apart from none (a Basic header names no bearer token).
        wrong = auth is not None and auth.startswith("Bearer")
        assert await r.text() == ("invalid token" if wrong else "a bearer token is required")
        assert ('error="invalid_token"' in r.headers["WWW-Authenticate"]) == wrong
    assert not live.ctl.paused
    assert live.ctl.gate.max_staleness == 1
    assert not live.run.done()


@pytest.mark.timeout(40, func_only=True)
async def test_pause_stops_dispatch_until_resume(live: Live, capfd: pytest.CaptureFixture[str],
                                                 ) -> None:
    seen: list[dict[str, Any]] = []
    async with live.http.get(live.url + "events") as resp:
        events = sse(resp)
        async with live.http.post(live.url + "pause", headers=live.auth) as r:
            assert r.status == 200
            assert (await r.json())["paused"] is True
        await next_kind(events, "paused", seen)
        drained = await next_kind(events, "drained", seen)
        status = await get_json(live, "status")
        assert status["paused"]
        assert all(w["in_flight"] == 0 for w in status["workers"])
        # Every finished task and this wake-up run a dispatch pass; none may dispatch.
        async with live.http.post(live.url + "staleness", json={"max_staleness": 2},
                                  headers=live.auth) as r:
            assert r.status == 200
        await next_kind(events, "staleness", seen)
        for _ in range(5):
            status = await get_json(live, "status")
            assert all(w["in_flight"] == 0 for w in status["workers"])
            # Only train micro-batches of the unfinished step, done but uncommitted, remain.
            pending = status["trainer"]["micro_batches_pending"]
            assert status["index"]["tasks_in_flight"] == pending
            assert status["version"] == drained["version"]
        async with live.http.post(live.url + "resume", headers=live.auth) as r:
            assert r.status == 200
            assert (await r.json())["paused"] is False
        resumed = await next_kind(events, "resumed", seen)
        step = await next_kind(events, "step", seen)
    between = [e["kind"] for e in seen if drained["seq"] < e["seq"] < resumed["seq"]]
    assert "step" not in between
    assert "version" not in between
    assert step["step"] == drained["version"] + 1  # the run goes on where it stopped
    live.ctl.set_max_staleness(1)
    out, err = capfd.readouterr()
    assert "monitor control" in out + err  # control actions are logged ...
    assert TOKEN not in out + err  # ... and the token never is


@pytest.mark.timeout(40, func_only=True)
async def test_staleness_change_applies_to_the_next_steps(live: Live) -> None:
    async with live.http.get(live.url + "events") as resp:
        events = sse(resp)
        async with live.http.post(live.url + "staleness", json={"max_staleness": 0},
                                  headers=live.auth) as r:
            assert r.status == 200
            assert (await r.json())["max_staleness"] == 0
        changed = await next_kind(events, "staleness", [])
        # Micro-batches already handed out keep their rows: those of the current step, and
        # the next step's first one, which the trainer may hold already (prefetch). Those may
        # still be one version old; from the step after, every trained sample is on-policy.
        seen: list[dict[str, Any]] = []
        try:
            while len([e for e in seen if e["kind"] == "step"]) < 5:
                await next_kind(events, "step", seen)
            assert (await get_json(live, "status"))["max_staleness"] == 0
        finally:  # the module's later tests expect the run's own bound
            live.ctl.set_max_staleness(1)
    late = [e for e in seen if e["kind"] == "step" and e["step"] > changed["version"] + 2]
    assert len(late) >= 2
    assert all(e["staleness_max"] == 0 for e in late)


@pytest.mark.timeout(30, func_only=True)
@pytest.mark.parametrize("body", [{}, {"max_staleness": -1}, {"max_staleness": 65},
                                  {"max_staleness": "1"}, {"max_staleness": True}, [1]])
async def test_bad_staleness_bodies_are_rejected(live: Live, body: Any) -> None:
    async with live.http.post(live.url + "staleness", json=body, headers=live.auth) as r:
        assert r.status == 400
    async with live.http.post(live.url + "staleness", data=b"{not json",
                              headers=live.auth) as r:
        assert r.status == 400
    assert live.ctl.gate.max_staleness == 1


# ---- binding and access -----------------------------------------------------------------------


@pytest.mark.timeout(30, func_only=True)
async def test_loopback_monitor_answers_loopback_host_names_only(live: Live) -> None:
    async with live.http.get(live.url + "status", headers={"Host": "rebound.example"}) as r:
        assert r.status == 421
    port = live.url.rsplit(":", 1)[1].rstrip("/")
    async with live.http.get(live.url + "status", headers={"Host": f"localhost:{port}"}) as r:
        assert r.status == 200


@pytest.mark.timeout(30, func_only=True)
async def test_off_loopback_every_data_endpoint_needs_the_token(live: Live) -> None:
    config = MonitorConfig(host="0.0.0.0", token=SecretStr(TOKEN))
    async with MonitorServer(live.ctl, config) as mon:
        local = mon.url.replace("0.0.0.0", "127.0.0.1")
        for path in ("status", "metrics", "trace", "events"):
            async with live.http.get(local + path) as r:
                assert r.status == 401, path
                assert await r.text() == "a bearer token is required"
            async with live.http.get(local + path,
                                     headers={"Authorization": "Bearer not-the-token"}) as r:
                assert r.status == 401, path
                assert await r.text() == "invalid token"
        async with live.http.get(local + "status", headers=live.auth) as r:
            assert r.status == 200
        async with live.http.get(local) as r:  # the page itself holds no data
            assert r.status == 200
            assert "dashboard.js" in await r.text()


async def test_non_loopback_without_a_token_refuses_to_start() -> None:
    unsafe = MonitorConfig.model_construct(host="0.0.0.0", port=None, token=None)
    ctl = Controller(spec(), monitor=unsafe)
    with pytest.raises(BindRefused, match="not loopback"):
        async with ctl:
            pass
    assert ctl.worker_pids() == []  # refused before any process started


@pytest.mark.timeout(30, func_only=True)
async def test_dashboard_and_its_files_are_served(live: Live) -> None:
    async with live.http.get(live.url) as r:
        assert r.status == 200
        assert r.content_type == "text/html"
        page = await r.text()
    assert "static/dashboard.js" in page
    assert "http" not in page.split("<body>")[1]
    for name, ctype in (("dashboard.js", "text/javascript"), ("dashboard.css", "text/css")):
        async with live.http.get(live.url + "static/" + name) as r:
            assert r.status == 200
            assert r.content_type == ctype
            assert "://" not in (await r.text()).replace("http://www.w3.org/2000/svg", "")
    async with live.http.get(live.url + "static/..%2Fserver.py") as r:
        assert r.status == 404


# ---- the terminal view ------------------------------------------------------------------------


@pytest.mark.timeout(30, func_only=True)
async def test_terminal_view_prints_one_snapshot(live: Live) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "flowrl.monitor", live.url, "--once",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "COLUMNS": "160"})
    out, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 0, err.decode()
    text = out.decode()
    assert f"run {live.ctl.run_id}" in text
    assert "version" in text
    workers = [w["id"] for w in live.ctl.status()["workers"]]
    for name in ("rollout", "reward", "train", "staleness", *workers):
        assert name in text


@pytest.mark.timeout(30, func_only=True)
async def test_terminal_view_redraws_until_ctrl_c_then_exits_cleanly(live: Live) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "flowrl.monitor", live.url, "--interval", "0.2",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        # draw as on a terminal
        env={**os.environ, "TTY_COMPATIBLE": "1", "TERM": "xterm", "COLUMNS": "160"})
    assert proc.stdout is not None
    try:
        seen = b""
        async with asyncio.timeout(20):
            while seen.count(live.ctl.run_id.encode()) < 2:  # two redraws
                seen += await proc.stdout.read(4096)
        proc.send_signal(signal.SIGINT)
        _, err = await asyncio.wait_for(proc.communicate(), 20)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()
    assert b"Traceback" not in err


@pytest.mark.timeout(30, func_only=True)
async def test_terminal_view_stops_at_a_wrong_token_naming_it(live: Live) -> None:
    config = MonitorConfig(host="0.0.0.0", token=SecretStr(TOKEN))
    async with MonitorServer(live.ctl, config) as mon:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "flowrl.monitor", mon.url.replace("0.0.0.0", "127.0.0.1"),
            "--interval", "0.2", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "FLOWRL_MONITOR_TOKEN": "not-the-token"})
        try:
            _, err = await asyncio.wait_for(proc.communicate(), 20)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert proc.returncode == 1
    assert b"HTTP 401: invalid token" in err
    assert b"FLOWRL_MONITOR_TOKEN" in err


@pytest.mark.timeout(30)
async def test_terminal_view_reports_an_unreachable_monitor() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "flowrl.monitor", "http://127.0.0.1:9/", "--once",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 1
    assert b"cannot read http://127.0.0.1:9/status" in err


# ---- limits: connections, event streams, timeouts ---------------------------------------------

# Small limits so that a crowd of a few hundred sockets is far beyond them.
LIMITS = {"max_connections": 24, "max_event_streams": 3, "header_timeout_s": 1.5,
          "stall_timeout_s": 5.0}


def server_sockets(port: int) -> int:
    """This process's accepted (server-side) TCP connections on `port`."""
    return sum(1 for c in psutil.Process().net_connections("tcp")
               if c.laddr and c.laddr.port == port and c.raddr)


async def raw_exchange(port: int, raw: bytes) -> tuple[int, bytes]:
    """Send `raw` on a fresh connection; the status and body of the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        async with asyncio.timeout(20):
            data = await reader.read()
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


async def until_closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection."""
    got = b""
    with contextlib.suppress(ConnectionError):
        while chunk := await reader.read(4096):
            got += chunk
    return got


@pytest.mark.timeout(90, func_only=True)
async def test_a_slowloris_crowd_is_bounded_and_timed_out(live: Live) -> None:
    async with MonitorServer(live.ctl, MonitorConfig(**LIMITS)) as mon:
        port = int(mon.url.rstrip("/").rsplit(":", 1)[1])
        crowd: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        fds_before = len(os.listdir("/proc/self/fd"))
        try:
            for i in range(300):  # each sends part of a request head, and never the rest
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                crowd.append((reader, writer))
                with contextlib.suppress(ConnectionError):
                    writer.write(f"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\nX-{i}: ".encode())
                    await writer.drain()
            # The monitor still answers: a new connection takes an idle one's place.
            async with aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(force_close=True)) as fresh:
                for _ in range(3):
                    async with fresh.get(mon.url + "status") as r:
                        assert r.status == 200
                        assert (await r.json())["run_id"] == live.ctl.run_id
            # It holds at most its limit of them; the rest were refused or evicted. (This
            # process holds both ends: the crowd's 300 sockets and the monitor's.)
            assert server_sockets(port) <= LIMITS["max_connections"]
            assert len(os.listdir("/proc/self/fd")) - fds_before <= 300 + LIMITS[
                "max_connections"] + 10
            assert mon.limits is not None
            assert mon.limits.refused + mon.limits.evicted >= 300 - LIMITS["max_connections"]
            # Every one of them is closed by the monitor: none ever completed its head.
            async with asyncio.timeout(LIMITS["header_timeout_s"] * 10):
                answers = await asyncio.gather(*(until_closed(r) for r, _ in crowd))
            assert all(a == b"" or a.startswith(b"HTTP/1.1 503") for a in answers)
            assert server_sockets(port) == 0
        finally:
            for _, writer in crowd:
                writer.close()


@pytest.mark.timeout(60, func_only=True)
async def test_event_streams_beyond_the_cap_get_503_and_share_one_subscription(
        live: Live) -> None:
    async with MonitorServer(live.ctl, MonitorConfig(**LIMITS)) as mon, \
            contextlib.AsyncExitStack() as streams:
        subscribers = len(live.ctl.events._subscribers)  # the module's own monitor's
        opened = []
        for _ in range(LIMITS["max_event_streams"]):
            resp = await streams.enter_async_context(live.http.get(mon.url + "events"))
            assert resp.status == 200
            opened.append(resp)
        async with live.http.get(mon.url + "events") as r:
            assert r.status == 503
            assert "event streams" in await r.text()
            assert "Retry-After" in r.headers
        # The controller feeds every stream through one subscription: an event costs its loop
        # one queue put however many clients watch.
        assert len(live.ctl.events._subscribers) <= subscribers + 1
        # Every stream still gets every event.
        for resp in opened:
            await next_kind(sse(resp), "step", [])
        async with live.http.get(mon.url + "status") as r:
            assert r.status == 200


@pytest.mark.timeout(30, func_only=True)
@pytest.mark.parametrize("bad", ["\u00b2", "\u0663", "\u00e9", "1" * 21, "9" * 5000, "-1", "1.5",
                                 "0x10"])
async def test_events_with_a_bad_id_answer_400(live: Live, bad: str) -> None:
    port = int(live.url.rstrip("/").rsplit(":", 1)[1])
    head = "GET /events HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
    status, body = await raw_exchange(
        port, f"{head}Last-Event-ID: {bad}\r\n\r\n".encode())
    assert status == 400, body
    assert b"Last-Event-ID" in body
    query = urllib.parse.quote(bad)
    status, body = await raw_exchange(
        port, f"GET /events?last_id={query} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
              "Connection: close\r\n\r\n".encode())
    assert status == 400, body
    assert b"last_id" in body


@pytest.mark.timeout(60, func_only=True)
async def test_an_event_stream_whose_client_stops_reading_is_dropped(live: Live) -> None:
    limits = {**LIMITS, "stall_timeout_s": 1.0}
    async with MonitorServer(live.ctl, MonitorConfig(**limits)) as mon:
        port = int(mon.url.rstrip("/").rsplit(":", 1)[1])
        sock = socket.socket()
        # A small receive window: the replay below (every kept event, hundreds of KiB) stays
        # queued in the monitor, which must then give up on this client instead of keeping it.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
            await asyncio.get_running_loop().sock_sendall(
                sock, b"GET /events?last_id=0 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            await live.ctl.wait_for(lambda: mon.streams == 1)
            assert mon.limits is not None
            conns = mon.limits
            async with asyncio.timeout(30):
                await live.ctl.wait_for(lambda: mon.streams == 0)
                # The stream may end before the aborted connection is closed: the transport
                # closes its socket in a later callback, with the protocol's connection_lost.
                await live.ctl.wait_for(lambda: len(conns) == 0)
            assert conns.timed_out >= 1
            assert server_sockets(port) == 0
        finally:
            sock.close()


@pytest.mark.timeout(30)
async def test_the_event_fanout_drops_a_reader_a_whole_ring_behind() -> None:
    bus = EventBus(keep=8)
    encoded: list[int] = []

    def encode(event: dict[str, Any]) -> bytes:
        encoded.append(event["seq"])
        return f"{event['seq']},".encode()

    fanout = EventFanout(bus, encode, keepalive_s=60.0)
    bus.emit("before")  # kept in the bus's log: replayed to a reader that asks for it
    task = asyncio.create_task(fanout.run())
    try:
        await fanout.changed()  # the log is taken
        fresh, behind = fanout.start(None), fanout.start(0)
        assert fanout.read(behind) == (b"1,", fresh)
        for _ in range(3):
            bus.emit("x")
            await fanout.changed()
        assert fanout.read(fresh) == (b"2,3,4,", fresh + 3)
        for _ in range(8):
            bus.emit("x")
            await fanout.changed()
        assert fanout.read(fresh) is None  # nine events since: more than the ring holds
        assert fanout.read(fanout.start(10)) == (b"11,12,", fanout.start(12))
        assert encoded == list(range(1, 13))  # each event encoded once
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert fanout.read(fanout.start(None)) is None  # closed: readers end


async def test_plan_trace_export_needs_the_token_and_reads_as_a_trace(
        live: Live, tmp_path: Any) -> None:
    from flowrl.run_trace import read_trace

    async with live.http.get(live.url + "plan-trace") as r:  # loopback, yet refused
        assert r.status == 401
        assert await r.text() == "a bearer token is required"
    async with live.http.get(live.url + "plan-trace", headers=live.auth) as r:
        assert r.status == 200, await r.text()
        assert "attachment" in r.headers["Content-Disposition"]
        body = await r.text()
    path = tmp_path / "live.trace.jsonl"
    path.write_text(body)
    trace = read_trace(path)
    assert trace.header["pools"] == WORKERS
    assert {t.role for t in trace.tasks} == set(WORKERS)
    assert all(len(t.lengths) == t.rows for t in trace.tasks_of("rollout"))
    assert any(t.step_end for t in trace.tasks_of("train"))
    assert trace.steps
    assert trace.syncs
    html = await (await live.http.get(live.url)).text()
    assert 'id="export-trace"' in html
