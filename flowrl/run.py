"""Run a validated recipe: prepare the model, start the controller, train, summarize.

Shared by the launch CLI, benchmarks and notebooks (``await run_recipe(recipe)`` inside a
running loop works: nothing here calls ``asyncio.run`` or installs an event-loop policy).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import signal
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import structlog

from flowrl.controller import Controller
from flowrl.node_hub import ClusterConfig
from flowrl.pipeline import PipelineSpec
from flowrl.recipe import CONTROLLER_NODE, TINY_MODEL, ClusterSettings, Recipe, TinyModelConfig
from flowrl.recipe.inputs import check_inputs
from flowrl.recipe_file import apply_overrides
from flowrl.resume import RunState, latest_checkpoint
from flowrl.run_output import RunRecord, check_resume, claim, run_dir_of
from flowrl.tiny_model import HeadKind
from flowrl.worker_spec import ModelSpec, ResumeSpec
from transport import shm
from transport.errors import SharedMemoryTooSmall

log = structlog.get_logger("flowrl.run")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "flowrl"


def prepare_model(recipe: Recipe) -> Path | None:
    """The local model directory the workers load; builds the tiny model once and caches it."""
    if recipe.rollout.engine == "sim":
        return None
    if recipe.model.path != TINY_MODEL:
        return Path(recipe.model.path)
    return tiny_model_dir(recipe.model.tiny)


def prepare_reward_model(recipe: Recipe) -> Path | None:
    """The reward model's local directory (a tiny one built once and cached); None when the
    reward is no model."""
    rm = recipe.reward.model
    if rm is None or recipe.rollout.engine == "sim":
        return None
    return Path(rm.path) if rm.path != TINY_MODEL else tiny_model_dir(rm.tiny, head="score")


def tiny_model_dir(tiny: TinyModelConfig, *, head: HeadKind = "lm") -> Path:
    """A tiny model of these settings in the cache, built on first use."""
    from flowrl.tiny_model import BUILD_FORMAT, build_tiny_model, build_versions

    settings = tiny.model_dump(mode="json")
    # Another install (other torch/transformers/tokenizers) or build procedure builds other
    # bytes: its own entry (a checkout with another procedure never rebuilds this one in place).
    keyed = {**settings, "libraries": build_versions(), "format": BUILD_FORMAT}
    if head != "lm":  # a causal LM's key names no head
        keyed["head"] = head
    key = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:12]
    out = cache_dir() / "models" / f"tiny-{key}"
    return build_tiny_model(
        out, vocab_size=settings["vocab_size"], hidden=settings["hidden"],
        layers=settings["layers"], heads=settings["heads"], kv_heads=settings["kv_heads"],
        max_positions=settings["max_positions"], pretrain_steps=settings["pretrain_steps"],
        seed=settings["seed"], corpus_kind=settings["corpus"], head=head,
    )


def compile_recipe(
    recipe: Recipe, *, resume: tuple[Path, RunState] | None = None
) -> PipelineSpec:
    """The recipe's pipeline with its model resolved to a local directory; with ``resume`` (a
    complete checkpoint and its state, as `flowrl.resume.latest_checkpoint` returns them),
    policy workers start from that checkpoint — weights, optimizer state, version — and the
    reference model stays the recipe's."""
    spec = recipe.to_pipeline()
    model = prepare_model(recipe)
    if model is None:
        return spec
    engine = recipe.engine_spec()
    placed = ModelSpec(path=str(model))
    if resume is not None:
        checkpoint, state = resume
        placed = ModelSpec(path=str(checkpoint), reference_path=str(model))
        engine = engine.model_copy(update={
            "resume": ResumeSpec(checkpoint=str(checkpoint), version=state.version)})
    update: dict[str, Any] = {"model": placed}
    reward_model = prepare_reward_model(recipe)
    if reward_model is not None and engine.reward.model is not None:
        update["reward"] = engine.reward.model_copy(update={
            "model": engine.reward.model.model_copy(update={"path": str(reward_model)})})
    engine = engine.model_copy(update=update)
    return dataclasses.replace(spec, engine_config=engine.model_dump(mode="json"))


def cluster_config(recipe: Recipe, *, host: str | None = None) -> ClusterConfig | None:
    """``placement.cluster`` as the controller's `ClusterConfig`; None when every role runs on
    the controller's node. ``host`` replaces the default address (not one the recipe gives)."""
    placement = recipe.placement
    if not placement.remote_nodes:
        return None
    return ClusterConfig.from_settings(placement.cluster or ClusterSettings(), host=host)


