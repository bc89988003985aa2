"""Colocated placement: one process hosts a trainer (or one data-parallel rank) and the rollout
engine that generates with the trainer's weights.

The two workers of such a process (`workers.main`) share one `Phases`: a generate task and a
train task (or a weight load) never run at once, and a switch from one phase to the other first
has the engine leaving release what it can and the engine entering take it back:

- the trainer (`TrainerMemory`) moves its optimizer state and gradients to host memory (pinned)
  and back; on a CPU, where host and device memory are the same, there is nothing to move;
- the rollout engine (`RolloutMemory`) holds no KV cache between calls (the HF engine's cache
  lives inside one ``generate``): it hands the accelerator's cached blocks back.

Each switch is logged (``phase``: time, bytes moved, the process's resident memory), and the
trainer's step line carries the figures (``phase_*`` metrics).

A new policy version costs the rollout engine nothing: the trainer's module already holds it
(`HFRolloutEngine.serve_in_place`). The engine reports the version of the weights it generated
with, which is the trainer's version: the phases keep training out while it generates.
On vLLM, which keeps weights of its own layout, `workers.colocated_vllm` loads each version
from the trainer's tensors and puts vLLM to sleep between its phases.

Data-parallel ranks (``trainer.ranks = N > 1``): N such processes, process i hosting trainer
rank i and rollout engine i. Replicated ranks hold whole weights, served in place as above.
FSDP2 ranks hold shards, so each engine keeps a whole module of its own, and at every step's end
every rank gathers the new weights bucket by bucket (`workers.resharding.export_bucketed`, a
collective) and copies each bucket into its engine's parameters in place
(`workers.resharding.copy_into`): one bucket beyond the engine at a time, never a second
gathered model; the step's metrics carry ``engine_sync_s`` and ``engine_sync_buckets``.

Why no rank waits in a collective for ever: a trainer that waits in a collective holds its
process's ``train`` phase, so its own engine cannot generate until the collective ends. A
collective therefore must only wait on peer trainers whose tasks the controller has already
sent, never on generation that is still to come.

- Every collective runs in a step-end task: replicated ranks all-reduce only there, and sharded
  ranks (whose every forward and backward gathers and scatters) keep each earlier micro-batch
  of the step and train them all in the step end's train phase (``ColocatedTrainer.defers``),
  then run the empty passes that pair them up (`workers.roles.dp_trainer`). The export, its
  gathers into the engine and any checkpoint gather are part of the step end too.
- The controller sends the step ends of all N ranks at once, and only when the whole step's
  groups have been generated (`flowrl.dp`, closing round). So when rank i enters its step end,
  every peer has its step end too; a peer still in its generate phase finishes the generate
  tasks ahead of it (`Phases` is a FIFO lock; generation needs nothing from another process)
  and then enters the train phase and the collective. Nothing in a step end waits for a
  generate task, so the wait ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import structlog
import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from flowrl import messages as m
from workers.runtime import RoleOutput

__all__ = [
    "ColocatedRollout",
    "ColocatedTrainer",
    "Phase",
    "PhaseMemory",
    "PhaseSpan",
    "Phases",
    "RolloutMemory",
    "TrainerMemory",
    "rss_bytes",
]

log = structlog.get_logger("flowrl.worker")

Phase = Literal["generate", "train"]

_MB = float(1 << 20)
#: phase spans kept for inspection (`Phases.history`)
_HISTORY = 512


def rss_bytes() -> int:
    """This process's resident memory now (Linux ``/proc``; 0 where unreadable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class PhaseMemory(Protocol):
    """What an engine gives up while the other phase runs; each returns the bytes moved."""

    def release(self) -> int: ...

    def restore(self) -> int: ...


def _empty_cache(device: torch.device) -> None:
    """Hand an accelerator's cached, unused blocks back to it."""
    backend = getattr(torch, device.type, None)
    empty = getattr(backend, "empty_cache", None)
    if device.type != "cpu" and callable(empty):
        empty()


def _synchronize(device: torch.device) -> None:
    backend = getattr(torch, device.type, None)
    sync = getattr(backend, "synchronize", None)
    if device.type != "cpu" and callable(sync):
        sync()


class _TrainerEngineLike(Protocol):
    @property
    def device(self) -> torch.device: ...

    @property
    def model(self) -> Any: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...


