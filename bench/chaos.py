"""Chaos benchmark: SIGKILL and hang (SIGSTOP) random worker processes of a running job, with a
broadcast subscriber that never reads; check that no row is lost, none is trained twice, the job
completes without long stalls, and a controller resumed from its state finishes it.

    python bench/chaos.py [--quick] [--engine sim|tiny] [--kills N] [--stops N] [--stalls N]
                          [--steps N] [--seed S] [--roles rollout,train] [--recipe FILE]
                          [--set KEY=VALUE ...] [--no-resume]

Prints one JSON line. Modes:

- full (default, ``--engine tiny``): the default recipe (``recipes/tiny_cpu.py``) with its real
  tiny model, shrunk so a step takes a fraction of a second (`TINY_OVERRIDES`: no warm start,
  4 groups of 4 responses per step in two micro-batches, two groups per rollout task) and with
  the KL term on (``algorithm.kl_coef=0.01``) so a reference stage exists; a checkpoint every
  step; ``--recipe`` names another recipe file (``recipes/tool_cpu.py``: multi-turn episodes
  with tool sandboxes), ``--set`` overrides more recipe fields. 20 kills, 4 stops and 1 stall
  over 40 steps.
- ``--quick`` (``--engine sim``): the simulated pipeline (`sim_spec`: real processes, sockets,
  shared memory and weight sync; modelled compute, ``workers.sim``; two rollout processes, one
  each of reward, reference and train). 8 kills, 2 stops and 1 stall over 24 steps.

Faults (`fault_plan`, drawn from ``--seed``): the victims' roles are rollout, reward, reference
and train in equal shares, shuffled (kills and stops each); each fault is due at a random policy
version of the chaos phase. The injector waits on controller events (`Controller.wait_for`)
until that version is reached and the role has a registered worker, then waits a random offset
of at most about a step (a bounded sleep), and hits one registered process of the role, then
waits until the controller has declared its workers down. So a fault lands anywhere in a step:
mid-generation, mid-micro-batch, between a step's micro-batches, while a restarted worker loads
weights.

- a kill: SIGKILL (`Controller.kill_worker_process`); the controller sees the process exit.
- a stop (a hang): SIGSTOP, never resumed. The process is alive but silent; the controller must
  find it by its missed heartbeats (every `HEARTBEAT_S` = 0.2 s, down after
  `HEARTBEAT_TIMEOUT_S` = 2 s without: `PipelineSpec` fields, set on the compiled recipe in tiny
  mode since a recipe allows no timeout under 3 s), redo its tasks, SIGKILL it and restart it.
  ``detected_s`` in ``stop_log`` is the time from SIGSTOP to the worker declared down. A stopped
  process the controller has not killed by the end is SIGKILLed by this harness and counted in
  ``stops_unrecovered``.
- a stall (``--stalls``): a local process (``bench/stuck_subscriber.py``) joins the run's
  broadcast endpoint before the first step, then stops itself and never reads again, until it
  is SIGKILLed after the controller closed. Broadcasts must not wait for it. (A run publishes
  about one broadcast a step, far fewer than ZeroMQ queues for a peer, so the publisher does not
  drop it within a run: what is checked is that it delays nothing.)

Worker processes are restarted with ``max_restarts = kills + stops + 3`` (every fault could hit
the same process; three spare for heartbeats that a loaded machine delays past the timeout; the
recipe's ``placement.max_restarts`` in tiny mode) after ``restart_backoff_s = 0.1`` seconds,
doubling per death of the same process (at most 30 s).

A killed trainer is restarted at the current policy version: its register reply carries the
weights published for that version, which it loads before training (a version-0 trainer would
make the next step publish a wrong version, which stops the run). Its optimizer state is lost:
Adam's moments and its step count (so the learning-rate warmup too) start afresh. The tiny mode
checks the weights: ``trainer_weights_continuous`` says that every step trained by a restarted
trainer moved the weights less from the previous step's checkpoint than from the initial model
(false when none could be measured). ``trainer_weight_jumps`` lists both distances (max-abs over
all tensors) and the step's gradient norm per trainer kill at version >= 2, where the two are
told apart; one step of Adam moves a weight by at most about the learning rate (1e-3).

Phases:

1. chaos: ``Controller.run(steps)`` with the injector alongside, then single steps until the
   last fault is done (a fault waits for its role's restarted worker; at most ``steps`` more).
2. drain: no faults; one step at a time until every dataset position admitted by the end of
   phase 1 is trained (at most `DRAIN_MAX_STEPS` steps), then until every worker process is
   registered again.
3. resume (``resume_ok``): the controller's death and ``--resume``. The chaos controller is
   closed and a new `Controller` starts from the run state a controller dying at that point
   leaves behind: for ``tiny``, the newest complete checkpoint the run wrote (trainer weights and
   optimizer state, and the controller's ``run_state.json``) compiled as the launch CLI's
   ``--resume`` does (`flowrl.run.compile_recipe`); for ``sim`` (which writes no checkpoints),
   `Controller.run_state` taken after phase 2. It trains until every position that state had
   admitted is trained (at least two steps). ``resume_ok``: it completed, every such position is
   trained, no position was trained twice across the two controllers, and nothing was left
   behind.

Keys:

- ``kills``, ``kills_by_role``, ``stops``, ``stops_by_role``, ``stalls``, ``stops_unrecovered``
  (0); ``restarts`` (worker processes restarted), ``worker_deaths``, ``hangs_detected``
  (workers declared down for missed heartbeats or unread broadcasts).
- ``max_step_gap_s``: the longest time without a step commit during the chaos phase (between
  two commits, or from the last one to the phase's end). ``step_gap_bound_s``: what that gap
  is allowed: one step (``step_time_s``, the median time between commits of phases 1 and 2)
  plus, for each worker declared down in it (at least one; a fault up to a step before the
  gap counts), one recovery: the heartbeat timeout, a restart backoff (the longest one a
  process hit by the most faults waited) and a restarted process's start-up (from its start
  to its registration: the longest one measured in the run, ``restart_up_s``, which on loaded
  cores is seconds of Python and torch imports). ``step_gap_terms`` lists the terms,
  ``max_step_gap_downs`` what went down around the longest gap. ``step_gap_ok``: every gap of
  the chaos phase within its bound.
- ``rows_lost``: group_size × the dataset positions admitted by the end of the chaos phase
  (below its run state's ``admitted_to``) that are still untrained after the drain. Every
  admitted group is at all times trained, live in the index (queued, or in a task in flight) or
  waiting to be admitted again (dropped as stale); the drain trains all of those (re-admissions go
  first and admission runs at most ``max_staleness + 1`` steps ahead), so a position still
  untrained is one whose rows the controller lost.
- ``rows_trained_twice``: the larger of the controller's own count
  (`Controller.rows_trained_twice`) and this harness's: group_size × the positions trained more
  than once, where each committed step trains exactly ``groups_per_step`` groups and the run
  state's ``groups_trained`` counts distinct positions, so ``version × groups_per_step -
  groups_trained`` is the number of extra trainings (chaos and drain phases; the resume phase is
  in ``resume``).
- ``completed``: phases 1 and 2 reached their target versions, and every worker process was
  back, without a run error within their time limits.
- ``resume_ok`` and ``resume`` (its details).
- ``clean``: no process of the runs, no ``/dev/shm/flowrl-<run_id>*`` segment and no
  ``/tmp/flowrl-<run_id>`` directory left after each controller closed (``leftovers`` names them).
- ``wall_s`` (phases 1 and 2), ``steps`` (the chaos phase's), ``drain_steps``, ``version``,
  ``stale_dropped``, ``store_live_bytes`` (the node store's bytes in use at the end, pooled
  segments not counted: live segments and reserved grants; a killed writer's spare grant, about
  one weight version for a trainer, stays counted until a put would otherwise wait, when the
  store reclaims it), ``kill_log``
  (per kill: role, process, pid, version, the victim's tasks in flight, whether the trainer was
  mid-step), ``stop_log`` (the same per stop, and ``detected_s``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import itertools
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil

from bench.chaos_hangs import (
    HEARTBEAT_S,
    HEARTBEAT_TIMEOUT_S,
    end_processes,
    kill_stopped,
    record,
    start_stuck_subscribers,
    step_timing,
)
from flowrl.logs import configure
from flowrl.pipeline import PipelineSpec, PoolSpec, grpo_stages
from flowrl.resume import RunState

if TYPE_CHECKING:
    from flowrl.controller import Controller
    from flowrl.recipe import Recipe

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny_cpu.py"
ROLES = ("rollout", "reward", "reference", "train")
#: the drain's bound: admission runs at most max_staleness + 1 steps ahead of the trainer.
DRAIN_MAX_STEPS = 12
RESTART_BACKOFF_S = 0.1
#: restarts allowed beyond one per injected fault: on loaded cores a heartbeat may come later
#: than the timeout, and that worker is then treated as hung too.
SPARE_RESTARTS = 3
#: the default recipe, shrunk: a step is a fraction of a second; the KL term adds a reference.
TINY_OVERRIDES = (
    "model.tiny.pretrain_steps=0", "trainer.groups_per_step=4", "trainer.micro_batch_groups=2",
    "rollout.groups_per_task=2", "algorithm.group_size=4", "algorithm.kl_coef=0.01",
)
#: modelled costs of the simulated pipeline: about 0.15 s a step on two cores.
SIM_COST: dict[str, Any] = {
    "prompt_len": 8, "max_new_tokens": 64, "log_mean": 3.0, "log_sigma": 0.6,
    "rollout_base_s": 0.02, "rollout_token_s": 0.0005, "reward_token_s": 0.00005,
    "reference_token_s": 0.0001, "train_token_s": 0.0001, "train_step_s": 0.03,
    "weight_numel": 4096,
}


@dataclasses.dataclass(frozen=True)
class Fault:
    """One planned fault: due once the policy reaches ``due_version``, then ``offset`` × the
    duration of the last step later; a SIGKILL, or with ``hang`` a SIGSTOP."""

    due_version: int
    role: str
    offset: float
    hang: bool = False


def _draw(rng: random.Random, n: int, steps: int, roles: Sequence[str],
          hang: bool) -> list[Fault]:
    victims = [roles[i % len(roles)] for i in range(n)]
    rng.shuffle(victims)
    due = sorted(rng.randrange(max(1, steps - 1)) for _ in range(n))
    return [Fault(v, r, round(rng.random(), 3), hang)
            for v, r in zip(due, victims, strict=True)]


def fault_plan(
    kills: int, steps: int, *, seed: int, roles: Sequence[str] = ROLES, stops: int = 0,
) -> list[Fault]:
    """``kills`` kills and ``stops`` hangs spread over versions ``[0, steps - 2]``, roles in
    equal shares (the hangs' shares start at a random role: there are few of them)."""
    rng = random.Random(seed + 2)
    first = rng.randrange(len(roles))
    plan = [*_draw(random.Random(seed), kills, steps, roles, False),
            *_draw(rng, stops, steps, [*roles[first:], *roles[:first]], True)]
    return sorted(plan, key=lambda f: (f.due_version, f.hang))


#: the offset's unit before two steps were timed.
FIRST_STEP_S = 0.2


def _step_time(ctl: Controller) -> float:
    """Seconds a step takes: the shortest of the last three (a step stalled by a restart is
    longer), at most 2 s."""
    walls = [float(e["wall_s"]) for e in ctl.step_log[-4:]]
    times = [b - a for a, b in itertools.pairwise(walls) if b > a]
    return min(2.0, *times) if times else FIRST_STEP_S


def sim_spec(*, seed: int = 0, max_restarts: int = 20) -> PipelineSpec:
    """The simulated GRPO pipeline with a reference stage (see the module docstring)."""
    return PipelineSpec(
        stages=grpo_stages(group_size=4, train_micro_groups=2, reference=True),
        pools=(PoolSpec("rollout", count=2), PoolSpec("reward"), PoolSpec("reference"),
               PoolSpec("train")),
        group_size=4, groups_per_step=4, max_staleness=1, engine="sim",
        engine_config=SIM_COST, store_capacity_bytes=64 << 20, heartbeat_s=HEARTBEAT_S,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, max_restarts=max_restarts,
        restart_backoff_s=RESTART_BACKOFF_S, seed=seed,
    )


def tiny_recipe(
    *, steps: int, seed: int, output: Path, max_restarts: int, extra: Sequence[str] = (),
    recipe: Path = RECIPE,
) -> Recipe:
    """``recipe`` (the default one unless named) with `TINY_OVERRIDES`, checkpointing every step
    into ``output``."""
    from flowrl.recipe_file import load_recipe

    return load_recipe(recipe, [*TINY_OVERRIDES, f"steps={steps}", f"seed={seed}",
                                f"output={output}", "checkpoint_every=1",
                                f"placement.max_restarts={max_restarts}", *extra])


def chaos_timing(spec: PipelineSpec) -> PipelineSpec:
    """``spec`` with `RESTART_BACKOFF_S`, `HEARTBEAT_S` and `HEARTBEAT_TIMEOUT_S` (a recipe
    keeps the default backoff of 0.5 s and heartbeats every second, and allows no heartbeat
    timeout under 3 s)."""
    return dataclasses.replace(spec, restart_backoff_s=RESTART_BACKOFF_S,
                               heartbeat_s=HEARTBEAT_S, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)


# ---- accounting ----------------------------------------------------------------------------------


def untrained_below(state: RunState, end: int) -> int:
    """Dataset positions below ``end`` that ``state`` does not count as trained."""
    if end <= state.trained_below:
        return 0
    above = sum(1 for p in state.trained_above if p < end)
    return end - state.trained_below - above


def _of_run(run_id: str, cmdline: Sequence[str]) -> bool:
    """Whether a command line is one of ``run_id``'s processes: a node agent names the run, a
    worker process the spec file in the run's directory."""
    return any(run_id in arg for arg in cmdline)


def leftovers(run_id: str) -> list[str]:
    """Processes, shared-memory segments and the socket directory of ``run_id`` still there."""
    found = [f"/tmp/flowrl-{run_id}"] if Path(f"/tmp/flowrl-{run_id}").exists() else []
    with contextlib.suppress(FileNotFoundError):
        found += [f"/dev/shm/{n}" for n in os.listdir("/dev/shm")
                  if n.startswith(f"flowrl-{run_id}")]
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if _of_run(run_id, cmdline) and proc.pid != os.getpid():
            found.append(f"pid {proc.info['pid']}: {' '.join(cmdline)[:100]}")
    return found


async def _gone(run_id: str, timeout_s: float = 10.0) -> list[str]:
    """`leftovers` once the controller closed; a reaped child may take a moment to vanish from
    the process table, so processes are waited for (bounded), never polled."""
    procs = []
    for proc in psutil.process_iter(["cmdline"]):
        if _of_run(run_id, proc.info["cmdline"] or []) and proc.pid != os.getpid():
            procs.append(proc)
    if procs:
        await asyncio.to_thread(psutil.wait_procs, procs, timeout=timeout_s)
    return leftovers(run_id)


# ---- the injector --------------------------------------------------------------------------------


def _due(ctl: Controller, fault: Fault) -> Callable[[], bool]:
    return lambda: ctl.version >= fault.due_version and bool(ctl.worker_pids(fault.role))


def _dead(ctl: Controller, role: str, pid: int) -> Callable[[], bool]:
    return lambda: pid not in ctl.worker_pids(role)


async def injector(ctl: Controller, plan: Sequence[Fault], *, seed: int,
                   log: dict[str, list[dict[str, Any]]], stopped: list[int]) -> None:
    """Carry out ``plan`` on ``ctl``'s worker processes (see the module docstring): kills are
    logged in ``log["kill"]``, hangs in ``log["stop"]`` and their pids in ``stopped``."""
    rng = random.Random(seed + 1)
    for fault in plan:
        await ctl.wait_for(_due(ctl, fault))
        # The random moment inside the step: a bounded sleep of a share of the last step's time.
        await asyncio.sleep(fault.offset * _step_time(ctl))
        await ctl.wait_for(_due(ctl, fault))  # its process may have died meanwhile
        pid = rng.choice(ctl.worker_pids(fault.role))
        status = ctl.status()
        hosted = [w for w in status["workers"] if w["pid"] == pid]
        entry: dict[str, Any] = {
            "role": fault.role, "process": hosted[0]["name"].rsplit(".", 1)[0], "pid": pid,
            "version": ctl.version, "tasks": sum(w["in_flight"] for w in hosted),
            "trainer_mid_step": status["trainer"]["micro_batches_pending"] > 0}
        t0 = time.perf_counter()
        if fault.hang:
            stopped.append(pid)
            os.kill(pid, signal.SIGSTOP)  # never resumed: the controller must find and kill it
        else:
            ctl.kill_worker_process(pid)
        log["stop" if fault.hang else "kill"].append(entry)
        await ctl.wait_for(_dead(ctl, fault.role, pid))
        if fault.hang:
            entry["detected_s"] = round(time.perf_counter() - t0, 2)


async def chaos(
    spec: PipelineSpec, *, steps: int, plan: Sequence[Fault], seed: int, timeout_s: float,
    stalls: int = 0, on_open: Callable[[Controller], None] | None = None,
) -> dict[str, Any]:
    """Phases 1 and 2 on a new controller; the figures of the module docstring's keys, plus
    ``state`` (the final `RunState`) and ``run_id``."""
    from flowrl.controller import Controller, RunError

    unknown = {f.role for f in plan} - {p.role for p in spec.pools}
    if unknown:
        raise ValueError(f"the pipeline has no pool for {sorted(unknown)}")
    log: dict[str, list[dict[str, Any]]] = {"kill": [], "stop": []}
    stopped: list[int] = []
    events: list[dict[str, Any]] = []
    stuck: list[asyncio.subprocess.Process] = []
    out: dict[str, Any] = {"completed": False}
    ran = steps
    processes = sum(-(-p.count // p.per_process) for p in spec.pools)
    t0 = time.perf_counter()
    try:
        async with Controller(spec) as ctl:
            out["run_id"] = ctl.run_id
            if on_open is not None:
                on_open(ctl)
            recorder = asyncio.ensure_future(record(ctl, events))
            stuck = await start_stuck_subscribers(ctl, stalls)
            faults = asyncio.ensure_future(
                injector(ctl, plan, seed=seed, log=log, stopped=stopped))
            chaos_end_t = time.time()
            try:
                async with asyncio.timeout(timeout_s):
                    await ctl.run(steps)
                    # Until the last fault: a fault waits for its role's worker to be back.
                    while not faults.done() and ran < 2 * steps:
                        await ctl.run(1)
                        ran += 1
                chaos_end = ctl.run_state()
                chaos_end_t = time.time()
                faults.cancel()
                drain = 0
                async with asyncio.timeout(timeout_s):
                    while drain < DRAIN_MAX_STEPS and (
                            drain == 0
                            or untrained_below(ctl.run_state(), chaos_end.admitted_to)):
                        await ctl.run(1)
                        drain += 1
                    # A step may commit before the last victim's restart (another process
                    # of its role did the work): completion includes every process back.
                    await ctl.wait_for(lambda: len(ctl.worker_pids()) >= processes)
                out["completed"] = True
                out["drain_steps"] = drain
            except (RunError, TimeoutError) as exc:
                out["error"] = f"{type(exc).__name__}: {exc}"[:500]
                chaos_end = ctl.run_state()
                chaos_end_t = time.time()
            finally:
                faults.cancel()
                (failed,) = await asyncio.gather(faults, return_exceptions=True)
                if isinstance(failed, Exception):
                    out["killer_error"] = repr(failed)[:500]
                out["stops_unrecovered"] = kill_stopped(stopped)
                recorder.cancel()
                await asyncio.gather(recorder, return_exceptions=True)
            state = ctl.run_state()
            out["wall_s"] = round(time.perf_counter() - t0, 2)
            extra = ctl.version * spec.groups_per_step - state.groups_trained
            per_process = collections.Counter(f["process"] for f in log["kill"] + log["stop"])
            backoff = ctl.workforce.restart_delay(max(per_process.values(), default=1))
            out.update({
                "kills": len(log["kill"]),
                "kills_by_role": dict(collections.Counter(k["role"] for k in log["kill"])),
                "stops": len(log["stop"]),
                "stops_by_role": dict(collections.Counter(k["role"] for k in log["stop"])),
                "stalls": len(stuck),
                "restarts": ctl.restarts,
                "worker_deaths": ctl.worker_deaths,
                "rows_lost": spec.group_size * untrained_below(state, chaos_end.admitted_to),
                "rows_trained_twice": max(ctl.rows_trained_twice, spec.group_size * extra),
                "steps": ran,
                "version": ctl.version,
                "stale_dropped": ctl.stale_dropped,
                "store_live_bytes": (ctl.store_stats.get("used_bytes", 0)
                                     - ctl.store_stats.get("pooled_bytes", 0)),
                **step_timing(events, chaos_end_t, backoff),
                "kill_log": log["kill"],
                "stop_log": log["stop"],
                "state": state,
                "grad_norms": {int(e["step"]): e.get("train_grad_norm") for e in ctl.step_log},
            })
    finally:
        # After the controller closed: its stop broadcast went past them too.
        await end_processes(stuck)
    out["leftovers"] = await _gone(out["run_id"])
    return out


async def resume(spec: PipelineSpec, state: RunState, *, timeout_s: float) -> dict[str, Any]:
    """Phase 3: a new controller from ``state``, until every position it admitted is trained."""
    from flowrl.controller import Controller, RunError

    out: dict[str, Any] = {"from_version": state.version, "redo": len(state.redo()),
                           "completed": False}
    async with Controller(spec, resume=state) as ctl:
        run_id = out["run_id"] = ctl.run_id
        steps = 0
        try:
            async with asyncio.timeout(timeout_s):
                while steps < 2 or (steps < DRAIN_MAX_STEPS
                                    and untrained_below(ctl.run_state(), state.admitted_to)):
                    await ctl.run(1)
                    steps += 1
            out["completed"] = True
        except (RunError, TimeoutError) as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"[:500]
        final = ctl.run_state()
        new = (final.version - state.version) * spec.groups_per_step
        twice = max(ctl.rows_trained_twice, spec.group_size * (
            new - (final.groups_trained - state.groups_trained)))
        out.update({"steps": steps, "version": final.version,
                    "rows_lost": spec.group_size * untrained_below(final, state.admitted_to),
                    "rows_trained_twice": twice})
    out["leftovers"] = await _gone(run_id)
    out["ok"] = bool(out["completed"] and out["rows_lost"] == 0 and twice == 0
                     and not out["leftovers"])
    return out


# ---- trainer weights after a restart (tiny mode) ---------------------------------------------


def weight_jumps(
    output: Path, init: Path, versions: Sequence[int], grad_norms: dict[int, Any],
) -> list[dict[str, Any]]:
    """For each ``v``: max-abs distance of checkpoint ``step_{v+1}`` from ``step_v`` and from
    the initial model (a restarted trainer that lost the weights would be near the latter), and
    that step's gradient norm (0 when every group's rewards were equal: a restarted trainer's
    fresh Adam then leaves the weights as they were). ``skipped`` says why one was not measured.
    """
    from safetensors.torch import load_file

    def load(path: Path) -> dict[str, Any]:
        return dict(load_file(str(path / "model.safetensors")))

    w0 = load(init)
    out: list[dict[str, Any]] = []
    for v in sorted(set(versions)):
        prev, new = output / f"step_{v}", output / f"step_{v + 1}"
        missing = [p.name for p in (prev, new) if not (p / "model.safetensors").is_file()]
        if v < 2 or missing:
            why = "version < 2" if v < 2 else f"no checkpoint {missing}"
            out.append({"version": v, "skipped": why})
            continue
        wp, wn = load(prev), load(new)
        names = sorted(set(wn) & set(wp) & set(w0))
        d_prev = max(float((wn[n] - wp[n]).abs().max()) for n in names)
        d_init = max(float((wn[n] - w0[n]).abs().max()) for n in names)
        out.append({"version": v, "d_prev": d_prev, "d_init": d_init,
                    "grad_norm": grad_norms.get(v + 1)})
    return out


# ---- main ----------------------------------------------------------------------------------------


def _plan(args: argparse.Namespace) -> list[Fault]:
    return fault_plan(args.kills, args.steps, seed=args.seed, roles=args.roles, stops=args.stops)


def _max_restarts(args: argparse.Namespace) -> int:
    """Every fault could hit the same process."""
    return int(args.kills + args.stops) + SPARE_RESTARTS


async def run_sim(args: argparse.Namespace) -> dict[str, Any]:
    spec = sim_spec(seed=args.seed, max_restarts=_max_restarts(args))
    plan = _plan(args)
    out = await chaos(spec, steps=args.steps, plan=plan, seed=args.seed, timeout_s=args.timeout,
                      stalls=args.stalls)
    state: RunState = out.pop("state")
    out.pop("grad_norms")
    ok = out["completed"] and args.resume
    out["resume"] = await resume(spec, state, timeout_s=args.timeout) if ok else {}
    return out


async def run_tiny(args: argparse.Namespace) -> dict[str, Any]:
    from flowrl.resume import latest_checkpoint
    from flowrl.run import compile_recipe, prepare_model

    with tempfile.TemporaryDirectory(prefix="flowrl-chaos-") as tmp:
        output = Path(tmp) / "run"
        recipe = tiny_recipe(steps=args.steps, seed=args.seed, output=output,
                             max_restarts=_max_restarts(args), extra=args.overrides,
                             recipe=args.recipe)
        init = await asyncio.to_thread(prepare_model, recipe)
        assert init is not None
        spec = chaos_timing(await asyncio.to_thread(compile_recipe, recipe))
        out = await chaos(spec, steps=args.steps, plan=_plan(args), seed=args.seed,
                          timeout_s=args.timeout, stalls=args.stalls)
        out.pop("state")
        trainer_kills = [k["version"] for k in out["kill_log"] if k["role"] == "train"]
        jumps = await asyncio.to_thread(weight_jumps, output, init, trainer_kills,
                                        out.pop("grad_norms"))
        out["trainer_weight_jumps"] = jumps
        measured = [j for j in jumps if "d_prev" in j]
        out["trainer_weights_continuous"] = bool(measured) and all(
            j["d_prev"] < j["d_init"] for j in measured)
        if out["completed"] and args.resume:
            checkpoint, state = latest_checkpoint(output)
            resumed = chaos_timing(
                await asyncio.to_thread(compile_recipe, recipe, resume=(checkpoint, state)))
            out["resume"] = await resume(resumed, state, timeout_s=args.timeout)
        else:
            out["resume"] = {}
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    out = await (run_tiny(args) if args.engine == "tiny" else run_sim(args))
    resumed = out.get("resume") or {}
    leftovers_all = [*out["leftovers"], *resumed.get("leftovers", [])]
    head = {
        "kills": out["kills"], "stops": out["stops"], "stalls": out["stalls"],
        "restarts": out["restarts"], "rows_lost": out["rows_lost"],
        "rows_trained_twice": out["rows_trained_twice"], "completed": out["completed"],
        "max_step_gap_s": out["max_step_gap_s"], "step_gap_bound_s": out["step_gap_bound_s"],
        "step_gap_ok": out["step_gap_ok"],
        "resume_ok": bool(resumed.get("ok")), "clean": not leftovers_all,
        "engine": args.engine, "quick": args.quick, "seed": args.seed,
        "total_wall_s": round(time.perf_counter() - t0, 2),
    }
    return {**head, **{k: v for k, v in out.items() if k not in head}}


def _roles(text: str) -> tuple[str, ...]:
    roles = tuple(r for r in text.split(",") if r)
    if not roles or set(roles) - set(ROLES):
        raise argparse.ArgumentTypeError(f"expected roles among {ROLES}, got {text!r}")
    return roles


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="simulated pipeline, 8 kills, 2 stops and 1 stall over 24 steps "
                        "(under a minute)")
    p.add_argument("--engine", choices=("sim", "tiny"),
                   help="tiny: the real tiny model (default); sim: modelled compute "
                        "(the default with --quick)")
    p.add_argument("--kills", type=int, help="default 20 (8 with --quick)")
    p.add_argument("--stops", type=int,
                   help="SIGSTOPs of worker processes, never resumed (default 4, 2 with --quick)")
    p.add_argument("--stalls", type=int,
                   help="stuck broadcast subscribers for the whole run (default 1)")
    p.add_argument("--steps", type=int, help="chaos-phase steps (default 40, 24 with --quick)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--roles", type=_roles, default=ROLES, metavar="R[,R...]",
                   help=f"roles to kill and stop, in equal shares (default {','.join(ROLES)})")
    p.add_argument("--recipe", type=Path, default=RECIPE,
                   help="tiny: the recipe file (default recipes/tiny_cpu.py; e.g. "
                        "recipes/tool_cpu.py for multi-turn episodes with a tool)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="tiny: override a field of the recipe, as the launcher's --set")
    p.add_argument("--no-resume", dest="resume", action="store_false",
                   help="skip the resume phase (resume_ok is then false)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="bound on each phase, seconds")
    args = p.parse_args()
    args.engine = args.engine or ("sim" if args.quick else "tiny")
    args.kills = args.kills if args.kills is not None else (8 if args.quick else 20)
    args.stops = args.stops if args.stops is not None else (2 if args.quick else 4)
    args.stalls = args.stalls if args.stalls is not None else 1
    args.steps = args.steps or (24 if args.quick else 40)
    if min(args.kills, args.stops, args.stalls) < 0 or args.steps < 2:
        p.error("need --kills, --stops and --stalls >= 0 and --steps >= 2")
    configure(level="error")
    print(json.dumps(asyncio.run(main_async(args))))


if __name__ == "__main__":
    main()
