"""The train role of one rank of a data-parallel group (``trainer.ranks > 1``).

Each rank is a `TrainerRole` that accumulates its share of the step's micro-batches exactly as
one trainer would (loss *sums*, see `workers.roles.trainer`). At the step's end the ranks
all-reduce their gradient sums and every count the step's normalisation and metrics use
(`workers.distributed.all_reduce_step`), so every rank holds ``Σ_ranks Σ_k ∇S_k`` and the whole
step's divisor ``D``; the base class then scales by ``1/D``, clips and steps. The step is thus
the one a single trainer takes on the concatenated batch (``tests/test_dp_trainer.py`` checks
1e-6), and all ranks hold the same parameters after it: the same kernels run on the same
values. The step's metrics cover the whole global batch on every rank.

Only rank 0 exports the new weights (one export per step) and writes checkpoints. The export
is bucketed (`workers.resharding`, buckets of ``group.export_bucket_bytes``): one bucket of
whole tensors is gathered, written into the node's store (through the worker's
`WeightPublisher`) and dropped before the next, so exporting holds one bucket beyond the
store's copy, not a second model; the rollout workers load the buckets' handles as one
version, as before (a step end that fails after its export frees them). Every rank reports
``param_checksum`` (`workers.distributed.parameter_checksum`) and ``rank_tokens`` (its own
share), which the controller compares and summarises (`flowrl.dp.merge_step_ends`).

Sharded (``sharding="fsdp2"``), each backward already reduce-scatters the ranks' gradients
(averaged: the step multiplies them by N, so the sum of the ranks' sums is the same
``Σ_ranks Σ_k ∇S_k``), and only the counts are all-reduced at the step's end. Before that a rank
that trained fewer micro-batches than the step's busiest (``params["passes"]``) runs empty
passes, so that every rank's gathers pair up. Exporting and checkpointing gather whole tensors
on every rank; rank 0 alone publishes and writes them. The step equals one process's as well
(``tests/test_dp_trainer.py``, both ways).

Colocated placement (`workers.colocated`): replicated ranks serve their module in place, and
rank 0 exports only when a copy is kept (``exports_weights``). A sharded rank's rollout engine
keeps whole weights of its own: `load_engine_with` makes every rank's step end copy each
gathered bucket into them as well (``engine_sync_s`` and ``engine_sync_buckets`` in the step's
metrics), so the engine holds the new version, bit for bit what a whole gather gives, with one
bucket of extra memory.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from flowrl import messages as m
from workers.distributed import (
    DataParallel,
    all_reduce_counts,
    all_reduce_step,
    broadcast_parameters,
    parameter_checksum,
)
from workers.engines.protocols import TrainerEngine
from workers.engines.torch_trainer import TorchTrainerEngine
from workers.resharding import BucketSink
from workers.roles.trainer import TrainerRole, TrainSettings, _Step, scale_gradients
from workers.runtime import RoleOutput

__all__ = ["DataParallelTrainerRole"]

#: the `_Step` sums the ranks add up (``step`` is the step number, the same on every rank).
_SUMS = tuple(f.name for f in fields(_Step) if f.name != "step")


class _Publisher(Protocol):
    """What `workers.runtime.WeightPublisher` does for this role."""

    def __call__(self, weights: Mapping[str, Tensor]) -> dict[str, list[Any]]: ...

    def discard(self, published: Mapping[str, Any]) -> None: ...


class DataParallelTrainerRole(TrainerRole):
    """`TrainerRole` on one rank of a joined group (`DataParallel.join`).

    The engine must expose its torch ``model``; its parameters are set to rank 0's here, so
    the ranks start identical whatever their seeds. A sharded group needs a
    `TorchTrainerEngine` that has not stepped yet (it is sharded here); load optimizer state
    after.
    """

    def __init__(
        self, engine: TrainerEngine, settings: TrainSettings, *, pad_token_id: int,
        group: DataParallel, version: int = 0,
    ) -> None:
        if settings.keeps_batches:
            raise ValueError("several updates per step (trainer.ppo_epochs, "
                             "mini_batch_groups) need trainer.ranks=1")
        super().__init__(engine, settings, pad_token_id=pad_token_id, version=version)
        model = getattr(engine, "model", None)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"{type(engine).__name__} has no torch model to all-reduce")
        self.group = group
        #: the base class's switch: one export per step, from rank 0 (sharded, every rank
        #: takes part in gathering it).
        self.exports_weights = group.rank == 0 or group.sharded
        broadcast_parameters([p for p in model.parameters() if p.requires_grad])
        #: the engine when sharded (its gathers and empty passes), else None.
        self._sharded: TorchTrainerEngine | None = None
        if group.sharded:
            if not isinstance(engine, TorchTrainerEngine):
                raise TypeError(f"sharding {group.sharding!r} needs a TorchTrainerEngine, got "
                                f"{type(engine).__name__}")
            engine.shard(group.compute_dtype)
            self._sharded = engine
        self._params = [p for p in model.parameters() if p.requires_grad]
        #: passes every rank runs in the current step (its end task says; sharded only).
        self._passes = 0
        #: writes a bucket into the store (the worker binds it); None: the export is returned
        #: whole (`RoleOutput.weights`), as when the role runs without a worker.
        self._publish: _Publisher | None = None
        #: buckets of this step end already in the store, not yet in its report.
        self._unreported: dict[str, list[Any]] = {}
        #: colocated placement over shards: every bucket of every step end is also copied into
        #: this rank's rollout engine (`load_engine_with`); None: no engine to load.
        self._engine_sink: BucketSink | None = None
        #: the last export's seconds and buckets (`finish_step` reports them).
        self._sync: tuple[float, int] | None = None

    def bind_weight_publisher(self, publish: _Publisher) -> None:
        self._publish = publish

    def load_engine_with(self, sink: BucketSink) -> None:
        """Colocated placement over shards: every step's end also hands each gathered bucket
        to ``sink`` (`workers.resharding.copy_into` over the rollout engine's parameters), on
        every rank. Every rank must set one, or none: the gathers are collectives."""
        if not self.group.sharded:
            raise ValueError("replicated ranks hold whole weights: the engine serves them in "
                             "place, with nothing to load")
        self._engine_sink = sink

    def export_version(self) -> tuple[dict[str, Tensor] | None, dict[str, list[Any]] | None]:
        """Rank 0's export, bucket by bucket (when `exports_weights`); a sharded rank > 0
        takes part in the gathers and keeps nothing. With an engine to load
        (`load_engine_with`) every rank gathers every bucket and copies it into its engine."""
        engine = self.engine
        if not isinstance(engine, TorchTrainerEngine) or engine.lora is not None:
            return super().export_version()  # adapters are small: exported whole
        rank0 = self.group.rank == 0
        into = self._engine_sink
        # `exports_weights` is the same on every rank of a sharded group (colocated: whether
        # a copy is kept; else True), so every rank takes part in the same gathers.
        if not self.exports_weights and into is None:
            return None, None
        if not rank0 and not self.group.sharded:
            return None, None
        weights: dict[str, Tensor] = {}
        published: dict[str, list[Any]] = {}
        keeps = rank0 and self.exports_weights
        publish = self._publish if keeps else None

        def sink(bucket: dict[str, Tensor]) -> None:
            if into is not None:
                into(bucket)
            if not keeps:
                return
            if publish is None:
                weights.update(bucket)
            else:
                published.update(publish(bucket))

        # Until the step end returns them, what is in the store is freed on a failure.
        self._unreported = published
        t0 = time.perf_counter()
        buckets = engine.export_bucketed(self.group.export_bucket_bytes, sink)
        self._sync = (time.perf_counter() - t0, buckets) if into is not None else None
        if not keeps:
            return None, None
        return (None, published) if publish is not None else (weights, None)

    def _train(self, task: m.TaskMsg, inputs: dict[str, list[Any]]) -> RoleOutput:
        self._passes = int(task["params"].get("passes", 0))
        return super()._train(task, inputs)

    def finish_step(self) -> RoleOutput:
        """All-reduce the step's gradient sums and counts, then step as one trainer would."""
        st = self._step
        own_tokens = st.tokens
        local = [float(getattr(st, name)) for name in _SUMS]
        if self._sharded is not None:
            for _ in range(self._passes - st.micro_batches):
                self._sharded.empty_pass()
            sums = all_reduce_counts(local, self._sharded.device)
            scale_gradients(self.engine, float(self.group.world))  # the backward averaged
        else:
            sums = all_reduce_step(self._params, local)
        for name, value in zip(_SUMS, sums, strict=True):
            # The integer counts are exact in float64 (below 2**53).
            setattr(st, name, round(value) if isinstance(getattr(st, name), int) else value)
        try:
            out = super().finish_step()
            out.metrics["param_checksum"] = parameter_checksum(self._params)
            if self._sync is not None:  # the rollout engine's load (colocated, sharded)
                seconds, buckets = self._sync
                out.metrics["engine_sync_s"] = seconds
                out.metrics["engine_sync_buckets"] = float(buckets)
                self._sync = None
        except BaseException:
            # A step end that fails after its export reports no handles: free the buckets
            # already in the store.
            self._discard(self._unreported)
            raise
        finally:
            self._unreported = {}
        if self.group.rank != 0:
            out.weights = out.published = None
        out.metrics["rank_tokens"] = float(own_tokens)
        return out

    def _discard(self, published: dict[str, list[Any]]) -> None:
        if self._publish is not None and published:
            with contextlib.suppress(Exception):  # the step's own error is the one to see
                self._publish.discard(published)

    def _checkpoint_due(self) -> bool:
        # Replicated, every rank holds the same state and rank 0 writes it, once; sharded,
        # every rank gathers it and rank 0 writes it.
        return (self.group.rank == 0 or self.group.sharded) and super()._checkpoint_due()

    def save_checkpoint(self) -> Path | None:
        if self._sharded is None:
            return super().save_checkpoint()
        # Every gather before any disk write: a failed write on rank 0 must not leave the
        # other ranks waiting in a gather.
        state, weights = self._sharded.state_dict(), self._sharded.whole_state()
        return self._write_checkpoint(state, weights) if self.group.rank == 0 else None

    def _final_due(self) -> bool:
        # As checkpoints: rank 0 writes; sharded, every rank takes part in the gathers.
        return (self.group.rank == 0 or self.group.sharded) and super()._final_due()

    def save_final(self) -> Path | None:
        if self._sharded is None:
            return super().save_final()
        weights = self._sharded.whole_state()  # every gather first, as in save_checkpoint
        return self._write_final(weights) if self.group.rank == 0 else None