class TrainerMemory:
    """A trainer's optimizer state and gradients, moved to host memory between its phases.

    ``offloads`` defaults to whether the trainer's device is an accelerator (on a CPU there is
    no other memory to move them to). Host copies are pinned where an accelerator exists, so
    the way back is a DMA."""

    def __init__(self, engine: _TrainerEngineLike, *, offloads: bool | None = None) -> None:
        self.engine = engine
        self.device = engine.device
        self.params = dict(engine.model.named_parameters())
        self.offloads = self.device.type != "cpu" if offloads is None else offloads
        self._pin = self.device.type != "cpu" and torch.cuda.is_available()
        self._grads: dict[str, Tensor] = {}
        self._released = False

    def _to_host(self, t: Tensor) -> Tensor:
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self._pin)
        out.copy_(t, non_blocking=self._pin)
        return out

    def release(self) -> int:
        if not self.offloads or self._released:
            return 0
        moved = 0
        for state in self.engine.optimizer.state.values():
            for key, value in state.items():
                if _movable(value):
                    state[key] = self._to_host(value)
                    moved += value.numel() * value.element_size()
        for name, p in self.params.items():
            if _movable(p.grad):  # a step part-way: its accumulated gradients
                assert p.grad is not None
                self._grads[name] = self._to_host(p.grad)
                moved += p.grad.numel() * p.grad.element_size()
                p.grad = None
        _synchronize(self.device)  # the copies are done before the device memory goes
        _empty_cache(self.device)
        self._released = True
        return moved

    def restore(self) -> int:
        if not self._released:
            return 0
        moved = 0
        for param, state in self.engine.optimizer.state.items():
            assert isinstance(param, Tensor)
            for key, value in state.items():
                if _movable(value):
                    state[key] = value.to(param.device, non_blocking=self._pin)
                    moved += value.numel() * value.element_size()
        for name, grad in self._grads.items():
            p = self.params[name]
            p.grad = grad.to(p.device, non_blocking=self._pin)
            moved += grad.numel() * grad.element_size()
        self._grads.clear()
        _synchronize(self.device)
        self._released = False
        return moved


def _movable(value: Any) -> bool:
    """Whether `TrainerMemory` moves ``value``: a plain tensor with elements. The shards of an
    FSDP2 rank (DTensors) stay where they are: their local part would have to be moved and
    wrapped again, which is not done yet."""
    return isinstance(value, Tensor) and not isinstance(value, DTensor) and value.dim() > 0