@contextlib.asynccontextmanager
async def placed_controller(
    recipe: Recipe, spec: PipelineSpec, *, monitor: bool = True, resume: RunState | None = None,
    run_id: str | None = None,
) -> AsyncIterator[Controller]:
    """The recipe's controller, started with its workers placed as ``placement`` says; with
    Ray placement, the other nodes' agents run as Ray actors (`flowrl.ray_placement`), which
    go after the controller has closed (its stop broadcast lets them leave on their own)."""
    async with contextlib.AsyncExitStack() as stack:
        agents = None
        if recipe.placement.kind == "ray" and recipe.placement.remote_nodes:
            from flowrl.ray_placement import RayAgents  # Ray loads only when placed by it

            agents = await stack.enter_async_context(RayAgents(recipe.placement.ray))
        ctl = Controller(spec, run_id=run_id, node=CONTROLLER_NODE,
                         monitor=recipe.monitor if monitor else None,
                         resume=resume, cluster=cluster_config(
                             recipe, host=None if agents is None else agents.host))
        stack.push_async_callback(ctl.aclose)  # also when the start fails half-way
        if agents is None:
            await ctl.start()
        else:
            await agents.start_controller(ctl)
        yield ctl


def check_store_room(recipe: Recipe) -> None:
    """Refuse a store this node's shared memory cannot hold, before anything starts (the node
    agent checks again, on every node, when it creates its store)."""
    try:
        shm.check_room(recipe.placement.store_capacity_mb << 20)
    except SharedMemoryTooSmall as exc:
        raise SharedMemoryTooSmall(
            f"{exc} (placement.store_capacity_mb = {recipe.placement.store_capacity_mb})"
        ) from None


async def run_recipe(
    recipe: Recipe, *, on_step: Callable[[dict[str, Any]], None] | None = None,
    steps: int | None = None, monitor: bool = True,
    on_start: Callable[[Controller], None] | None = None, resume: Path | None = None,
    run_id: str | None = None, overwrite: bool = False,
    on_eval: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Train until version ``steps`` (default: the recipe's; given, it replaces the recipe's
    ``steps`` as ``--steps`` does); SIGTERM stops cleanly.

    With ``recipe.output``, the run keeps its results there (`flowrl.run_output`: the final
    model in ``final/``, the recipe, the step log as steps commit, the summary) and the
    summary returned gains ``output`` and ``final_model`` (its path, or None when the run
    stopped before its last step). A directory holding another run's results is refused
    (`flowrl.run_output.OutputInUse`) unless ``resume`` continues that run or ``overwrite``
    replaces them. Without ``recipe.output`` nothing is written (only the launcher makes a
    default directory).

    ``resume``: a run's output directory (or one checkpoint in it); the run continues from its
    newest complete checkpoint (`flowrl.resume`) up to the same total number of steps. A
    recipe that changed what resumption cannot change is refused
    (`flowrl.run_output.ResumeMismatch`); other changes are logged.

    ``on_eval`` is called with each evaluation round's line (``eval``), as ``on_step`` with
    each step's. ``monitor`` starts the recipe's HTTP monitor; ``on_start`` is called once the
    controller and its workers are up (the launcher prints the monitor's URL there). ``run_id``
    names the run (default: a fresh one).

    Before any process starts, what the workers will load is checked
    (`flowrl.recipe.inputs.check_inputs`: reward function, data file, model directories);
    an input they could not use raises `flowrl.recipe.inputs.InputError` naming its field.
    """
    if steps is not None and steps != recipe.steps:
        # The trainer's schedule ends, and its final model is written, at the recipe's steps.
        recipe = apply_overrides(recipe, [(("steps",), steps)])
    found = latest_checkpoint(resume) if resume is not None else None
    state = None if found is None else found[1]
    total = recipe.steps
    if found is not None and found[1].version >= total:
        raise ValueError(f"--resume: {found[0]} is at step {found[1].version} of {total}: "
                         "nothing left to train (raise --steps to train further)")
    if resume is not None:
        for change in check_resume(resume, recipe):
            log.warning("resumed with a changed recipe field", change=change)
    out = recipe.output
    if out is not None:
        claim(out, resume=resume, overwrite=overwrite)
    check_store_room(recipe)
    await asyncio.to_thread(check_inputs, recipe)
    spec = await asyncio.to_thread(compile_recipe, recipe, resume=found)
    record = None
    if out is not None:
        resumed_at = None  # the step log goes on only in the resumed run's own directory
        if found is not None and run_dir_of(found[0]).resolve() == out.resolve():
            resumed_at = found[1].version
        record = RunRecord(out, recipe, resumed_at=resumed_at)
    me = asyncio.current_task()
    loop = asyncio.get_running_loop()
    handled = False
    # Signal handlers can only be installed from the main thread (not in a notebook's helper).
    if me is not None and threading.current_thread() is threading.main_thread():
        loop.add_signal_handler(signal.SIGTERM, me.cancel)
        handled = True
    try:
        async with placed_controller(recipe, spec, monitor=monitor, resume=state,
                                     run_id=run_id) as ctl:
            if on_start is not None:
                on_start(ctl)
            if record is not None:  # before the caller's: a line is kept before it is shown
                ctl.on_step.append(record.step)
                ctl.on_eval.append(record.eval)
            if on_step is not None:
                ctl.on_step.append(on_step)
            if on_eval is not None:
                ctl.on_eval.append(on_eval)
            summary = await ctl.run(total - ctl.version)
            if record is not None:
                summary = record.finish(summary, ctl.step_log)
            return summary
    finally:
        if record is not None:
            record.close()
        if handled:
            loop.remove_signal_handler(signal.SIGTERM)

