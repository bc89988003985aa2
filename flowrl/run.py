"""Run a validated recipe: prepare the model, start the controller, train, summarize.

Shared by the launch CLI, benchmarks and notebooks (``await run_recipe(recipe)`` inside a
running loop works: nothing here calls ``asyncio.run`` or installs an event-loop policy).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import json
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import structlog

from flowrl.control.trace_recorder import TraceRecorder
from flowrl.controller import Controller
from flowrl.data import scan
from flowrl.interrupts import Interrupts
from flowrl.model_build import build_in_child
from flowrl.node_hub import ClusterConfig
from flowrl.pipeline import PipelineSpec
from flowrl.progress import Progress, seconds
from flowrl.recipe import CONTROLLER_NODE, TINY_MODEL, ClusterSettings, Recipe, TinyModelConfig
from flowrl.recipe.inputs import check_inputs
from flowrl.recipe_file import apply_overrides
from flowrl.resume import STATE_FILE, RunState, latest_checkpoint
from flowrl.run_output import FINAL_DIR, RunRecord, check_resume, claim, run_dir_of
from flowrl.run_trace import write_trace
from flowrl.tiny_model import HeadKind
from flowrl.tracking import Tracking, check_installed
from flowrl.worker_spec import ResumeSpec
from transport import shm
from transport.endpoints import new_run_id
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
    from flowrl.tiny_model import build_tiny_model

    out, settings = tiny_build(tiny, head=head)
    return build_tiny_model(out, **settings)


def tiny_build(tiny: TinyModelConfig, *, head: HeadKind = "lm") -> tuple[Path, dict[str, Any]]:
    """Where a tiny model of these settings is cached, and `build_tiny_model`'s keyword
    arguments that build it."""
    from flowrl.tiny_model import BUILD_FORMAT, build_versions

    settings = tiny.model_dump(mode="json")
    # Another install (other torch/transformers/tokenizers) or build procedure builds other
    # bytes: its own entry (a checkout with another procedure never rebuilds this one in place).
    if not settings["pretrain_steps"]:
        settings["pretrain_until"] = None  # no warm-up to end: the same build as without
    keyed = {**settings, "libraries": build_versions(), "format": BUILD_FORMAT}
    if keyed["pretrain_until"] is None:  # keys of models cached before the field existed
        del keyed["pretrain_until"]
    if head != "lm":  # a causal LM's key names no head
        keyed["head"] = head
    key = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:12]
    out = cache_dir() / "models" / f"tiny-{key}"
    return out, {
        "vocab_size": settings["vocab_size"], "hidden": settings["hidden"],
        "layers": settings["layers"], "heads": settings["heads"],
        "kv_heads": settings["kv_heads"], "max_positions": settings["max_positions"],
        "pretrain_steps": settings["pretrain_steps"], "seed": settings["seed"],
        "pretrain_until": settings["pretrain_until"],
        "corpus_kind": settings["corpus"], "head": head,
    }


def tiny_models(recipe: Recipe) -> list[tuple[str, TinyModelConfig, HeadKind]]:
    """The tiny models a recipe's workers load (each named, with its settings and head)."""
    if recipe.rollout.engine == "sim":
        return []
    found: list[tuple[str, TinyModelConfig, HeadKind]] = []
    if recipe.model.path == TINY_MODEL:
        found.append(("tiny model", recipe.model.tiny, "lm"))
    rm = recipe.reward.model
    if rm is not None and rm.path == TINY_MODEL:
        found.append(("tiny reward model", rm.tiny, "score"))
    return found


async def build_tiny_models(recipe: Recipe, progress: Progress,
                            interrupts: Interrupts) -> None:
    """Build the recipe's tiny models that the cache lacks, each in a child process that says
    how it goes and stops when cancelled (`flowrl.model_build`); a cached one is said."""
    from flowrl.tiny_model import is_built

    for what, tiny, head in tiny_models(recipe):
        out, settings = tiny_build(tiny, head=head)
        if await asyncio.to_thread(is_built, out, **settings):
            progress.line("model", f"the {what} from the cache: {out}")
        else:
            await build_in_child(out, settings, what=what, progress=progress,
                                 interrupts=interrupts)


