"""Compute device selection and CPU thread budgets for worker processes.

`pick_device` prefers an accelerator: CUDA, then an Ascend NPU (``torch_npu`` is imported only
when it is installed, since importing it registers the ``npu`` backend with torch), else CPU.
`set_threads` gives a compute process its explicit torch thread count from the placement, so
that processes sharing a small machine overlap instead of fighting over cores.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

__all__ = ["npu_available", "pick_device", "set_threads"]


def npu_available() -> bool:
    """True when ``torch_npu`` is installed and sees at least one NPU."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    importlib.import_module("torch_npu")
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def pick_device(prefer: str | torch.device | None = None) -> torch.device:
    """The device to compute on: ``prefer`` when given, else cuda, npu or cpu in that order.

    An explicit ``prefer`` is returned as is (``torch.device`` validates its spelling); asking
    for an accelerator that is absent fails at first use, not here.
    """
    if prefer is not None:
        if str(prefer).startswith("npu"):
            npu_available()  # registers the npu backend with torch when torch_npu is installed
        return torch.device(prefer)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if npu_available():
        return torch.device("npu")
    return torch.device("cpu")


def set_threads(n: int) -> None:
    """Limit torch's intra-op CPU threads for this process to ``n`` (n >= 1)."""
    if n < 1:
        raise ValueError(f"thread count must be >= 1, got {n}")
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