class RolloutMemory:
    """The HF rollout engine keeps no KV cache between calls (it lives inside one
    ``generate``): what it leaves is the accelerator's cache of freed blocks, handed back."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def release(self) -> int:
        cuda = self.device.type == "cuda"
        before = torch.cuda.memory_reserved(self.device) if cuda else 0
        _empty_cache(self.device)
        return before - torch.cuda.memory_reserved(self.device) if cuda else 0

    def restore(self) -> int:
        return 0


@dataclass(frozen=True, slots=True)
class PhaseSpan:
    """One stretch of one phase: when it ran (``perf_counter``) and the RSS at its end."""

    phase: Phase
    start: float
    end: float
    rss_bytes: int


class Phases:
    """Generate and train in one process take turns; see the module docstring."""

    def __init__(self, memory: Mapping[Phase, PhaseMemory]) -> None:
        self.memory = dict(memory)
        self.current: Phase | None = None
        self.history: deque[PhaseSpan] = deque(maxlen=_HISTORY)
        self.switches = 0
        #: per phase: the highest RSS at the end of one of its stretches, since `take_metrics`
        self._peak: dict[Phase, int] = {}
        self._switch_s = 0.0
        self._moved = 0
        self._lock = asyncio.Lock()
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def enter(self, phase: Phase) -> AsyncIterator[None]:
        """Hold ``phase`` for the block: waits for the other phase to end, then switches."""
        async with self._lock:
            if self.current != phase:
                await asyncio.to_thread(self._switch, phase)
            start = time.perf_counter()
            try:
                yield
            finally:
                rss = rss_bytes()
                self.history.append(PhaseSpan(phase, start, time.perf_counter(), rss))
                self._peak[phase] = max(self._peak.get(phase, 0), rss)

    def _switch(self, phase: Phase) -> None:
        t0 = time.perf_counter()
        leaving = self.current
        released = self.memory[leaving].release() if leaving is not None else 0
        restored = self.memory[phase].restore()
        self.current = phase
        seconds = time.perf_counter() - t0
        self.switches += 1
        self._switch_s += seconds
        self._moved += released + restored
        log.info("phase", phase=phase, previous=leaving, switch_ms=round(seconds * 1e3, 3),
                 released_mb=round(released / _MB, 3), restored_mb=round(restored / _MB, 3),
                 rss_mb=round(rss_bytes() / _MB, 1))

    def take_metrics(self) -> dict[str, float]:
        """Figures since the last call (a trainer step's): each phase's peak RSS, switches,
        their total time and the bytes they moved."""
        out = {f"phase_rss_mb_{p}": v / _MB for p, v in self._peak.items()}
        out.update(phase_switches=float(self.switches), phase_switch_ms=self._switch_s * 1e3,
                   phase_moved_mb=self._moved / _MB)
        self._peak.clear()
        self.switches, self._switch_s, self._moved = 0, 0.0, 0
        return out

    async def changed(self) -> None:
        """Wake `wait_until` callers (a version changed)."""
        async with self._changed:
            self._changed.notify_all()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        async with self._changed:
            await self._changed.wait_for(predicate)


class _TrainerLike(Protocol):
    version: int
    exports_weights: bool

    async def run(self, task: m.TaskMsg, inputs: dict[str, list[Any]]) -> RoleOutput: ...

    async def load_version(self, version: int, weights: dict[str, Tensor]) -> None: ...


class ColocatedTrainer:
    """A trainer role that trains in the ``train`` phase. A step's end announces the new
    version with the weights (``keep_weight_copy``: the copy a restarted process joins from)
    or with none: the colocated rollout engine serves them in place.

    ``announces``: whether this trainer's step end is the one that announces the version (a
    data-parallel group's rank 0; the other ranks report none). ``defers``: keep each
    micro-batch that does not end its step and train them all in the step end's train phase
    (sharded ranks, see the module docstring). ``engine_load``: called in the train phase after
    joining at a version with its weights (a restarted process), when the rollout engine holds
    weights of its own to load them into."""

    def __init__(self, role: _TrainerLike, phases: Phases, *, keep_weight_copy: bool,
                 announces: bool = True, defers: bool = False,
                 engine_load: Callable[[int, dict[str, Tensor]], None] | None = None) -> None:
        self.role = role
        self.phases = phases
        self.keep_weight_copy = keep_weight_copy
        self.announces = announces
        self.defers = defers
        self.engine_load = engine_load
        role.exports_weights = keep_weight_copy
        #: the current step's micro-batches not trained yet (``defers``)
        self._deferred: list[tuple[m.TaskMsg, dict[str, list[Any]]]] = []

    @property
    def version(self) -> int:
        return self.role.version

    async def run(self, task: m.TaskMsg, inputs: dict[str, list[Any]]) -> RoleOutput:
        params = task["params"]
        if self.defers:
            # A redone step (another attempt) or another step: what was kept is not its own.
            key = (params.get("step"), params.get("attempt", 0))
            self._deferred = [(t, i) for t, i in self._deferred
                              if (t["params"].get("step"), t["params"].get("attempt", 0)) == key]
            if not params.get("step_end", False):
                self._deferred.append((task, _owned(inputs)))
                return RoleOutput(fields={}, metrics={"deferred": 1.0})
        try:
            async with self.phases.enter("train"):
                for kept, kept_inputs in self._deferred:
                    await self.role.run(kept, kept_inputs)
                out = await self.role.run(task, inputs)
        finally:
            if params.get("step_end", False):
                self._deferred = []
        if out.version is not None:  # a step's end
            if out.weights is None and self.announces:
                out.weights = {}
            out.metrics.update(self.phases.take_metrics())
            await self.phases.changed()
        return out

    async def load_version(self, version: int, weights: dict[str, Tensor]) -> None:
        if version <= self.role.version:
            return  # its own step coming back through the broadcast: no phase to take
        if not weights:
            raise RuntimeError(
                f"this colocated process joins the run at policy version {version}, but no "
                f"copy of those weights exists (placement.keep_weight_copy = false); it "
                f"holds version {self.role.version}")
        async with self.phases.enter("train"):
            await self.role.load_version(version, weights)
            if self.engine_load is not None:
                await asyncio.to_thread(self.engine_load, version, weights)
        await self.phases.changed()


def _owned(inputs: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """``inputs`` with tensors of their own: a deferred micro-batch outlives its task, and
    what it read may be views of the store's memory."""
    return {k: [v.clone() if isinstance(v, Tensor) else v for v in values]
            for k, values in inputs.items()}


class _RolloutLike(Protocol):
    async def run(self, task: m.TaskMsg, inputs: dict[str, list[Any]]) -> RoleOutput: ...


class _InPlaceEngine(Protocol):
    def serve_in_place(self, version: int) -> None: ...


class ColocatedRollout:
    """A rollout role over the trainer's module: it generates in the ``generate`` phase, and
    a new version is served once the trainer holds it (nothing is fetched or loaded)."""

    def __init__(self, role: _RolloutLike, engine: _InPlaceEngine, trainer: ColocatedTrainer,
                 phases: Phases) -> None:
        self.role = role
        self.engine = engine
        self.trainer = trainer
        self.phases = phases

    async def run(self, task: m.TaskMsg, inputs: dict[str, list[Any]]) -> RoleOutput:
        async with self.phases.enter("generate"):
            self.engine.serve_in_place(self.trainer.version)
            return await self.role.run(task, inputs)

    async def load_version(self, version: int, weights: dict[str, Tensor]) -> None:
        # The trainer's step end (or its load, for a restarted process) made the version:
        # serving it waits for nothing else. The store's copy, if any, is not read.
        await self.phases.wait_until(lambda: self.trainer.version >= version)

    async def aclose(self) -> None:
        close = getattr(self.role, "aclose", None)
        if close is not None:
            await close()
