"""Placement from a recipe: the rules that name their field, the compiled pools and cluster, and
a simulated run whose node agents Ray places (skipped when Ray is not installed).

The Ray run emulates two machines on one: a local Ray cluster offers the custom resources
``node_a`` and ``node_b``, and each node's agent actor asks for one of them.
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from flowrl.controller import Controller, RunError
from flowrl.ray_placement import RayAgents, import_ray
from flowrl.recipe import ClusterSettings, PlacementConfig, Recipe
from flowrl.recipe_file import RecipeError, load_recipe
from flowrl.run import cluster_config, run_recipe
from transport import shm

HAVE_RAY = importlib.util.find_spec("ray") is not None
ROOT = Path(__file__).resolve().parent.parent
needs_ray = pytest.mark.skipif(not HAVE_RAY, reason="Ray is not installed (pip install "
                               "'flowrl[ray]')")

# Tiny modelled costs (tests/test_controller_sim.py's FAST, as recipe fields).
FAST_SIM = {
    "prompt_len": 8, "log_mean": 2.5, "log_sigma": 0.8, "rollout_base_s": 0.001,
    "rollout_token_s": 0.0002, "reward_token_s": 0.0, "reference_token_s": 0.0,
    "train_token_s": 0.00002, "train_step_s": 0.005, "weight_numel": 1024,
}
SPLIT = {"rollout": ("a",), "reward": ("b",), "train": ("b",)}
PINNED = {"a": {"resources": {"node_a": 1}}, "b": {"resources": {"node_b": 1}}}


def sim_recipe(steps: int, placement: dict[str, Any]) -> Recipe:
    return Recipe(
        steps=steps, max_staleness=1,
        rollout={"engine": "sim", "workers": 2, "max_new_tokens": 64},  # type: ignore[arg-type]
        sim=FAST_SIM,  # type: ignore[arg-type]
        trainer={"groups_per_step": 4, "micro_batch_groups": 2},  # type: ignore[arg-type]
        placement={"store_capacity_mb": 32, **placement},  # type: ignore[arg-type]
    )


# ---- CPU priority (no Ray) ------------------------------------------------------------------

TAKE_NICENESS = "from flowrl.lifecycle import take_niceness; print(take_niceness(0))"


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root, to run with and without CAP_SYS_NICE (setpriv)")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("privileged", [True, False])
def test_a_process_leaves_rays_worker_niceness_when_it_may(privileged: bool) -> None:
    drop = [] if privileged else ["setpriv", "--inh-caps=-sys_nice", "--ambient-caps=-sys_nice",
                                  "--bounding-set=-sys_nice"]
    proc = subprocess.run([*drop, "nice", "-n", "15", sys.executable, "-c", TAKE_NICENESS],
                          cwd=ROOT, capture_output=True, text=True, timeout=50, check=True)
    assert proc.stdout.strip() == ("0" if privileged else "15")


# ---- rules and compilation (no Ray) --------------------------------------------------------------


@pytest.mark.parametrize(
    ("placement", "field", "says"),
    [
        ("{'roles': {'rolout': ['a']}, 'kind': 'ray'}", "placement.roles.rolout",
         "unknown role"),
        ("{'roles': {'reference': ['a']}, 'kind': 'ray'}", "placement.roles.reference",
         "no reference workers"),
        ("{'roles': {'rollout': []}, 'kind': 'ray'}", "placement.roles.rollout",
         "empty node list"),
        ("{'roles': {'rollout': ['a b']}, 'kind': 'ray'}", "placement.roles.rollout",
         "bad node names"),
        ("{'roles': {'rollout': ['a']}}", "placement.cluster", "required"),
        ("{'roles': {'rollout': ['a']}, 'cluster': {'host': '10.0.0.1'}}",
         "placement.cluster.keys_file", "required"),
        ("{'roles': {'rollout': ['a']}, 'kind': 'ray', 'nodes': 2}", "placement.nodes",
         "implied by roles"),
        ("{'ray': {'address': 'auto'}}", "placement.ray", "kind is 'local'"),
        ("{'roles': {'rollout': ['a']}, 'kind': 'ray', 'ray': {'nodes': {'c': {}}}}",
         "placement.ray.nodes.c", "not a node roles places on"),
        ("{'kind': 'ray', 'ray': {'agent': {'resources': {'NPU': -1}}}}",
         "placement.ray.agent.resources", "amount >= 0"),
        ("{'kind': 'ray', 'ray': {'agent': {'num_gpus': -1}}}",
         "placement.ray.agent.num_gpus", "greater than or equal to 0"),
    ],
)
def test_placement_rules_name_their_field(tmp_path: Path, placement: str, field: str,
                                          says: str) -> None:
    path = tmp_path / "recipe.py"
    path.write_text("from flowrl.recipe import Recipe\n"
                    f"recipe = Recipe(steps=1, placement={placement})\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    problems = dict(info.value.problems)
    assert field in problems, str(info.value)
    assert says in problems[field]
    assert str(info.value).startswith(f"{path}:2: {field}: ")


def test_roles_compile_into_pool_nodes_and_the_cluster(tmp_path: Path) -> None:
    keys = tmp_path / "run.keys"
    r = Recipe(steps=1, placement=PlacementConfig(
        roles={"rollout": ("gpu1", "gpu2"), "train": ("node0",)},
        cluster=ClusterSettings(host="10.0.0.1", port=5555, keys_file=str(keys),
                                join_timeout_s=7.0)))
    assert {p.role: p.nodes for p in r.to_pipeline().pools} == {
        "rollout": ("gpu1", "gpu2"), "reward": (), "train": ("node0",)}
    assert r.placement.remote_nodes == ["gpu1", "gpu2"]  # node0 is the controller's
    cluster = cluster_config(r, host="10.9.9.9")
    assert cluster is not None
    # The recipe's host wins over the one Ray would suggest.
    assert (cluster.host, cluster.port, cluster.keys_file, cluster.join_timeout_s) == (
        "10.0.0.1", 5555, str(keys), 7.0)
    # Mappings in a recipe keep it hashable and copyable, and cannot change.
    assert hash(r) == hash(copy.deepcopy(r))
    assert r.model_copy(deep=True) == r
    with pytest.raises(TypeError):
        r.placement.roles["reward"] = ("gpu1",)


def test_ray_placement_needs_no_cluster_section_and_one_node_needs_none() -> None:
    recipe = sim_recipe(1, {"kind": "ray", "roles": SPLIT})
    cluster = cluster_config(recipe, host="10.9.9.9")
    assert cluster is not None
    assert (cluster.host, cluster.port, cluster.keys_file) == ("10.9.9.9", 0, None)
    assert cluster_config(sim_recipe(1, {"roles": {"train": ("node0",)}})) is None
    assert cluster_config(sim_recipe(1, {})) is None


def test_a_missing_ray_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # makes `import ray` fail
    with pytest.raises(ImportError, match=r"pip install 'flowrl\[ray\]'"):
        import_ray()


# ---- a run on Ray --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """A local Ray cluster whose one machine offers the resources of two "nodes" (one for the
    module: starting Ray takes seconds)."""
    ray = importlib.import_module("ray")
    # Ray's session files (sockets, logs) go to a short private directory, removed afterwards.
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    try:
        ray.init(num_cpus=2, resources={"node_a": 1, "node_b": 1}, include_dashboard=False,
                 object_store_memory=80 << 20, log_to_driver=True, _temp_dir=temp)
        try:
            yield ray
        finally:
            ray.shutdown()
    finally:
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture
def ray_run(ray_cluster: Any) -> Iterator[Any]:
    """`ray_cluster` for one test, which ends once the processes of the actors it killed have
    exited (Ray reports an actor dead before its process is gone)."""
    yield ray_cluster
    actors = [p for p in psutil.Process().children(recursive=True)
              if _cmdline(p).startswith("ray::_AgentActor")]
    _, alive = psutil.wait_procs(actors, timeout=30)
    assert alive == [], "actor processes outlived their actors"


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.NoSuchProcess:
        return ""


def _no_process_shows(secrets: list[str]) -> list[str]:
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if any(s in cmdline for s in secrets):
            found.append(f"{proc.info['pid']}: {cmdline[:80]}")
    return found


# Ray tests take 5-20 s on quiet cores; Ray's actors start far slower when the cores are
# contended (agents took 50 s to join with two CPU-bound processes beside the suite).
@needs_ray
@pytest.mark.timeout(360)
async def test_a_run_on_two_ray_placed_agents_trains_every_row_once(ray_run: Any) -> None:
    ray = ray_run
    steps = 3
    recipe = sim_recipe(steps, {"kind": "ray", "roles": SPLIT,
                                "ray": {"agent": {"num_cpus": 0.5}, "nodes": PINNED}})
    seen: dict[str, Any] = {}

    def on_start(ctl: Controller) -> None:
        seen["ctl"] = ctl
        assert ctl.nodes is not None
        keys = ctl.nodes.keys
        seen["secrets"] = [keys.server_secret.decode(), keys.client_secret.decode()]

    def on_step(metrics: dict[str, Any]) -> None:
        if "placed" not in seen:
            ctl = seen["ctl"]
            seen["placed"] = {(w["role"], w["node"]) for w in ctl.status()["workers"]}
            seen["free"] = ray.available_resources()
            seen["actors"] = set(ray.util.list_named_actors())
            seen["shown"] = _no_process_shows(seen["secrets"])

    out = await run_recipe(recipe, monitor=False, on_start=on_start, on_step=on_step)

    assert out["version"] == steps
    assert out["samples"] == steps * 4 * 4  # every row of every step trained ...
    assert out["rows_trained_twice"] == 0  # ... once
    assert seen["placed"] == {("rollout", "a"), ("reward", "b"), ("train", "b")}
    # Each agent's actor held its node's resource while the run went on.
    assert seen["free"].get("node_a", 0) == 0
    assert seen["free"].get("node_b", 0) == 0
    assert seen["shown"] == []  # the keys are on no command line
    ctl = seen["ctl"]
    assert f"flowrl-{ctl.run_id}" not in os.listdir("/tmp")  # its run directory is gone
    assert shm.segments_of(ctl.run_id) == []  # every node's store removed its segments
    agents = {f"flowrl-{ctl.run_id}-{n}" for n in "ab"}
    assert seen["actors"] >= agents
    assert not set(ray.util.list_named_actors()) & agents  # killed with the run


@needs_ray
@pytest.mark.timeout(180)
async def test_an_agent_ray_cannot_place_fails_the_start_naming_the_node(
    ray_run: Any,
) -> None:
    ray = ray_run
    recipe = sim_recipe(1, {
        "kind": "ray", "roles": SPLIT, "cluster": {"join_timeout_s": 8.0},
        "ray": {"nodes": {**PINNED, "b": {"resources": {"node_c": 1}}}}})
    with pytest.raises(RunError) as info:
        await run_recipe(recipe, monitor=False)
    said = str(info.value)
    assert re.search(r"did not join within 8.0s: missing \[.*'b'.*\]", said), said
    assert ("Ray did not start node 'b''s agent: it requests {'CPU': 1.0, 'node_c': 1.0},"
            " which no live Ray node offers") in said
    # a's actor may not have started in time on busy cores, but Ray can place it.
    assert "node 'a''s agent: it requests {'CPU': 1.0, 'node_a': 1.0}, which no" not in said
    assert ray.util.list_named_actors() == []  # a's actor was killed too
    assert os.environ.get("FLOWRL_CURVE_KEYS") is None


@needs_ray
@pytest.mark.timeout(240)
async def test_an_agent_and_its_workers_die_with_their_actor(ray_run: Any) -> None:
    ray = ray_run
    recipe = sim_recipe(1, {"kind": "ray", "roles": {"rollout": ("a",)},
                            "ray": {"nodes": {"a": PINNED["a"]}}})
    async with RayAgents(recipe.placement.ray) as agents:
        # A controller on loopback: the agent's store binds loopback too.
        ctl = Controller(recipe.to_pipeline(), cluster=cluster_config(recipe, host="127.0.0.1"))
        try:
            await agents.start_controller(ctl)
            await ctl.run(steps=1, timeout_s=60)  # the agent's store now holds segments
            agent = psutil.Process(agents.started["a"]["pid"])
            family = [agent, *agent.children(recursive=True)]
            assert any("workers.main" in " ".join(p.cmdline()) for p in family)
            assert "127.0.0.1" in agent.cmdline()
            # Not Ray's worker niceness (15): the controller's, for the agent and its workers.
            assert {p.nice() for p in family} == {os.getpriority(os.PRIO_PROCESS, 0)}
            ray.kill(ray.get_actor(f"flowrl-{ctl.run_id}-a"))
            _, alive = await asyncio.to_thread(psutil.wait_procs, family, timeout=30)
            assert alive == []
        finally:
            await ctl.aclose()
            # A killed agent leaves its segments to the sweep of dead owners' segments.
            shm.sweep(run_id=ctl.run_id)
