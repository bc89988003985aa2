"""Secure by default: no pickle reachable from any entry point, every default bind on loopback,
the monitor's token in no log line and no `/status` answer, and no process acting as a worker
without that worker's token.

Covered elsewhere and not repeated here: the source scan for pickle (`test_no_pickle`),
`check_bind` refusing non-loopback addresses (`test_endpoints`), control without or with a wrong
token answered 401 and with it 200 (`test_monitor`).
"""

from __future__ import annotations

import importlib
import ipaddress
import json
import os
import pkgutil
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType, SimpleNamespace

import psutil
import pytest
from test_no_pickle import BANNED_MODULES, violations

from flowrl import messages as m
from flowrl.controller import Controller
from flowrl.pipeline import PipelineSpec, PoolSpec, grpo_stages
from flowrl.recipe import MonitorConfig
from transport.endpoints import ipc_endpoint, run_dir
from transport.errors import RemoteError
from transport.rpc import RpcClient

ROOT = Path(__file__).resolve().parent.parent
INSTALLED = ("flowrl", "workers", "transport")
# The `python -m` entry points the launcher and the docs use.
MAIN_MODULES = ("flowrl.launch", "flowrl.node", "flowrl.cleanup", "flowrl.monitor.__main__",
                "workers.main")
FAST = {
    "prompt_len": 8, "max_new_tokens": 32, "log_mean": 2.0, "log_sigma": 0.5,
    "rollout_base_s": 0.001, "rollout_token_s": 0.0001, "reward_token_s": 0.0,
    "reference_token_s": 0.0, "train_token_s": 0.00001, "train_step_s": 0.002,
    "weight_numel": 256,
}


def sim_spec() -> PipelineSpec:
    return PipelineSpec(
        stages=grpo_stages(group_size=4, train_micro_groups=2),
        pools=(PoolSpec("rollout", count=1), PoolSpec("reward", count=1),
               PoolSpec("train", count=1)),
        group_size=4, groups_per_step=2, max_staleness=1, engine="sim", engine_config=FAST,
        store_capacity_bytes=16 << 20, heartbeat_s=0.5, heartbeat_timeout_s=10.0)


def installed_modules() -> list[str]:
    names = []
    for pkg in INSTALLED:
        module = importlib.import_module(pkg)
        names.append(pkg)
        names += [m.name for m in pkgutil.walk_packages(module.__path__, f"{pkg}.")]
    return names


def entry_modules() -> set[str]:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    return {target.split(":")[0] for target in scripts.values()} | set(MAIN_MODULES)


def test_no_installed_module_or_entry_point_uses_pickle() -> None:
    names = installed_modules()
    entries = entry_modules()
    assert entries <= set(names), "every entry point is an installed module"
    found = []
    for name in names:
        spec = importlib.util.find_spec(name)
        assert spec is not None
        assert spec.origin is not None
        found += violations(Path(spec.origin).read_text(), name)
    assert found == []


def pickle_references(modules: dict[str, ModuleType]) -> list[str]:
    """`module.name` for every global of our modules that is, or comes from, a pickle-family
    module."""
    bad = []
    for name, mod in modules.items():
        if name.split(".")[0] not in INSTALLED:
            continue
        for key, value in vars(mod).items():
            origin = (value.__name__ if isinstance(value, ModuleType)
                      else str(getattr(value, "__module__", "")))
            if origin.split(".")[0] in BANNED_MODULES:
                bad.append(f"{name}.{key}")
    return bad


PROBE = """
import importlib, json, sys
from test_security import pickle_references
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(pickle_references(dict(sys.modules))))
"""


