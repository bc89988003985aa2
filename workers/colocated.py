"""Colocated placement: one process hosts a trainer and the rollout engine that generates with
the trainer's own module.

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
                if isinstance(value, Tensor) and value.dim() > 0:
                    state[key] = self._to_host(value)
                    moved += value.numel() * value.element_size()
        for name, p in self.params.items():
            if p.grad is not None:  # a step part-way: its accumulated gradients
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
                if isinstance(value, Tensor) and value.dim() > 0:
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
    or with none: the colocated rollout engine serves them in place."""

    def __init__(self, role: _TrainerLike, phases: Phases, *, keep_weight_copy: bool) -> None:
        self.role = role
        self.phases = phases
        self.keep_weight_copy = keep_weight_copy
        role.exports_weights = keep_weight_copy

    @property
    def version(self) -> int:
        return self.role.version

    async def run(self, task: m.TaskMsg, inputs: dict[str, list[Any]]) -> RoleOutput:
        async with self.phases.enter("train"):
            out = await self.role.run(task, inputs)
        if out.version is not None:  # a step's end
            if out.weights is None:
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
        await self.phases.changed()


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
