"""The public API: what ``flowrl`` exports, and that importing it stays cheap."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import flowrl
from flowrl import controller, node_hub, pipeline, recipe, recipe_file, run
from flowrl.recipe.section import _Section

ROOT = Path(__file__).resolve().parent.parent

# Changing this list changes the public API: say so in CHANGELOG.md.
PUBLIC = [
    "AlgorithmConfig", "ArithmeticConfig", "ClusterConfig", "ClusterSettings", "Controller",
    "CriticConfig", "DataConfig", "EvalConfig", "JudgeConfig", "ModelConfig", "MonitorConfig",
    "PipelineSpec",
    "PlacementConfig", "PoolSpec", "RayConfig", "RayResources", "Recipe", "RecipeError",
    "RewardConfig", "RewardModelConfig", "RolloutConfig", "RunError", "SimConfig",
    "StabilityActions", "StabilityConfig",
    "TinyModelConfig", "TrainerConfig", "LoraConfig",
    "compile_recipe", "given", "load_recipe", "run_recipe",
]


def test_all_is_pinned() -> None:
    assert sorted(flowrl.__all__) == sorted(PUBLIC)
    assert len(set(flowrl.__all__)) == len(flowrl.__all__)


def test_each_name_is_its_home_module_object() -> None:
    homes = (controller, node_hub, pipeline, recipe, recipe_file, run)
    for name in PUBLIC:
        value = getattr(flowrl, name)
        assert [m for m in homes if getattr(m, name, None) is value], name
    assert set(PUBLIC) <= set(dir(flowrl))


def test_every_section_of_a_recipe_is_exported() -> None:
    # A user writes a recipe with these classes: one left out would send them to a submodule.
    sections = {f.annotation.__name__ for f in flowrl.Recipe.model_fields.values()
                if isinstance(f.annotation, type) and issubclass(f.annotation, _Section)}
    assert sections
    assert sections <= set(PUBLIC)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = flowrl.Nope  # type: ignore[attr-defined]
    assert not hasattr(flowrl, "Index")  # internals stay in their modules


def _loaded_after(code: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport json, sys; print(json.dumps(sorted(sys.modules)))"],
        capture_output=True, text=True, check=True, timeout=60)
    return list(json.loads(out.stdout))


HEAVY = ("flowrl.controller", "flowrl.recipe", "flowrl.run", "pydantic", "zmq", "torch",
         "aiohttp")


def test_import_flowrl_loads_nothing_heavy() -> None:
    loaded = _loaded_after("import flowrl")
    assert [m for m in loaded if m.startswith("flowrl")] == ["flowrl"]
    assert not [m for m in loaded if m.split(".")[0] in HEAVY or m in HEAVY]


def test_workers_do_not_pay_for_the_controller() -> None:
    # What a worker process imports of flowrl (its messages, datasets, logs, lifecycle).
    loaded = _loaded_after(
        "import flowrl.messages, flowrl.data, flowrl.logs, flowrl.lifecycle")
    assert not [m for m in loaded if m in ("flowrl.controller", "flowrl.recipe", "flowrl.run",
                                           "flowrl.node", "flowrl.monitor", "aiohttp")]


def test_star_import_gives_the_public_names() -> None:
    loaded = _loaded_after("from flowrl import *\nassert Recipe and run_recipe and Controller")
    assert "flowrl.controller" in loaded


def _flowrl_imports(source: str) -> list[str]:
    """The flowrl modules that ``from flowrl... import`` statements of `source` name."""
    return [n.module for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("flowrl")]


def test_readme_examples_and_recipes_import_from_flowrl() -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in readme.split("```python\n")[1:]]
    assert blocks
    sources = {f"README.md block {i}": b for i, b in enumerate(blocks)}
    sources |= {str(p.relative_to(ROOT)): p.read_text() for p in (ROOT / "recipes").glob("*.py")}
    found = {where: _flowrl_imports(src) for where, src in sources.items()}
    assert any(found.values())
    assert {where: mods for where, mods in found.items() if set(mods) - {"flowrl"}} == {}
