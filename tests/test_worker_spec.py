"""The worker spec: handed over in a private file, validated on arrival, every field read, and
``tis_cap="auto"`` following the staleness in force."""

from __future__ import annotations

import json
import os
import stat
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import BaseModel, ValidationError

from flowrl import worker_spec as ws
from flowrl.controller import Controller
from flowrl.recipe import (
    AlgorithmConfig,
    DataConfig,
    EvalConfig,
    JudgeConfig,
    LoraConfig,
    ModelConfig,
    Recipe,
    RewardConfig,
    RewardModelConfig,
    RolloutConfig,
    TinyModelConfig,
    TrainerConfig,
)
from flowrl.run import compile_recipe
from flowrl.tiny_model import build_tiny_model
from flowrl.worker_launch import read_spec, spec_file, worker_command
from flowrl.worker_spec import Endpoints, EngineSpec, ProcessSpec, WorkerSpec, engine_spec
from transport.endpoints import remove_run_dir
from workers import main as worker_main
from workers.distributed import DataParallel

SIM = {"prompt_len": 8, "max_new_tokens": 16}
TINY = TinyModelConfig(hidden=32, layers=1, heads=2, kv_heads=1, max_positions=64)


def sim_spec(run_id: str, **process: Any) -> WorkerSpec:
    return WorkerSpec(
        process=ProcessSpec(**{
            "name": "rollout.0", "role": "rollout", "count": 2, "capacity": 1, "threads": 1,
            "seed": 3, "heartbeat_s": 0.5, "weight_sync_timeout_s": 7.5, "engine": "sim",
            "sim": SIM, "start_token": "0123456789abcdef", **process}),
        endpoints=Endpoints(run_id=run_id, node="node0", controller="ipc:///x/ctl.sock",
                            broadcast="ipc:///x/pub.sock", store="ipc:///x/store.sock",
                            peers={"b": "tcp://127.0.0.1:5000"}))


def test_the_spec_travels_in_a_private_file_not_on_the_command_line(run_id: str) -> None:
    spec = sim_spec(run_id)
    argv = worker_command(spec)
    path = spec_file(run_id, "rollout.0")
    assert argv[-2:] == ["--spec", str(path)]
    assert not any("prompt_len" in a or "7.5" in a for a in argv)  # nothing of it in `ps`
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert read_spec(path) == spec
    assert not path.exists()  # read once, then gone
    # A restarted process's spec replaces the old one.
    worker_command(spec)
    worker_command(sim_spec(run_id, seed=4))
    assert read_spec(path).process.seed == 4


def test_a_malformed_spec_is_refused_naming_the_field(run_id: str) -> None:
    good = json.loads(sim_spec(run_id).model_dump_json())
    for change, field in (({"weight_sync_timeout_s": -1}, "weight_sync_timeout_s"),
                          ({"name": "../x.0"}, "name"), ({"surprise": 1}, "surprise"),
                          ({"engine": "hf"}, "engine")):
        bad = {**good, "process": {**good["process"], **change}}
        with pytest.raises(ValidationError, match=field):
            WorkerSpec.model_validate(bad)
    config = Recipe(steps=1).engine_config()
    with pytest.raises(ValidationError, match=r"algorithm\.tis_cap"):
        engine_spec({**config, "algorithm": {**config["algorithm"], "tis_cap": "sometimes"}})
    with pytest.raises(ValidationError, match="max_staleness"):
        engine_spec({**config, "max_staleness": 1})  # nobody would read it


# ---- every field is read -------------------------------------------------------------------------


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> set[tuple[str, str]]:
    """(model, field) of every field read on any spec model while the test runs."""
    seen: set[tuple[str, str]] = set()

    def recording(self: BaseModel, name: str) -> Any:
        value = object.__getattribute__(self, name)
        if name in type(self).model_fields:
            seen.add((type(self).__name__, name))
        return value

    monkeypatch.setattr(ws._Spec, "__getattribute__", recording)  # undone after the test
    return seen


def every_field(model: type[BaseModel]) -> set[tuple[str, str]]:
    """(model, field) of ``model`` and of every spec model its fields hold."""
    out: set[tuple[str, str]] = set()
    for name, info in model.model_fields.items():
        out.add((model.__name__, name))
        for arg in _types(info.annotation):
            if isinstance(arg, type) and issubclass(arg, ws._Spec):
                out |= every_field(arg)
    return out


def _types(annotation: Any) -> Iterator[Any]:
    """``annotation`` and every type it is made of (union members, container arguments)."""
    yield annotation
    for arg in typing.get_args(annotation):
        yield from _types(arg)


#: an episode that asks for the endpoint (its recipe's)
AGENT = Path(__file__).resolve().parents[1] / "recipes" / "openai_agent.py"


