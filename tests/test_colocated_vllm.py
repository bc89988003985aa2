"""`workers.colocated_vllm.VLLMInPlace` without vLLM: what it asks of the engine in each phase.

vLLM's sleep mode needs CUDA (``bench/device_check.py`` runs it there) and the real engine
needs vLLM (``tests/vllm/test_vllm_colocated.py``); here an engine that records its calls
stands in, so the normal suite covers the order of sleep, wake-up and loads on both paths.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pytest
import torch
from torch import Tensor

from workers.colocated import Phases
from workers.colocated_vllm import SLEEP_LEVEL, VLLMInPlace, module_buckets

pytestmark = pytest.mark.timeout(30)


class _LLM:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def sleep(self, level: int) -> None:
        self.calls.append(f"sleep {level}")

    def wake_up(self) -> None:
        self.calls.append("wake_up")

    def reset_prefix_cache(self) -> None:
        self.calls.append("reset_prefix_cache")


class _Engine:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.llm = _LLM(self.calls)
        self.version = 0
        self.loaded: dict[str, Tensor] = {}

    def load_weight_stream(self, buckets: Iterable[Mapping[str, Tensor]], version: int) -> None:
        for bucket in buckets:
            self.loaded.update(bucket)
        self.version = version
        self.calls.append(f"load {version}")


class _Nothing:
    def release(self) -> int:
        return 0

    def restore(self) -> int:
        return 0


async def _turns(engine: _Engine, *, sleeps: bool) -> list[str]:
    model = torch.nn.Linear(2, 2)
    version = 0
    served = VLLMInPlace(engine, lambda: module_buckets(model), lambda: version, sleeps=sleeps)
    phases = Phases({"train": _Nothing(), "generate": served})
    async with phases.enter("generate"):  # the engine's own weights are version 0
        pass
    async with phases.enter("train"):  # no step
        pass
    async with phases.enter("generate"):
        pass
    async with phases.enter("train"):  # a step
        version = 1
    async with phases.enter("generate"):
        served.serve_in_place(1)
    # By reference: the module's own tensors (detached views of them).
    assert {n: t.data_ptr() for n, t in engine.loaded.items()} == {
        n: p.data_ptr() for n, p in model.named_parameters()}
    return engine.calls


async def test_with_sleep_mode_vllm_sleeps_through_train_and_reloads_after_each_wake_up() -> None:
    assert SLEEP_LEVEL == 2
    calls = await _turns(_Engine(), sleeps=True)
    # Level 2 discards the weights: every wake-up loads the trainer's, stepped or not.
    assert calls == ["sleep 2", "wake_up", "load 0", "sleep 2", "wake_up", "load 1"]


async def test_without_sleep_mode_only_a_new_version_is_loaded() -> None:
    calls = await _turns(_Engine(), sleeps=False)
    assert calls == ["reset_prefix_cache", "reset_prefix_cache", "load 1"]


def test_release_reports_no_bytes_without_a_device() -> None:
    engine: Any = _Engine()
    served = VLLMInPlace(engine, lambda: iter(()), lambda: 0, sleeps=True)
    assert served.release() == 0  # no CUDA here: nothing measured
    assert served.release() == 0  # asleep already: no second sleep
    assert engine.calls == ["sleep 2"]