async def say_data(recipe: Recipe, progress: Progress) -> None:
    """Say how many prompts the workers will load: a data file is read through (its rows
    counted, not kept) with a line every `Progress.every_s` on the way; stopped when
    cancelled. Nothing is said of data read on other nodes."""
    data = recipe.data
    if not recipe.inputs_are_local or not progress.enabled:
        return
    if data.kind == "arithmetic":
        a = data.arithmetic
        progress.line("data", f"{a.count} arithmetic prompts (a+b= with a, b in "
                              f"0..{a.max_operand})")
        return
    assert data.path is not None  # DataConfig: a file kind has a path
    path = data.path
    progress.begin("data", "reading the data", f"reading {path}")
    cancelled = threading.Event()

    def seen(rows: int) -> None:
        if cancelled.is_set():
            raise asyncio.CancelledError
        progress.update(lambda: f"{rows} rows read ({seconds(progress.elapsed())})")

    try:
        usable, skipped = await asyncio.to_thread(
            scan, path, kind=data.kind, prompt_key=data.prompt_key,
            answer_key=data.answer_key, template=data.prompt_template, seen=seen)
    finally:
        cancelled.set()
    progress.end(f"{usable} prompts in {path}" + (f" ({skipped} malformed rows skipped)"
                                                  if skipped else "")
                 + f" ({seconds(progress.elapsed())})")


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
    placed = engine.model.model_copy(update={"path": str(model)})
    if resume is not None:
        checkpoint, state = resume
        placed = engine.model.model_copy(update={"path": str(checkpoint),
                                                 "reference_path": str(model)})
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
    run_id: str | None = None, progress: Progress | None = None,
    interrupts: Interrupts | None = None,
) -> AsyncIterator[Controller]:
    """The recipe's controller, started with its workers placed as ``placement`` says; with
    Ray placement, the other nodes' agents run as Ray actors (`flowrl.ray_placement`), which
    go after the controller has closed (its stop broadcast lets them leave on their own).
    ``progress`` is told how the workers' start goes; ``interrupts`` learns the run's
    processes and shared memory, for a forced stop."""
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
        if interrupts is not None:
            interrupts.run_ids.add(ctl.run_id)
            stack.callback(interrupts.track(
                lambda: [c.pid for c in ctl.workforce.supervisor.children]))
        told = progress or Progress(enabled=False)
        wanted = {p.role: p.count for p in spec.pools}
        total = sum(wanted.values())
        told.begin("workers", "starting the workers",
                   f"starting {total} workers ({', '.join(_counted(wanted))})")
        ticking = asyncio.create_task(told.ticks(lambda: _starting(ctl, wanted, told)))
        try:
            if agents is None:
                await ctl.start()
            else:
                await agents.start_controller(ctl)
        finally:
            ticking.cancel()
        told.end(f"{total} of {total} up in {seconds(told.elapsed())}")
        yield ctl


def _counted(roles: dict[str, int]) -> list[str]:
    return [role if n == 1 else f"{role} ×{n}" for role, n in roles.items()]


def _starting(ctl: Controller, wanted: dict[str, int], progress: Progress) -> str:
    """How the workers' start goes: how many are up, and which roles are still starting."""
    up = collections.Counter(w.role for w in ctl.registry.all())
    waiting = {role: n - up[role] for role, n in wanted.items() if up[role] < n}
    return (f"{sum(up.values())} of {sum(wanted.values())} up ({seconds(progress.elapsed())});"
            f" still starting: {', '.join(_counted(waiting)) or 'none'}")


def say_saves(entry: dict[str, Any], out: Path, progress: Progress) -> None:
    """Say the checkpoint and final model a committed step saved (an ``on_step`` callback):
    the trainer's figures (``checkpoint_bytes``, ``checkpoint_s``, ``final_bytes``,
    ``final_s``), a checkpoint only once complete (its run state written)."""
    step = int(entry["step"])
    checkpoint = out / f"step_{step}"
    if "train_checkpoint_s" in entry and (checkpoint / STATE_FILE).is_file():
        progress.saved("checkpoint", step, checkpoint, entry.get("train_checkpoint_bytes"),
                       entry["train_checkpoint_s"])
    if entry.get("train_final_saved") and (out / FINAL_DIR).is_dir():
        progress.saved("final model", step, out / FINAL_DIR, entry.get("train_final_bytes"),
                       entry.get("train_final_s"))


def trace_recipe(recipe: Recipe) -> dict[str, Any]:
    """The recipe as a trace's header keeps it: the fields as given (so that the planner's
    overrides are judged as the launcher's are), the monitor token left out."""
    return recipe.model_dump(mode="json", exclude_unset=True, exclude={"monitor": {"token"}})


