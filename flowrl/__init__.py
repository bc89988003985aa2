"""flowrl: asyncio-native, single-controller orchestration for RL post-training of LLMs.

The names users touch: a `Recipe` and its sections, `load_recipe` for recipe files,
`run_recipe` to train one, and `Controller` to drive a compiled pipeline by hand (a notebook,
a custom loop). Everything else is reached through its module.

Each name is imported on first use: worker processes import ``flowrl.messages`` and friends
without paying for the controller, pydantic or ZeroMQ, and ``import flowrl`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flowrl.controller import Controller, RunError
    from flowrl.node_hub import ClusterConfig
    from flowrl.pipeline import PipelineSpec, PoolSpec
    from flowrl.recipe import (
        AlgorithmConfig,
        ArithmeticConfig,
        ClusterSettings,
        CriticConfig,
        DataConfig,
        EvalConfig,
        JudgeConfig,
        LoraConfig,
        ModelConfig,
        MonitorConfig,
        PlacementConfig,
        RayConfig,
        RayResources,
        Recipe,
        RewardConfig,
        RewardModelConfig,
        RolloutConfig,
        SimConfig,
        StabilityActions,
        StabilityConfig,
        TinyModelConfig,
        TrainerConfig,
    )
    from flowrl.recipe_file import RecipeError, given, load_recipe
    from flowrl.run import compile_recipe, run_recipe

# name -> the module that defines it
_HOMES = {
    "Controller": "flowrl.controller",
    "RunError": "flowrl.controller",
    "ClusterConfig": "flowrl.node_hub",
    "PipelineSpec": "flowrl.pipeline",
    "PoolSpec": "flowrl.pipeline",
    **dict.fromkeys([
        "AlgorithmConfig", "ArithmeticConfig", "ClusterSettings", "CriticConfig", "DataConfig",
        "EvalConfig", "JudgeConfig", "LoraConfig", "ModelConfig", "MonitorConfig",
        "PlacementConfig", "RayConfig",
        "RayResources", "Recipe", "RewardConfig", "RewardModelConfig", "RolloutConfig",
        "SimConfig", "StabilityActions", "StabilityConfig", "TinyModelConfig", "TrainerConfig",
    ], "flowrl.recipe"),
    "RecipeError": "flowrl.recipe_file",
    "given": "flowrl.recipe_file",
    "load_recipe": "flowrl.recipe_file",
    "compile_recipe": "flowrl.run",
    "run_recipe": "flowrl.run",
}

__all__ = [
    "AlgorithmConfig",
    "ArithmeticConfig",
    "ClusterConfig",
    "ClusterSettings",
    "Controller",
    "CriticConfig",
    "DataConfig",
    "EvalConfig",
    "JudgeConfig",
    "LoraConfig",
    "ModelConfig",
    "MonitorConfig",
    "PipelineSpec",
    "PlacementConfig",
    "PoolSpec",
    "RayConfig",
    "RayResources",
    "Recipe",
    "RecipeError",
    "RewardConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "RunError",
    "SimConfig",
    "StabilityActions",
    "StabilityConfig",
    "TinyModelConfig",
    "TrainerConfig",
    "compile_recipe",
    "given",
    "load_recipe",
    "run_recipe",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'flowrl' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