@pytest.mark.timeout(300)
async def test_every_field_of_the_spec_is_read_by_the_worker_side(
    tmp_path: Path, run_id: str, reads: set[tuple[str, str]],
) -> None:
    model = build_tiny_model(tmp_path / "tiny", hidden=32, layers=1, heads=2, kv_heads=1,
                             max_positions=64)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"q": f"{i}+1=", "a": str(i + 1)}) + "\n"
                            for i in range(8)))
    ppo = Recipe(steps=2, model=ModelConfig(path=str(model)), output=tmp_path / "out",
                 checkpoint_every=1, data=DataConfig(max_prompt_tokens=16),
                 algorithm=AlgorithmConfig(name="ppo", group_size=1, kl_coef=0.1),
                 rollout=RolloutConfig(max_new_tokens=4)).engine_spec()
    resumed = Recipe(
        steps=2, model=ModelConfig(path=str(model)),
        data=DataConfig(kind="jsonl", path=str(rows), prompt_key="q", answer_key="a",
                        max_prompt_tokens=16, chat_template=True, system_prompt="Add."),
        algorithm=AlgorithmConfig(name="ppo", group_size=1, kl_coef=0.1),
        rollout=RolloutConfig(max_new_tokens=4),
        trainer=TrainerConfig(ranks=2, groups_per_step=2),
        eval=EvalConfig(every=1, prompts=2, path=str(rows))).engine_spec().model_copy(update={
            "model": ws.ModelSpec(path=str(model), reference_path=str(model)),
            "resume": ws.ResumeSpec(checkpoint=str(tmp_path / "elsewhere" / "step_1"),
                                    version=1)})
    scorer = build_tiny_model(tmp_path / "rm", hidden=32, layers=1, heads=2, kv_heads=1,
                              max_positions=64, head="score")
    graded = [Recipe(steps=1, model=ModelConfig(path=str(model)),
                     reward=RewardConfig(**source)).engine_spec()
              for source in ({"model": RewardModelConfig(path=str(scorer), max_length=32)},
                             {"judge": JudgeConfig(max_prompt_tokens=32)})]
    lora = Recipe(steps=1, model=ModelConfig(path=str(model), lora=LoraConfig(rank=2)),
                  trainer=TrainerConfig(gradient_checkpointing=True)).engine_spec()
    served = Recipe(steps=1, model=ModelConfig(path=str(model)),
                    rollout=RolloutConfig(episode=f"{AGENT}:episode", endpoint=True)
                    ).engine_spec()
    agent = tmp_path / "agent.py"
    agent.write_text("async def run(policy, example):\n    return 1.0\n\n"
                     "def tool():\n    return 1\n")
    episodes = Recipe(steps=1, model=ModelConfig(path=str(model)), rollout=RolloutConfig(
        episode=f"{agent}:run", tools={"t": f"{agent}:tool"}, max_turns=2,
        max_episode_tokens=8)).engine_spec()
    threads = torch.get_num_threads()
    try:
        # What a worker process does with its spec (`workers.main.main` and `serve`) ...
        spec = sim_spec(run_id)
        worker_main.use_threads(spec)
        await worker_main.store_client(spec).aclose()
        assert len(worker_main.worker_configs(spec)) == 2
        assert len(worker_main.make_roles(spec)) == 2
        assert worker_main.start_failure(spec, ValueError("x"))["error"] == "ValueError: x"
        # ... and what the real engines' factory reads, every role of each variant.
        for config, roles in ((ppo, ("rollout", "reward", "reference", "critic", "train")),
                              (resumed, ("rollout", "reference", "critic")),
                              (lora, ("rollout", "train")),
                              (served, ("rollout",)),
                              (episodes, ("rollout",)),
                              *((g, ("reward",)) for g in graded)):
            for role in roles:
                process = spec.process.model_copy(update={
                    "name": f"{role}.0", "role": role, "count": 1, "engine": "hf",
                    "sim": None, "config": config})
                worker_main.make_roles(spec.model_copy(update={"process": process}))
        # A colocated trainer process: its two workers, the rollout over the trainer's module.
        process = spec.process.model_copy(update={
            "name": "train.0", "role": "train", "count": 1, "engine": "hf", "sim": None,
            "config": ppo, "colocated": ws.ColocatedSpec(role="rollout", capacity=2,
                                                         keep_weight_copy=False)})
        both = spec.model_copy(update={"process": process})
        assert [c.role for c in worker_main.worker_configs(both)] == ["train", "rollout"]
        assert len(worker_main.make_roles(both)) == 2
        # A data-parallel rank's group (the factory's call, before it joins the other ranks).
        assert resumed.data_parallel is not None
        DataParallel.of_process(resumed.data_parallel, process="train.1",
                                run_dir=tmp_path)
    finally:
        torch.set_num_threads(threads)
    unread = every_field(WorkerSpec) | every_field(EngineSpec)
    assert sorted(unread - reads) == []


def test_the_read_check_sees_a_field_nobody_reads(reads: set[tuple[str, str]]) -> None:
    spec = Recipe(steps=1).engine_spec()
    assert spec.steps == 1
    assert ("EngineSpec", "steps") in reads
    assert ("EngineSpec", "seed") not in reads
    assert ("ArithmeticDataSpec", "count") in every_field(EngineSpec)


# ---- tis_cap "auto" follows the staleness in force -----------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_raising_staleness_mid_run_turns_the_correction_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    recipe = Recipe(
        steps=20, model=ModelConfig(tiny=TINY), data=DataConfig(max_prompt_tokens=16),
        algorithm=AlgorithmConfig(group_size=2), rollout=RolloutConfig(max_new_tokens=4),
        trainer=TrainerConfig(groups_per_step=2, lr=1e-4), max_staleness=0)
    assert recipe.tis_cap is None  # off at the start: nothing is stale
    spec = compile_recipe(recipe)
    async with Controller(spec, start_timeout_s=120) as ctl:
        try:
            await ctl.run(steps=2, timeout_s=120)
            on_policy = list(ctl.step_log)
            ctl.set_max_staleness(2)  # what POST /staleness does
            for _ in range(10):  # until a step trains rows that are actually stale
                await ctl.run(steps=1, timeout_s=120)
                if ctl.step_log[-1]["staleness_max"] > 0:
                    break
            stale = ctl.step_log[len(on_policy):]
        finally:
            remove_run_dir(ctl.run_id)
    assert all("train_tis_mean" not in s and s["staleness_max"] == 0 for s in on_policy)
    assert any(s["staleness_max"] > 0 for s in stale), stale
    # Every step trained under max_staleness 2 had truncated importance sampling on.
    assert all("train_tis_mean" in s for s in stale), stale
    assert all(0.0 < s["train_tis_mean"] <= 2.0 for s in stale)
