"""What the vLLM tests share: one in-process engine (vLLM allows one per process) on a tiny
Qwen2 model, the trainer on the same weights, and other weights of the same shapes.

Its fixtures import vLLM only when a test asks for the engine; the test modules skip themselves
where vLLM is not installed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from flowrl.tiny_model import build_tiny_model
from workers.devices import set_threads

if TYPE_CHECKING:
    from workers.engines import TorchTrainerEngine
    from workers.engines.vllm_rollout import VLLMRolloutEngine

#: the engine's version while no test has loaded other weights
VERSION = 3


@pytest.fixture(scope="session", autouse=True)
def _vllm_process() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    set_threads(2)  # before the engine starts: vLLM freezes the thread count afterwards


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("vllm") / "tiny")


@pytest.fixture(scope="session")
def other_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture and shapes, other weights."""
    return build_tiny_model(tmp_path_factory.mktemp("vllm") / "tiny-other", seed=1)


@pytest.fixture(scope="session")
def engine(model_dir: Path) -> VLLMRolloutEngine:
    from workers.engines.vllm_rollout import VLLMRolloutEngine

    return VLLMRolloutEngine(model_dir, seed=0, version=VERSION)


@pytest.fixture(scope="session")
def trainer(model_dir: Path) -> TorchTrainerEngine:
    from workers.engines import TorchTrainerEngine

    return TorchTrainerEngine(model_dir, device="cpu")


@pytest.fixture(scope="session")
def weights(trainer: TorchTrainerEngine) -> dict[str, torch.Tensor]:
    return trainer.export_weights()


@pytest.fixture(scope="session")
def other_weights(other_dir: Path) -> dict[str, torch.Tensor]:
    from workers.engines import TorchTrainerEngine

    return TorchTrainerEngine(other_dir, device="cpu").export_weights()


@pytest.fixture
def restore(engine: VLLMRolloutEngine, weights: dict[str, torch.Tensor]) -> Iterator[None]:
    """Put the original weights and version back after a test that changes them."""
    yield
    engine.load_weights(weights, VERSION)
