"""Run a validated recipe: prepare the model, start the controller, train, summarize.

Shared by the launch CLI, benchmarks and notebooks (``await run_recipe(recipe)`` inside a
running loop works: nothing here calls ``asyncio.run`` or installs an event-loop policy).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flowrl.controller import Controller
from flowrl.pipeline import PipelineSpec
from flowrl.recipe import TINY_MODEL, Recipe
from flowrl.resume import latest_checkpoint


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "flowrl"


def prepare_model(recipe: Recipe) -> Path | None:
    """The local model directory the workers load; builds the tiny model once and caches it."""
    if recipe.rollout.engine == "sim":
        return None
    if recipe.model.path != TINY_MODEL:
        return Path(recipe.model.path)
    from workers.tiny_model import build_tiny_model

    settings = recipe.model.tiny.model_dump(mode="json")
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    out = cache_dir() / "models" / f"tiny-{key}"
    return build_tiny_model(
        out, vocab_size=settings["vocab_size"], hidden=settings["hidden"],
        layers=settings["layers"], heads=settings["heads"], kv_heads=settings["kv_heads"],
        max_positions=settings["max_positions"], pretrain_steps=settings["pretrain_steps"],
        seed=settings["seed"], corpus_kind=settings["corpus"],
    )


def compile_recipe(recipe: Recipe, *, resume: Path | None = None) -> PipelineSpec:
    """The recipe's pipeline with its model resolved to a local directory; with ``resume`` (a
    complete checkpoint directory, `flowrl.resume.latest_checkpoint`), policy workers start
    from that checkpoint — weights, optimizer state, version — and the reference model stays
    the recipe's."""
    spec = recipe.to_pipeline()
    model = prepare_model(recipe)
    if model is not None:
        config = dict(spec.engine_config)
        config["model"] = {**config["model"], "path": str(model)}
        if resume is not None:
            state = latest_checkpoint(resume)[1]
            config["model"] = {**config["model"], "path": str(resume),
                               "reference_path": str(model)}
            config["resume"] = {"checkpoint": str(resume), "version": state.version}
        spec = dataclasses.replace(spec, engine_config=config)
    return spec


async def run_recipe(
    recipe: Recipe, *, on_step: Callable[[dict[str, Any]], None] | None = None,
    steps: int | None = None, monitor: bool = True,
    on_start: Callable[[Controller], None] | None = None, resume: Path | None = None,
) -> dict[str, Any]:
    """Train until version ``steps`` (default: the recipe's); SIGTERM stops cleanly.

    ``resume``: a run's output directory (or one checkpoint in it); the run continues from its
    newest complete checkpoint (`flowrl.resume`) up to the same total number of steps.

    ``monitor`` starts the recipe's HTTP monitor; ``on_start`` is called once the controller
    and its workers are up (the launcher prints the monitor's URL there).
    """
    checkpoint, state = latest_checkpoint(resume) if resume is not None else (None, None)
    total = steps or recipe.steps
    if state is not None and state.version >= total:
        raise ValueError(f"--resume: {checkpoint} is at step {state.version} of {total}: "
                         "nothing left to train (raise --steps to train further)")
    spec = await asyncio.to_thread(compile_recipe, recipe, resume=checkpoint)
    me = asyncio.current_task()
    loop = asyncio.get_running_loop()
    handled = False
    # Signal handlers can only be installed from the main thread (not in a notebook's helper).
    if me is not None and threading.current_thread() is threading.main_thread():
        loop.add_signal_handler(signal.SIGTERM, me.cancel)
        handled = True
    try:
        async with Controller(spec, monitor=recipe.monitor if monitor else None,
                              resume=state) as ctl:
            if on_start is not None:
                on_start(ctl)
            if on_step is not None:
                ctl.on_step.append(on_step)
            summary = await ctl.run(total - ctl.version)
            return summary
    finally:
        if handled:
            loop.remove_signal_handler(signal.SIGTERM)

