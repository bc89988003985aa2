"""A node agent never loads torch: it moves no tensor of its own (`transport.lazy_torch`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowrl.controller import Controller
from tests.test_controller_sim import spec
from transport.codec import DTYPES as WIRE_DTYPES
from transport.handles import DTYPES, ITEMSIZE, dtype_name


def test_the_wire_dtypes_are_torchs_with_their_sizes() -> None:
    assert set(DTYPES) == set(ITEMSIZE) == set(WIRE_DTYPES)
    for name in ITEMSIZE:
        assert DTYPES[name] is getattr(torch, name)
        assert ITEMSIZE[name] == torch.empty((), dtype=DTYPES[name]).element_size()
        assert dtype_name(DTYPES[name]) == name
    with pytest.raises(TypeError, match="unsupported dtype"):
        dtype_name(torch.complex64)
    with pytest.raises(KeyError):
        DTYPES["complex64"]


@pytest.mark.timeout(90)
async def test_a_runs_node_agent_has_no_torch_mapped() -> None:
    """Checked in the agent's memory map mid-run, after it served a store through steps: what
    it imported at start and whatever it ran since."""
    async with Controller(spec(1)) as ctl:
        await ctl.run(steps=2, timeout_s=60)
        agents = [c for c in ctl.workforce.supervisor.children if c.name.startswith("node:")]
        workers = [c for c in ctl.workforce.supervisor.children if c not in agents]
        assert len(agents) == 1
        assert workers
        agent_maps, worker_maps = (mapped(c.pid) for c in (agents[0], workers[0]))
    # The check itself: a worker (which trains with torch) does have it mapped.
    assert "libtorch" in worker_maps
    assert "libtorch" not in agent_maps


def mapped(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()
