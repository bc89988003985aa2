"""Colocated placement on the vLLM engine: one process hosts a trainer and a
`workers.engines.vllm_rollout.VLLMRolloutEngine` taking turns in one `workers.colocated.Phases`.

vLLM keeps weights of its own layout (fused projections, kernel packing), so it cannot generate
with the trainer's module as the HF engine does. A new version is loaded from the module inside
the process instead: vLLM's in-place reload draws the trainer's tensors by reference from a lazy
stream of buckets (`module_buckets`: one bucket, the module's own parameters), with no store
round trip and no copy besides vLLM's own. A sharded trainer's source would be a generator over
`workers.resharding.export_bucketed`'s buckets, one gathered at a time (not built: colocated
placement runs one trainer).

`VLLMInPlace` is the generate phase's `PhaseMemory` and the engine the colocated rollout role
serves versions through:

- where vLLM has sleep mode (CUDA or ROCm, the engine built with ``enable_sleep_mode=True``:
  `colocated_llm_kwargs`), release puts vLLM to sleep at level 2: its weights and KV cache are
  discarded, not kept. Level 1 would copy the weights to host memory and back at wake-up, but
  every wake-up here is followed by a load of the trainer's tensors (which the train phase may
  just have stepped), so that host copy would only cost host memory and two transfers per
  phase. Restore wakes vLLM up and loads the trainer's weights at the trainer's version. Both
  report the device memory given up or taken back (free memory before and after).
- elsewhere (vLLM on the CPU has no sleep mode) release resets vLLM's prefix cache (its KV cache
  is one fixed allocation that stays) and reports 0 bytes; restore loads the trainer's weights
  when the trainer's version moved on, else nothing.

Loading in restore puts the load in the switch: off the event loop, counted in the switch's
time, and logged in a line of its own (``vllm weights loaded from the trainer``).

Verified on the CPU build (``tests/vllm/test_vllm_colocated.py``); sleep and wake-up need CUDA
and are checked by ``bench/device_check.py`` there.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

import structlog
import torch
from torch import Tensor

__all__ = ["GPU_SHARE", "SLEEP_LEVEL", "VLLMInPlace", "colocated_llm_kwargs", "module_buckets"]

log = structlog.get_logger("flowrl.worker")

#: vLLM's sleep level between generate phases (see the module docstring).
SLEEP_LEVEL = 2
#: the share of the device's memory vLLM takes while awake (its ``gpu_memory_utilization``):
#: the trainer's weights, and its optimizer state and gradients once the trainer takes them
#: back, need the rest. vLLM asks for it at start, when the trainer holds only its weights.
GPU_SHARE = 0.5


def colocated_llm_kwargs() -> dict[str, Any]:
    """``vllm.LLM`` settings of a colocated engine: sleep mode where vLLM's platform has it."""
    platform = importlib.import_module("vllm.platforms").current_platform
    if platform.is_cpu() or not platform.is_sleep_mode_available():
        return {}
    return {"enable_sleep_mode": True, "gpu_memory_utilization": GPU_SHARE}


def module_buckets(model: torch.nn.Module) -> Iterator[dict[str, Tensor]]:
    """A module's weights as one bucket of its own tensors (detached views: no copy; a tied
    weight once). A generator: nothing is gathered before vLLM draws it."""
    yield {name: p.detach() for name, p in model.named_parameters()}


class _VLLMLike(Protocol):
    @property
    def version(self) -> int: ...

    @property
    def llm(self) -> Any: ...

    def load_weight_stream(self, buckets: Iterable[Mapping[str, Tensor]],
                           version: int) -> None: ...


def _free_device_bytes() -> int:
    if not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


class VLLMInPlace:
    """A colocated vLLM engine's phases and versions (see the module docstring).

    ``weights`` gives the trainer's tensors as a fresh stream of buckets on each call;
    ``version`` the version they hold. ``sleeps``: whether the engine has sleep mode
    (default: it was built with ``enable_sleep_mode``)."""

    def __init__(self, engine: _VLLMLike, weights: Callable[[], Iterable[Mapping[str, Tensor]]],
                 version: Callable[[], int], *, sleeps: bool | None = None) -> None:
        self.engine = engine
        self.weights = weights
        self.version = version
        if sleeps is None:
            sleeps = bool(engine.llm.llm_engine.vllm_config.model_config.enable_sleep_mode)
        self.sleeps = sleeps
        self.asleep = False
        #: vLLM's weights are gone (a level-2 sleep): the next restore loads them whatever
        #: the version
        self._stale = False
        #: for inspection: the last load's version and time (ms), the last release's bytes
        self.last_load: tuple[int, float] | None = None
        self.last_release = 0

    def release(self) -> int:
        if not self.sleeps:
            # No sleep mode (vLLM on the CPU): its KV cache is one fixed allocation that stays;
            # only the cached prefixes go.
            self.engine.llm.reset_prefix_cache()
            return 0
        if self.asleep:
            return 0
        before = _free_device_bytes()
        self.engine.llm.sleep(level=SLEEP_LEVEL)
        self.asleep = True
        self._stale = SLEEP_LEVEL >= 2
        self.last_release = max(0, _free_device_bytes() - before)
        return self.last_release

    def restore(self) -> int:
        before = _free_device_bytes()
        if self.asleep:
            self.engine.llm.wake_up()
            self.asleep = False
        self._load(self.version())
        return max(0, before - _free_device_bytes())

    def serve_in_place(self, version: int) -> None:
        """Serve ``version``: restore loaded it already, unless the trainer's version moved
        on since (not while the phases keep training out)."""
        self._load(version)

    def _load(self, version: int) -> None:
        if not self._stale and version == self.engine.version:
            return
        start = time.perf_counter()
        self.engine.load_weight_stream(self.weights(), version)
        self._stale = False
        ms = (time.perf_counter() - start) * 1e3
        self.last_load = (version, ms)
        log.info("vllm weights loaded from the trainer", version=version, load_ms=round(ms, 3))