def save_trace(recorder: TraceRecorder, path: Path) -> None:
    """Write what ``recorder`` kept to ``path``; a failed write is logged, the run's own
    outcome stands."""
    try:
        write_trace(path, recorder.header(now=time.time(), cpu=time.process_time()),
                    list(recorder.records))
    except OSError as exc:
        log.error("trace not saved", path=str(path), error=repr(exc))
    else:
        log.info("trace saved", path=str(path), records=len(recorder.records))


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
    run_id: str | None = None, overwrite: bool = False, progress: Progress | None = None,
    interrupts: Interrupts | None = None,
    on_eval: Callable[[dict[str, Any]], None] | None = None,
    record_trace: Path | None = None,
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

    ``recipe.tracking``: each step's line, each evaluation round's, the recipe and the summary
    also go to the trackers it names (`flowrl.tracking`), which end with the run however it
    ends; one whose library is not installed raises `flowrl.recipe.inputs.InputError` before
    anything starts.

    ``on_eval`` is called with each evaluation round's line (``eval``), as ``on_step`` with
    each step's. ``monitor`` starts the recipe's HTTP monitor; ``on_start`` is called once the
    controller and its workers are up (the launcher prints the monitor's URL there). ``run_id``
    names the run (default: a fresh one).

    Before any process starts, what the workers will load is checked
    (`flowrl.recipe.inputs.check_inputs`: reward function, data file, model directories);
    an input they could not use raises `flowrl.recipe.inputs.InputError` naming its field.

    ``progress`` is told how the long stages go (`flowrl.progress`: the tiny model's build,
    reading the data, the workers' start, each save) and what the run did so far; a tiny model
    the cache lacks is built in a child process that stops when the run is cancelled.
    ``interrupts`` learns the run's processes and shared memory, for a forced stop
    (`flowrl.interrupts`). ``record_trace``: write the run's trace there when it ends, however
    it ends (`flowrl.run_trace`; ``python -m flowrl.plan`` replays it).
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
    check_installed(recipe.tracking)
    if resume is not None:
        for change in check_resume(resume, recipe):
            log.warning("resumed with a changed recipe field", change=change)
    out = recipe.output
    if out is not None:
        claim(out, resume=resume, overwrite=overwrite)
    check_store_room(recipe)
    await asyncio.to_thread(check_inputs, recipe)
    told = progress or Progress(enabled=False)
    told.steps = total
    await say_data(recipe, told)
    await build_tiny_models(recipe, told, interrupts or Interrupts())
    spec = await asyncio.to_thread(compile_recipe, recipe, resume=found)
    record = None
    if out is not None:
        resumed_at = None  # the step log goes on only in the resumed run's own directory
        if found is not None and run_dir_of(found[0]).resolve() == out.resolve():
            resumed_at = found[1].version
        record = RunRecord(out, recipe, resumed_at=resumed_at)
    run_id = run_id or new_run_id()  # the trackers name their runs by it
    tracking = Tracking.of(recipe, run_id,
                           resumed_at=None if record is None else record.resumed_at)
    error: BaseException | None = None
    me = asyncio.current_task()
    loop = asyncio.get_running_loop()
    handled = False
    recorder: TraceRecorder | None = None
    # Signal handlers can only be installed from the main thread (not in a notebook's helper).
    if me is not None and threading.current_thread() is threading.main_thread():
        loop.add_signal_handler(signal.SIGTERM, me.cancel)
        handled = True
    try:
        async with placed_controller(recipe, spec, monitor=monitor, resume=state,
                                     run_id=run_id, progress=told,
                                     interrupts=interrupts) as ctl:
            ctl.trace.recipe = trace_recipe(recipe)
            recorder = ctl.trace
            told.doing, told.step = "training", ctl.version
            if on_start is not None:
                on_start(ctl)
            if record is not None:  # before the caller's: a line is kept before it is shown
                ctl.on_step.append(record.step)
                ctl.on_eval.append(record.eval)
            ctl.on_step.append(tracking.step)
            ctl.on_eval.append(tracking.eval)
            ctl.on_step.append(told.on_step)
            if on_step is not None:
                ctl.on_step.append(on_step)
            if on_eval is not None:
                ctl.on_eval.append(on_eval)
            if out is not None:  # after the step's line: what it saved
                ctl.on_step.append(lambda entry: say_saves(entry, out, told))
            summary = await ctl.run(total - ctl.version)
            if record is not None:
                summary = record.finish(summary, ctl.step_log)
            tracking.summary(summary)
            return summary
    except BaseException as exc:
        error = exc
        raise
    finally:
        if record is not None:
            record.close()
        if recorder is not None and record_trace is not None:
            save_trace(recorder, record_trace)
        if handled:
            loop.remove_signal_handler(signal.SIGTERM)
        await tracking.aclose(error)  # last: what else ends cannot wait on a tracker

