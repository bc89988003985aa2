"""`bench/capacity.py`'s workload and options (its figures are bench/README.md's, not a test's)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from flowrl.control.node_leases import dispatching_nodes

ROOT = Path(__file__).resolve().parents[1]
# Loaded from its file, as it runs (``bench`` is not an installed package; the script puts the
# repository root on the path itself).
_SPEC = importlib.util.spec_from_file_location("bench_capacity", ROOT / "bench" / "capacity.py")
assert _SPEC is not None
assert _SPEC.loader is not None
capacity = importlib.util.module_from_spec(_SPEC)
sys.modules["bench_capacity"] = capacity
_SPEC.loader.exec_module(capacity)
GROUPS_PER_STEP, workload = capacity.GROUPS_PER_STEP, capacity.workload


def test_the_workload_puts_that_many_groups_in_a_rollout_task() -> None:
    for groups in (1, 4):
        spec, nodes = workload(1024, 8, groups)
        rollout = next(s for s in spec.stages if s.name == "rollout")
        assert rollout.micro_batch == groups
        assert nodes == ("node0", *(f"n{i}" for i in range(1, 8)))
        counts = {p.role: p.count for p in spec.pools}
        assert counts == {"rollout": 1024 - 64 - 1, "reward": 64, "train": 1}


@pytest.mark.timeout(60)
def test_a_rollout_group_count_out_of_range_is_refused() -> None:
    for bad in ("0", str(GROUPS_PER_STEP + 1)):
        proc = subprocess.run([sys.executable, "bench/capacity.py", "--rollout-groups", bad],
                              cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 2
        assert f"--rollout-groups must be 1..{GROUPS_PER_STEP}" in proc.stderr


@pytest.mark.timeout(60)
def test_a_niceness_out_of_range_is_refused() -> None:
    proc = subprocess.run([sys.executable, "bench/capacity.py", "--workers-nice", "20"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2
    assert "--workers-nice must be 0..19" in proc.stderr


@pytest.mark.timeout(60)
def test_every_process_under_the_controller_is_reniced() -> None:
    me = psutil.Process()
    own = me.nice()
    # a child with a child of its own, as a node agent and its worker process
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys\n"
         "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
         "print(p.pid, flush=True)\np.wait()"], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        capacity.renice_children(me, 7)
        assert (psutil.Process(parent.pid).nice(), child.nice()) == (7, 7)
        assert me.nice() == own
    finally:
        for p in psutil.Process(parent.pid).children(recursive=True):
            p.kill()
        parent.kill()
        parent.wait(timeout=30)
        parent.stdout.close()


def test_the_workload_runs_multi_turn_episodes_when_asked() -> None:
    spec, _ = workload(64, 1, 1, 3)
    assert spec.engine_config["episode_turns"] == 3
    assert spec.engine_config["tool_s"] == 0.0
    assert {p.role: p.count for p in spec.pools} == {"rollout": 63, "train": 1}
    assert [s.name for s in spec.stages] == ["rollout", "train"]  # episodes score themselves
    assert "episode_turns" not in workload(64, 1)[0].engine_config


@pytest.mark.timeout(240)
async def test_episodes_are_counted_by_their_turns() -> None:
    # A small shape through the real controller, agents and episode workers: every response
    # is an episode of 1-3 turns, so there are more turns than samples and each costs less.
    r = await capacity.measure(16, 1, 1, episode_turns=3)
    per_sample, per_turn = r["cpu_us_per_sample"], r["cpu_us_per_turn"]
    assert r["turns_per_s"] > r["samples_per_s"]
    assert per_turn < per_sample
    single = await capacity.measure(16, 1, 1)
    assert single["cpu_us_per_turn"] is None  # single-turn: nothing counted as turns
    # The simulated cluster's own CPU, by kind of process: the node agent's (its store and
    # relay) and the workers' were both spent on the measured step.
    for run in (r, single):
        assert run["agents_cpu_us_per_sample"] > 0
        assert run["workers_cpu_us_per_sample"] > 0


@pytest.mark.timeout(60)
def test_pinning_moves_every_thread_of_a_process() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs")
    # A child with a second thread started before the pinning, as ZeroMQ's I/O threads are.
    code = ("import sys, threading; e = threading.Event(); "
            "threading.Thread(target=e.wait, daemon=True).start(); "
            "print('up', flush=True); sys.stdin.read()")
    with subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout is not None
            assert child.stdout.readline() == "up\n"
            proc = psutil.Process(child.pid)
            assert len(proc.threads()) == 2
            capacity.set_affinity(proc, cpus[1:])
            assert [os.sched_getaffinity(t.id) for t in proc.threads()] == [set(cpus[1:])] * 2
        finally:
            child.kill()


def test_the_workload_dispatches_on_the_nodes_only_where_there_are_other_nodes() -> None:
    spec, nodes = workload(1024, 8, 4, node_dispatch=True)
    assert spec.node_dispatch
    assert dispatching_nodes(spec, "node0") == set(nodes) - {"node0"}
    # One agent, the controller's own: no node to lease to, so the shape runs as without.
    assert not workload(64, 1, 4, node_dispatch=True)[0].node_dispatch
    assert not workload(1024, 8, 4)[0].node_dispatch


def test_the_reference_workload_is_timed_in_this_threads_cpu(monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    # Its figure is the median of its repeats, each the thread's CPU time around the workload.
    ticks = iter([0.0, 0.001, 1.0, 1.003, 2.0, 2.002])
    monkeypatch.setattr(capacity.time, "thread_time", lambda: next(ticks))
    assert capacity.reference_us(repeats=3) == pytest.approx(2000.0)


def test_a_figure_is_scaled_to_the_fast_hosts_reference() -> None:
    # A host twice as slow at the reference work measured twice the CPU: half of it scaled.
    slow = 2 * capacity.FAST_HOST_REFERENCE_US
    assert capacity.scaled_to_fast_host(100.0, slow) == pytest.approx(50.0)
    assert capacity.scaled_to_fast_host(100.0, capacity.FAST_HOST_REFERENCE_US) == 100.0
