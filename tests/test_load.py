"""Load: the index's memory per row and its release, registry churn, a store at capacity.

Figures come from `bench/load.py` (the same functions, smaller sizes); the bounds are measured
values with a wide margin (bench/README.md has the figures).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench_load() -> Any:
    # bench/ is not an installed package: load the benchmark module from its file.
    spec = importlib.util.spec_from_file_location("flowrl_bench_load", ROOT / "bench" / "load.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_load = _bench_load()
index_memory = _load.index_memory
registry_churn = _load.registry_churn
store_at_capacity = _load.store_at_capacity

# Measured on CPython 3.11: ~330 B/row of index structures (row object, its handle list, the
# row table's entry and key, the group) and ~1.4 KB/row with msgpack-decoded store handles.
MAX_BYTES_PER_ROW = 500
MAX_BYTES_PER_ROW_WIRE = 2000


@pytest.mark.timeout(150)
def test_index_memory_per_row_is_bounded_and_released() -> None:
    rows = 100_000
    mem = index_memory(rows)
    assert mem["rows"] == rows
    assert mem["bytes_per_row"] < MAX_BYTES_PER_ROW
    # Every row retired: what is left is the emptied tables, not the rows (under 2% of peak).
    assert mem["retained_bytes"] < 0.02 * mem["bytes_per_row"] * rows


@pytest.mark.timeout(150)
def test_index_memory_with_wire_handles() -> None:
    mem = index_memory(20_000, wire=True)
    assert mem["bytes_per_row"] < MAX_BYTES_PER_ROW_WIRE
    assert mem["retained_bytes"] < 0.02 * mem["bytes_per_row"] * mem["rows"]


@pytest.mark.timeout(150)
def test_registry_churn_leaves_nothing_behind() -> None:
    churn = registry_churn(workers=256, rounds=12)
    assert churn["max_size"] == 256
    assert churn["final_size"] == 0
    # After the warm-up round the traced memory is flat: no per-worker residue.
    after = churn["bytes_after_round"]
    assert max(after[1:]) - min(after[1:]) < 4096, after


# A store of 32 KiB holds about two steps of the store spec's data (a group's rollout is one
# 4 KiB segment, a weight version another); 16 KiB cannot hold one step (four groups and the
# weights: five segments).
SMALL_STORE = 32 << 10
TOO_SMALL_STORE = 16 << 10


@pytest.mark.timeout(60)
async def test_a_small_store_pauses_admission_and_completes() -> None:
    out = await store_at_capacity(SMALL_STORE, steps=4, timeout_s=15.0)
    assert out["completed"], out["error"]
    assert out["version"] == 4
    assert out["rows_trained_twice"] == 0
    assert out["errors"] == 0
    # Admission waited for the store (later steps' groups), and the store never overflowed.
    assert out["admission_paused_for_store"]
    assert out["pauses"] >= 1
    assert 0 < out["peak_used_bytes"] <= SMALL_STORE


@pytest.mark.timeout(90)
async def test_a_store_too_small_for_a_step_stops_the_run_with_its_capacity() -> None:
    out = await store_at_capacity(TOO_SMALL_STORE, steps=2, timeout_s=40.0)
    assert not out["completed"]
    error = out["error"]
    assert error is not None
    assert not error.startswith("timed out"), error
    assert f"{TOO_SMALL_STORE}-byte capacity" in error
    assert "put(s) have waited" in error
    assert "placement.store_capacity_mb" in error
    # Stopped by the stall check (6 s without progress, looked at every 1 s), not the timeout.
    assert out["wall_s"] < 20.0
    assert out["version"] == 0