def test_entry_points_load_and_hold_no_pickle_module() -> None:
    """Each entry point imports cleanly in a fresh interpreter, and no module of ours keeps a
    reference to a pickle-family module (torch imports pickle itself; we must not use it)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    out = subprocess.run([sys.executable, "-c", PROBE, *sorted(entry_modules())], env=env,
                         capture_output=True, text=True, timeout=60, check=True, cwd=ROOT)
    assert json.loads(out.stdout) == []


def test_the_probe_finds_a_pickle_reference() -> None:
    mod = ModuleType("flowrl.fake")
    mod.loads = SimpleNamespace(__module__="_pickle")  # type: ignore[attr-defined]
    mod.shelf = ModuleType("shelve")  # type: ignore[attr-defined]
    assert pickle_references({"flowrl.fake": mod}) == ["flowrl.fake.loads", "flowrl.fake.shelf"]


def _listening(pid: int) -> tuple[list[str], list[str]]:
    """(tcp/udp addresses listened on, unix socket paths) of process `pid`."""
    proc = psutil.Process(pid)
    inet = [c.laddr.ip for c in proc.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN]
    unix = [str(c.laddr) for c in proc.net_connections(kind="unix") if c.laddr]
    return inet, unix


@pytest.mark.timeout(90)
async def test_every_default_bind_is_loopback() -> None:
    async with Controller(sim_spec(), monitor=MonitorConfig()) as ctl:
        here = run_dir(ctl.run_id)
        assert os.stat(here).st_mode & 0o777 == 0o700
        children = {c.pid: c for c in psutil.Process().children(recursive=True)}
        node = [pid for pid, c in children.items() if "flowrl.node" in c.cmdline()]
        workers = ctl.worker_pids()
        assert len(node) == 1
        assert len(workers) == 3
        for pid in [os.getpid(), *node, *workers]:
            inet, unix = _listening(pid)
            assert all(ipaddress.ip_address(ip).is_loopback for ip in inet), (pid, inet)
            assert all(path.startswith(f"{here}/") for path in unix), (pid, unix)
        inet, _ = _listening(os.getpid())
        assert inet, "the monitor listens (on loopback)"
        for pid in [*node, *workers]:  # only the controller's monitor speaks tcp
            assert _listening(pid)[0] == []
        assert ctl.monitor_url is not None
        assert ctl.monitor_url.startswith("http://127.0.0.1:")


SECRETS_RUN = r"""
import asyncio, json, sys
import aiohttp
from test_security import sim_spec
from flowrl.controller import Controller
from flowrl.logs import configure
from flowrl.recipe import MonitorConfig

async def main():
    configure()
    async with Controller(sim_spec(), monitor=MonitorConfig()) as ctl:
        token = ctl.monitor_token.get_secret_value()
        with open(sys.argv[1], "w") as f:
            f.write(token)
        await ctl.run(steps=2, timeout_s=60)
        url = ctl.monitor_url
        bodies = {}
        async with aiohttp.ClientSession() as http:
            for path in ("status", "metrics", "trace"):
                async with http.get(url + path) as r:
                    bodies[path] = await r.text()
            auth = {"Authorization": f"Bearer {token}"}
            async with http.post(url + "staleness", json={"max_staleness": 1},
                                 headers=auth) as r:
                bodies["control"] = await r.text()
            async with http.post(url + "pause", headers={"Authorization": "Bearer x" + token}):
                pass
        print(repr(ctl.monitor_token), repr(ctl.monitor_config))
        print(json.dumps(bodies))

asyncio.run(main())
"""


@pytest.mark.timeout(90)
def test_the_monitor_token_is_in_no_log_line_and_no_status(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    env = {**os.environ, "FLOWRL_LOG_FORMAT": "json", "FLOWRL_LOG_LEVEL": "debug",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", SECRETS_RUN, str(token_file)], env=env,
                          capture_output=True, text=True, timeout=80, check=False, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    token = token_file.read_text()
    assert len(token) >= 24
    bodies = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads(bodies["status"])["version"] == 2  # the answers are real ones
    assert json.loads(bodies["control"])["ok"] is True
    lines = proc.stderr.strip().splitlines()
    assert any('"monitor control"' in line for line in lines), "control actions are logged"
    assert all(json.loads(line) for line in lines if line.startswith("{"))
    for text in (proc.stdout, proc.stderr, *bodies.values()):
        assert token not in text


async def test_no_other_process_can_act_as_a_worker() -> None:
    """Worker ids are guessable (``rollout-1``); a call in a registered worker's name without
    the token of its register reply is refused and changes nothing."""
    async with Controller(sim_spec()) as ctl:
        await ctl.wait_for(lambda: len(ctl.registry.of_role("rollout")) == 1)
        (victim,) = [w.worker_id for w in ctl.registry.of_role("rollout")]
        async with RpcClient(ipc_endpoint(ctl.run_id, "ctl"), timeout=10.0) as intruder:
            for op, payload in [
                (m.OP_BYE, {"worker_id": victim}),
                (m.OP_HEARTBEAT, {"worker_id": victim, "version": 0, "busy": 0,
                                  "token": b"\0" * 16}),
                (m.OP_GET_TASK, {"worker_id": victim, "wait_s": 0.0, "token": "guess"}),
                (m.OP_TASK_FAILED, {"worker_id": victim, "task_id": 1, "error": "x"}),
                # A process not yet registered vouches with its spec's start token.
                (m.OP_START_FAILED, {"process": "rollout.0", "token": "0" * 32,
                                     "error": "x"}),
                (m.OP_START_FAILED, {"process": "train.0", "token": "", "error": "x"}),
            ]:
                with pytest.raises(RemoteError) as excinfo:
                    await intruder.call(op, payload)
                assert excinfo.value.kind == "PermissionError", op
        # The worker is still registered and the run trains as usual.
        assert ctl.registry.get(victim) is not None
        out = await ctl.run(steps=2, timeout_s=30)
        assert out["version"] == 2
        assert ctl.status()["worker_deaths"] == 0
