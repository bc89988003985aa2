"""Recipes: validation, compilation to a PipelineSpec, recipe files, overrides and their errors."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr, ValidationError

import flowrl.recipe as recipe_mod
from flowrl.pipeline import PipelineSpec
from flowrl.recipe import (
    AlgorithmConfig,
    ArithmeticConfig,
    DataConfig,
    JudgeConfig,
    ModelConfig,
    MonitorConfig,
    PlacementConfig,
    Recipe,
    RewardConfig,
    RewardModelConfig,
    RolloutConfig,
    SimConfig,
    TinyModelConfig,
    TrainerConfig,
)
from flowrl.recipe_file import RecipeError, load_recipe, parse_override
from workers.roles.reward_runner import resolve_reward_fn

REPO = Path(__file__).resolve().parents[1]
TOKEN = "s3cr3t-t0ken-abcdefgh"


def score(prompt: str, response: str, **meta: Any) -> float:
    """A module-level reward function, locatable by reference."""
    return float(response == meta.get("answer"))


def write(tmp_path: Path, body: str, name: str = "recipe.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def problems_of(excinfo: pytest.ExceptionInfo[RecipeError]) -> dict[str, str]:
    return dict(excinfo.value.problems)


# ---- valid recipes -------------------------------------------------------------------------------


def test_public_api_is_pinned() -> None:
    assert set(recipe_mod.__all__) == {
        "LOSS_AGG_ALGORITHM_NAMES", "TINY_MODEL", "AlgorithmConfig", "ArithmeticConfig",
        "ClusterSettings", "CriticConfig", "DataConfig", "EvalConfig", "JudgeConfig", "ModelConfig",
        "MonitorConfig", "PlacementConfig", "RayConfig", "RayResources", "Recipe",
        "RewardConfig", "RewardModelConfig", "RolloutConfig", "SimConfig", "StabilityActions",
        "StabilityConfig", "TinyModelConfig", "LoraConfig",
        "TrainerConfig", "callable_ref", "check_fn_ref",
    }


def test_minimal_recipe_compiles_to_the_grpo_pipeline() -> None:
    spec = Recipe(steps=3).to_pipeline()
    assert isinstance(spec, PipelineSpec)
    assert [s.name for s in spec.graph().order] == ["rollout", "reward", "train"]
    assert [p.role for p in spec.pools] == ["rollout", "reward", "train"]
    assert spec.engine == "hf"
    assert (spec.group_size, spec.groups_per_step, spec.max_staleness) == (4, 8, 0)
    assert spec.store_capacity_bytes == 1024 << 20
    assert (spec.max_failure_share, spec.max_failure_steps) == (0.5, 3)
    assert Recipe(steps=3, reward={"max_failure_share": 1.0, "max_failure_steps": 7}
                  ).to_pipeline().max_failure_steps == 7
    # The reward's maximum reaches the trainer (the guard's solved groups); none by default.
    assert Recipe(steps=3).engine_spec().reward.max_score is None
    assert Recipe(steps=3, reward={"max_score": 1.0}).engine_spec().reward.max_score == 1.0
    train = spec.graph().stage("train")
    assert train.consumes_version_bound
    assert train.group_level
    assert "ref_logprobs" not in train.needs


def test_kl_adds_the_reference_stage_and_pool() -> None:
    r = Recipe(
        steps=1, max_staleness=2, seed=7,
        algorithm=AlgorithmConfig(group_size=8, kl_coef=0.01),
        rollout=RolloutConfig(workers=3, threads=2),
        reward=RewardConfig(workers=2, concurrency=16),
        trainer=TrainerConfig(ranks=2, threads=3, groups_per_step=4, micro_batch_groups=2),
        placement=PlacementConfig(store_capacity_mb=64, heartbeat_timeout_s=5),
    )
    spec = r.to_pipeline()
    assert [s.name for s in spec.graph().order] == ["rollout", "reward", "reference", "train"]
    assert "ref_logprobs" in spec.graph().stage("train").needs
    assert spec.graph().stage("train").micro_batch == 2
    pools = {p.role: p for p in spec.pools}
    assert (pools["rollout"].count, pools["rollout"].per_process, pools["rollout"].threads) == (
        3, 1, 2)
    assert (pools["reward"].count, pools["reward"].capacity) == (2, 2)  # 16 calls / groups of 8
    assert pools["reference"].count == 1
    assert (pools["train"].count, pools["train"].threads) == (2, 3)
    assert (spec.group_size, spec.groups_per_step, spec.max_staleness, spec.seed) == (8, 4, 2, 7)
    assert spec.store_capacity_bytes == 64 << 20
    assert spec.heartbeat_timeout_s == 5.0


def test_engine_config_is_plain_json_with_resolved_values() -> None:
    r = Recipe(
        steps=5, max_staleness=1,
        algorithm=AlgorithmConfig(clip_low=0.2, loss_agg="seq_mean_token_sum_norm",
                                  entropy_coef=0.05),
        rollout=RolloutConfig(temperature=0.7, stop=("\n\n",)),
        reward=RewardConfig(fn=score, batched=True),
        monitor=MonitorConfig(token=SecretStr(TOKEN)),
    )
    cfg = r.to_pipeline().engine_config
    assert json.loads(json.dumps(cfg)) == cfg
    a = cfg["algorithm"]
    assert a["clip_high"] == 0.2  # None resolves to clip_low
    assert a["tis_cap"] == "auto"  # resolved per train task from the staleness in force
    assert a["loss_agg"] == "seq-mean-token-sum-norm"
    assert a["entropy_coef"] == 0.05
    assert cfg["sampling"] == {"temperature": 0.7, "top_p": 1.0, "max_new_tokens": 256,
                               "stop": ["\n\n"]}
    assert cfg["reward"]["fn"] == f"{__name__}:score"
    assert cfg["reward"]["batched"] is True
    assert cfg["model"]["path"] == "tiny"
    assert cfg["trainer"]["betas"] == [0.9, 0.999]
    assert TOKEN not in json.dumps(cfg)
    assert "monitor" not in cfg


def test_recipe_names_and_defaults_match_the_algorithms() -> None:
    from flowrl.algorithms import DEFAULT_TIS_CAP, LossAgg, default_tis_cap

    for staleness in (0, 1, 4):
        assert Recipe(steps=1, max_staleness=staleness).tis_cap == default_tis_cap(staleness)
    assert recipe_mod.DEFAULT_TIS_CAP == DEFAULT_TIS_CAP

    recipe_names = typing.get_args(recipe_mod.LossAggName)
    assert set(recipe_mod.LOSS_AGG_ALGORITHM_NAMES) == set(recipe_names)
    assert set(recipe_mod.LOSS_AGG_ALGORITHM_NAMES.values()) == set(typing.get_args(LossAgg))

    import flowrl.algorithms as alg
    from flowrl.recipe import algorithm as section
    from flowrl.worker_spec import CorrectionName, PolicyLossName

    assert typing.get_args(PolicyLossName) == typing.get_args(alg.PolicyLoss)
    assert typing.get_args(CorrectionName) == typing.get_args(alg.CorrectionKind)
    assert section.CLIP_DEFAULTS == alg.CLIP_DEFAULTS
    assert section.DEFAULT_MASK_BOUNDS == alg.DEFAULT_MASK_BOUNDS
    assert set(section.TRUNCATING_CORRECTIONS) | set(alg.MASKING_KINDS) == set(typing.get_args(
        CorrectionName))
    assert not set(section.TRUNCATING_CORRECTIONS) & set(alg.MASKING_KINDS)
    for loss in typing.get_args(PolicyLossName):
        a = AlgorithmConfig(policy_loss=loss)
        assert (a.clip_low_resolved, a.clip_high_resolved) == alg.clip_range(loss)


def test_sim_config_mirrors_sim_cost() -> None:
    from workers.sim_cost import SimCost

    r = Recipe(steps=1, rollout=RolloutConfig(engine="sim", max_new_tokens=77))
    spec = r.to_pipeline()
    cost = SimCost.from_dict(spec.engine_config)
    expected = dataclasses.replace(SimCost(), max_new_tokens=77)
    assert cost == expected  # same field names and the same defaults
    assert spec.engine == "sim"
    assert {p.role: p.per_process for p in spec.pools}["rollout"] == 1


@pytest.mark.parametrize(
    ("staleness", "cap", "expected"),
    [(0, "auto", None), (1, "auto", 2.0), (3, None, None), (0, 1.5, 1.5)],
)
def test_tis_cap_resolution(staleness: int, cap: Any, expected: float | None) -> None:
    r = Recipe(steps=1, max_staleness=staleness, algorithm=AlgorithmConfig(tis_cap=cap))
    assert r.tis_cap == expected
    # Workers get "auto" as it is: trainers resolve it from the staleness in force.
    assert r.to_pipeline().engine_config["algorithm"]["tis_cap"] == cap


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({}, ("ppo_clip", 0.2, 0.2, "token-mean")),
        ({"clip_low": 0.1}, ("ppo_clip", 0.1, 0.1, "token-mean")),
        ({"clip_high": 0.28}, ("ppo_clip", 0.2, 0.28, "token-mean")),
        ({"policy_loss": "gspo"}, ("gspo", 3e-4, 4e-4, "seq-mean-token-mean")),
        ({"policy_loss": "gspo", "clip_high": 1e-3, "loss_agg": "token_mean"},
         ("gspo", 3e-4, 1e-3, "token-mean")),
        ({"policy_loss": "cispo"}, ("cispo", 1.0, 0.28, "token-mean")),
    ],
)
def test_policy_loss_and_its_defaults_reach_the_workers(
    given: dict[str, Any], expected: tuple[str, float, float, str]
) -> None:
    a = Recipe(steps=1, algorithm=AlgorithmConfig(**given)).to_pipeline().engine_config[
        "algorithm"]
    assert (a["policy_loss"], a["clip_low"], a["clip_high"], a["loss_agg"]) == expected


def test_corrections_reach_the_workers(tmp_path: Path) -> None:
    a = Recipe(steps=1).to_pipeline().engine_config["algorithm"]
    assert (a["correction"], a["tis_cap"], a["mask_bounds"]) == ("tis", "auto", "auto")
    icepop = Recipe(steps=1, max_staleness=2,
                    algorithm=AlgorithmConfig(correction="icepop", mask_bounds=(0.25, 4.0)))
    a = icepop.to_pipeline().engine_config["algorithm"]
    assert (a["correction"], a["mask_bounds"]) == ("icepop", [0.25, 4.0])
    assert icepop.tis_cap is None  # a masking correction has no cap
    seq = Recipe(steps=1, max_staleness=1, algorithm=AlgorithmConfig(correction="seq_tis"))
    assert seq.tis_cap == 2.0
    # ... and from the command line.
    path = write(tmp_path, "from flowrl.recipe import Recipe\nrecipe = Recipe(steps=1)\n")
    r = load_recipe(path, ["algorithm.policy_loss=gspo", "algorithm.correction=mis",
                           "algorithm.mask_bounds=[0.5, 3]"])
    assert (r.algorithm.policy_loss, r.algorithm.correction) == ("gspo", "mis")
    assert r.algorithm.mask_bounds == (0.5, 3.0)


def test_recipe_is_frozen_and_hashable() -> None:
    r = Recipe(steps=1)
    with pytest.raises(ValidationError):
        r.steps = 2
    assert hash(r) == hash(Recipe(steps=1))


def test_fields_are_documented() -> None:
    for cls in (Recipe, ModelConfig, TinyModelConfig, DataConfig, AlgorithmConfig,
                RolloutConfig, RewardConfig, RewardModelConfig, JudgeConfig, TrainerConfig,
                MonitorConfig, SimConfig, PlacementConfig):
        undocumented = [n for n, f in cls.model_fields.items() if not f.description]
        assert not undocumented, f"{cls.__name__}: {undocumented}"


# ---- rules ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ("data={'kind': 'jsonl'}", "data.path"),
        ("data={'path': 'x.jsonl'}", "data.path"),
        ("data={'kind': 'jsonl', 'path': 'x.jsonl', 'arithmetic': {'count': 3}}",
         "data.arithmetic"),
        ("trainer={'groups_per_step': 2, 'micro_batch_groups': 4}", "trainer.micro_batch_groups"),
        ("checkpoint_every=10", "checkpoint_every"),
        ("placement={'nodes': 2}", "placement.nodes"),
        ("sim={'prompt_len': 8}", "sim"),
        ("rollout={'max_new_tokens': 400}", "rollout.max_new_tokens"),
        ("model={'path': '/nonexistent/model'}", "model.path"),
        ("model={'path': '/m', 'tiny': {'hidden': 64}}, rollout={'engine': 'sim'}", "model.tiny"),
        ("model={'tiny': {'hidden': 100, 'heads': 3}}", "model.tiny.hidden"),
        ("monitor={'host': '0.0.0.0'}", "monitor.token"),
        ("algorithm={'group_size': 1}", "algorithm.group_size"),
        ("algorithm={'name': 'reinforce_pp', 'group_size': 1, 'dynamic_sampling': True}",
         "algorithm.dynamic_sampling"),
        ("algorithm={'tis_cap': 0.0}", "algorithm.tis_cap"),
        ("algorithm={'entropy_coef': -0.01}", "algorithm.entropy_coef"),
        ("algorithm={'entropy_coef': 2.0}", "algorithm.entropy_coef"),
        ("algorithm={'tis_cap': float('nan')}", "algorithm.tis_cap"),
        ("algorithm={'policy_loss': 'ppo'}", "algorithm.policy_loss"),
        ("algorithm={'clip_low': 1.5}", "algorithm.clip_low"),
        ("algorithm={'correction': 'truncate'}", "algorithm.correction"),
        ("algorithm={'correction': 'icepop', 'tis_cap': 1.5}", "algorithm.tis_cap"),
        ("algorithm={'mask_bounds': (0.5, 2.0)}", "algorithm.mask_bounds"),
        ("algorithm={'correction': 'mis', 'mask_bounds': (1.5, 2.0)}", "algorithm.mask_bounds"),
        ("algorithm={'correction': 'mis', 'mask_bounds': (0.5, float('inf'))}",
         "algorithm.mask_bounds"),
        ("reward={'fn': 'no_colon'}", "reward.fn"),
        ("reward={'fn': 'missing_file.py:f'}", "reward.fn"),
        ("reward={'fn': lambda p, r: 1.0}", "reward.fn"),
        ("rollout={'stop': ['ok', '']}", "rollout.stop"),
        ("reward={'fn': None}", "reward.fn"),
        ("reward={'model': {'path': 'tiny', 'tiny': {'hidden': 100, 'heads': 3}}}",
         "reward.model.tiny.hidden"),
        ("reward={'judge': {'template': 'Score:'}}", "reward.judge.template"),
        ("reward={'judge': {'stop': ['']}}", "reward.judge.stop"),
        ("reward={'judge': {'default': float('nan')}}", "reward.judge.default"),
        ("reward={'max_failure_share': 1.5}", "reward.max_failure_share"),
        ("reward={'max_failure_steps': 0}", "reward.max_failure_steps"),
        ("reward={'max_score': float('nan')}", "reward.max_score"),
        # colocated placement: a rollout engine on a node without a trainer, and what the
        # trainer's module cannot serve in place
        ("placement={'mode': 'colocated', 'roles': {'train': ('node0',), 'rollout': "
         "('node1',)}, 'cluster': {'keys_file': '/tmp/k'}}", "placement.roles.rollout"),
        # (data-parallel ranks colocate, one rollout engine in each rank's process)
        ("trainer={'ranks': 2, 'groups_per_step': 2}, placement={'mode': 'colocated'}",
         "rollout.workers"),
        ("model={'lora': {'rank': 2}}, placement={'mode': 'colocated'}", "model.lora"),
        # node dispatch: only other nodes' agents dispatch, and not evaluation's scoring
        ("placement={'node_dispatch': True}", "placement.node_dispatch"),
        ("placement={'node_dispatch': True, 'mode': 'colocated', 'roles': {'rollout': "
         "('a',)}, 'cluster': {'keys_file': '/tmp/k'}}", "placement.node_dispatch"),
        ("placement={'node_dispatch': True, 'roles': {'reward': ('a',)}, 'cluster': "
         "{'keys_file': '/tmp/k'}}, eval={'prompts': 4, 'every': 1}", "placement.node_dispatch"),
    ],
)
def test_rules_name_their_field(tmp_path: Path, kwargs: str, field: str) -> None:
    body = f"from flowrl.recipe import Recipe\nrecipe = Recipe(steps=1, {kwargs})\n"
    path = write(tmp_path, body)
    with pytest.raises(RecipeError) as ei:
        load_recipe(path)
    assert field in problems_of(ei), str(ei.value)
    assert str(ei.value).startswith(f"{path}:2: {field}: ")


def test_a_section_used_in_two_places_names_its_field_and_line_not_a_guess(
    tmp_path: Path,
) -> None:
    # TinyModelConfig is both model.tiny and reward.model.tiny: built on its own, the error
    # cannot know which, so it names the field and the line.
    body = ("from flowrl.recipe import RewardModelConfig, TinyModelConfig\n"
            "rm = RewardModelConfig(path='tiny',\n"
            "                       tiny=TinyModelConfig(hidden=100, heads=3))\n")
    path = write(tmp_path, body)
    with pytest.raises(RecipeError) as ei:
        load_recipe(path)
    assert str(ei.value) == f"{path}:3: hidden: 100 does not divide by heads=3"


def test_real_local_paths_pass(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    rewards = write(tmp_path, "def f(prompt, response, **meta):\n    return 1.0\n", "rw.py")
    r = Recipe(steps=1, model=ModelConfig(path=model),  # type: ignore[arg-type]  # Path → text
               data=DataConfig(kind="jsonl", path=str(data)),
               reward=RewardConfig(fn=f"{rewards}:f"))
    assert r.model.path == str(model)
    assert r.to_pipeline().engine_config["data"]["path"] == str(data)
    # Ray placement: the paths live on the cluster, so they are not checked here.
    Recipe(steps=1, model=ModelConfig(path="/cluster/model"),
           placement=PlacementConfig(kind="ray", nodes=2))


# ---- secrets -------------------------------------------------------------------------------------


def test_monitor_token_is_never_shown(tmp_path: Path) -> None:
    r = Recipe(steps=1, monitor=MonitorConfig(host="0.0.0.0", token=SecretStr(TOKEN)))
    assert r.monitor.token is not None
    assert r.monitor.token.get_secret_value() == TOKEN
    for text in (repr(r), str(r), r.model_dump_json(), repr(r.model_dump()),
                 json.dumps(r.to_pipeline().engine_config)):
        assert TOKEN not in text
    # A rejected token is not echoed either: not by pydantic, nor by RecipeError.
    weak = "weak-token"
    with pytest.raises(ValidationError) as ei:
        Recipe(steps=1, monitor={"token": weak})  # type: ignore[arg-type]
    assert weak not in str(ei.value)
    path = write(tmp_path, "from flowrl.recipe import Recipe\nrecipe = Recipe(steps=1)\n")
    with pytest.raises(RecipeError) as ei2:
        load_recipe(path, [f"monitor.token={weak}"])
    assert weak not in str(ei2.value)
    assert "monitor.token" in problems_of(ei2)


# ---- recipe files --------------------------------------------------------------------------------


def test_recipe_file_with_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, """
        from flowrl.recipe import Recipe, RolloutConfig

        recipe = Recipe(steps=3, rollout=RolloutConfig(engine="sim", workers=2))
    """)
    r = load_recipe(path, [
        "steps=10", "trainer.lr=3e-6", "rollout.stop=[\"</s>\"]", "output=runs/x",
        "sim.prompt_len=16", "algorithm.tis_cap=null", "trainer.betas=[0.9, 0.95]",
        "monitor.token=" + TOKEN,
    ])
    assert r.steps == 10
    assert r.trainer.lr == 3e-6
    assert r.rollout.stop == ("</s>",)
    assert r.rollout.workers == 2  # untouched fields keep the file's values
    assert r.output == Path("runs/x")
    assert r.sim.prompt_len == 16
    assert r.algorithm.tis_cap is None
    assert r.trainer.betas == (0.9, 0.95)
    assert r.monitor.token is not None
    assert r.monitor.token.get_secret_value() == TOKEN


def test_build_function_recipe(tmp_path: Path) -> None:
    path = write(tmp_path, """
        from flowrl.recipe import Recipe

        def build() -> Recipe:
            return Recipe(steps=4)
    """)
    assert load_recipe(path).steps == 4


def test_a_function_defined_in_the_recipe_file_travels_by_file_reference(tmp_path: Path) -> None:
    path = write(tmp_path, """
        from flowrl.recipe import Recipe, RewardConfig

        BONUS = 0.5

        def my_reward(prompt, response, **meta):
            return len(response) + BONUS

        recipe = Recipe(steps=1, reward=RewardConfig(fn=my_reward))
    """, "with_fn.py")
    r = load_recipe(path)
    ref = r.to_pipeline().engine_config["reward"]["fn"]
    assert ref == f"{path.resolve()}:my_reward"
    assert json.loads(r.model_dump_json())["reward"]["fn"] == ref
    # What a worker process does with it: load the file as a module and call the function.
    fn = resolve_reward_fn(ref)
    assert fn("1+1=", "abc") == 3.5
    # Overrides keep the callable.
    assert load_recipe(path, ["steps=2"]).reward.ref == ref


@pytest.mark.parametrize(
    ("body", "line", "field", "message"),
    [
        ("recipe = Recipe(\n    steps=1,\n    trainer=TrainerConfig(lrr=1e-5),\n)\n", 4,
         "trainer.lrr", "unknown field (did you mean 'lr'?)"),
        ("recipe = Recipe(steps=1, trainr={'lr': 1.0})\n", 2,
         "trainr", "unknown field (did you mean 'trainer'?)"),
        ("recipe = Recipe(steps=1, trainer={'lr': 'fast'})\n", 2,
         "trainer.lr", "input should be a valid number, unable to parse string as a number "
                       "(got 'fast')"),
        ("recipe = Recipe(trainer=TrainerConfig())\n", 2, "steps", "required field missing"),
        ("recipe = Recipe(steps=0)\n", 2, "steps",
         "input should be greater than or equal to 1 (got 0)"),
        ("recipe = Recipe(steps=1, rollout={'engine': 'vlm'})\n", 2, "rollout.engine",
         "input should be 'hf', 'vllm' or 'sim' (got 'vlm')"),
        ("def build():\n    return Recipe(steps=1, seed=-1)\n", 3, "seed",
         "input should be greater than or equal to 0 (got -1)"),
        ("recipe = Recipe(steps=1, trainer={'betas': [0.9, 1.5]})\n", 2, "trainer.betas.1",
         "input should be less than 1 (got 1.5)"),
    ],
)
def test_file_errors_name_the_file_line_and_field(
    tmp_path: Path, body: str, line: int, field: str, message: str
) -> None:
    path = write(tmp_path, "from flowrl.recipe import Recipe, TrainerConfig\n" + body)
    with pytest.raises(RecipeError) as ei:
        load_recipe(path)
    assert str(ei.value) == f"{path}:{line}: {field}: {message}"
    assert (ei.value.file, ei.value.line) == (str(path), line)


@pytest.mark.parametrize(
    ("body", "text"),
    [
        ("x = 1\n", "defines neither `recipe = Recipe(...)` nor `def build() -> Recipe`"),
        ("recipe = {'steps': 1}\n", "`recipe` is a dict, expected flowrl.recipe.Recipe"),
        ("def build():\n    return None\n", "build() returned a NoneType, expected"),
        ("recipe = Recipe(steps=1)\ndef build():\n    return recipe\n", "defines both"),
        ("build = 3\n", "`build` is a int"),
    ],
)
def test_files_without_a_recipe(tmp_path: Path, body: str, text: str) -> None:
    path = write(tmp_path, "from flowrl.recipe import Recipe\n" + body)
    with pytest.raises(RecipeError) as ei:
        load_recipe(path)
    assert str(ei.value).startswith(f"{path}: ")
    assert text in str(ei.value)


def test_exceptions_while_running_the_file_name_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "from flowrl.recipe import Recipe\n\nrecipe = Recipe(steps=stepz)\n")
    with pytest.raises(RecipeError) as ei:
        load_recipe(path)
    assert str(ei.value) == f"{path}:3: NameError: name 'stepz' is not defined"
    bad = write(tmp_path, "recipe = (\n", "syntax.py")
    with pytest.raises(RecipeError) as ei2:
        load_recipe(bad)
    assert str(ei2.value).startswith(f"{bad}:1: SyntaxError: ")
    with pytest.raises(RecipeError, match="no such recipe file"):
        load_recipe(tmp_path / "absent.py")


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("stepz=3", "stepz: unknown field (did you mean 'steps'?) (after --set stepz=3)"),
        ("trainer.lrr=1e-5",
         "trainer.lrr: unknown field (did you mean 'lr'?) (after --set trainer.lrr=1e-05)"),
        ("trainer.lr=fast", "trainer.lr: input should be a valid number, unable to parse string "
                            "as a number (got 'fast') (after --set trainer.lr=fast)"),
        ("checkpoint_every=5", "checkpoint_every: needs output (a directory to write "
                               "checkpoints to) (after --set checkpoint_every=5)"),
        ("steps.max=3", "steps.max: steps is a value, not a section (--set steps.max)"),
        ("steps", "--set 'steps': expected key=value with a dotted field path, "
                  "e.g. trainer.lr=1e-5"),
        ("trainer..lr=1", "--set 'trainer..lr=1': expected key=value"),
        ("=3", "--set '=3': expected key=value"),
        ("model.tiny.pretrain_until=2",
         "model.tiny.pretrain_until: input should be less than or equal to 1 (got 2) "
         "(after --set model.tiny.pretrain_until=2)"),
    ],
)
def test_bad_overrides_name_the_file_and_field(
    tmp_path: Path, override: str, expected: str
) -> None:
    path = write(tmp_path, "from flowrl.recipe import Recipe\nrecipe = Recipe(steps=1)\n")
    with pytest.raises(RecipeError) as ei:
        load_recipe(path, [override])
    assert str(ei.value).startswith(f"{path}: {expected}"), str(ei.value)


def test_parse_override_values() -> None:
    assert parse_override("a.b=1") == (("a", "b"), 1)
    assert parse_override("a=1.5e-3") == (("a",), 1.5e-3)
    assert parse_override("a=null") == (("a",), None)
    assert parse_override("a=true") == (("a",), True)
    assert parse_override('a=["x", 2]') == (("a",), ["x", 2])
    assert parse_override("a=hello world") == (("a",), "hello world")
    assert parse_override("a=") == (("a",), "")
    assert parse_override("a=x=y") == (("a",), "x=y")


def test_numbers_given_to_text_fields_become_text(tmp_path: Path) -> None:
    path = write(tmp_path, "from flowrl.recipe import Recipe\nrecipe = Recipe(steps=1)\n")
    r = load_recipe(path, ["data.prompt_key=123"])
    assert r.data.prompt_key == "123"


def test_set_kind_switches_a_section_and_drops_the_old_kinds_settings(tmp_path: Path) -> None:
    path = write(tmp_path, """
        from flowrl.recipe import ArithmeticConfig, DataConfig, Recipe

        recipe = Recipe(steps=1, data=DataConfig(max_prompt_tokens=64,
                                                 arithmetic=ArithmeticConfig(max_operand=5)))
    """)
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"question": "1+1=", "answer": "2"}\n')
    notes: list[str] = []
    r = load_recipe(path, ["data.kind=jsonl", f"data.path={rows}", "data.prompt_key=question"],
                    on_note=notes.append)
    assert (r.data.kind, r.data.path, r.data.prompt_key) == ("jsonl", str(rows), "question")
    assert r.data.max_prompt_tokens == 64  # a setting every kind shares is kept
    assert r.data.arithmetic == ArithmeticConfig()
    assert notes == [f"{path}: --set data.kind=jsonl: data switches from kind 'arithmetic', "
                     "dropping the recipe's data.arithmetic"]
    # Other bad values still fail, naming the field and the file.
    with pytest.raises(RecipeError) as ei:
        load_recipe(path, ["data.kind=jsonl"])
    assert str(ei.value).startswith(f"{path}: data.path: required when kind is 'jsonl'")
    with pytest.raises(RecipeError) as ei:
        load_recipe(path, ["data.kind=jsonl", f"data.path={rows}", "data.arithmetic.count=3"])
    assert problems_of(ei)["data.arithmetic"].startswith("settings given but kind is 'jsonl'")
    with pytest.raises(RecipeError) as ei:
        load_recipe(path, ["data.kind=csv"])
    assert "data.kind" in problems_of(ei)
    # The same kind is no switch: nothing dropped, nothing said.
    same = load_recipe(path, ["data.kind=arithmetic"], on_note=notes.append)
    assert same.data.arithmetic.max_operand == 5
    assert len(notes) == 1


def test_set_kind_switches_placement(tmp_path: Path) -> None:
    path = write(tmp_path, """
        from flowrl.recipe import PlacementConfig, RayConfig, Recipe

        recipe = Recipe(steps=1, placement=PlacementConfig(
            kind="ray", ray=RayConfig(address="auto"), max_restarts=7))
    """)
    notes: list[str] = []
    r = load_recipe(path, ["placement.kind=local"], on_note=notes.append)
    assert r.placement.kind == "local"
    assert r.placement.ray.address is None
    assert r.placement.max_restarts == 7
    assert notes == [f"{path}: --set placement.kind=local: placement switches from kind 'ray', "
                     "dropping the recipe's placement.ray"]


# ---- the shipped recipe and the import cost ----------------------------------------------------


def test_import_is_light() -> None:
    code = ("import sys, flowrl.recipe_file, flowrl.recipe.inputs, workers.roles.reward_runner; "
            "heavy = [m for m in ('torch', 'transformers', 'numpy', 'zmq') if m in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)


def test_sim_grpo_recipe_compiles() -> None:
    r = load_recipe(REPO / "recipes" / "sim_grpo.py")
    spec = r.to_pipeline()
    assert spec.engine == "sim"
    assert [s.name for s in spec.graph().order] == ["rollout", "reward", "reference", "train"]
    assert {p.role: (p.count, p.per_process) for p in spec.pools}["rollout"] == (8, 8)


@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_sim_grpo_recipe_runs() -> None:
    from flowrl.controller import Controller

    r = load_recipe(REPO / "recipes" / "sim_grpo.py", [
        "steps=3", "rollout.workers=2", "rollout.max_new_tokens=32", "algorithm.group_size=4",
        "trainer.groups_per_step=2", "placement.store_capacity_mb=32",
        'sim={"prompt_len": 8, "log_mean": 2.0, "rollout_token_s": 0.0001, '
        '"train_token_s": 0.00001, "train_step_s": 0.002, "weight_numel": 256}',
    ])
    async with Controller(r.to_pipeline()) as ctl:
        out = await ctl.run(steps=r.steps, timeout_s=60)
    assert out["version"] == 3
    assert out["samples"] == 3 * 2 * 4
    assert out["rows_trained_twice"] == 0


def test_node_dispatch_reaches_the_pipeline() -> None:
    from flowrl.recipe import Recipe

    placement = {"node_dispatch": True, "roles": {"reward": ("a",)},
                 "cluster": {"keys_file": "/tmp/k"}}
    assert Recipe(steps=1, placement=placement).to_pipeline().node_dispatch
    assert not Recipe(steps=1).to_pipeline().node_dispatch
