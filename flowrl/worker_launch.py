"""Starting a worker process: the one place its spec and command line are made.

The controller starts its own node's workers and node agents start theirs (`flowrl.node`), both
through `worker_command`: the process's `WorkerSpec` is written to a file in the node's run
directory (0700; the file 0600, so engine settings never show in ``ps``), and the command names
that file. `read_spec` is the worker's side: it validates the file and removes it.

`process_spec` is what the controller decides for worker process ``proc_no`` of a pool, the
same wherever it runs (a node agent adds only its node's `Endpoints`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from flowrl.pipeline import PipelineSpec
from flowrl.worker_spec import ProcessSpec, WorkerSpec
from transport.endpoints import run_dir

__all__ = ["engine_config_of_group", "process_spec", "read_spec", "spec_file", "worker_command"]


def spec_file(run_id: str, name: str) -> Path:
    """Where worker process ``name`` of run ``run_id`` finds its spec on this node."""
    return run_dir(run_id) / f"{name}.spec.json"


def worker_command(spec: WorkerSpec) -> list[str]:
    """Write ``spec`` to its file (replacing a restarted process's) and return the command
    that starts the worker process reading it."""
    path = spec_file(spec.endpoints.run_id, spec.process.name)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(spec.model_dump_json())
    os.replace(tmp, path)  # a starting process never reads half a file
    return [sys.executable, "-m", "workers.main", "--spec", str(path)]


def read_spec(path: Path) -> WorkerSpec:
    """The spec `worker_command` wrote, validated; the file is removed once read."""
    try:
        text = path.read_text()
    finally:
        path.unlink(missing_ok=True)
    return WorkerSpec.model_validate_json(text)


def process_spec(pipeline: PipelineSpec, *, role: str, proc_no: int, count: int,
                 capacity: int, threads: int, engine_config: dict[str, Any],
                 start_token: str) -> ProcessSpec:
    """Worker process ``proc_no`` of ``role``'s pool, configured with ``engine_config`` (the
    pipeline's, or `engine_config_of_group`'s for data-parallel trainer ranks); it reports a
    failed start with ``start_token``."""
    sim = pipeline.engine == "sim"
    # Validated as it arrives from elsewhere: the pipeline's engine name is free text.
    return ProcessSpec.model_validate({
        "name": f"{role}.{proc_no}", "role": role, "count": count, "capacity": capacity,
        "threads": threads, "seed": pipeline.seed * 1000 + proc_no,
        "heartbeat_s": pipeline.heartbeat_s,
        "weight_sync_timeout_s": pipeline.weight_sync_timeout_s, "engine": pipeline.engine,
        "sim": engine_config if sim else None, "config": None if sim else engine_config,
        "colocated": _colocated(pipeline) if role == "train" else None,
        "start_token": start_token})


def _colocated(pipeline: PipelineSpec) -> dict[str, Any] | None:
    """The rollout worker a train process hosts under colocated placement, or None."""
    rollout = pipeline.pool("rollout")
    if not pipeline.colocated or rollout is None:
        return None
    return {"role": "rollout", "capacity": rollout.capacity,
            "keep_weight_copy": pipeline.keep_weight_copy}


def engine_config_of_group(config: dict[str, Any], *, generation: int,
                           store: str | None) -> dict[str, Any]:
    """``config`` for the data-parallel trainer ranks of a group started ``generation`` times
    before (its ranks meet in a fresh rendezvous), meeting in ``store`` when on several nodes;
    ``config`` itself when it has no ranks or nothing changes."""
    section = config.get("data_parallel")
    extra: dict[str, Any] = {}
    if generation:
        extra["generation"] = generation
    if store is not None:
        extra["store"] = store
    if not extra or not section:
        return config
    return {**config, "data_parallel": {**section, **extra}}
