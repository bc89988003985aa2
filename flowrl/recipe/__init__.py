"""Recipes: the typed, validated description of one RL run.

A `Recipe` is a frozen pydantic model made of small sections (model, data, algorithm, rollout,
reward, trainer, monitor, sim, placement, stability, eval). Defaults make the common case short::

    recipe = Recipe(
        steps=200,
        model=ModelConfig(path="/models/qwen2.5-0.5b"),
        data=DataConfig(kind="jsonl", path="data/gsm8k.jsonl"),
        reward=RewardConfig(fn="my_rewards:score"),  # or model=RewardModelConfig(path=...)
    )

Guarantees:

- Every section forbids unknown keys and checks bounds and cross-field rules at construction; a
  rule violation is a ``recipe_rule`` error whose context names the field (`flowrl.recipe_file`
  turns errors into messages naming the file and the dotted field path).
- A constructed recipe is immutable and always compiles: `Recipe.to_pipeline` returns a valid
  `PipelineSpec` whose ``engine_config`` is the JSON form of a `flowrl.worker_spec.EngineSpec`
  (what workers are told, in a 0600 file).
- The monitor token is a `SecretStr`: it is never shown by ``repr``/``str``/``model_dump_json``,
  input values are hidden in validation errors, and it is never put in ``engine_config``.
- Filesystem checks (model directory, data file, reward file, reward model and judge
  directories) run only for local placement on
  one node with a real engine, where the controller's filesystem is the workers' filesystem.
- ``placement.roles`` names only roles the run has, each with at least one node; nodes other
  than the controller's need ``placement.cluster`` (with a key file) unless Ray places them.
- Data-parallel trainer ranks run on one node unless ``placement.cluster.trainer_rendezvous``
  is ``cluster`` (an unauthenticated, unencrypted rendezvous: trusted fabrics only).

Each section lives in the module named after it (`flowrl.recipe.model`, `.data`, `.algorithm`,
`.critic`, `.rollout`, `.reward`, `.trainer`, `.monitor`, `.sim`, `.placement`; ``eval`` in
`.evaluation`), the `Recipe` and its compilation in `flowrl.recipe.recipe`, what they share in
`flowrl.recipe.section`; import them from here.

Imports nothing heavy (pydantic and the standard library), so `workers` may import it.
"""

from __future__ import annotations

from flowrl.recipe.algorithm import DEFAULT_TIS_CAP as DEFAULT_TIS_CAP
from flowrl.recipe.algorithm import LOSS_AGG_ALGORITHM_NAMES, AlgorithmConfig
from flowrl.recipe.algorithm import LossAggName as LossAggName
from flowrl.recipe.critic import CriticConfig
from flowrl.recipe.data import ArithmeticConfig, DataConfig
from flowrl.recipe.evaluation import EvalConfig
from flowrl.recipe.model import TINY_MODEL, LoraConfig, ModelConfig, TinyModelConfig
from flowrl.recipe.monitor import MonitorConfig
from flowrl.recipe.placement import CONTROLLER_NODE as CONTROLLER_NODE
from flowrl.recipe.placement import ROLES as ROLES
from flowrl.recipe.placement import (
    ClusterSettings,
    PlacementConfig,
    RayConfig,
    RayResources,
)
from flowrl.recipe.recipe import Recipe
from flowrl.recipe.reward import (
    JudgeConfig,
    RewardConfig,
    RewardModelConfig,
    callable_ref,
    check_fn_ref,
)
from flowrl.recipe.rollout import RolloutConfig
from flowrl.recipe.sim import SimConfig
from flowrl.recipe.stability import StabilityActions, StabilityConfig
from flowrl.recipe.trainer import TrainerConfig

__all__ = [
    "LOSS_AGG_ALGORITHM_NAMES",
    "TINY_MODEL",
    "AlgorithmConfig",
    "ArithmeticConfig",
    "ClusterSettings",
    "CriticConfig",
    "DataConfig",
    "EvalConfig",
    "JudgeConfig",
    "LoraConfig",
    "ModelConfig",
    "MonitorConfig",
    "PlacementConfig",
    "RayConfig",
    "RayResources",
    "Recipe",
    "RewardConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "SimConfig",
    "StabilityActions",
    "StabilityConfig",
    "TinyModelConfig",
    "TrainerConfig",
    "callable_ref",
    "check_fn_ref",
]
